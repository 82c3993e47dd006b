"""The embedded default checkpoint: release layout, determinism, size, configs, tokenizer, values."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv41.checkpoint import tiny
from dsv41.checkpoint.engram import EngramLayout, build_compressed_token_map
from dsv41.checkpoint.formats import dequantize, torch_dtype
from dsv41.checkpoint.headers import INDEX_NAME, layout_problems, read_header
from dsv41.checkpoint.inventory import derived_engram_rows, expected_tensors, shard_names
from dsv41.checkpoint.tokenizer import (
    BOS_TOKEN,
    DSPARK_NOISE_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    build_tiny_tokenizer,
)
from dsv41.core.config import TINY, load_config


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint):
    return load_config(tiny_checkpoint)


@pytest.fixture(scope="module")
def specs(cfg):
    return expected_tensors(cfg)


@pytest.fixture(scope="module")
def tensors(tiny_checkpoint, specs):
    from safetensors import safe_open

    out = {}
    for shard in sorted({s.shard for s in specs}):
        with safe_open(os.path.join(tiny_checkpoint, shard), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _files(directory):
    root = Path(directory)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------- bytes
def test_same_seed_same_bytes_and_fast(tiny_checkpoint, tmp_path):
    start = time.perf_counter()
    again = tiny.write_tiny_checkpoint(tmp_path / "again", seed=0)
    elapsed = time.perf_counter() - start
    first, second = _files(tiny_checkpoint), _files(again)
    assert sorted(first) == sorted(second) and tiny.MANIFEST_NAME in first
    differing = [name for name in first if first[name] != second[name]]
    assert not differing, f"files differ between two writes with seed 0: {differing}"
    assert elapsed < 30, f"writing took {elapsed:.1f} s"


def test_size_under_60_mb(tiny_checkpoint):
    total = sum(len(b) for b in _files(tiny_checkpoint).values())
    assert 1_000_000 < total < 60_000_000


def test_cli_other_seed_changes_weights_not_layout(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "seed1"
    assert tiny.cli_main([str(out), "--seed", "1"]) == 0
    assert f"{len(expected_tensors(load_config(str(out))))} tensors" in capsys.readouterr().out
    a, b = _files(tiny_checkpoint), _files(out)
    assert sorted(a) == sorted(b)
    same = {"config.json", "inference/config.json", INDEX_NAME, "tokenizer.json", "tokenizer_config.json"}
    for name in a:
        if name in same:
            assert a[name] == b[name], name
        elif name == tiny.MANIFEST_NAME:
            assert json.loads(b[name])["seed"] == 1 and json.loads(a[name])["seed"] == 0
        else:
            assert a[name] != b[name], f"{name} did not change with the seed"
            assert read_header(str(Path(tiny_checkpoint) / name)).raw == read_header(str(out / name)).raw


def test_cli_refuses_a_file_as_output(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert tiny.cli_main([str(target)]) == 1
    err = capsys.readouterr().err
    assert "not a directory" in err and "Traceback" not in err


# ---------------------------------------------------------------------- layout
def test_every_inventory_tensor_present_with_dtype_shape_and_shard(tiny_checkpoint, specs, cfg):
    on_disk = {}
    for shard in shard_names(cfg):
        header = read_header(os.path.join(tiny_checkpoint, shard))
        assert layout_problems(header) == [], shard
        assert header.metadata == {"format": "pt"}
        for name, entry in header.entries.items():
            assert name not in on_disk, f"{name} is in two shards"
            on_disk[name] = (shard, entry.dtype, entry.shape)
    expected = {s.name: (s.shard, s.dtype, s.shape) for s in specs}
    assert set(on_disk) == set(expected), (
        sorted(set(expected) - set(on_disk))[:5],
        sorted(set(on_disk) - set(expected))[:5],
    )
    wrong = [n for n in expected if on_disk[n] != expected[n]]
    assert not wrong, [(n, on_disk[n], expected[n]) for n in wrong[:5]]
    shards_on_disk = sorted(p.name for p in Path(tiny_checkpoint).glob("*.safetensors"))
    assert shards_on_disk == sorted(shard_names(cfg))


def test_release_layout_features_present(specs, cfg):
    names = {s.name for s in specs}
    dtypes = {s.name: s.dtype for s in specs}
    assert dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.experts.0.w1.weight"] == "I8"
    assert dtypes["layers.1.engram.embed.weight"] == "F8_E4M3"
    assert all(f"layers.{i}.ffn.gate.bias_vl" in names for i in range(cfg.n_layers))
    assert any(n.startswith("vision.") for n in names) and "mtp.2.markov_head.head.weight" in names
    assert "mtp.0.main_proj.weight" in names and "mtp.1.main_proj.weight" not in names
    # the ratio-1 KV source has no compressor gate, the ratio-2 one does
    assert "layers.2.attn.compressor.wgate.weight" in names
    assert "layers.4.attn.compressor.wkv.weight" in names and "layers.4.attn.compressor.wgate.weight" not in names


def test_index_matches_shards(tiny_checkpoint, specs):
    index = json.loads((Path(tiny_checkpoint) / INDEX_NAME).read_text())
    assert index["weight_map"] == {s.name: s.shard for s in specs}
    headers = {shard: read_header(os.path.join(tiny_checkpoint, shard)) for shard in set(index["weight_map"].values())}
    for name, shard in index["weight_map"].items():
        assert name in headers[shard].entries, f"{name} is not in {shard}"
    assert index["metadata"]["total_size"] == sum(h.data_size for h in headers.values())
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)


# ---------------------------------------------------------------------- configs
def test_configs_round_trip_and_verify(tiny_checkpoint, cfg):
    nested = load_config(tiny_checkpoint)
    flat = load_config(os.path.join(tiny_checkpoint, "inference", "config.json"))
    assert nested.layout == "nested" and flat.layout == "flat"
    assert nested.verify() == [] and flat.verify() == []
    assert flat.as_reference_dict() == nested.as_reference_dict()
    # the flat file is silent on exactly the nested-only fields
    from dsv41.core.config_fields import NESTED_ONLY_KEYS

    assert sorted(line.split(":")[0] for line in nested.differs_from(flat)) == sorted(NESTED_ONLY_KEYS)
    assert nested == tiny.tiny_config()
    assert nested.differs_from(TINY) == [
        f"engram_num_embeddings: {json.dumps(list(nested.engram_num_embeddings))} vs (absent)",
        f"engram_compressed_vocab_size: {nested.engram_compressed_vocab_size} vs (absent)",
    ]


def test_engram_rows_are_the_derived_layout(cfg, tensors):
    layout = EngramLayout.from_config(cfg)
    assert layout.verify() == []
    assert cfg.engram_num_embeddings == layout.derived_num_embeddings == derived_engram_rows(cfg)
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        assert tensors[f"layers.{layer}.engram.embed.weight"].shape == (rows, cfg.engram_head_dim)
        assert tensors[f"layers.{layer}.engram.embed.scale"].shape == (rows, cfg.engram_head_dim // 32)


# ---------------------------------------------------------------------- tokenizer
def test_tokenizer_special_ids_and_size(tiny_checkpoint, cfg):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tiny_checkpoint, "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size
    assert tok.token_to_id(BOS_TOKEN) == cfg.bos_token_id == 0
    assert tok.token_to_id(EOS_TOKEN) == cfg.eos_token_id == 1
    assert tok.token_to_id(PAD_TOKEN) == cfg.pad_token_id == cfg.engram_pad_id == 2
    assert tok.token_to_id(IMAGE_TOKEN) == cfg.image_token_id
    assert tok.token_to_id(DSPARK_NOISE_TOKEN) == cfg.dspark_noise_token_id
    text = "The café, the  CAFE and 2024 résumés."
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: lossless
    ids = tok.encode(f"{BOS_TOKEN}hi{IMAGE_TOKEN}").ids
    assert ids[0] == 0 and cfg.image_token_id in ids  # special tokens are atomic
    side = json.loads((Path(tiny_checkpoint) / "tokenizer_config.json").read_text())
    assert (side["bos_token"], side["eos_token"], side["pad_token"]) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)


def test_compressed_vocab_folds_case_accents_whitespace(tiny_checkpoint, cfg):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tiny_checkpoint, "tokenizer.json"))
    token_map, n = build_compressed_token_map(tok)
    assert n == cfg.engram_compressed_vocab_size
    assert n < cfg.vocab_size
    assert sorted(set(token_map.tolist())) == list(range(n))

    def same(a, b):
        ia, ib = tok.token_to_id(a), tok.token_to_id(b)
        assert ia is not None and ib is not None, (a, b)
        return token_map[ia] == token_map[ib]

    assert same("ĠThe", "Ġthe")  # case (byte-level spelling: Ġ is a space)
    assert same("Ġnaive", "ĠnaÃ¯ve") and same("Ġresume", "ĠrÃ©sumÃ©")  # accents: naïve, résumé
    assert same("Ġ", "ĠĠ")  # whitespace run
    assert not same("Ġthe", "Ġand")


def test_tokenizer_training_is_reproducible_across_processes():
    code = (
        "import hashlib; from dsv41.checkpoint.tokenizer import build_tiny_tokenizer; "
        "print(hashlib.sha256(build_tiny_tokenizer().to_str().encode()).hexdigest())"
    )
    digests = set()
    for env in ({"PYTHONHASHSEED": "1", "RAYON_NUM_THREADS": "1"}, {"PYTHONHASHSEED": "2", "RAYON_NUM_THREADS": "2"}):
        run = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=True
        )
        digests.add(run.stdout.strip())
    digests.add(hashlib.sha256(build_tiny_tokenizer().to_str().encode()).hexdigest())
    assert len(digests) == 1


# ---------------------------------------------------------------------- values
def test_no_nan_or_inf_after_dequantization(tensors, specs):
    n_quantized = 0
    for name, t in tensors.items():
        if name.endswith(".scale"):
            assert (t.view(torch.uint8) != 255).all(), f"{name}: NaN scale byte"
            continue
        scale = tensors.get(name[: -len("weight")] + "scale") if name.endswith(".weight") else None
        n_quantized += scale is not None
        values = dequantize(t, scale)
        assert torch.isfinite(values).all(), name
    # every FP8 linear, FP4 expert and Engram table went through its scale
    assert n_quantized == sum(s.dtype == "F8_E8M0" for s in specs) > 0


def test_weights_are_well_scaled(tensors, cfg):
    import math

    def std(name):
        weight = tensors[name + ".weight"]
        return dequantize(weight, tensors.get(name + ".scale")).std().item()

    # unit-variance outputs: std ~ 1/sqrt(fan_in), through FP8, FP4 and plain BF16 storage alike
    for name, fan_in in (
        ("layers.0.attn.wq_a", cfg.dim),
        ("layers.3.ffn.experts.5.w2", cfg.moe_inter_dim),
        ("layers.0.ffn.shared_experts.w1", cfg.dim),
        ("layers.0.ffn.gate", cfg.dim),
    ):
        assert abs(std(name) * math.sqrt(fan_in) - 1) < 0.15, name
    assert torch.equal(tensors["layers.0.attn_norm.weight"].float(), torch.ones(cfg.dim))
    assert torch.equal(tensors["layers.0.attn.attn_sink"], torch.zeros(cfg.n_heads))
    assert tensors["layers.0.hc_attn_fn"].abs().max() < 0.1
    assert tensors["layers.0.ffn.gate.bias"].abs().max() < 0.05
    # a head over RMS-normalized embeddings gives logits of order one
    h = tensors["embed.weight"].float()[:64]
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True))
    logits = h @ tensors["head.weight"].float().T
    assert 0.5 < logits.std().item() < 2.0 and logits.abs().max() < 20


def test_stored_dtypes_match_torch(tensors, specs):
    for s in specs:
        assert tensors[s.name].dtype == torch_dtype(s.dtype), s.name


# ---------------------------------------------------------------------- cache
def test_default_checkpoint_builds_once_atomically(tiny_checkpoint, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny, "_VERIFIED", set())
    calls = []

    def failing(out_dir, seed, progress):
        Path(out_dir, "model-00001-of-00016.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "_write_files", failing)
    with pytest.raises(RuntimeError):
        tiny.default_checkpoint(seed=0)
    assert list((tmp_path / "cache").iterdir()) == [], "a failed build leaves nothing behind"

    def copying(out_dir, seed, progress):
        calls.append(seed)
        shutil.copytree(tiny_checkpoint, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(tiny, "_write_files", copying)
    path = tiny.default_checkpoint(seed=0)
    assert Path(path).name == f"tiny-0-{tiny.content_version()}"
    assert Path(path).parent == tmp_path / "cache"
    assert tiny.default_checkpoint(seed=0) == path and calls == [0], "built once, then reused"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(path).name]
    assert (Path(path) / INDEX_NAME).is_file()


def test_every_source_the_content_version_hashes_exists():
    """The tag hashed `engram.py` as absent after Engram became a package, so a change to the
    Engram layout would have reused a stale cached checkpoint: every listed file must exist."""
    here = Path(tiny.__file__).resolve().parents[1]
    missing = [rel for rel in tiny.CONTENT_SOURCES if not (here / rel).is_file()]
    assert missing == []
    assert (
        "checkpoint/engram/layout.py" in tiny.CONTENT_SOURCES and "checkpoint/engram/hasher.py" in tiny.CONTENT_SOURCES
    )
