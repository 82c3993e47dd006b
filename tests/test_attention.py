"""CSA2 attention on the tiny geometry: modes, caches, parity, causality, candidate blocks,
stale index keys, and the ties that are the only thing allowed to split prefill from decode.

TINY: 8 layers, ratios (0, 0, 2, 2, 1, 1, 1, 0), Full layers 2 (ratio 2) and 4 (ratio 1, also the
candidate source), Reindex layer 6, Reuse layers 3 and 5, pure window layers 0, 1, 7; window 8,
index_topk 8, candidate blocks 4 x 2.
"""

import dataclasses

import pytest
import torch

from dsv41.core.config import TINY
from dsv41.core.numerics import WINDOW_LAYOUTS, Numerics
from dsv41.kernels import SPARSE_ATTN_CHUNK, fp4_act_quant, sparse_attn
from dsv41.model.attention import (
    Attention,
    AttentionRuntime,
    Compressor,
    candidate_block_scores,
    select_candidate_blocks,
)
from dsv41.model.attention import layer as attention_layer
from dsv41.model.attention import state as attention_state
from dsv41.model.layers import apply_rotary_emb, init_random_, precompute_freqs_cis
from dsv41.model.trace import Trace
from dsv41.observe.csa2_stack import AttentionStack

# wide enough that nothing is truncated at the lengths used here: every reachable position kept
WIDE = dataclasses.replace(TINY, index_topk=64, candidate_topk_blocks=64)
MAX_SEQ = 64
FULL, REINDEX, REUSE = (2, 4), (6,), (0, 1, 3, 5, 7)
# the parity options, with both orders scoring the same index keys
PARITY_FIXED_KEYS = Numerics.parity()  # both orders score the same index keys, equal scores tie one way
# the same, but equal scores left to torch.topk as the reference does: ties are all that can part
PARITY_TOPK_TIES = Numerics.parity().with_options(tie_break="topk")

pytestmark = pytest.mark.usefixtures("one_thread")


def _x(seqlen, seed=0, batch=1):
    return torch.randn(batch, seqlen, TINY.dim, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _both_orders(stack, x, method="forward"):
    """(prefill output, decode output, prefill trace, decode trace), each from a reset state."""
    run = getattr(stack, method)
    axis = 1 if method == "forward" else 2
    tp, td = Trace(keep_index_scores=True), Trace(keep_index_scores=True)
    stack.reset_state()
    with tp.recording(stack.sites):
        pre = run(x, 0)
    stack.reset_state()
    with td.recording(stack.sites):
        dec = torch.cat([run(x[:, p : p + 1], p) for p in range(x.size(1))], dim=axis)
    return pre, dec, tp, td


def _grouped(stack, x, method="forward"):
    pre, dec, tp, td = _both_orders(stack, x, method)
    return pre, dec, tp.attention_by_layer(), td.attention_by_layer()


# ------------------------------------------------------------------------------ structure
def test_modes_own_exactly_their_checkpoint_tensors_in_runtime_dtypes():
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ)
    common = {
        "attn_sink",
        "wq_a.weight",
        "wq_a.scale",
        "q_norm.weight",
        "wq_b.weight",
        "wq_b.scale",
        "wkv.weight",
        "wkv.scale",
        "kv_norm.weight",
        "wo_a.weight",
        "wo_b.weight",
        "wo_b.scale",
    }
    index_q = {"indexer.wq_b.weight", "indexer.wq_b.scale", "indexer.weights_proj.weight"}
    full = index_q | {"compressor.wkv.weight", "compressor.norm.weight", "indexer.wk.weight", "indexer.k_norm.weight"}
    for i, layer in enumerate(stack.layers):
        names = {n for n, _ in layer.named_parameters()}
        extra = {2: full | {"compressor.wgate.weight"}, 4: full, 6: index_q}.get(i, set())
        assert names == common | extra, i
        assert layer.mode == TINY.layer_mode(i)
    p = dict(stack.named_parameters())
    assert p["layers.2.compressor.wkv.weight"].dtype == torch.float32
    assert p["layers.2.compressor.wgate.weight"].dtype == torch.float32
    assert p["layers.4.compressor.wkv.weight"].dtype == torch.bfloat16  # ratio 1: no fp32 promotion
    assert p["layers.0.wo_a.weight"].dtype == torch.bfloat16  # FP8 on disk, BF16 at runtime
    assert p["layers.0.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert p["layers.0.attn_sink"].dtype == torch.float32
    assert p["layers.2.indexer.wk.weight"].dtype == torch.bfloat16
    assert p["layers.6.indexer.weights_proj.weight"].dtype == torch.bfloat16
    # only Full layers hold compressed-KV and index-key caches; packed: raw bytes plus scales
    for i, layer in enumerate(stack.layers):
        bufs = dict(layer.named_buffers())
        assert ("compress_kv_cache.values" in bufs) == (i in FULL)
        assert ("indexer.k_cache.values" in bufs) == (i in FULL)
        assert bufs["window_kv_cache.values"].shape == (1, TINY.window_size, TINY.head_dim)
        assert bufs["window_kv_cache.scales"].shape == (1, TINY.window_size, TINY.head_dim // 32)
        if i in FULL:
            rows = MAX_SEQ // TINY.compress_ratios[i]
            assert bufs["compress_kv_cache.values"].shape == (1, rows, TINY.head_dim // 2)
            assert bufs["compress_kv_cache.scales"].shape == (1, rows, TINY.head_dim // 16)
            assert bufs["indexer.k_cache.values"].shape == (1, rows, TINY.index_head_dim // 2)
            assert bufs["indexer.k_cache.scales"].shape == (1, rows, TINY.index_head_dim // 32)
            kv_values, kv_scales = layer.compress_kv_cache.stored()
            assert (kv_values.dtype, kv_scales.dtype) == (torch.float4_e2m1fn_x2, torch.float8_e4m3fn)
            assert [t.dtype for t in layer.indexer.k_cache.stored()] == [torch.float4_e2m1fn_x2, torch.float8_e8m0fnu]
        assert [t.dtype for t in layer.window_kv_cache.stored()] == [torch.float8_e4m3fn, torch.float8_e8m0fnu]
    old = AttentionStack(TINY, max_seq_len=MAX_SEQ, cache_format="bf16")
    for i, layer in enumerate(old.layers):
        bufs = dict(layer.named_buffers())
        assert bufs["window_kv_cache.values"].dtype == torch.bfloat16 and "window_kv_cache.scales" not in bufs
        if i in FULL:
            assert bufs["compress_kv_cache.values"].shape == (1, MAX_SEQ // TINY.compress_ratios[i], TINY.head_dim)


def test_rope_tables_compressed_layers_yarn_window_layers_plain():
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ)
    yarn = precompute_freqs_cis(
        TINY.rope_head_dim,
        MAX_SEQ,
        TINY.original_seq_len,
        TINY.compress_rope_theta,
        TINY.rope_factor,
        TINY.beta_fast,
        TINY.beta_slow,
    )
    plain = precompute_freqs_cis(TINY.rope_head_dim, MAX_SEQ, 0, TINY.rope_theta, 1, 32, 1)
    for i, layer in enumerate(stack.layers):
        assert torch.equal(layer.freqs_cis, yarn if TINY.compress_ratios[i] else plain), i
    assert not torch.equal(yarn, plain)


# ------------------------------------------------------------------------------ compressor
def test_compressor_pools_with_a_float32_softmax_gate_and_carries_the_partial_group():
    comp = init_random_(Compressor(TINY, 2, max_batch_size=1), 5)
    x = _x(5, seed=1)
    out = comp(x, 0)  # 5 tokens at ratio 2: groups (0,1), (2,3); token 4 waits
    assert out.shape == (1, 2, TINY.head_dim) and out.dtype == torch.bfloat16
    kv = x.float() @ comp.wkv.weight.T
    gate = x.float() @ comp.wgate.weight.T
    for g in range(2):
        w = gate[0, 2 * g : 2 * g + 2].softmax(dim=0)
        pooled = (kv[0, 2 * g : 2 * g + 2] * w).sum(0)
        torch.testing.assert_close(
            out[0, g].float(), comp.norm(pooled.bfloat16()[None])[0].float(), atol=0.02, rtol=0.02
        )
    torch.testing.assert_close(comp.kv_state[0, 0], (x[0, 4:5].float() @ comp.wkv.weight.T)[0], rtol=1e-5, atol=1e-6)
    x5 = _x(1, seed=2)
    done = comp(x5, 5)  # position 5 completes group (4, 5), pooled from the carried token 4
    both = torch.cat([x[:, 4:5], x5], dim=1)
    fresh = init_random_(Compressor(TINY, 2), 5)
    assert torch.equal(done, fresh(both, 0))
    assert comp(_x(1, seed=3), 6) is None  # half a group: nothing to emit


def test_ratio_one_compressor_has_no_gate_and_emits_every_token():
    comp = init_random_(Compressor(TINY, 4), 0)
    assert not hasattr(comp, "wgate") and not hasattr(comp, "kv_state")
    assert comp(_x(3), 0).shape == (1, 3, TINY.head_dim)
    assert comp(_x(1), 3).shape == (1, 1, TINY.head_dim)


@pytest.mark.parametrize("cache_format", ["packed", "bf16"])
def test_compressed_kv_and_index_keys_rotate_at_their_groups_first_token(cache_format):
    layer = init_random_(Attention(TINY, 2, max_seq_len=MAX_SEQ, cache_format=cache_format), 9)
    probe = init_random_(Attention(TINY, 2, max_seq_len=MAX_SEQ), 9)  # same weights, untouched state
    x = _x(7, seed=4)
    layer(x, 0, AttentionRuntime())
    latent = probe.compressor(x, 0)  # pre-RoPE latents of groups 0..2
    rd = TINY.rope_head_dim
    for g in range(3):
        for pos, should_match in ((2 * g, True), (2 * g + 1, False)):
            kv = latent[:, g : g + 1].clone()
            apply_rotary_emb(kv[..., -rd:], layer.freqs_cis[pos : pos + 1])
            fp4_act_quant(kv, 16, inplace=True, scale_dtype=torch.float8_e4m3fn)
            assert torch.equal(layer.compress_kv_cache.read(1)[0, g], kv[0, 0]) == should_match, (g, pos)
            # the index key: wk of the latent *before* RoPE and quantization, then its own RoPE + FP4
            k = probe.indexer.k_norm(probe.indexer.wk(latent[:, g : g + 1]))
            apply_rotary_emb(k[..., -rd:], layer.freqs_cis[pos : pos + 1])
            fp4_act_quant(k, 32, inplace=True)
            assert torch.equal(layer.indexer.k_cache.read(1)[0, g], k[0, 0]) == should_match, (g, pos)


# ------------------------------------------------------------------------------ candidates
def test_the_block_being_filled_is_kept_even_when_an_older_full_block_outscores_it():
    inf = float("inf")
    # 7 reachable positions in blocks of 2: blocks 0..2 full, block 3 holds only position 6
    logits = torch.tensor([[5.0, 4.0, 9.0, 8.0, 7.0, 6.0, 0.5, -inf]])
    mask = select_candidate_blocks(logits, 7, topk_blocks=2, block_size=2)
    assert mask.shape == logits.shape and mask.dtype == torch.bool
    # the two best blocks by best position are 1 (9.0) and 2 (7.0); the filling block 3 (0.5)
    # displaces block 2 rather than losing to it
    assert mask.tolist() == [[False, False, True, True, False, False, True, True]]
    scores = candidate_block_scores(logits, 7, 2)
    assert scores.tolist() == [[5.0, 9.0, 7.0, inf]]
    # unreachable blocks are never kept, even with picks to spare
    few = torch.tensor([[1.0, 2.0, -inf, -inf, -inf, -inf]])
    assert select_candidate_blocks(few, 2, topk_blocks=3, block_size=2).tolist() == [[True, True] + [False] * 4]
    # prefill form: one compress length per query row
    rows = torch.tensor([[3.0, 1.0, -inf, -inf], [3.0, 1.0, 2.0, -inf], [3.0, 1.0, 2.0, 0.0]])
    lens = torch.tensor([[2], [3], [4]])
    assert select_candidate_blocks(rows, lens, 1, 2).tolist() == [
        [True, True, False, False],
        [False, False, True, True],
        [False, False, True, True],
    ]


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_token_by_token_decode_are_bit_identical_when_nothing_is_truncated(batch):
    stack = AttentionStack(WIDE, max_batch_size=batch, max_seq_len=MAX_SEQ, seed=0, numerics=PARITY_FIXED_KEYS)
    x = _x(21, seed=11, batch=batch)
    pre, dec, tp, td = _grouped(stack, x)
    assert pre.shape == x.shape and torch.isfinite(pre.float()).all()
    assert torch.equal(pre, dec)
    assert not torch.equal(pre, x)  # the layers did something
    for layer in (2, 3, 4, 5, 6):
        assert torch.equal(tp[layer]["selected"], td[layer]["selected"]), layer
    if batch == 2:  # rows of a batch do not see each other
        single = AttentionStack(WIDE, max_seq_len=MAX_SEQ, seed=0, numerics=PARITY_FIXED_KEYS)
        assert torch.equal(single(x[1:], 0), pre[1:])


def _sparse_attn_calls(monkeypatch):
    """Record every sparse_attn call the attention layers make: (topk_idxs, kv, output) per call."""
    calls = []

    def recording(q, kv, sink, idxs, scale):
        out = sparse_attn(q, kv, sink, idxs, scale)
        calls.append((idxs.clone(), kv.clone(), out.clone()))
        return out

    monkeypatch.setattr(attention_layer, "sparse_attn", recording)
    return calls


@pytest.mark.parametrize("layout", WINDOW_LAYOUTS)
def test_a_window_wider_than_one_sparse_attn_chunk(monkeypatch, layout):
    # sparse_attn folds a row into an online softmax 64 columns at a time, so bits depend on which
    # columns share a chunk. While the ring fills, the reference's decode row puts the empty slots
    # first and its present positions end at the last column, where the prefill row starts them at
    # the first: from position window - 64 on they straddle the chunk boundary at another place.
    # Once the ring is full both list the same positions oldest first.
    win = SPARSE_ATTN_CHUNK + 8
    cfg = dataclasses.replace(TINY, window_size=win)
    # a pure window layer
    layer = init_random_(Attention(cfg, 0, numerics=Numerics(window_layout=layout), max_seq_len=96), 0)
    x, rt, n = _x(90, seed=21), AttentionRuntime(), 90
    calls = _sparse_attn_calls(monkeypatch)
    pre = layer(x, 0, rt)
    layer.reset_state()
    dec = torch.cat([layer(x[:, p : p + 1], p, rt) for p in range(n)], dim=1)
    attn_pre, kv = calls[0][2][0], calls[0][1]  # [s, heads, head_dim] bf16, every position's KV
    attn_dec = torch.cat([out[0] for _, _, out in calls[1:]])
    if layout == "uniform":
        assert torch.equal(pre, dec) and torch.equal(attn_pre, attn_dec)
        return
    differ = (pre != dec).any(-1)[0].nonzero().flatten().tolist()
    assert differ and set(differ) <= set(range(win - SPARSE_ATTN_CHUNK, win - 1))
    assert torch.equal(pre[:, win - 1 :], dec[:, win - 1 :])
    # the same sums in another grouping; the weights are rounded to bf16 against each chunk's
    # running max, so the two can part by a bf16 rounding of the weights, times at most the largest value
    assert not torch.equal(attn_pre, attn_dec)
    bound = torch.finfo(torch.bfloat16).eps * kv.float().abs().max()
    assert (attn_pre.float() - attn_dec.float()).abs().max() <= bound


def _expected_window_row(p, start_pos, seqlen, win, layout):
    """The window columns of the query at position p, from the layouts' definitions: positions
    oldest first over the last `win` (a prefill row of the reference: min(seqlen, win) columns),
    as prefill rows (row = position) or ring slots (position % win)."""
    if layout == "reference" and start_pos > 0:
        # the whole ring from the slot after the newest; positions before 0 are unwritten slots
        return [q % win if q >= 0 else -1 for q in range(p - win + 1, p + 1)]
    width = min(seqlen, win) if layout == "reference" else win
    first = max(0, p - win + 1)
    rows = [q if start_pos == 0 else q % win for q in range(first, first + width)]
    return [r if q <= p else -1 for q, r in zip(range(first, first + width), rows)]


@pytest.mark.parametrize("layout", WINDOW_LAYOUTS)
def test_index_rows_handed_to_sparse_attn(monkeypatch, layout):
    win, k = TINY.window_size, TINY.index_topk
    assert win > 5 and AttentionStack(TINY, max_seq_len=MAX_SEQ).numerics.window_layout == "reference"  # the default
    numerics = Numerics(fix_stale_index_keys=True, window_layout=layout)
    x = _x(2 * win + 4, seed=22)
    prefills = (5, 2 * win)  # a prefill narrower than the window, and one past it

    def run(cache_format):
        stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=8, numerics=numerics, cache_format=cache_format)
        calls, trace = _sparse_attn_calls(monkeypatch), Trace()
        with trace.recording(stack.sites):
            for n_pre in prefills:
                stack.reset_state()
                stack(x[:, :n_pre], 0)
                for p in range(n_pre, x.size(1)):
                    stack(x[:, p : p + 1], p)
        return calls, trace

    # packed storage hands sparse_attn only the selected compressed rows, renumbered: every column
    # gathers the same row as the BF16 storage's reference-shaped kv (and -1 stays -1)
    packed, _ = run("packed")
    calls, trace = run("bf16")
    assert len(packed) == len(calls) == len(trace.attention)
    for (idx_p, kv_p, out_p), (idx_b, kv_b, out_b) in zip(packed, calls):
        assert torch.equal(idx_p == -1, idx_b == -1) and torch.equal(out_p, out_b)
        assert torch.equal(kv_p[0][idx_p[0].clamp_min(0).long()], kv_b[0][idx_b[0].clamp_min(0).long()])
    for (idxs, _, _), rec in zip(calls, trace.attention):
        start, s = rec.start_pos, rec.seqlen
        n_kv = s if start == 0 else win  # window KV rows ahead of the compressed ones
        width = min(s, win) if layout == "reference" and start == 0 else win
        n_sel = 0
        if rec.compress_ratio:
            reach = (start + s) // rec.compress_ratio
            n_sel = min(k, reach) if layout == "reference" else k
        assert idxs.shape == (1, s, width + n_sel), (layout, rec.layer, start, s)
        for i, p in enumerate(range(start, start + s)):
            assert idxs[0, i, :width].tolist() == _expected_window_row(p, start, s, win, layout), (rec.layer, p)
            if rec.compress_ratio:  # the selection the trace records, shifted past the window rows
                sel = rec.selected[0, i]
                assert idxs[0, i, width:].tolist() == [t + n_kv if t >= 0 else -1 for t in sel[:n_sel].tolist()]
                assert (sel[n_sel:] == -1).all()


def test_an_unknown_window_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="window_layout must be one of 'reference', 'uniform'"):
        AttentionStack(TINY, max_seq_len=MAX_SEQ, numerics=Numerics(window_layout="oldest-first"))


def test_stale_key_default_is_also_bit_identical_when_nothing_is_truncated():
    # with every reachable position selected the scores do not matter, stale keys or not
    stack = AttentionStack(WIDE, max_seq_len=MAX_SEQ, seed=1, numerics=Numerics.parity())
    pre, dec, _, _ = _grouped(stack, _x(17, seed=12))
    assert torch.equal(pre, dec)


def test_selections_are_causal_sorted_and_minus_one_padded():
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=2, numerics=Numerics(fix_stale_index_keys=True))
    for trace in _grouped(stack, _x(26, seed=13), "forward_each")[2:]:
        for layer, ratio in enumerate(TINY.compress_ratios[: TINY.n_layers]):
            if not ratio:
                assert "selected" not in trace[layer]
                continue
            sel, reach = trace[layer]["selected"][0], trace[layer]["reachable"]  # [n, index_topk], [n]
            assert sel.shape[-1] == TINY.index_topk
            n_present = (sel >= 0).sum(-1)
            for q in range(sel.size(0)):
                row = sel[q]
                present = row[: n_present[q]]
                assert (row[n_present[q] :] == -1).all()  # padding only at the tail
                assert (present < reach[q]).all() and (present >= 0).all()  # nothing from the future
                assert (present[1:] > present[:-1]).all()  # sorted, no repeats
                if layer in REINDEX:  # -inf picks outside the candidate pool may fall on unreachable rows
                    assert n_present[q] <= min(int(reach[q]), TINY.index_topk)
                else:
                    assert n_present[q] == min(int(reach[q]), TINY.index_topk)
    # with a wide top-k every reachable position is taken
    wide = AttentionStack(WIDE, max_seq_len=MAX_SEQ, seed=2)
    _, _, tp, _ = _grouped(wide, _x(12, seed=13))
    sel = tp[4]["selected"][0]
    for q in range(12):
        assert sel[q, : q + 1].tolist() == list(range(q + 1))


# ------------------------------------------------------------------------------ ownership
def _snapshot(stack):
    bufs = {
        (i, n): b.clone() for i, layer in enumerate(stack.layers) for n, b in layer.named_buffers() if n != "freqs_cis"
    }
    rt = stack.runtime
    pub = {
        "compress_kv": rt.compress_kv_from,
        "index_k": rt.index_k_from,
        "topk": rt.topk_from,
        "candidates": rt.candidates_from,
        "topk_obj": rt.topk,
        "cand_obj": rt.candidates,
    }
    return bufs, pub


def _differs(a, b):
    # published tensors compare by identity (was a new selection published?), publishers by value
    return a is not b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a != b


# TINY's last Full layer compresses at ratio 1 and so publishes its index keys on every call; with
# the ratios swapped it compresses at 2, and a call completing none of its groups leaves the
# ratio-1 layer's keys published (with the reference's stale keys)
LAST_SOURCE_AT_RATIO_2 = dataclasses.replace(TINY, compress_ratios=(0, 0, 1, 1, 2, 2, 2, 0, 0, 0, 0))


@pytest.mark.parametrize("fix", [True, False])
@pytest.mark.parametrize("cfg, start, keep_end", [(TINY, 7, 10), (LAST_SOURCE_AT_RATIO_2, 8, 9)])
def test_cutting_a_call_short_in_place_equals_running_the_shorter_call(fix, cfg, start, keep_end):
    # the undo record of a call over [start, 13) is enough to leave every cache, the compressor's
    # partial group and what the runtime publishes as a call over [start, keep_end) would have
    numerics = Numerics.parity().with_options(fix_stale_index_keys=fix)
    cut, whole = (AttentionStack(cfg, max_seq_len=MAX_SEQ, seed=9, numerics=numerics) for _ in range(2))
    x = _x(13, seed=30)
    with torch.inference_mode():
        for stack in (cut, whole):
            stack(x[:, :start], 0)
        rows = attention_state.capture(cut.layers, cut.runtime, start, 13)
        assert [r.tail is not None for r in rows.layers] == [
            layer.ratio > 1 and layer.mode == "full" for layer in cut.layers
        ]
        cut(x[:, start:], start)
        assert attention_state.truncatable(cut.layers, start, 13)
        attention_state.truncate(cut.layers, cut.runtime, rows, keep_end)
        whole(x[:, start:keep_end], start)
        for a, b in zip(cut.layers, whole.layers):
            for (name, buf), (_, want) in zip(a.named_buffers(), b.named_buffers()):
                assert torch.equal(buf, want), (a.layer, name)
        got, want = cut.runtime.published(), whole.runtime.published()
        assert (got.compress_kv_from, got.index_k_from) == (want.compress_kv_from, want.index_k_from)
        assert got.index_k is cut.layers[got.index_k_from].indexer.k_cache
        if cfg is LAST_SOURCE_AT_RATIO_2 and not fix:
            assert got.index_k_from == 2  # not layer 4, which published last before the call
        assert torch.equal(cut(x[:, keep_end:12], keep_end), whole(x[:, keep_end:12], keep_end))


def test_caches_and_runtime_slots_are_written_only_by_their_owners():
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=3, numerics=Numerics(fix_stale_index_keys=True))
    x = _x(10, seed=14)
    calls = [(x[:, :7], 0)] + [(x[:, p : p + 1], p) for p in range(7, 10)]
    for chunk, pos in calls:
        for i, layer in enumerate(stack.layers):
            before_bufs, before_pub = _snapshot(stack)
            layer(chunk, pos, stack.runtime)
            after_bufs, after_pub = _snapshot(stack)
            changed = {key for key in before_bufs if not torch.equal(before_bufs[key], after_bufs[key])}
            assert {owner for owner, _ in changed} <= {i}, (pos, i, changed)
            assert (i, "window_kv_cache.values") in changed  # every layer keeps its own window
            if i in FULL and pos == 0:
                assert {(i, "compress_kv_cache.values"), (i, "indexer.k_cache.values")} <= changed
            rt = stack.runtime
            moved = {k for k in before_pub if _differs(before_pub[k], after_pub[k])}
            if i in FULL:
                assert rt.compress_kv_from == i and rt.compress_kv is layer.compress_kv_cache
                assert rt.index_k_from == i and rt.index_k is layer.indexer.k_cache
            else:
                assert not moved & {"compress_kv", "index_k"}, (pos, i)
            if i in FULL + REINDEX:
                assert rt.topk_from == i and "topk_obj" in moved
            else:
                assert not moved & {"topk", "topk_obj"}, (pos, i)
            if i == TINY.candidate_source_layer:
                assert rt.candidates_from == i and "cand_obj" in moved
            else:
                assert "cand_obj" not in moved, (pos, i)


def test_reset_state_clears_every_cache_and_two_stacks_share_nothing():
    a = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=4)
    b = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=4)
    x, y = _x(12, seed=15), _x(12, seed=16)

    def decode(stack, seq):
        return torch.cat([stack(seq[:, p : p + 1], p) for p in range(seq.size(1))], 1)

    ref_x, ref_y = decode(a, x), decode(b, y)
    # interleaving two stacks' calls changes nothing: no state lives outside the objects
    a.reset_state(), b.reset_state()
    out_x, out_y = [], []
    for p in range(12):
        out_x.append(a(x[:, p : p + 1], p))
        out_y.append(b(y[:, p : p + 1], p))
    assert torch.equal(torch.cat(out_x, 1), ref_x) and torch.equal(torch.cat(out_y, 1), ref_y)
    assert not torch.equal(ref_x, ref_y)
    a.reset_state()
    assert all(
        not buf.any()
        for layer in a.layers
        for n, buf in layer.named_buffers()
        if n not in ("freqs_cis", "compressor.score_state")
    )
    assert (a.layers[2].compressor.score_state == -torch.inf).all()
    assert a.runtime.topk is None and a.runtime.index_k is None and a.runtime.compress_kv is None


def test_calls_out_of_order_fail_with_a_sentence():
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=0)
    with pytest.raises(RuntimeError, match="layer 3 reuses"):
        stack.layers[3](_x(4), 0, stack.runtime)
    with pytest.raises(ValueError, match="exceed the caches"):
        stack(_x(MAX_SEQ + 1), 0)


# ------------------------------------------------------------------------------ index scores
def test_trace_records_the_kth_and_next_index_scores_per_query():
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=5, numerics=Numerics(fix_stale_index_keys=True))
    trace = Trace(keep_index_scores=True)
    with trace.recording(stack.sites):
        stack.forward_each(_x(30, seed=17), 0)
    k = TINY.index_topk
    n_truncated = n_ties = 0
    for rec in trace.attention:
        if rec.layer not in FULL + REINDEX:
            assert rec.kth_score is None
            continue
        scores, sel = rec.index_scores[0], rec.selected[0]  # [s, T], [s, k]
        for q in range(rec.seqlen):
            reach = int(rec.reachable[q])
            kth, nxt = rec.kth_score[0, q], rec.next_score[0, q]
            if reach <= k:
                assert kth.isnan() and nxt.isnan()
                continue
            n_truncated += 1
            ranked = scores[q, :reach].sort(descending=True).values
            assert kth == ranked[k - 1] and nxt == ranked[k] and kth >= nxt
            picked = sel[q][sel[q] >= 0]
            # a prefill row also holds unreachable positions at -inf: a -inf pick may land there
            assert len(picked) == k or kth == -torch.inf
            # every kept position scores at least the k-th, every dropped one at most the (k+1)-th
            dropped = torch.ones(reach, dtype=torch.bool)
            dropped[picked.long()] = False
            assert (scores[q, picked.long()] >= kth).all() and (scores[q, :reach][dropped] <= kth).all()
            n_ties += bool(kth == nxt)
    assert n_truncated > 20
    # bf16 scores of relu'd heads tie often (exact zeros, and -inf outside the candidate pool)
    assert n_ties > 0
    cand = [r for r in trace.attention if r.layer == TINY.candidate_source_layer][0]
    assert cand.candidate_blocks.shape[-1] == -(-30 // TINY.candidate_block_size)
    assert (cand.candidate_blocks.sum(-1) <= TINY.candidate_topk_blocks).all()


def test_reindex_ranks_inside_the_candidate_pool():
    stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=6, numerics=Numerics(fix_stale_index_keys=True))
    trace, x = Trace(), _x(30, seed=18)
    with trace.recording(stack.sites):
        for p in range(30):  # decode rows hold reachable positions only, so every pick is reachable
            stack.forward_each(x[:, p : p + 1], p)
    by = trace.attention_by_layer()
    pool = by[TINY.candidate_source_layer]["candidate_blocks"][0].repeat_interleave(TINY.candidate_block_size, -1)
    assert torch.equal(by[6]["candidate_blocks"], by[TINY.candidate_source_layer]["candidate_blocks"])
    sel = by[6]["selected"][0]
    outside_seen = 0
    for q in range(30):
        picked = sel[q][sel[q] >= 0].long()
        inside = pool[q, picked]
        pool_size = int(pool[q, : q + 1].sum())
        # positions outside the pool appear only when the pool is smaller than the top-k: the
        # reference keeps reachable -inf picks (with 4 blocks of 2 and a half-filled newest block
        # the pool holds 7 positions for a top-k of 8)
        assert int((~inside).sum()) == max(0, min(TINY.index_topk, q + 1) - pool_size)
        outside_seen += int((~inside).sum())
    assert outside_seen > 0


def test_stale_index_keys_default_and_fix_differ_exactly_on_the_incomplete_group_steps():
    x = _x(28, seed=19)
    runs = {}
    for fix in (False, True):
        stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=7, numerics=Numerics(fix_stale_index_keys=fix))
        runs[fix] = _both_orders(stack, x, "forward_each")
    # prefill publishes every Full layer's keys anyway: identical
    assert torch.equal(runs[False][0], runs[True][0])
    dec_stale, dec_fix = runs[False][1], runs[True][1]
    recs = {r.start_pos: r for r in runs[False][3].attention if r.layer == 2}
    fixed = {r.start_pos: r for r in runs[True][3].attention if r.layer == 2}
    # layer 2 (ratio 2) completes a group on odd positions; on even ones it scores against the
    # keys layer 4 published last, unless the fix republishes its own
    stale_steps = [p for p in range(28) if (p + 1) % 2 and (p + 1) // 2 > 0]
    assert [p for p, r in recs.items() if r.index_keys_from == 4] == stale_steps
    assert all(recs[p].index_keys_from == 2 for p in range(28) if p not in stale_steps and (p + 1) // 2 > 0)
    assert all(r.index_keys_from == 2 for p, r in fixed.items() if p > 0)
    # the index scores agree wherever the group completed and differ on the stale steps
    for p in range(1, 28):
        same = torch.equal(recs[p].index_scores, fixed[p].index_scores)
        assert same == (p not in stale_steps) or (p in stale_steps and (recs[p].index_scores == 0).all()), p
    assert (
        sum(not torch.equal(recs[p].index_scores, fixed[p].index_scores) for p in stale_steps) >= len(stale_steps) - 2
    )

    out_diff = (dec_stale != dec_fix).any(-1)[:, 0]  # [layer, position]
    # only layer 2 and its Reuse reader 3 can change, and only on stale steps
    assert not out_diff[[0, 1, 4, 5, 6, 7]].any()
    changed_at = set(out_diff[2].nonzero().flatten().tolist())
    assert changed_at and changed_at <= set(stale_steps)
    assert torch.equal(out_diff[3], out_diff[2])
    tstale, tfix = runs[False][3].attention_by_layer()[2], runs[True][3].attention_by_layer()[2]
    sel_diff = set((tstale["selected"] != tfix["selected"]).any(-1)[0].nonzero().flatten().tolist())
    assert sel_diff == changed_at
    # a selection can only change where the top-k truncates
    assert all((p + 1) // 2 > TINY.index_topk for p in sel_diff)


def test_every_prefill_decode_difference_under_truncation_is_a_tie():
    k_blocks = TINY.candidate_topk_blocks
    n_diff = n_checked = 0
    for seed in range(3):
        stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=seed, numerics=PARITY_TOPK_TIES)
        pre, dec, tp, td = _grouped(stack, _x(28, seed=20 + seed), "forward_each")
        for layer, ratio in enumerate(TINY.compress_ratios[: TINY.n_layers]):
            out_diff = (pre[layer] != dec[layer]).any(-1)[0]
            if not ratio:
                assert not out_diff.any()
                continue
            sel_diff = (tp[layer]["selected"] != td[layer]["selected"]).any(-1)[0]
            # an output changes only where its selection does (the arithmetic is otherwise shared)
            assert torch.equal(out_diff, sel_diff), (seed, layer)
            source = TINY.source_at_or_before(layer, TINY.index_source_layers)
            src_p, src_d = tp[source], td[source]
            tie = (src_p["kth_score"] == src_p["next_score"]) | (src_d["kth_score"] == src_d["next_score"])
            if "candidate_blocks" in src_p:
                cand = tp[TINY.candidate_source_layer]
                block_tie = cand["candidate_kth_score"] == cand["candidate_next_score"]
                masks_differ = (src_p["candidate_blocks"] != src_d["candidate_blocks"]).any(-1)
                tie = tie | (block_tie & masks_differ)
            n_checked += int(sel_diff.numel())
            for q in sel_diff.nonzero().flatten().tolist():
                n_diff += 1
                assert tie[0, q], f"seed {seed} layer {layer} query {q}: differs without a tie"
        # identical scores: where the same keys are scored the k-th / (k+1)-th agree exactly
        assert torch.equal(tp[4]["kth_score"].nan_to_num(1e9), td[4]["kth_score"].nan_to_num(1e9))
        assert k_blocks == 4
    assert n_diff > 10, "the truncating geometry should produce tie-broken differences"
    # one tie rule for both orders: nothing parts at all
    for seed in range(3):
        stack = AttentionStack(TINY, max_seq_len=MAX_SEQ, seed=seed, numerics=PARITY_FIXED_KEYS)
        pre, dec, tp, td = _grouped(stack, _x(28, seed=20 + seed), "forward_each")
        assert torch.equal(pre, dec), seed


@pytest.mark.parametrize("numerics", [Numerics.parity(), Numerics()], ids=["parity", "reference"])
def test_the_grouped_output_projection_at_the_released_widths(numerics):
    # 8 groups of 4,096 -> 1,024 in bf16: there a one-row call (a decode step) rounds differently
    # from a many-row one on CPU BLAS (small widths do not show it). Parity runs it in blocks of 8
    # rows, so a row's result does not depend on the call's row count; the reference runs it as it is.
    from dsv41.bench.released import released_decode_config

    cfg = released_decode_config(2)
    layer = init_random_(Attention(cfg, 1, numerics=numerics, max_seq_len=16), 0)  # a Reuse layer: no compressor
    o = torch.randn(1, 16, cfg.n_heads, cfg.head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    freqs = layer.freqs_cis[:16]
    with torch.no_grad():
        # project_out takes the rotation off in place (its o is sparse_attn's fresh output): copies here
        together = layer.project_out(o.clone(), freqs)  # [1, 16, dim]
        alone = torch.cat([layer.project_out(o[:, t : t + 1].clone(), freqs[t : t + 1]) for t in range(16)], dim=1)
        plain = torch.einsum(
            "bsgd,grd->bsgr",
            attention_layer.rotate_tail(o, freqs, layer.rope_head_dim, inverse=True)
            .flatten(2)
            .unflatten(-1, (cfg.o_groups, -1)),
            layer.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1),
        )
    if numerics.pad_f32_rows:
        assert torch.equal(together, alone)
    else:  # the reference's own product, one call for the rows it is given
        assert torch.equal(together, layer.wo_b(plain.flatten(2)))
