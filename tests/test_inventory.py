"""The release-layout tensor inventory against the released checkpoint's measured facts: totals,
category table, namespaces, per-layer partition, shard table, and the shapes its headers show."""

import math
from collections import Counter, defaultdict

import pytest

from dsv41.checkpoint import inventory as inv
from dsv41.core.config import RELEASED, TINY

GIB = 1 << 30


@pytest.fixture(scope="module")
def released():
    return inv.expected_tensors(RELEASED)


@pytest.fixture(scope="module")
def by_name(released):
    return {s.name: s for s in released}


def tiny_config():
    return TINY.replace(engram_num_embeddings=inv.derived_engram_rows(TINY), engram_compressed_vocab_size=700)


def test_released_totals(released):
    total = sum(s.nbytes for s in released)
    assert len(released) == 96_085
    assert total == 510_286_023_000
    assert f"{total / GIB:.2f}" == "475.24"
    assert len({s.name for s in released}) == len(released)


def test_released_category_table(released):
    table = {c: (n, f"{b / GIB:.2f}") for c, (n, b) in inv.category_totals(released).items()}
    assert table == {
        "routed experts": (94_464, "275.67"),
        "Engram": (12, "189.13"),
        "attention": (603, "4.80"),
        "embedding and head": (3, "2.47"),
        "shared experts": (240, "1.32"),
        "vision and aligner": (266, "0.90"),
        "MTP / DSpark": (97, "0.66"),
        "norms and hyper-connections": (400, "0.29"),
    }
    assert list(table) == list(inv.CATEGORIES)


def test_released_namespaces(released):
    counts = Counter(s.name.split(".", 1)[0] for s in released)
    assert counts["layers"] == 93_415
    assert counts["mtp"] == 2_401
    assert counts["vision"] == 259
    assert counts["aligner"] == 4
    for name in ("embed", "head", "norm", "image_start", "image_newline", "image_end"):
        assert counts[name] == 1


def test_released_per_layer_partition(released):
    per_layer = Counter(inv.layer_of(s.name) for s in released)
    counts = {i: per_layer[("layers", i)] for i in range(40)}
    assert counts[1] == 2_340  # Reuse + six Engram tensors
    assert counts[14] == 2_348  # Full + Engram
    assert counts[20] == 2_341  # Full minus compressor.wgate: ratio 1
    for layer in (2, 8):
        assert counts[layer] == 2_342
    for layer in (24, 28, 32, 36):
        assert counts[layer] == 2_337
    reuse = set(range(40)) - {1, 2, 8, 14, 20, 24, 28, 32, 36}
    assert {counts[i] for i in reuse} == {2_334}
    assert [RELEASED.layer_mode(i) for i in (2, 24, 0)] == ["full", "reindex", "reuse"]


def test_mode_deltas_are_the_documented_tensors(released):
    names = defaultdict(set)
    for s in released:
        where = inv.layer_of(s.name)
        if where and where[0] == "layers" and ".engram." not in s.name:
            names[where[1]].add(s.name.split(".", 2)[2])
    reuse, reindex, full, full_ratio1 = names[3], names[24], names[2], names[20]
    assert reindex - reuse == {
        "attn.indexer.wq_b.weight",
        "attn.indexer.wq_b.scale",
        "attn.indexer.weights_proj.weight",
    }
    assert full - reindex == {
        "attn.compressor.wkv.weight",
        "attn.compressor.norm.weight",
        "attn.compressor.wgate.weight",
        "attn.indexer.wk.weight",
        "attn.indexer.k_norm.weight",
    }
    assert full - full_ratio1 == {"attn.compressor.wgate.weight"}
    assert reuse < reindex < full
    assert not any("ape" in n or "tid2eid" in n or "hc_head" in n for n in full)


def test_released_shard_table(released):
    names = inv.shard_names(RELEASED)
    assert len(names) == 48
    assert names[0] == "model-00001-of-00048.safetensors" and names[-1] == "model-00048-of-00048.safetensors"
    count, size = Counter(), Counter()
    for s in released:
        count[s.shard] += 1
        size[s.shard] += s.nbytes
    gib = {n: f"{size[n] / GIB:.2f}" for n in names}
    assert (count[names[0]], gib[names[0]]) == (263, "0.90")  # 259 vision + 4 aligner
    assert (count[names[1]], gib[names[1]]) == (4, "1.23")  # embed + three image markers
    assert (count[names[2]], gib[names[2]]) == (2_334, "6.88")  # layer 0, plain
    assert count[names[3]] == 2_334  # layer 1: its Engram tensors ship in shard 47
    assert (count[names[16]], gib[names[16]]) == (2_342, "6.90")  # layer 14 without its table
    assert count[names[22]] == 2_341  # layer 20
    assert (count[names[26]], gib[names[26]]) == (2_337, "6.89")  # layer 24, Reindex
    assert (count[names[42]], gib[names[42]]) == (2, "1.23")  # head + norm
    for k in (43, 44, 45):
        assert 2.3 < size[names[k]] / GIB < 2.6
    for k in (46, 47):
        assert (count[names[k]], gib[names[k]]) == (6, "94.56")
    assert {s.name for s in released if s.shard == names[46]} == {
        f"layers.1.engram.{n}"
        for n in ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight")
    }
    assert {s.name for s in released if s.shard == names[42]} == {"head.weight", "norm.weight"}


@pytest.mark.parametrize(
    "name, dtype, shape",
    [
        ("layers.0.attn.wq_a.weight", "F8_E4M3", (1280, 5120)),
        ("layers.0.attn.wq_a.scale", "F8_E8M0", (40, 160)),
        ("layers.0.attn.wo_a.weight", "F8_E4M3", (8192, 4096)),
        ("layers.0.attn.wo_a.scale", "F8_E8M0", (256, 128)),
        ("layers.0.attn.attn_sink", "F32", (64,)),
        ("layers.5.ffn.experts.17.w1.weight", "I8", (2304, 2560)),
        ("layers.5.ffn.experts.17.w1.scale", "F8_E8M0", (2304, 160)),
        ("layers.5.ffn.experts.17.w2.weight", "I8", (5120, 1152)),
        ("layers.5.ffn.experts.17.w2.scale", "F8_E8M0", (5120, 72)),
        ("layers.5.ffn.shared_experts.w1.weight", "F8_E4M3", (2304, 5120)),
        ("layers.5.ffn.shared_experts.w1.scale", "F8_E8M0", (72, 160)),
        ("layers.7.ffn.gate.bias_vl", "F32", (384,)),
        ("mtp.1.ffn.gate.bias_vl", "F32", (128,)),
        ("layers.1.engram.embed.weight", "F8_E4M3", (384006168, 256)),
        ("layers.1.engram.embed.scale", "F8_E8M0", (384006168, 8)),
        ("layers.14.engram.embed.weight", "F8_E4M3", (384016682, 256)),
        ("layers.14.engram.wkv.weight", "F8_E4M3", (25600, 6144)),
        ("layers.14.engram.wkv.scale", "F8_E8M0", (800, 192)),
        ("layers.14.engram.q_weight", "BF16", (4, 5120)),
        ("layers.2.attn.compressor.wkv.weight", "BF16", (512, 5120)),
        ("layers.20.attn.compressor.wkv.weight", "BF16", (512, 5120)),
        ("mtp.0.main_proj.weight", "F8_E4M3", (5120, 15360)),
        ("mtp.2.markov_head.embed.weight", "BF16", (129280, 256)),
        ("mtp.2.markov_head.head.weight", "BF16", (129280, 256)),
        ("mtp.2.confidence_head.proj.weight", "BF16", (1, 5376)),
        ("embed.weight", "BF16", (129280, 5120)),
        ("head.weight", "BF16", (129280, 5120)),
    ],
)
def test_released_shapes_match_the_headers(by_name, name, dtype, shape):
    spec = by_name[name]
    assert (spec.dtype, spec.shape) == (dtype, shape)
    assert spec.nbytes == math.prod(shape) * inv.DTYPE_SIZES[dtype]


def test_mtp_asymmetries(by_name):
    assert "mtp.0.main_norm.weight" in by_name and "mtp.1.main_proj.weight" not in by_name
    assert "mtp.2.norm.weight" in by_name and "mtp.0.markov_head.embed.weight" not in by_name
    assert "mtp.0.ffn.experts.127.w3.scale" in by_name and "mtp.0.ffn.experts.128.w1.weight" not in by_name
    assert not any(n.startswith("mtp.") and (".compressor." in n or ".indexer." in n) for n in by_name)


def test_engram_rows_derive_from_the_prime_layout():
    assert inv.derived_engram_rows(RELEASED) == (384006168, 384016682)
    assert inv.derived_engram_rows(RELEASED.replace(engram_n_heads=7)) == (336004849, 336012883)


def test_category_of():
    assert inv.category_of("layers.3.attn_norm.weight") == "attention"
    assert inv.category_of("layers.3.ffn_norm.weight") == "norms and hyper-connections"
    assert inv.category_of("layers.3.ffn.gate.weight") == "norms and hyper-connections"
    assert inv.category_of("layers.3.hc_attn_fn") == "norms and hyper-connections"
    assert inv.category_of("mtp.0.ffn.experts.3.w1.weight") == "routed experts"
    assert inv.category_of("mtp.0.attn.wq_a.weight") == "MTP / DSpark"
    assert inv.category_of("image_newline") == "vision and aligner"
    assert inv.category_of("something.else") == "other"


def test_vision_names_are_one_rule_for_category_and_audit(released):
    assert all(inv.is_vision_name(m) for m in inv.IMAGE_MARKERS)
    assert all(inv.is_vision_name(s.name) == (s.category == inv.VISION) for s in released)
    # a stray image_* tensor counts as vision, as the audit's vision checks and the loader see it
    assert inv.category_of("image_extra") == inv.VISION
    assert not inv.is_vision_name("layers.0.vision_gate") and not inv.is_vision_name("visionary.x")


def test_tiny_needs_its_engram_rows_filled():
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        inv.expected_tensors(TINY)


def test_tiny_inventory_exercises_every_branch():
    cfg = tiny_config()
    specs = inv.expected_tensors(cfg)
    names = {s.name for s in specs}
    assert inv.shard_names(cfg) == sorted({s.shard for s in specs}) and len(inv.shard_names(cfg)) == 16
    assert {cfg.layer_mode(i) for i in range(cfg.n_layers)} == {"full", "reindex", "reuse"}
    assert "layers.2.attn.compressor.wgate.weight" in names  # ratio-2 source
    assert "layers.4.attn.compressor.wkv.weight" in names and "layers.4.attn.compressor.wgate.weight" not in names
    assert {"layers.1.engram.embed.weight", "layers.2.engram.embed.weight"} <= names
    assert all(c in {s.category for s in specs} for c in inv.CATEGORIES)
    for s in specs:  # every quantized tensor has its partner, and FP8 scales use 32x32 blocks
        if s.dtype in ("F8_E4M3", "I8"):
            assert s.name[: -len("weight")] + "scale" in names
    by_name = {s.name: s for s in specs}
    assert by_name["layers.0.ffn.experts.15.w1.weight"].shape == (64, 64)
    assert by_name["layers.0.ffn.experts.15.w1.scale"].shape == (64, 4)
    assert by_name["layers.0.attn.wo_a.scale"].shape == (2, 4)
    assert sum(s.nbytes for s in specs) < 60_000_000


def test_unquantized_config_stores_dense_linears_without_scales():
    specs = {s.name: s for s in inv.expected_tensors(tiny_config().replace(dtype="bf16"))}
    assert specs["layers.0.attn.wq_a.weight"].dtype == "BF16"
    assert "layers.0.attn.wq_a.scale" not in specs
    assert specs["layers.0.ffn.experts.0.w1.weight"].dtype == "I8"  # experts still fp4


# ---------------------------------------------------------------------- configs no inventory can follow
@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"n_layers": 10**9}, "n_layers is 1,000,000,000"),  # was billions of specs: the audit and load hung
        ({"n_mtp_layers": 137438953471}, "n_mtp_layers is 137,438,953,471"),
        ({"n_routed_experts": 10**12}, "n_routed_experts is 1,000,000,000,000"),
        ({"n_routed_experts": 3_000}, "imply up to 724,652 tensors"),
        ({"dim": -1}, "dim is -1"),
        ({"o_groups": 0}, "o_groups is 0"),  # ZeroDivisionError in the builder otherwise
    ],
)
def test_an_absurd_config_is_refused_before_anything_is_enumerated(change, fragment):
    import time

    from dsv41.core.config import ConfigError

    cfg = RELEASED.replace(**change, layout=None)
    for enumerate_it in (inv.expected_tensors, inv.shard_names):
        began = time.perf_counter()
        with pytest.raises(ConfigError, match=fragment) as info:
            enumerate_it(cfg)
        assert time.perf_counter() - began < 1
        assert isinstance(info.value, ValueError)  # what the loader's check_tensors catches
        assert "no tensor inventory is derived from it" in str(info.value)


def test_the_tensor_bound_bounds_the_inventory(released):
    assert len(released) <= RELEASED.inventory_tensor_bound() < 1.01 * len(released)
    for cfg in (
        tiny_config(),
        tiny_config().replace(dtype="bf16"),
        tiny_config().replace(vision_n_layers=0),
        RELEASED.replace(dspark_n_routed_experts=0),
        RELEASED.replace(n_mtp_layers=0, dspark_target_layer_ids=()),
    ):
        assert len(inv.expected_tensors(cfg)) <= cfg.inventory_tensor_bound()
