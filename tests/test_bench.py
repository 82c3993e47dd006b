"""`dsv41 bench experts` at a tiny shape: the report's structure, and that its ratios are the
measured numbers divided (no timing thresholds: this machine is shared and times move)."""

import json
import math
import os

import pytest
import torch

from dsv41 import bench
from dsv41.app.cli import main
from dsv41.bench.common import token_list
from dsv41.bench.experts import _check_targets, _expand_bf16
from dsv41.bench.released import _released_targets
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
    assert report["prefill_path"] == native.prefill_path() and report["prefill_path"] in native.PREFILL_PATHS

    def kernel_name(cell):
        return next(k for k, c in row["kernels"].items() if c is cell)

    for row in report["shapes"]:
        assert row["baseline_s"] > 0 and set(row["kernels"]) == set(kernels)
        for cell in row["kernels"].values():
            assert cell["s"] > 0
            assert math.isclose(cell["speedup"], row["baseline_s"] / cell["s"], rel_tol=1e-12)
            assert math.isclose(cell["bytes_per_s"], row["packed_bytes"] / cell["s"], rel_tol=1e-12)
            assert math.isclose(cell["fraction_of_copy"], cell["bytes_per_s"] / copy_bw, rel_tol=1e-12)
            assert math.isclose(cell["fraction_of_bf16_gemm"], row["bf16_gemm_s"] / cell["s"], rel_tol=1e-12)
            assert cell["path"] == bench.kernel_path(kernel_name(cell), row["tokens"])
        # 6 of 6 experts selected: each read once, plus the shared one
        assert row["experts_selected"] == 6
        assert row["packed_bytes"] == 6 * routed[0].nbytes + shared.nbytes
    assert "targets" not in report  # judged at the released sizes only
    # up to 8 tokens the block order, beyond it the CPU's prefill path (torch: its own kernel)
    assert bench.kernel_path("torch", 512) == "torch"
    if native.available():
        assert bench.kernel_path("native", 8).startswith("block order")
        assert bench.kernel_path("native", 9).startswith(native.prefill_path())


def test_targets_are_judged_from_the_measured_numbers():
    shapes = [
        {"tokens": 1, "kernels": {"native": {"speedup": 31.0, "fraction_of_copy": 0.39}}},
        {"tokens": 16, "kernels": {"native": {"speedup": 2.0, "fraction_of_copy": 0.1}}},
        {"tokens": 512, "kernels": {"native": {"speedup": 5.5, "fraction_of_copy": 0.02}}},
    ]
    lines = []
    results = _check_targets(shapes, "native", lines.append)
    assert [(r["tokens"], r["met"]) for r in results] == [(1, False), (512, True)]  # 39% < 40%; 5.5x >= 5x
    assert "NOT met" in lines[0] and lines[1].endswith(": met")
    # where the BF16 GEMM was timed, 512 tokens also need 80% of its throughput
    shapes[2]["kernels"]["native"]["fraction_of_bf16_gemm"] = 0.79
    results = _check_targets(shapes, "native", lines.append)
    assert results[1]["met"] is False and results[1]["bf16_gemm_fraction_target"] == 0.80
    shapes[2]["kernels"]["native"]["fraction_of_bf16_gemm"] = 0.81
    assert _check_targets(shapes, "native", lines.append)[1]["met"] is True


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
    from dsv41.checkpoint.formats import dequantize
    from dsv41.kernels.experts import expert_ffn_reference, routed_experts_reference

    routed, shared = bench.make_experts(8, 64, 32)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids, weights = bench.make_routing(4, 8, 6)
    assert ids.shape == (4, 6) and all(len(set(row.tolist())) == 6 for row in ids)
    assert torch.allclose(weights.sum(-1), torch.ones(4))
    got = bench.fused_moe(x, ids, weights, routed, shared, bench.SWIGLU_LIMIT)
    ref = (
        routed_experts_reference(x, ids, weights, routed, bench.SWIGLU_LIMIT)
        + expert_ffn_reference(x, shared, bench.SWIGLU_LIMIT).float()
    )
    assert (got - ref).abs().max() <= 2.0**-6 * ref.abs().max()
    for w, s in ((routed[0].w1, routed[0].w1_scale), (shared.w2, shared.w2_scale)):
        assert torch.equal(_expand_bf16(w, s), dequantize(w, s, dtype=torch.bfloat16))
    base = bench.baseline_moe(x, ids, weights, routed, shared, bench.SWIGLU_LIMIT)
    # no FP8 activation quantization in the baseline, so close but not equal
    assert (base - ref).abs().max() <= 0.1 * ref.abs().max()


@pytest.mark.parametrize("text", ["a", "1,,2", "-3"])
def test_token_list_parsing(text):
    if text == "1,,2":
        assert token_list(text) == [1, 2]
    else:
        with pytest.raises(ValueError):
            token_list(text)


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
    assert math.isclose(
        report["speedup"],
        report["modes"]["fused"]["tokens_per_s"] / report["modes"]["baseline"]["tokens_per_s"],
        rel_tol=1e-12,
    )
    # the site registry's cost with nothing registered, as a ratio measured in the same run
    registry = report["registry"]
    assert (
        registry["rounds"] == bench.REGISTRY_ROUNDS
        and min(registry["with_registry_s"], registry["without_registry_s"]) > 0
    )
    assert math.isclose(registry["ratio"], registry["with_registry_s"] / registry["without_registry_s"], rel_tol=1e-12)
    assert "site registry, nothing registered" in printed
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
@pytest.mark.skipif(
    not CUDA,
    reason="needs a CUDA device with Triton; the kernels are checked on CPU through TRITON_INTERPRET in test_experts",
)
def test_bench_on_cuda_reports_measured_ratios(tmp_path):
    out = tmp_path / "gpu.json"
    assert (
        main(
            [
                "bench",
                "experts",
                "--device",
                "cuda",
                "--tokens",
                "1,3",
                "--experts",
                "6",
                "--json",
                str(out),
                "--dims",
                "256,128",
                "--repeats",
                "2",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    copy_bw = report["copy_bandwidth_bytes_per_s"]
    decode, three = report["shapes"]
    for row in (decode, three):
        assert math.isclose(row["fraction_of_copy"], row["packed_bytes"] / row["routed_s"] / copy_bw, rel_tol=1e-12)
    assert math.isclose(
        decode["gemv_fraction_of_copy"], decode["packed_bytes"] / decode["gemv_s"] / copy_bw, rel_tol=1e-12
    )
    assert "gemv_s" not in three and "targets" not in report  # targets: released sizes only


def test_bench_prefill_times_one_shot_against_chunks_in_one_run(tiny_checkpoint, tmp_path, capsys):
    from dsv41.bench import cli_main

    out = tmp_path / "prefill.json"
    assert (
        cli_main(
            [
                "prefill",
                "--checkpoint",
                tiny_checkpoint,
                "--tokens",
                "48",
                "--chunks",
                "8,16,64",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())["embedded"]
    runs = {r["chunk"]: r for r in report["runs"]}
    assert sorted(runs) == [8, 16, 48]  # 64 is not below the prompt: one-shot already covers it
    assert runs[48]["ratio_to_one_shot"] == 1.0 and runs[48]["last_logits_equal"]
    assert runs[8]["calls"] == 6 and all(
        r["seconds"] > 0 and math.isfinite(r["ratio_to_one_shot"]) for r in runs.values()
    )
    assert "chunks of     8" in capsys.readouterr().out
    assert cli_main(["prefill", "--checkpoint", tiny_checkpoint, "--tokens", "1"]) == 2


def test_bench_decode_released_reports_phases_against_their_floor(tmp_path, capsys):
    """`bench decode --geometry released` on the released layer plan at tiny dims: per phase and
    for the whole token the four numbers, each a division of measured or counted ones; bytes from
    the tensors as held; the 40-layer prediction built from the measured layers."""
    from dsv41.core.config import RELEASED

    out = tmp_path / "released.json"
    args = [
        "bench",
        "decode",
        "--geometry",
        "released",
        "--small",
        "--tokens",
        "2",
        "--prompt",
        "4",
        "--repeats",
        "1",
        "--copy-mib",
        "8",
        "--json",
        str(out),
    ]
    assert main([*args, "--checkpoint", str(tmp_path / "ckpt")]) == 0
    printed = capsys.readouterr().out
    assert "released-geometry checkpoint" in printed and "of floor" in printed and "a prediction" in printed
    report = json.loads(out.read_text())
    assert report["layer_modes"] == ["full", "reuse"] and report["engram_layers"] == [1]
    assert report["vocab_size"] == RELEASED.vocab_size and report["checkpoint_bytes"] > 0
    assert set(report["settings"]) <= {"1", str(os.cpu_count())} and "1" in report["settings"]
    cfg = bench.released_decode_config(2, 8, small=True)
    expert_bytes = 3 * (cfg.moe_inter_dim * cfg.dim // 2 + cfg.moe_inter_dim * cfg.dim // 32)
    for cell in report["settings"].values():
        bw = cell["read_bandwidth_bytes_per_s"]  # the floors' bandwidth: a GEMV only reads
        assert cell["copy_bandwidth_bytes_per_s"] > 0
        assert set(cell["phases"]) == set(bench.RELEASED_PHASES)
        for name, c in [*cell["phases"].items(), ("token", cell["token"])]:
            assert math.isclose(c["floor_seconds"], c["bytes"] / bw, rel_tol=1e-12), name
            assert c["measurement_error"] == (c["fraction_of_floor"] > 1), name
            assert math.isclose(c["fraction_of_floor"], c["floor_seconds"] / c["seconds"], rel_tol=1e-12), name
        assert all(cell["phases"][p]["seconds"] > 0 for p in bench.RELEASED_PHASES[:-1])  # every phase was timed
        assert math.isclose(sum(c["seconds"] for c in cell["phases"].values()), cell["token"]["seconds"], rel_tol=1e-9)
        assert cell["token"]["bytes"] == sum(c["bytes"] for c in cell["phases"].values())
        assert cell["phases"]["routed experts"]["bytes"] == 2 * 6 * expert_bytes
        assert cell["phases"]["head"]["bytes"] == RELEASED.vocab_size * cfg.dim * 4  # held in float32
        assert math.isclose(cell["tokens_per_s"], 2 / cell["decode_s"], rel_tol=1e-12)
        p = cell["prediction_released"]
        assert p["layers"] == 40 and p["layer_kinds"]["full"] + p["layer_kinds"]["reuse"] == 40
        assert math.isclose(p["fraction_of_floor"], p["bytes"] / bw / p["seconds_per_token"], rel_tol=1e-9)
        assert p["bytes"] > cell["token"]["bytes"]  # 40 layers read more than 2
    assert report["phases"] == report["settings"][str(report["threads"])]["phases"]
    assert "target:" not in printed and all("targets" not in c for c in report["settings"].values())


def test_released_decode_targets_leave_out_the_latency_bound_phase():
    """The decode targets: the whole token at 50% of its floor, every phase at 30% but "other"."""

    def cell(token, **fractions):
        phases = {
            name: {"fraction_of_floor": fractions.get(name.replace(" ", "_"), 0.9)} for name in bench.RELEASED_PHASES
        }
        return {"token": {"fraction_of_floor": token}, "phases": phases}

    met = _released_targets(cell(0.6, other=0.02, routed_experts=0.31))
    assert met["met"] and met["lowest_phase"] == "routed experts" and met["lowest_phase_fraction"] == 0.31
    assert met["latency_bound_phases"] == ["other"]
    assert not _released_targets(cell(0.49))["met"]
    assert not _released_targets(cell(0.9, shared_expert=0.29))["met"]
    errored = cell(0.6)
    errored["phases"]["head"]["measurement_error"] = True  # above 100% of its floor: not a result
    judged = _released_targets(errored)
    assert judged["measurement_errors"] == ["head"] and not judged["met"]


def test_released_decode_config_is_the_released_geometry_on_few_layers():
    from dsv41.core.config import RELEASED

    cfg = bench.released_decode_config(3, 10)
    for field in (
        "dim",
        "n_heads",
        "head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "index_n_heads",
        "index_head_dim",
        "window_size",
        "index_topk",
        "moe_inter_dim",
        "n_activated_experts",
        "vocab_size",
        "n_shared_experts",
        "engram_head_dim",
        "engram_n_heads",
    ):
        assert getattr(cfg, field) == getattr(RELEASED, field), field
    assert cfg.layer_modes == ("full", "reuse", "reuse") and cfg.n_routed_experts == 10
    assert cfg.verify() == []
    with pytest.raises(ValueError, match="at least 2"):
        bench.released_decode_config(1, 8)
    with pytest.raises(ValueError, match="at least 6"):
        bench.released_decode_config(2, 5)


def test_bench_decode_released_on_cuda_is_one_command(tmp_path, capsys):
    """`--device cuda` runs the routed experts on the device where one is there, and is refused in
    one sentence, before any checkpoint is written, where none is."""
    from dsv41.kernels.triton_experts import available

    out = tmp_path / "cuda.json"
    args = [
        "bench",
        "decode",
        "--geometry",
        "released",
        "--small",
        "--tokens",
        "1",
        "--prompt",
        "3",
        "--repeats",
        "1",
        "--copy-mib",
        "8",
        "--device",
        "cuda",
        "--checkpoint",
        str(tmp_path / "ckpt"),
        "--json",
        str(out),
    ]
    if available():
        assert main(args) == 0
        assert json.loads(out.read_text())["expert_device"] == "cuda"
    else:
        assert main(args) == 2
        assert "needs a CUDA device and Triton" in capsys.readouterr().err
        assert not (tmp_path / "ckpt").exists() and not out.exists()
