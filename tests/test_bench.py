"""`dsv41 bench experts` at a tiny shape: the report's structure, and that its ratios are the
measured numbers divided (no timing thresholds: this machine is shared and times move)."""

import json
import math

import pytest
import torch

from dsv41 import bench
from dsv41.cli import main
from dsv41.kernels import native

TINY = ["--dims", "64,32", "--repeats", "1", "--copy-mib", "8"]


def test_bench_experts_writes_a_report_of_measured_numbers(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "experts", "--tokens", "1,3", "--experts", "6", "--json", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "memory copy bandwidth" in printed and "resident memory" in printed
    report = json.loads(out.read_text())
    assert (report["dim"], report["inter"], report["n_experts"], report["topk"]) == (64, 32, 6, 6)
    copy_bw = report["copy_bandwidth_bytes_per_s"]
    assert copy_bw > 0 and "8 MiB" in report["copy_bandwidth_definition"]
    for key in ("after_build", "end"):
        assert report[key]["rss_bytes"] > 0 and report[key]["peak_rss_bytes"] >= report[key]["rss_bytes"] // 2
    assert [row["tokens"] for row in report["shapes"]] == [1, 3]

    routed, shared = bench.make_experts(6, 64, 32)
    assert report["routed_expert_bytes"] == routed[0].nbytes and report["shared_expert_bytes"] == shared.nbytes
    kernels = report["kernels"]
    assert kernels == (["native", "torch"] if native.available() else ["torch"])
    for row in report["shapes"]:
        assert row["baseline_s"] > 0 and set(row["kernels"]) == set(kernels)
        for cell in row["kernels"].values():
            assert cell["s"] > 0
            assert math.isclose(cell["speedup"], row["baseline_s"] / cell["s"], rel_tol=1e-12)
            assert math.isclose(cell["bytes_per_s"], row["packed_bytes"] / cell["s"], rel_tol=1e-12)
            assert math.isclose(cell["fraction_of_copy"], cell["bytes_per_s"] / copy_bw, rel_tol=1e-12)
        # 6 of 6 experts selected: each read once, plus the shared one
        assert row["experts_selected"] == 6
        assert row["packed_bytes"] == 6 * routed[0].nbytes + shared.nbytes
    assert "targets" not in report  # judged at the released sizes only


def test_targets_are_judged_from_the_measured_numbers():
    shapes = [{"tokens": 1, "kernels": {"native": {"speedup": 31.0, "fraction_of_copy": 0.39}}},
              {"tokens": 16, "kernels": {"native": {"speedup": 2.0, "fraction_of_copy": 0.1}}},
              {"tokens": 512, "kernels": {"native": {"speedup": 5.5, "fraction_of_copy": 0.02}}}]
    lines = []
    results = bench._check_targets(shapes, "native", lines.append)
    assert [(r["tokens"], r["met"]) for r in results] == [(1, False), (512, True)]  # 39% < 40%; 5.5x >= 5x
    assert "NOT met" in lines[0] and lines[1].endswith(": met")


def test_bench_rejects_bad_arguments(capsys):
    assert main(["bench", "experts", "--tokens", "1", "--kernels", "fast", *TINY]) == 2
    assert "--kernels" in capsys.readouterr().err
    assert main(["bench", "experts", "--tokens", "0", *TINY]) == 2
    assert "positive token counts" in capsys.readouterr().err
    assert main(["bench", "experts", "--tokens", "1", "--experts", "3", *TINY]) == 2
    assert "at least 6" in capsys.readouterr().err


def test_bench_times_the_computation_the_model_runs():
    """The fused MoE the bench times equals the reference experts; the baseline's expansion
    equals the storage dequantizer."""
    from dsv41.formats import dequantize
    from dsv41.kernels.experts import expert_ffn_reference, routed_experts_reference

    routed, shared = bench.make_experts(8, 64, 32)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids, weights = bench.make_routing(4, 8, 6)
    assert ids.shape == (4, 6) and all(len(set(row.tolist())) == 6 for row in ids)
    assert torch.allclose(weights.sum(-1), torch.ones(4))
    got = bench.fused_moe(x, ids, weights, routed, shared, bench.SWIGLU_LIMIT)
    ref = routed_experts_reference(x, ids, weights, routed, bench.SWIGLU_LIMIT) + \
        expert_ffn_reference(x, shared, bench.SWIGLU_LIMIT).float()
    assert (got - ref).abs().max() <= 2.0**-6 * ref.abs().max()
    for w, s in ((routed[0].w1, routed[0].w1_scale), (shared.w2, shared.w2_scale)):
        assert torch.equal(bench._expand_bf16(w, s), dequantize(w, s, dtype=torch.bfloat16))
    base = bench.baseline_moe(x, ids, weights, routed, shared, bench.SWIGLU_LIMIT)
    # no FP8 activation quantization in the baseline, so close but not equal
    assert (base - ref).abs().max() <= 0.1 * ref.abs().max()


@pytest.mark.parametrize("text", ["a", "1,,2", "-3"])
def test_token_list_parsing(text):
    if text == "1,,2":
        assert bench._token_list(text) == [1, 2]
    else:
        with pytest.raises(ValueError):
            bench._token_list(text)


def test_bench_decode_runs_both_modes_on_a_synthetic_checkpoint(tmp_path, capsys):
    """The decode benchmark at tiny sizes: it writes a checkpoint `dsv41.load` accepts, decodes
    with the BF16 baseline and the fused experts, and reports per-phase seconds that add up."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "decode.json"
    args = ["bench", "decode", "--dims", "64,32", "--tokens", "2", "--prompt", "3", "--json", str(out)]
    assert main([*args, "--checkpoint", str(ckpt)]) == 0
    assert (ckpt / "config.json").is_file()  # kept for the next run
    printed = capsys.readouterr().out
    assert "routed experts" in printed and "tokens/s" in printed
    report = json.loads(out.read_text())
    assert (report["dim"], report["inter"], report["n_layers"], report["topk"]) == (64, 32, 2, 6)
    assert report["fused_cpu_kernel"] == ("native" if native.available() else "torch")
    for mode in ("baseline", "fused"):
        r = report["modes"][mode]
        assert len(r["tokens"]) == 2
        assert math.isclose(r["tokens_per_s"], 2 / r["decode_s"], rel_tol=1e-12)
        phases = r["phases_s_per_token"]
        assert set(phases) == set(bench.PHASES) | {"other"}
        assert all(phases[p] > 0 for p in bench.PHASES)  # every phase ran and was timed
        assert math.isclose(sum(phases.values()), r["decode_s"] / 2, rel_tol=1e-9)
    assert math.isclose(report["speedup"], report["modes"]["fused"]["tokens_per_s"]
                        / report["modes"]["baseline"]["tokens_per_s"], rel_tol=1e-12)
    # the second run reuses the checkpoint; a non-empty folder that is not one is refused
    assert main([*args, "--checkpoint", str(ckpt)]) == 0
    assert "wrote the synthetic checkpoint" not in capsys.readouterr().out
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    assert main([*args, "--checkpoint", str(tmp_path / "junk")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="checks the refusal without CUDA; this machine has a CUDA device")
def test_bench_on_cuda_without_cuda_is_refused_in_one_sentence(capsys):
    assert main(["bench", "experts", "--device", "cuda", "--tokens", "1", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device with Triton; the kernels are checked on CPU through TRITON_INTERPRET in test_experts")
def test_bench_on_cuda_reports_measured_ratios(tmp_path):
    out = tmp_path / "gpu.json"
    assert main(["bench", "experts", "--device", "cuda", "--tokens", "1,3", "--experts", "6", "--json", str(out),
                 "--dims", "256,128", "--repeats", "2"]) == 0
    report = json.loads(out.read_text())
    copy_bw = report["copy_bandwidth_bytes_per_s"]
    decode, three = report["shapes"]
    for row in (decode, three):
        assert math.isclose(row["fraction_of_copy"], row["packed_bytes"] / row["routed_s"] / copy_bw, rel_tol=1e-12)
    assert math.isclose(decode["gemv_fraction_of_copy"], decode["packed_bytes"] / decode["gemv_s"] / copy_bw,
                        rel_tol=1e-12)
    assert "gemv_s" not in three and "targets" not in report  # targets: released sizes only


def test_bench_prefill_times_one_shot_against_chunks_in_one_run(tiny_checkpoint, tmp_path, capsys):
    from dsv41.bench import cli_main

    out = tmp_path / "prefill.json"
    assert cli_main(["prefill", "--checkpoint", tiny_checkpoint, "--tokens", "48", "--chunks", "8,16,64",
                     "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["embedded"]
    runs = {r["chunk"]: r for r in report["runs"]}
    assert sorted(runs) == [8, 16, 48]  # 64 is not below the prompt: one-shot already covers it
    assert runs[48]["ratio_to_one_shot"] == 1.0 and runs[48]["last_logits_equal"]
    assert runs[8]["calls"] == 6 and all(r["seconds"] > 0 and math.isfinite(r["ratio_to_one_shot"]) for r in runs.values())
    assert "chunks of     8" in capsys.readouterr().out
    assert cli_main(["prefill", "--checkpoint", tiny_checkpoint, "--tokens", "1"]) == 2
