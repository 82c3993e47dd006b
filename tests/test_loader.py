"""Loading the embedded tiny checkpoint: every tensor accounted for, strict errors, runtime dtypes,
retained bytes against the inventory-only prediction, the packed expert cache, Engram gathers."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import dsv41
from dsv41.checkpoint.checkpoint import Checkpoint, LoadError
from dsv41.checkpoint.inventory import expected_tensors
from dsv41.checkpoint.stores import ExpertCache
from dsv41.core.config import RELEASED
from dsv41.core.numerics import Numerics
from dsv41.generation.generate import decode_n, generate, prefill
from dsv41.model import sequence
from dsv41.runtime.loader import load
from dsv41.runtime.report import ENGRAM, LOADED, MTP, ROUTED, predict_retained_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load(tiny_checkpoint, quiet=True)


def _copy(src, dst):
    """A writable copy of a checkpoint folder (the tiny one is a few MB)."""
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite_shard(folder, name, change):
    """Rewrite the shard holding `name` with `change(tensors)` applied; keep the index in step."""
    from safetensors.torch import load_file, save_file

    index_file = os.path.join(folder, "model.safetensors.index.json")
    with open(index_file) as f:
        index = json.load(f)
    shard = os.path.join(folder, index["weight_map"][name])
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if k in tensors or v != index["weight_map"][name]
    }
    with open(index_file, "w") as f:
        json.dump(index, f)


# ---------------------------------------------------------------------- accounting
def test_every_tensor_is_accounted_for(model, tiny_checkpoint):
    report = model.report
    on_disk = set(Checkpoint(tiny_checkpoint).names())
    assert set(report.tensors) == on_disk
    assert report.unexpected == []
    cfg = model.cfg
    counts = report.counts()
    draft_experts = cfg.moe_shape(cfg.n_layers)[0]
    # w1/w2/w3, weight + scale, of the backbone's experts and the draft stages' own
    assert counts[ROUTED] == (cfg.n_layers * cfg.n_routed_experts + cfg.n_mtp_layers * draft_experts) * 6
    assert counts[ENGRAM] == 2 * len(cfg.engram_layer_ids)
    assert MTP not in counts  # the draft stack runs: its dense tensors are loaded, its experts read on demand
    # the dense tree: everything else (the vision tower included), each read exactly as the inventory lists it
    dense = {s.name for s in expected_tensors(cfg)} - set(
        report.names(ROUTED) + report.names(ENGRAM) + report.names(MTP)
    )
    assert {n for n in dense if n.startswith(("vision.", "aligner.", "image_"))}  # loaded, not left on disk
    assert set(report.names(LOADED)) == dense
    assert report.tensors_read == len(dense)
    assert "layers.0.ffn.gate.bias_vl" in dense  # read and kept for image spans
    assert report.parameters_filled == len(list(model.backbone.parameters())) + len(
        list(model.draft_stack.parameters())
    )


def test_runtime_dtypes_and_conversions(model):
    bb, cfg = model.backbone, model.cfg
    conversions = {name: (src, dst) for name, src, dst in model.report.dequantized}
    for i, block in enumerate(bb.layers):
        assert block.attn.wo_a.weight.dtype == torch.bfloat16
        assert conversions[f"layers.{i}.attn.wo_a.weight"] == ("F8_E4M3", "BF16")
        assert block.attn.wq_a.weight.dtype == torch.float8_e4m3fn  # dense FP8 linears stay FP8
        assert block.ffn.shared_experts.w2.weight.dtype == torch.float8_e4m3fn
        assert block.hc_attn_fn.dtype == torch.float32 and block.ffn.gate.bias.dtype == torch.float32
        if block.attn.compressor is not None:
            want = torch.float32 if cfg.compress_ratios[i] > 1 else torch.bfloat16
            assert block.attn.compressor.wkv.weight.dtype == want
    assert bb.head.weight.dtype == torch.float32 and conversions["head.weight"] == ("BF16", "F32")
    # wo_a dequantized exactly: weight * power-of-two block scale
    ckpt = Checkpoint(model.report.checkpoint)
    from dsv41.checkpoint.formats import dequantize_fp8_blocks

    want = dequantize_fp8_blocks(ckpt.read("layers.3.attn.wo_a.weight"), ckpt.read("layers.3.attn.wo_a.scale"))
    assert torch.equal(bb.layers[3].attn.wo_a.weight.float(), want)


def test_retained_bytes_match_the_inventory_prediction(model):
    measured = sum(p.numel() * p.element_size() for p in model.backbone.parameters())
    assert model.report.bytes_retained == measured
    assert model.report.predicted_bytes_retained == measured == predict_retained_bytes(model.cfg)["bytes"]
    assert _retained_bytes_by_formula(model.cfg) == measured  # the formulas below, on the tiny geometry
    # nothing of the routed experts or the Engram tables was allocated
    assert model.experts.nbytes == 0
    specs = {s.name: s for s in expected_tensors(model.cfg)}
    tensors = list(model.backbone.parameters()) + list(model.backbone.buffers())
    assert not any(t.dtype in (torch.float4_e2m1fn_x2, torch.int8) for t in tensors)  # no packed expert
    assert not any(tuple(t.shape) == specs["layers.1.engram.embed.weight"].shape for t in tensors)


def _retained_bytes_by_formula(cfg) -> int:
    """The dense tree the loader keeps, summed component by component from the geometry and the
    runtime dtypes, independently of the inventory: FP8 linears stay FP8 (1 byte) with one E8M0
    byte per 32 x 32 block; attn.wo_a is dequantized to BF16 and its scale dropped; ratio > 1
    compressor wkv / wgate and the head are FP32; hyper-connection tensors, attn_sink and router
    biases FP32 as stored; norms, embedding, router weight and the BF16-stored projections BF16.
    The vision tower is bf16 as stored with its RMSNorm weights float32. Routed experts, Engram
    tables and MTP stay on disk and count nothing."""
    BF16, F32 = 2, 4

    def fp8_linear(fan_in, fan_out):  # weight bytes plus its E8M0 block scales
        return fan_out * fan_in + -(-fan_out // 32) * -(-fan_in // 32)

    dim, hc, heads, hd = cfg.dim, cfg.hc_mult, cfg.n_heads, cfg.head_dim
    mix = (2 + hc) * hc
    per_layer = (
        2 * (mix * hc * dim + mix + 3) * F32  # hc_attn / hc_ffn: fn, base, scale
        + 2 * dim * BF16  # attn_norm, ffn_norm
        + heads * F32  # attn_sink
        + fp8_linear(dim, cfg.q_lora_rank)
        + cfg.q_lora_rank * BF16  # wq_a, q_norm
        + fp8_linear(cfg.q_lora_rank, heads * hd)  # wq_b
        + fp8_linear(dim, hd)
        + hd * BF16  # wkv, kv_norm
        + cfg.o_groups * cfg.o_lora_rank * (heads * hd // cfg.o_groups) * BF16  # wo_a, scale dropped
        + fp8_linear(cfg.o_groups * cfg.o_lora_rank, dim)  # wo_b
        + cfg.n_routed_experts * dim * BF16  # router weight
        + cfg.n_routed_experts * F32 * (2 if cfg.vision_n_layers else 1)  # router bias (and bias_vl)
        + cfg.n_shared_experts * (2 * fp8_linear(dim, cfg.moe_inter_dim) + fp8_linear(cfg.moe_inter_dim, dim))
    )
    compressors = sum(
        (2 * dim * hd * F32 if cfg.compress_ratios[i] > 1 else dim * hd * BF16)  # wkv (+ wgate when pooling)
        + hd * BF16  # compressor norm
        for i in cfg.kv_source_layers
    )
    indexers = sum(
        fp8_linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)  # indexer wq_b
        + cfg.index_n_heads * dim * BF16  # weights_proj
        + ((cfg.index_head_dim * hd + cfg.index_head_dim) * BF16 if i in cfg.kv_source_layers else 0)  # wk, k_norm
        for i in cfg.index_source_layers
    )
    n_hash_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    engram = len(cfg.engram_layer_ids) * (
        fp8_linear(n_hash_cols * cfg.engram_head_dim, dim * (hc + 1))  # engram wkv (the table stays on disk)
        + 2 * hc * dim * BF16
    )  # q_weight, k_weight
    top = cfg.vocab_size * dim * BF16 + cfg.vocab_size * dim * F32 + dim * BF16  # embed, head, final norm
    vision = 0
    if cfg.vision_n_layers:
        v, inter, patch, ratio = (
            cfg.vision_dim,
            cfg.vision_inter_dim,
            cfg.vision_patch_size,
            cfg.vision_downsample_ratio,
        )
        block = (4 * v * v + 4 * v + 3 * inter * v) * BF16 + 2 * v * F32  # wqkv, wo (+ biases), fused w1, w2; 2 norms
        vision = (
            (3 * patch * patch * v + v) * BF16
            + cfg.vision_n_layers * block
            + v * F32  # patch embed, final norm
            + (v * ratio * ratio * dim + dim + dim * dim + dim) * BF16  # aligner w1, w2 with biases
            + 3 * dim * BF16
        )  # image_start, image_newline, image_end
    return cfg.n_layers * per_layer + compressors + indexers + engram + top + vision


def test_released_prediction_leaves_experts_and_engram_on_disk():
    pred = predict_retained_bytes(RELEASED)
    derived = _retained_bytes_by_formula(RELEASED)
    assert pred["bytes"] == derived
    # the number the README prints (12.59 GiB, the vision tower's 0.90 GiB included) is this derivation
    readme = open(os.path.join(os.path.dirname(__file__), os.pardir, "README.md"), encoding="utf-8").read()
    assert "13,513,569,728 retained bytes" in readme and derived == 13_513_569_728
    assert pred["tensors"] == 1214 + 266  # the text model's and the vision tower's
    assert "routed experts" not in pred["by_category"]
    total = sum(s.nbytes for s in expected_tensors(RELEASED))
    assert pred["on_disk_bytes"] > 0.97 * total  # experts, Engram tables and MTP


def test_loading_never_reads_experts_or_engram_tables(tiny_checkpoint, monkeypatch):
    names = []
    original = Checkpoint.read

    def recording(self, name):
        names.append(name)
        return original(self, name)

    monkeypatch.setattr(Checkpoint, "read", recording)
    load(tiny_checkpoint, quiet=True)
    # the draft stack's dense tensors are read, its experts (mtp.N.ffn.experts.*) are not
    assert names and not any(".ffn.experts." in n or ".engram.embed." in n for n in names)
    assert any(n.startswith("mtp.") for n in names)
    names.clear()
    load(tiny_checkpoint, quiet=True, dspark=False)
    assert names and not any(n.startswith("mtp.") for n in names)


# ---------------------------------------------------------------------- strict errors
def test_missing_tensor_is_an_error_naming_it(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    _rewrite_shard(folder, "layers.3.attn.wq_a.scale", lambda t: t.pop("layers.3.attn.wq_a.scale"))
    with pytest.raises(LoadError, match=r"layers\.3\.attn\.wq_a\.scale is missing"):
        load(folder, quiet=True)


def test_misshaped_tensor_is_an_error_naming_it(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    name = "layers.0.attn_norm.weight"

    def grow(t):
        t[name] = torch.ones(t[name].numel() + 1, dtype=t[name].dtype)

    _rewrite_shard(folder, name, grow)
    with pytest.raises(LoadError, match=r"layers\.0\.attn_norm\.weight is BF16 \[129\]"):
        load(folder, quiet=True)


def test_unexpected_tensor_is_reported_not_loaded(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")

    def add(t):
        t["layers.0.attn.mystery"] = torch.zeros(3)

    _rewrite_shard(folder, "layers.0.attn_norm.weight", add)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    index["weight_map"]["layers.0.attn.mystery"] = index["weight_map"]["layers.0.attn_norm.weight"]
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    report = load(folder, quiet=True).report
    assert report.unexpected == ["layers.0.attn.mystery"]


# ---------------------------------------------------------------------- the expert cache
def test_expert_cache_holds_packed_bytes_and_counts(tiny_checkpoint):
    ckpt = Checkpoint(tiny_checkpoint)
    cache = ExpertCache(ckpt, capacity=2)
    per_expert = sum(
        ckpt.nbytes(f"layers.0.ffn.experts.0.{w}.{k}") for w in ("w1", "w2", "w3") for k in ("weight", "scale")
    )
    cache.counters.begin_step(0, 1)
    cache.fetch(0, [1, 2])  # two misses
    cache.counters.begin_step(1, 1)
    cache.fetch(0, [1])  # hit
    got = cache.fetch(0, [3])  # miss; evicts 2, the least recently used
    assert (got.hits, got.misses, len(got)) == (0, 1, 1)  # the call's own counts
    got = cache.fetch(0, [3, 2])  # a hit, then 2 misses again
    assert (got.hits, got.misses) == (1, 1)
    cache.fetch(5, [1])  # another layer has its own window
    assert cache.counters.totals(0) == (2, 4) and cache.counters.totals(5) == (0, 1)
    assert cache.counters.steps[0]["layers"] == {0: [0, 2]}
    assert cache.counters.steps[1]["layers"] == {0: [2, 2], 5: [0, 1]}
    assert cache.cached(0) == [3, 2]
    assert cache.nbytes == 3 * per_expert  # packed: one byte per two weights plus the scales
    for packed in (p for window in cache._lru.values() for p in window.values()):
        assert {t.dtype for t in packed} == {torch.float4_e2m1fn_x2, torch.float8_e8m0fnu}
    # capacity 0 keeps nothing: every fetch misses
    none = ExpertCache(ckpt, capacity=0)
    none.fetch(0, [1])
    none.fetch(0, [1])
    assert none.counters.totals(0) == (0, 2) and none.nbytes == 0


def test_forward_counts_cache_traffic_per_layer_and_step(model):
    ids = model.encode("The cache sees every expert once.")
    model(ids, 0)
    first = model.experts.counters.steps[-1]
    k = model.cfg.n_activated_experts
    for layer in range(model.cfg.n_layers):
        hits, misses = first["layers"][layer]
        assert k <= hits + misses <= model.cfg.n_routed_experts
    model([ids[-1]], len(ids))
    step = model.experts.counters.steps[-1]
    assert step["start_pos"] == len(ids) and all(sum(v) == k for v in step["layers"].values())
    assert (
        model.experts.nbytes
        <= model.cfg.n_layers * 16 * model.experts._lru[0][next(iter(model.experts._lru[0]))].nbytes
    )


def test_clearing_the_expert_store_starts_cold_and_zeroes_counters(model):
    ids = model.encode("Warm the cache, then start it cold.")
    model(ids, 0)
    assert model.experts.nbytes > 0 and model.experts.counters.steps
    position = model.position
    model.experts.clear()
    counters = model.experts.counters
    assert model.experts.nbytes == 0 and all(not model.experts.cached(i) for i in range(model.cfg.n_layers))
    assert counters.hits == {} and counters.misses == {} and counters.steps == []
    assert model.position == position  # the sequence is untouched
    model([ids[-1]], position)  # the next call misses on everything it asks for
    assert sum(counters.hits.values()) == 0 and len(counters.steps) == 1
    assert sum(counters.misses.values()) == model.cfg.n_layers * model.cfg.n_activated_experts


# ---------------------------------------------------------------------- Engram and the contract
def test_engram_gathers_mapped_rows_and_resident_gives_same_logits(model, tiny_checkpoint):
    table = model.engram_tables[1]
    ckpt = Checkpoint(tiny_checkpoint)
    ids = torch.tensor([[0, 5, 17], [99, 3, 5]])
    rows, scales = table.gather(ids)
    full_w = ckpt.read("layers.1.engram.embed.weight")
    full_s = ckpt.read("layers.1.engram.embed.scale")
    assert rows.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(rows.view(torch.uint8), full_w[ids].view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), full_s[ids].view(torch.uint8))

    prompt = model.encode("Engram rows, mapped or resident.")
    mapped = model(prompt, 0)
    resident = load(tiny_checkpoint, quiet=True, resident_engram=True)
    assert resident.report.resident_engram_bytes == sum(
        ckpt.nbytes(f"layers.{i}.engram.embed.{k}") for i in model.cfg.engram_layer_ids for k in ("weight", "scale")
    )
    assert torch.equal(resident(prompt, 0), mapped)


def test_call_contract(model):
    ids = model.encode("Contract.")
    logits = model(ids, 0)
    assert logits.dtype == torch.float32 and logits.shape == (1, model.cfg.vocab_size)
    assert torch.isfinite(logits).all()
    nxt = model([int(logits.argmax())], len(ids))
    assert nxt.shape == (1, model.cfg.vocab_size) and model.position == len(ids) + 1
    with pytest.raises(ValueError, match="start_pos"):
        model([1], len(ids) + 5)
    # a prefill at 0 starts over: the same prompt gives the same logits
    assert torch.equal(model(ids, 0), logits)


def test_package_import_stays_light():
    code = "import sys, dsv41; assert 'torch' not in sys.modules; assert callable(dsv41.load); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert dsv41.load is load


def test_a_callers_default_dtype_changes_nothing(model, tiny_checkpoint):
    prompt = model.encode("Default dtypes belong to the caller.")
    want = [model(prompt, 0)] + [model([t], len(prompt) + i) for i, t in enumerate((5, 9, 11))]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        other = load(tiny_checkpoint, quiet=True)
        got = [other(prompt, 0)] + [other([t], len(prompt) + i) for i, t in enumerate((5, 9, 11))]
    finally:
        torch.set_default_dtype(before)
    assert other.backbone.layers[2].attn.compressor.kv_state.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("pad", [False, True])
def test_numerics_options_reach_every_float32_projection_and_the_runtime(tiny_checkpoint, monkeypatch, pad):
    from dsv41.model import layers
    from dsv41.model import model as model_module
    from dsv41.model import moe as moe_module

    m = load(
        tiny_checkpoint,
        quiet=True,
        numerics=Numerics(window_layout="uniform" if pad else "reference", pad_f32_rows=pad),
    )
    assert m.numerics == (Numerics(window_layout="uniform", pad_f32_rows=True) if pad else Numerics())
    seen = []
    original = layers.f32_linear

    def recording(x, weight, *, pad_f32_rows):
        seen.append(pad_f32_rows)
        return original(x, weight, pad_f32_rows=pad_f32_rows)

    monkeypatch.setattr(layers, "f32_linear", recording)
    monkeypatch.setattr(model_module, "f32_linear", recording)
    monkeypatch.setattr(moe_module, "f32_linear", recording)  # the router's
    m(m.encode("Every float32 projection."), 0)
    cfg = m.cfg
    # per forward: the ratio > 1 compressors' wkv and wgate, each layer's router and its two
    # hyper-connection mixes, and the head
    pooling = sum(cfg.compress_ratios[s] > 1 for s in cfg.kv_source_layers)
    assert len(seen) == 2 * pooling + 3 * cfg.n_layers + 1
    assert set(seen) == {pad}


def test_numerics_is_the_only_arithmetic_option_and_a_bad_one_fails_before_loading(tiny_checkpoint):
    with pytest.raises(ValueError, match="window_layout"):
        load(tiny_checkpoint, quiet=True, numerics=Numerics(window_layout="ring"))  # refused building the value
    with pytest.raises(TypeError):  # the old keyword shortcuts are gone: a field is set on the value
        load(tiny_checkpoint, quiet=True, window_layout="uniform")
    with pytest.raises(LoadError, match="numerics must be a Numerics value"):
        load(tiny_checkpoint, quiet=True, numerics="parity")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(threads=0), "threads must be"),
        (dict(cache_format="fp16"), "cache_format must be one of"),
        (dict(max_batch_size=0), r"max_batch_size must lie in \[1, 64\]"),
        (dict(undo_calls=-1), "undo_calls must be a whole number >= 0"),
        (dict(expert_cache=-1), "expert cache capacity must be >= 0"),
        (dict(expert_device="nonsense"), "expert_device 'nonsense' is not a torch device name"),
        (dict(max_seq_len=10**9), r"max_seq_len must lie in \[1, "),
    ],
)
def test_bad_arguments_are_a_load_error_still_a_value_error(tiny_checkpoint, options, message):
    with pytest.raises(LoadError, match=message) as info:
        load(tiny_checkpoint, quiet=True, **options)
    assert isinstance(info.value, ValueError) and isinstance(info.value, dsv41.Dsv41Error)


def test_load_takes_each_option_as_one_keyword(tiny_checkpoint):
    """One way to give an option: a keyword of load, the same name and default as the field of the
    group it fills (CacheOptions, Placement: what load checks them as), so the two cannot drift."""
    import dataclasses
    import inspect

    from dsv41.runtime.loader import CacheOptions, Placement

    keywords = inspect.signature(load).parameters
    for group in (CacheOptions, Placement):
        for f in dataclasses.fields(group):
            assert keywords[f.name].kind is inspect.Parameter.KEYWORD_ONLY and keywords[f.name].default == f.default, (
                f.name
            )
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in keywords.values())
    model = load(
        tiny_checkpoint,
        quiet=True,
        max_seq_len=32,
        undo_calls=3,
        cache_format="bf16",
        expert_cache=2,
        resident_engram=True,
    )
    assert model.backbone.max_seq_len == 32 and sequence.rollback_limit(model) == 0 and model.experts.capacity == 2
    assert model.backbone.cache_format == "bf16"
    with pytest.raises(TypeError, match="unexpected keyword argument 'expert_cahce'"):
        load(tiny_checkpoint, quiet=True, expert_cahce=2)


def test_the_steps_the_cli_shares_with_load(tiny_checkpoint, tmp_path):
    from dsv41.runtime.loader import checkpoint_path, expert_placement, read_config

    assert checkpoint_path(tiny_checkpoint) == tiny_checkpoint
    assert checkpoint_path(None, progress=False) == load(quiet=True).report.checkpoint  # the embedded default
    assert expert_placement("cpu") == [torch.device("cpu")]
    with pytest.raises(LoadError, match="^--expert-device 'gpu0' is not a torch device name"):
        expert_placement("gpu0", option="--expert-device")
    with pytest.raises(LoadError, match="not a checkpoint directory"):
        read_config(str(tmp_path / "missing"))


# ---------------------------------------------------------------------- a second numerics, no second copy
def test_a_sibling_equals_a_fresh_load_under_its_numerics_and_shares_every_weight():
    from dsv41.runtime.loader import sibling

    loaded = load(quiet=True)  # the embedded miniature: trained, so its draft stack agrees with the target
    parity_loaded = load(quiet=True, numerics=Numerics.parity())
    twin = sibling(loaded, Numerics.parity())
    assert twin.numerics == Numerics.parity() and twin.experts is loaded.experts
    shared = lambda a, b: all(x.data_ptr() == y.data_ptr() for x, y in zip(a.parameters(), b.parameters()))  # noqa: E731
    assert shared(loaded.backbone, twin.backbone) and shared(loaded.draft_stack, twin.draft_stack)
    ids = loaded.encode("def main(argv):\n    return")
    for m in (parity_loaded, twin):
        m.reset()
    first = [prefill(m, ids) for m in (parity_loaded, twin)]
    assert torch.equal(*first)
    assert decode_n(parity_loaded, int(first[0].argmax()), 5) == decode_n(twin, int(first[1].argmax()), 5)
    runs = [generate(m, "def f(x):", max_new_tokens=8, speculative=True) for m in (parity_loaded, twin)]
    assert runs[0].ids == runs[1].ids and runs[0].speculation.target_forwards == runs[1].speculation.target_forwards
    loaded.reset()  # the original keeps its own arithmetic and sequence
    assert torch.equal(prefill(loaded, ids), prefill(load(quiet=True), ids))


def test_a_sibling_needs_a_loaded_model():
    from dsv41.runtime.loader import sibling

    with pytest.raises(LoadError, match="takes a model dsv41.load returned"):
        sibling("not a model", Numerics.parity())
