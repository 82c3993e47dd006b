"""Packed caches: the window ring as FP8 E4M3 + E8M0 per 32, compressed KV as FP4 E2M1 + E4M3 per
16 and index keys as FP4 + E8M0 per 32 (`cache_format="packed"`, the default), decoded when read.

What they must give: the values the in-place quantizers write, bit for bit (so logits equal to the
BF16 storage under every call shape and `Numerics`), rollback and snapshots over the packed bytes,
and the model card's 890 bytes per token measured from the allocated buffers."""

import copy
import random

import pytest
import torch

import dsv41
from dsv41.core.config import RELEASED, TINY
from dsv41.core.numerics import Numerics
from dsv41.generation.generate import generate
from dsv41.model import sequence
from dsv41.model.attention import (
    CACHE_FORMATS,
    COMPRESSED_ENCODING,
    HOLDING,
    INDEX_KEY_ENCODING,
    WINDOW_ENCODING,
    QuantizedCache,
    kv_cache_bytes,
)
from dsv41.model.model import Model
from dsv41.observe import csa2_stats as cs
from dsv41.observe.csa2_stack import AttentionStack

pytestmark = pytest.mark.usefixtures("one_thread")
ENCODINGS = {"window": WINDOW_ENCODING, "compressed": COMPRESSED_ENCODING, "index": INDEX_KEY_ENCODING}
MAX_SEQ = 64


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 differs from +0.0, and NaN payloads count)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _hard_rows(dim: int, dtype) -> torch.Tensor:
    """Rows meant to break a codec: zeros and negative zeros, exact E2M1 / E4M3 rounding ties,
    blocks at the scale floors, bf16 subnormals, huge and mixed magnitudes."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.zeros(dim), -torch.zeros(dim), torch.full((dim,), 6.0), torch.full((dim,), -448.0)]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(dim // 8)  # E2M1 midpoints, amax 6
    rows += [ties, -ties, ties * 2.0**-7, ties * 3.0]
    for scale in (2.0**-133, 2.0**-126, 1e-30, 1e-8, 1e-4 / 448, 2.0**-9, 1.0, 1e4, 1e30, 2.0**120):
        rows.append(torch.randn(dim, generator=g) * scale)
    mixed = torch.randn(dim, generator=g) * torch.logspace(-20, 20, dim)
    rows.append(mixed)
    one_big = torch.randn(dim, generator=g) * 1e-3
    one_big[::16] = 300.0  # one large value per block: everything else rounds to zero or a small code
    rows.append(one_big)
    return torch.stack(rows).to(dtype)[None]  # [1, n, dim]


@pytest.mark.parametrize("name", ENCODINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_bytes_decode_to_the_in_place_quantizers_values_bit_for_bit(name, dtype):
    enc = ENCODINGS[name]
    noise = torch.randn(1, 200, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = torch.cat([_hard_rows(64, dtype), noise], 1)
    want = enc.fake_quantize_(x.clone())
    values, scales = enc.quantize(x)
    assert values.dtype == scales.dtype == torch.uint8
    assert values.shape[-1] == 64 * enc.value_bits // 8 and scales.shape[-1] == 64 // enc.block
    got = enc.decode(values, scales, dtype)
    assert got.dtype == dtype and torch.equal(_bits(got), _bits(want))
    # and a cache hands back those same values
    cache = QuantizedCache(enc, 1, x.size(1), 64, dtype, "packed")
    parts, quantized = cache.quantize(x)
    assert torch.equal(_bits(quantized), _bits(want))
    cache.write(slice(0, x.size(1)), parts)
    assert torch.equal(_bits(cache.read(1)), _bits(want))


def test_a_reset_packed_cache_reads_positive_zeros_like_a_bf16_one():
    for enc in ENCODINGS.values():
        packed, bf16 = (QuantizedCache(enc, 2, 5, 64, torch.bfloat16, f) for f in CACHE_FORMATS)
        x = torch.randn(2, 5, 64)
        for cache in (packed, bf16):
            cache.write(slice(0, 5), cache.quantize(x.bfloat16())[0])
            cache.reset()
            assert torch.equal(_bits(cache.read(2)), _bits(torch.zeros(2, 5, 64, dtype=torch.bfloat16)))


def test_cache_rows_write_read_save_and_load_agree_across_formats():
    g = torch.Generator().manual_seed(2)
    for enc in ENCODINGS.values():
        caches = {f: QuantizedCache(enc, 2, 12, 64, torch.bfloat16, f) for f in CACHE_FORMATS}
        for rows in (slice(0, 7), torch.tensor([9, 3, 11]), slice(7, 8)):
            n = len(range(12)[rows]) if isinstance(rows, slice) else rows.numel()
            x = torch.randn(2, n, 64, generator=g).bfloat16()
            for cache in caches.values():
                cache.write(rows, cache.quantize(x.clone())[0])
        assert torch.equal(caches["packed"].read(2), caches["bf16"].read(2))
        assert torch.equal(caches["packed"].read(1, 5), caches["bf16"].read(1, 5))
        saved = {f: c.save(torch.tensor([3, 4])) for f, c in caches.items()}
        assert all(t.dtype == torch.uint8 for t in saved["packed"]) and saved["bf16"][0].dtype == torch.bfloat16
        before = caches["packed"].read(2)
        overwrite = torch.randn(2, 12, 64, generator=g).bfloat16()
        for f, c in caches.items():
            c.write(slice(0, 12), c.quantize(overwrite.clone())[0])
            c.load(torch.tensor([3, 4]), saved[f])
        assert torch.equal(caches["packed"].read(2)[:, 3:5], before[:, 3:5])
        assert torch.equal(caches["packed"].read(2), caches["bf16"].read(2))
    with pytest.raises(ValueError, match="cache_format must be one of 'packed', 'bf16'"):
        QuantizedCache(WINDOW_ENCODING, 1, 4, 64, torch.bfloat16, "fp8")
    with pytest.raises(ValueError, match="cache_format"):
        AttentionStack(TINY, max_seq_len=8, cache_format="BF16")


# ------------------------------------------------------------------------------ whole model
def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _built_like(model, cache_format: str) -> Model:
    """The same weights, experts and Engram tables in a model whose caches use `cache_format`."""
    twin = Model(
        model.cfg,
        numerics=model.numerics,
        max_batch_size=model.backbone.max_batch_size,
        max_seq_len=model.backbone.max_seq_len,
        tokenizer=model.tokenizer,
        tokenizer_meta=model.tokenizer_meta,
        hasher=copy.deepcopy(model.hasher),
        cache_format=cache_format,
    )
    twin.backbone.load_state_dict(model.backbone.state_dict(), strict=True)
    twin.attach(model.experts, model.engram_tables)
    return twin


@pytest.fixture(scope="module", params=["reference", "parity"])
def pair(request, tiny_checkpoint):
    numerics = Numerics() if request.param == "reference" else Numerics.parity()
    packed = dsv41.load(tiny_checkpoint, quiet=True, numerics=numerics, max_seq_len=MAX_SEQ)
    assert packed.backbone.cache_format == "packed"  # the default
    return packed, _built_like(packed, "bf16")


# prefill, chunks that end inside a ratio-2 group and wrap the 8-slot window, then decode steps
# past where index_topk (8) truncates the ratio-1 selections
CALLS = [13, 7, 9, 1, 3] + [1] * 14


def _run(model, ids, sizes=CALLS) -> torch.Tensor:
    out, at = [], 0
    for size in sizes:
        out.append(model(torch.tensor([ids[at : at + size]]), at, all_positions=True)[0])
        at += size
    return torch.cat(out)


def _cache_values(model) -> list[torch.Tensor]:
    """Every cache of every layer, decoded ([b, rows, dim] in the activation dtype)."""
    out = []
    for block in model.backbone.layers:
        attn = block.attn
        out.append(attn.window_kv_cache.read(1))
        if attn.compressor is not None:
            out += [attn.compress_kv_cache.read(1), attn.indexer.k_cache.read(1)]
    return out


def test_packed_logits_equal_bf16_storage_over_prefill_chunks_and_decode(pair):
    packed, bf16 = pair
    ids = _ids(sum(CALLS), 5)
    a, b = _run(packed, ids), _run(bf16, ids)
    assert a.shape == (sum(CALLS), packed.cfg.vocab_size)
    assert torch.equal(_bits(a), _bits(b))
    # and what the caches hold decodes to the BF16 buffers' values exactly
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(_cache_values(packed), _cache_values(bf16)))
    # the same prompt in one prefill and one token per call, too
    for sizes in ([sum(CALLS)], [1] * 20):
        n = sum(sizes)
        assert torch.equal(_bits(_run(packed, ids[:n], sizes)), _bits(_run(bf16, ids[:n], sizes)))


def test_generation_is_the_same_with_either_storage(pair):
    packed, bf16 = pair
    kw = dict(max_new_tokens=10, stop_at_eos=False, prefill_chunk=5)
    assert generate(packed, _ids(17, 6), **kw).ids == generate(bf16, _ids(17, 6), **kw).ids


def test_rollback_and_snapshots_work_on_the_packed_bytes(pair):
    packed, bf16 = pair
    ids = _ids(40, 7)
    for model in pair:
        _run(model, ids[:25], [11, 6, 1, 1, 1, 5])
    snap = sequence.snapshot(packed)
    assert all(t.dtype == torch.uint8 for saved in snap.attention.layers for t in saved.window)
    assert all(t.dtype == torch.bfloat16 for saved in sequence.snapshot(bf16).attention.layers for t in saved.window)
    # roll back over a group flush and a ring wrap, continue, and compare with the BF16 model doing the same
    results = []
    for model in pair:
        sequence.rollback(model, 6)
        cont = [model(torch.tensor([ids[p : p + 1]]), p, all_positions=True)[0] for p in range(19, 30)]
        results.append(torch.cat(cont))
    assert torch.equal(_bits(results[0]), _bits(results[1]))
    # a fresh sequence that never went past 19 positions gives the same
    packed.reset()
    fresh = _run(packed, ids[:30], [11, 6, 1, 1] + [1] * 11)[19:]
    assert torch.equal(_bits(fresh), _bits(results[0]))
    # restore the snapshot (25 positions) and continue: as if nothing happened since
    sequence.restore(packed, snap)
    after = packed(torch.tensor([ids[25:31]]), 25, all_positions=True)[0]
    packed.reset()
    straight = _run(packed, ids[:31], [11, 6, 1, 1, 1, 5, 6])[25:]
    assert torch.equal(_bits(after), _bits(straight))


# ------------------------------------------------------------------------------ bytes
def _buffer_bytes(module) -> int:
    return sum(b.numel() * b.element_size() for n, b in module.named_buffers() if not n.endswith("freqs_cis"))


def test_measured_bytes_per_token_on_the_tiny_checkpoint(pair):
    packed, bf16 = pair
    got = packed.cache_bytes()
    # head_dim 64 and index_head_dim 32: FP4 latent 32 + 4 E4M3 scales, FP4 key 16 + 1 E8M0 scale
    assert got.per_token_by_source == {2: (32 + 4 + 16 + 1) / 2, 4: 32 + 4 + 16 + 1}
    assert got.per_token["total"] == kv_cache_bytes(TINY).per_token == 79.5
    assert bf16.cache_bytes().per_token["total"] == kv_cache_bytes(TINY, "runtime").per_token == 288
    for model in pair:  # every allocated cache byte is accounted for, and nothing else
        assert model.cache_bytes().total == _buffer_bytes(model.backbone)
    assert got.components["window ring"] == TINY.n_layers * TINY.window_size * (64 + 2)
    assert got.sources == ((2, 2, MAX_SEQ, 32 * 36, 32 * 17), (4, 1, MAX_SEQ, 64 * 36, 64 * 17))
    assert "79.5 B/token" in got.summary()


@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
def test_bytes_per_position_added_equal_the_formula(cache_format):
    holding = HOLDING[cache_format]
    for cfg in (TINY, RELEASED):
        formula = kv_cache_bytes(cfg, holding)
        sizes = {L: cs.measured_cache_bytes(cfg, L, cache_format=cache_format) for L in (300, 301, 302, 812)}
        # two positions more add one row to every ratio-2 cache and two to every ratio-1 cache
        assert (sizes[302].total - sizes[300].total) / 2 == formula.per_token
        assert (sizes[812].long_term - sizes[300].long_term) / 512 == formula.per_token
        # an odd length holds its last position in no compressed row of a ratio-2 source (the ring has it)
        assert sizes[301].total - sizes[300].total == sum(s.per_entry for s in formula.sources if s.ratio == 1)
        for L, got in sizes.items():
            assert got.total == formula.total(L) and got.fixed == formula.fixed
            assert got.per_token["total"] == formula.per_token  # each source over the positions it holds
    # a stack built on the meta device reports what a real one allocates
    real = AttentionStack(TINY, max_seq_len=37, cache_format=cache_format)
    assert real.cache_bytes() == cs.measured_cache_bytes(TINY, 37, cache_format=cache_format)
    assert real.cache_bytes().components == cs.allocated_cache_bytes(real)
    assert real.cache_bytes().total == _buffer_bytes(real)


def test_released_geometry_measures_the_model_cards_890_bytes_per_token():
    got = cs.measured_cache_bytes(RELEASED, 512)
    assert got.per_token == {"compressed KV": 3 * 288 / 2 + 288, "index keys": 3 * 68 / 2 + 68, "total": 890}
    assert got.per_token_by_source == {2: 178, 8: 178, 14: 178, 20: 356}
    assert got.parts["compressed KV data"] == (3 * 256 + 2 * 256) * 256  # 3 sources x 256 rows + 1 x 512
    assert got.components["window ring"] == 40 * 128 * (512 + 16)
    assert got.components["compressor tails"] == 3 * 2 * 2 * 512 * 4
    # a million positions (2**20): 890 B each plus the fixed window rings and compressor tails
    million = cs.measured_cache_bytes(RELEASED, 2**20)
    assert million.total == 890 * 2**20 + 2_703_360 + 24_576 == 935_960_576
    assert cs.measured_cache_bytes(RELEASED, 2**20, cache_format="bf16").total == 3_360_710_656


# ------------------------------------------------------------------------------ released-size rows
def _released_rows_cfg():
    """The tiny geometry with the released cache rows: head_dim 512, index_head_dim 128, a 128-slot
    window (wider than one sparse_attn chunk), rope_head_dim 64."""
    return TINY.replace(
        head_dim=512,
        index_head_dim=128,
        rope_head_dim=64,
        window_size=128,
        index_topk=16,
        candidate_topk_blocks=4,
        candidate_block_size=8,
    )


def _stack_outputs(stack, x, sizes):
    stack.reset_state()
    out, at = [], 0
    for size in sizes:
        out.append(stack.forward_each(x[:, at : at + size], at))
        at += size
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("numerics", [Numerics(), Numerics.parity()], ids=["reference", "parity"])
def test_released_row_sizes_give_the_same_outputs_packed_and_bf16(numerics):
    cfg = _released_rows_cfg()
    x = torch.randn(1, 300, cfg.dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    sizes = [150, 7, 64, 1, 1, 77]  # the window ring wraps in a chunk and across decode steps
    outs = [
        _stack_outputs(AttentionStack(cfg, numerics=numerics, max_seq_len=300, seed=1, cache_format=f), x, sizes)
        for f in CACHE_FORMATS
    ]
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))


def test_a_decode_step_decodes_only_the_selected_compressed_rows(monkeypatch):
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=4)
    x = torch.randn(1, 40, TINY.dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    stack(x[:, :39], 0)
    gathered = []
    real = QuantizedCache.gather

    def counting(self, bsz, rows):
        gathered.append(rows.numel())
        return real(self, bsz, rows)

    monkeypatch.setattr(QuantizedCache, "gather", counting)
    stack(x[:, 39:40], 39)
    readers = [i for i, r in enumerate(TINY.compress_ratios[: TINY.n_layers]) if r]
    assert len(gathered) == len(readers)  # one gather per layer reading compressed KV
    # the ratio-1 readers reach 40 rows, more than index_topk: decoding them all is what this avoids
    assert all(0 < n <= TINY.index_topk < 40 for n in gathered)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_caches_on_cuda_equal_bf16_storage():
    cfg = _released_rows_cfg()
    x = torch.randn(1, 300, cfg.dim, generator=torch.Generator().manual_seed(3)).bfloat16().cuda()
    outs = []
    for f in CACHE_FORMATS:
        stack = AttentionStack(cfg, max_seq_len=300, seed=1, cache_format=f).cuda()
        outs.append(_stack_outputs(stack, x, [150, 7, 64, 1, 1, 77]).cpu())
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))


def test_load_takes_the_cache_format_and_refuses_an_unknown_one(tiny_checkpoint):
    import dsv41

    packed, bf16 = dsv41.load(tiny_checkpoint, quiet=True), dsv41.load(tiny_checkpoint, quiet=True, cache_format="bf16")
    assert packed.backbone.cache_format == "packed" and bf16.backbone.cache_format == "bf16"
    ids = packed.encode("Both formats, the same logits")
    assert torch.equal(packed(ids, 0, all_positions=True), bf16(ids, 0, all_positions=True))
    assert packed.cache_bytes().per_token["total"] < bf16.cache_bytes().per_token["total"]
    with pytest.raises(ValueError, match="cache_format"):
        dsv41.load(tiny_checkpoint, quiet=True, cache_format="fp16")
