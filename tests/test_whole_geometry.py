"""The whole released layer plan on a small scale: `dsv41 make-synthetic --small` (40 layers, 384
experts per layer, both Engram tables, the MTP stack, at tiny widths; experts and Engram tables as
holes), then the same commands the full-size check runs on it under a memory budget."""

import json
import os

import pytest

from dsv41.app.cli import main
from dsv41.checkpoint.released_synthetic import (
    MARKER_NAME,
    SyntheticError,
    is_hole,
    plan_bytes,
    released_synthetic_config,
    write_released_synthetic,
)
from dsv41.core.outdir import OutDirError

pytestmark = pytest.mark.xdist_group("whole-geometry")


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("whole") / "ck")
    write_released_synthetic(folder, small=True, progress=False, log=lambda _: None)
    return folder


def test_the_layout_is_the_released_one_with_holes(small):
    from dsv41.checkpoint.checkpoint import Checkpoint
    from dsv41.checkpoint.inventory import shard_names
    from dsv41.core.config import RELEASED, load_config

    cfg = load_config(small)
    assert (cfg.n_layers, cfg.n_mtp_layers, cfg.n_routed_experts) == (
        RELEASED.n_layers,
        RELEASED.n_mtp_layers,
        RELEASED.n_routed_experts,
    )
    assert sorted(f for f in os.listdir(small) if f.endswith(".safetensors")) == shard_names(cfg)
    sizes = plan_bytes(released_synthetic_config(small=True))
    apparent = sum(os.path.getsize(os.path.join(small, f)) for f in shard_names(cfg))
    on_disk = sum(os.stat(os.path.join(small, f)).st_blocks * 512 for f in shard_names(cfg))
    assert apparent >= sizes["apparent"]  # headers come on top of the payloads
    assert on_disk < sizes["on_disk"] + (64 << 20) < sizes["apparent"]  # the holes take no disk
    ck = Checkpoint(small)
    assert len(ck.names()) == sizes["tensors"]
    hole = next(n for n in ck.names() if is_hole(n))
    assert not ck.read(hole).view(-1).view(dtype=__import__("torch").uint8).any()  # a hole reads as zeros
    dense = "layers.0.attn.wq_a.weight"
    assert not is_hole(dense) and ck.read(dense).float().abs().sum() > 0


def test_the_audit_passes(small, capsys):
    assert main(["audit", "--checkpoint-dir", small]) == 0
    assert "0 failed" in capsys.readouterr().out


def test_generate_under_a_budget(small, capsys):
    code = main(
        [
            "generate",
            "--checkpoint",
            small,
            "--memory",
            "3GiB",
            "--prompt",
            "The quick brown fox",
            "--max-new-tokens",
            "3",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "memory budget 3.00 GiB" in err and "\n3 tokens (length)" in err  # random weights: any 3 tokens


def test_the_whole_bench_adds_its_phases_up(small, tmp_path, capsys):
    report_path = str(tmp_path / "whole.json")
    code = main(
        [
            "bench",
            "whole",
            "--checkpoint",
            small,
            "--memory",
            "3GiB",
            "--prompt",
            "16",
            "--tokens",
            "2",
            "--probe-mib",
            "16",
            "--json",
            report_path,
        ]
    )
    assert code == 0, capsys.readouterr().err
    run = json.load(open(report_path))["runs"][0]
    assert run["n_layers"] == 40
    total = sum(cell["seconds"] for cell in run["phases"].values())
    assert total == pytest.approx(run["seconds_per_token"], rel=1e-6)
    assert run["token"]["floor_seconds"] == pytest.approx(sum(c["floor_seconds"] for c in run["phases"].values()))
    assert run["prefill_experts_read"] > 0 and run["peak_rss_bytes"] > 0
    ahead = run["read_ahead"]  # decoded as loaded (no reads ahead), then as many tokens with them
    assert not ahead["in_the_phases"] and ahead["seconds_per_token_without"] == run["seconds_per_token"]
    assert ahead["experts_read_ahead"] > 0 and ahead["experts_read_ahead"] >= ahead["used_by_the_next_layer"] >= 0
    assert ahead["speedup"] == pytest.approx(ahead["seconds_per_token_without"] / ahead["seconds_per_token_with"])
    kernel = run["expert_compute_vs_kernel"]
    assert run["expert_kernel_bytes_per_s"] > 0 and kernel["floor_seconds"] > 0
    # the report says how the misses were read and which kernel bodies ran, as the run took them
    from dsv41.kernels import native

    assert run["expert_reads"]["reader"] in ("direct", "preadv", "pread") and run["expert_reads"]["how"]
    loaded = native.load()
    assert run["kernels"]["native"] == (loaded is not None)
    if loaded is not None:
        assert (run["kernels"]["fp4_dot"], run["kernels"]["fp8_dot"]) == (loaded.fp4_dot, loaded.fp8_dot)
    out = capsys.readouterr().out
    assert "expert misses read" in out and run["expert_reads"]["how"] in out


def test_a_folder_it_did_not_write_is_refused(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(OutDirError, match=r"holds notes\.txt and is not a folder make-synthetic wrote"):
        write_released_synthetic(str(folder), small=True, progress=False, log=lambda _: None)
    with pytest.raises(OutDirError, match="is a file, not a folder"):
        write_released_synthetic(str(folder / "notes.txt"), small=True, progress=False, log=lambda _: None)
    assert (folder / "notes.txt").read_text() == "keep me"


def test_other_options_on_a_written_folder_are_refused(small):
    with pytest.raises(SyntheticError, match="other options"):
        write_released_synthetic(small, small=True, real_expert_layers=[3], progress=False, log=lambda _: None)


def test_too_little_disk_is_said_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 1 << 20))
    folder = tmp_path / "ck"
    with pytest.raises(SyntheticError, match=r"needs .* GiB free .* the disk has 0\.0 GiB"):
        write_released_synthetic(str(folder), small=True, progress=False, log=lambda _: None)
    assert not folder.exists() or not any(folder.iterdir())


def test_an_interrupted_write_resumes_with_the_same_bytes(tmp_path, small, monkeypatch):
    from dsv41.checkpoint import released_synthetic

    folder = str(tmp_path / "ck")
    real, written = released_synthetic._write_shard, []

    def stop_after_three(path, *args):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(path)
        return real(path, *args)

    monkeypatch.setattr(released_synthetic, "_write_shard", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        write_released_synthetic(folder, small=True, progress=False, log=lambda _: None)
    marker = json.load(open(os.path.join(folder, MARKER_NAME)))
    assert len(marker["shards_done"]) == 3 and not marker["complete"]
    monkeypatch.setattr(released_synthetic, "_write_shard", real)
    write_released_synthetic(folder, small=True, progress=False, log=lambda _: None)
    for name in sorted(os.listdir(small)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as a, open(os.path.join(small, name), "rb") as b:
                assert a.read() == b.read(), name


def test_real_experts_on_chosen_layers(tmp_path):
    from dsv41.checkpoint.checkpoint import Checkpoint

    folder = str(tmp_path / "ck")
    write_released_synthetic(folder, small=True, real_expert_layers=[3], progress=False, log=lambda _: None)
    ck = Checkpoint(folder)
    assert ck.read("layers.3.ffn.experts.7.w1.weight").view(-1).view(dtype=__import__("torch").uint8).any()
    assert not ck.read("layers.4.ffn.experts.7.w1.weight").view(-1).view(dtype=__import__("torch").uint8).any()


def test_a_decode_token_counts_no_vision_weight():
    """The floor of a text token: the vision tower is never read by it (it was counted in "other")."""
    import dsv41
    from dsv41.bench.released import decode_token_bytes

    model = dsv41.load(quiet=True)
    cfg = model.cfg
    counted = decode_token_bytes(model)
    text_params = 0
    for name, p in model.backbone.named_parameters():
        if name.split(".")[0] in ("vision", "aligner") or name.startswith("image_"):
            continue
        text_params += p.size(1) * p.element_size() if name == "embed.weight" else p.numel() * p.element_size()
    experts = cfg.n_layers * cfg.n_activated_experts * counted["routed_expert_bytes"]
    engram = len(cfg.engram_layer_ids) * cfg.n_hash_cols * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
    assert sum(counted["phases"].values()) == text_params + experts + engram
