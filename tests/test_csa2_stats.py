"""dsv41.observe.csa2_stats: the layer map, KV-cache bytes (formula vs the model card and vs allocated
buffers), the compressor trace, the candidate-block pin, prefill/decode divergence and stale keys."""

import pytest
import torch

from dsv41.core.config import RELEASED, TINY
from dsv41.core.numerics import Numerics
from dsv41.model.attention import HOLDING, kv_cache_bytes, select_candidate_blocks
from dsv41.model.trace import Trace
from dsv41.observe import csa2_stats as cs
from dsv41.observe.csa2_stack import AttentionStack


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    import dsv41

    return dsv41.load(tiny_checkpoint, quiet=True, max_seq_len=64)


# the opt-ins under which prefill and decode outputs part only where a selection does
PARITY_FIXED_KEYS = Numerics.parity()  # both orders score the same index keys, equal scores tie one way


def _x(seqlen, seed=0):
    return torch.randn(1, seqlen, TINY.dim, generator=torch.Generator().manual_seed(seed)).bfloat16()


# ------------------------------------------------------------------------------ layer map
def test_released_layer_map_partition_sources_and_rope():
    roles = cs.layer_map(RELEASED)
    assert len(roles) == 40
    part = cs.mode_partition(RELEASED)
    assert part["full"] == [2, 8, 14, 20] and part["reindex"] == [24, 28, 32, 36] and len(part["reuse"]) == 32
    by = {r.layer: r for r in roles}
    assert by[0].reads == {"window ring": 0} and by[0].writes == ("window ring",)
    assert not by[1].yarn and by[1].rope_base == 10000.0
    assert by[2].writes == ("window ring", "compressed KV", "index keys", "top-k")
    assert by[20].writes[-1] == "candidate blocks"  # the candidate source
    assert by[19].reads == {"window ring": 19, "compressed KV": 14, "top-k": 14}
    assert by[21].reads["top-k"] == 20 and by[25].reads["top-k"] == 24 and by[39].reads["top-k"] == 36
    assert by[24].reads["index keys"] == 20 and by[24].reads["candidate blocks"] == 20
    assert "index keys" not in by[25].reads  # a Reuse layer never scores
    assert all(r.yarn and r.rope_base == 160000.0 for r in roles[2:])


def test_tiny_layer_map():
    by = {r.layer: r for r in cs.layer_map(TINY)}
    assert by[3].reads == {"window ring": 3, "compressed KV": 2, "top-k": 2}
    assert by[5].reads["compressed KV"] == 4 and by[5].reads["top-k"] == 4
    assert by[6].reads == {"window ring": 6, "compressed KV": 4, "index keys": 4, "candidate blocks": 4, "top-k": 6}
    assert "candidate blocks" not in by[2].reads  # the candidate source (4) comes after it
    assert by[7].reads == {"window ring": 7} and not by[7].yarn


# ------------------------------------------------------------------------------ bytes
def test_released_kv_bytes_per_token_is_the_model_cards_890():
    kv = kv_cache_bytes(RELEASED)
    per = {s.layer: s for s in kv.sources}
    # FP4 latent 512/2 + E4M3 scales 512/16; FP4 key 128/2 + E8M0 scales 128/32
    assert (per[2].kv_data, per[2].kv_scales, per[2].key_data, per[2].key_scales) == (256, 32, 64, 4)
    assert [per[l].per_token for l in (2, 8, 14, 20)] == [178, 178, 178, 356]
    assert kv.per_token == 890
    assert kv.window_entry == 528 and kv.window_ring_bytes == 40 * 128 * 528
    assert kv.tail_bytes == {2: 8192, 8: 8192, 14: 8192}  # ratio 1 has no tail
    assert kv.total(1001) == kv.fixed + 3 * 500 * 356 + 1001 * 356  # whole groups only
    comps = kv.components(1001)
    assert sum(comps.values()) == kv.total(1001)
    assert comps["layer 20 index keys"] == 1001 * 68
    assert kv.formula(RELEASED)[-3].endswith("= 890 B")


def test_stored_formula_follows_the_geometry():
    kv = kv_cache_bytes(TINY)  # head_dim 64, index_head_dim 32, ratios 2 and 1
    assert [s.per_entry for s in kv.sources] == [32 + 4 + 16 + 1] * 2
    assert kv.per_token == 53 / 2 + 53
    assert kv_cache_bytes(TINY, "runtime").per_token == (128 + 64) / 2 + (128 + 64)
    with pytest.raises(ValueError, match="holding"):
        kv_cache_bytes(TINY, "fp4")


@pytest.mark.parametrize("cache_format,holding", [("packed", "stored"), ("bf16", "runtime")])
@pytest.mark.parametrize(
    "ratios,max_seq_len",
    [
        ((0, 0, 2, 2, 1, 1, 1, 0, 0, 0, 0), 64),
        ((0, 0, 2, 2, 1, 1, 1, 0, 0, 0, 0), 37),  # odd: floor(37 / 2) compressed rows
        ((0, 0, 4, 4, 1, 1, 1, 0, 0, 0, 0), 30),
    ],
)
def test_formula_equals_the_allocated_buffers(ratios, max_seq_len, cache_format, holding):
    """Packed caches (the default) allocate the stored formula's bytes; BF16 ones the runtime's."""
    assert HOLDING[cache_format] == holding
    cfg = TINY.replace(compress_ratios=ratios)
    stack = AttentionStack(cfg, max_seq_len=max_seq_len, cache_format=cache_format)
    allocated = cs.allocated_cache_bytes(stack)
    comps = kv_cache_bytes(cfg, holding).components(max_seq_len)
    assert allocated["window ring"] == comps["window ring"]
    assert allocated["compressor tails"] == comps["compressor tails"] > 0
    assert allocated["compressed KV"] == sum(v for k, v in comps.items() if k.endswith("compressed KV"))
    assert allocated["index keys"] == sum(v for k, v in comps.items() if k.endswith("index keys"))
    assert sum(allocated.values()) == kv_cache_bytes(cfg, holding).total(max_seq_len)
    assert cs.bytes_by_kind(kv_cache_bytes(cfg, holding), max_seq_len) == allocated  # the formula, kind for kind
    measured = stack.cache_bytes()
    assert measured.components == allocated
    assert measured.per_token["total"] == kv_cache_bytes(cfg, holding).per_token


def test_measured_released_bytes_per_token_next_to_the_formula():
    formula = kv_cache_bytes(RELEASED)
    for positions in (300, 301, 4096):
        measured = cs.measured_cache_bytes(RELEASED, positions)
        assert measured.per_token["total"] == formula.per_token == 890
        assert measured.per_token_by_source == {s.layer: s.per_token for s in formula.sources}
        assert measured.parts["compressed KV scales"] == sum(
            s.entries(positions) * s.kv_scales for s in formula.sources
        )
        assert measured.parts["index key scales"] == sum(s.entries(positions) * s.key_scales for s in formula.sources)
        assert measured.total == formula.total(positions)
    held = cs.measured_cache_bytes(RELEASED, 4096, cache_format="bf16")
    assert held.per_token["total"] == kv_cache_bytes(RELEASED, "runtime").per_token == 3200
    with pytest.raises(ValueError, match="cache_format"):
        cs.measured_cache_bytes(RELEASED, 8, cache_format="fp4")


@pytest.mark.parametrize("cache_format", ["packed", "bf16"])
def test_attention_stack_takes_the_models_cache_format(model, cache_format):
    assert model.backbone.cache_format == "packed"
    assert cs.attention_stack(model, max_seq_len=8).cache_format == "packed"
    stack = cs.attention_stack(model, max_seq_len=8, cache_format=cache_format)
    assert {layer.cache_format for layer in stack.layers} == {cache_format}


# ------------------------------------------------------------------------------ weights
def test_attention_stack_carries_the_checkpoint_weights(model):
    stack = cs.attention_stack(model, max_seq_len=32, index_topk=3)
    assert stack.cfg.index_topk == 3 and model.cfg.index_topk == TINY.index_topk
    mine = dict(stack.named_parameters())
    for i, block in enumerate(model.backbone.layers):
        for name, p in block.attn.named_parameters():
            assert torch.equal(mine[f"layers.{i}.{name}"].float(), p.float()), (i, name)
    assert mine["layers.2.compressor.wkv.weight"].abs().sum() > 0  # not left at zero
    with pytest.raises(RuntimeError):  # a change that reshapes weights is refused
        cs.attention_stack(model, max_seq_len=32, index_head_dim=64)


# ------------------------------------------------------------------------------ compressor
def test_compressor_trace_groups_tail_and_rotation(model):
    stack = cs.attention_stack(model, max_seq_len=16)
    x = cs.embed(model, list(range(3, 15)))  # 12 tokens
    t2 = cs.compressor_trace(stack.layers[2], x, prefill=7)
    assert t2.ratio == 2
    assert [c["emitted_groups"] for c in t2.calls] == [[0, 1, 2], [3], [], [4], [], [5]]
    assert [c["held"] for c in t2.calls] == [[6], [], [8], [], [10], []]
    assert all(c["held_state_matches"] for c in t2.calls)
    assert [c["wrote_compressed"] for c in t2.calls] == [True, True, False, True, False, True]
    for g in t2.groups:
        assert g["kv_rotated_at"] == [2 * g["group"]] == g["key_rotated_at"]
        assert abs(sum(g["gate_weights"]) - 1) < 1e-5 and len(g["gate_weights"]) == 2
    assert t2.groups[3]["emitted_at_call"] == 1  # the held token 6 pooled with 7 in the first decode call
    t4 = cs.compressor_trace(stack.layers[4], x, prefill=7)
    assert [c["emitted_groups"] for c in t4.calls] == [list(range(7))] + [[p] for p in range(7, 12)]
    assert all(g["kv_rotated_at"] == [g["group"]] for g in t4.groups)
    assert all(
        not buf.any() for n, buf in stack.layers[2].named_buffers() if n not in ("freqs_cis", "compressor.score_state")
    )  # left reset
    with pytest.raises(ValueError, match="no compressor"):
        cs.compressor_trace(stack.layers[3], x, 7)


# ------------------------------------------------------------------------------ candidates
def test_filling_block_pin_constructed_case():
    inf = float("inf")
    logits = torch.tensor([5.0, 4.0, 9.0, 8.0, 7.0, 6.0, 0.5, -inf])
    pin = cs.candidate_pin_effect(logits, 7, topk_blocks=2, block_size=2)
    assert pin["block_scores"] == [[5.0, 9.0, 7.0, 0.5]]
    assert pin["newest_block"] == [3] and pin["filling"] == [True]
    assert pin["kept"] == [[1, 3]] and pin["kept_unpinned"] == [[1, 2]]
    assert pin["pin_mattered"] == [True] and pin["displaced"] == [[2]]
    # a newest block that wins on its own score: the pin changes nothing
    high = cs.candidate_pin_effect(torch.tensor([5.0, 4.0, 9.0, 8.0, 7.0, 6.0, 9.5, -inf]), 7, 2, 2)
    assert high["pin_mattered"] == [False] and high["kept"] == high["kept_unpinned"] == [[1, 3]]
    # rows of queries, one reach each; agrees with select_candidate_blocks
    rows = torch.tensor([[3.0, 1.0, -inf, -inf], [3.0, 1.0, 2.0, -inf], [3.0, 1.0, 2.0, 0.0]])
    many = cs.candidate_pin_effect(rows, [2, 3, 4], 1, 2)
    assert many["kept"] == [[0], [1], [1]] and many["pin_mattered"] == [False, True, True]
    mask = select_candidate_blocks(rows, torch.tensor([[2], [3], [4]]), 1, 2)[..., ::2]
    assert [r.nonzero().flatten().tolist() for r in mask] == many["kept"]


# ------------------------------------------------------------------------------ divergence
def test_divergence_every_difference_a_tie_and_parity_untruncated():
    x = _x(28, seed=20)
    n_differ = 0
    for seed in (0, 1):
        # ties left to torch.topk, as the reference does: they are all that can part
        stack = AttentionStack(
            TINY, max_seq_len=28, seed=seed, numerics=PARITY_FIXED_KEYS.with_options(tie_break="topk")
        )
        d = cs.prefill_decode_divergence(stack, x)
        assert d.numerics == {"window_layout": "uniform", "pad_f32_rows": True}
        assert d.n_differ == d.n_ties and all(tie for _, _, tie in d.differ_at)
        assert d.n_output_differ_without_selection == 0 and d.n_truncated > 0
        assert all(r["max_output_diff"] == 0 for r in d.layers if not r["ratio"])
        n_differ += d.n_differ
    assert n_differ > 0  # the truncating width produces tie-broken differences at all
    for seed in (0, 1):  # one tie rule for both orders: nothing parts
        assert cs.prefill_decode_divergence(
            AttentionStack(TINY, max_seq_len=28, seed=seed, numerics=PARITY_FIXED_KEYS), x
        ).identical
    assert cs.untruncated_topk(TINY, 28) == 28
    wide = AttentionStack(TINY.replace(index_topk=28), max_seq_len=28, seed=0, numerics=PARITY_FIXED_KEYS)
    d = cs.prefill_decode_divergence(wide, x)
    assert d.identical and d.n_differ == 0 and d.max_output_diff == 0.0
    narrow = AttentionStack(
        TINY.replace(index_topk=27), max_seq_len=28, seed=0, numerics=Numerics(fix_stale_index_keys=True)
    )
    assert cs.prefill_decode_divergence(narrow, x).n_truncated > 0  # one short of it truncates


def test_untruncated_positions_end_where_the_trace_records_the_first_cut():
    stack = AttentionStack(TINY, max_seq_len=28, seed=0)
    trace = Trace()
    with trace.recording(stack.sites):
        stack.forward_each(_x(28, seed=20), 0)
    cuts = [
        ~torch.isnan(getattr(r, name)[0])
        for r in trace.attention
        for name in ("kth_score", "candidate_kth_score")
        if getattr(r, name) is not None
    ]
    first = int(torch.stack(cuts).any(0).nonzero()[0])
    assert cs.untruncated_positions(TINY) == first == TINY.index_topk  # TINY: a ratio-1 index source


def test_spare_picks_outside_a_small_candidate_pool_are_ties_the_trace_cut_misses():
    # index_topk 16 over a pool of at most 4 x 2 positions: a Reindex query reaching 9..16 positions
    # is not truncated by its reachable count (kth_score NaN), yet its prefill row (every position,
    # the unreachable ones at -inf) fills the spare picks from -inf ties, so the orders may differ
    stack = AttentionStack(
        TINY.replace(index_topk=16), max_seq_len=28, seed=0, numerics=Numerics(fix_stale_index_keys=True)
    )
    x = _x(28, seed=20)
    d = cs.prefill_decode_divergence(stack, x)
    early = [(q, tie) for layer, q, tie in d.differ_at if layer == 6 and q < 16]
    assert early and all(tie for _, tie in early)
    _, _, tp, _ = cs._both_orders(stack, x)
    kth = tp.attention_by_layer()[6]["kth_score"][0]
    assert all(kth[q].isnan() for q, _ in early)  # the recorded cut alone would not call them ties
    assert d.n_differ == d.n_ties


def test_stale_keys_make_divergences_that_are_not_ties():
    # the negative control of the tie classifier: stale keys change scores, not tie-breaking
    stack = AttentionStack(TINY, max_seq_len=28, seed=0, numerics=Numerics(fix_stale_index_keys=False))
    d = cs.prefill_decode_divergence(stack, _x(28, seed=20))
    not_tie = [(layer, q) for layer, q, tie in d.differ_at if not tie]
    assert not_tie and {layer for layer, _ in not_tie} <= {2, 3}
    assert d.n_ties == d.n_differ - len(not_tie)
    fixed = cs.prefill_decode_divergence(
        AttentionStack(TINY, max_seq_len=28, seed=0, numerics=Numerics(fix_stale_index_keys=True)), _x(28, seed=20)
    )
    assert fixed.n_differ == fixed.n_ties  # the same input with the fix: every difference a tie again


def test_tie_rule_on_hand_made_rows():
    inf = float("inf")
    row = torch.tensor([5.0, 3.0, 3.0, 1.0])
    assert cs._tie_broken({0, 1}, {0, 2}, row, row, 2)  # which of the two 3.0s: a tie at the cut
    assert not cs._tie_broken({0, 1}, {1, 2}, row, row, 2)  # 5.0 dropped: above the cut
    assert not cs._tie_broken({0, 1}, {0, 2}, row, torch.tensor([5.0, 3.0, 2.0, 1.0]), 2)  # scores differ
    # fewer finite scores than k (a small candidate pool): the cut is -inf, only -inf picks may differ
    pool = torch.tensor([2.0, -inf, 1.0, -inf, -inf, -inf])
    assert cs._tie_broken({0, 1, 2, 3}, {0, 2, 4, 5}, pool, pool, 4)
    assert not cs._tie_broken({0, 1, 2, 3}, {0, 1, 3, 4}, pool, pool, 4)  # the finite 1.0 left out
    # a narrower decode row (width <= k: everything picked) against the wider prefill row
    assert cs._tie_broken({0, 2, 3}, {0, 1, 2, 3}, pool, pool[:4], 4)


def _doctored_decode_pick(stack, x, layer, q, replace_finite: bool):
    """The traces of both orders, with one pick of the decode selection of `layer` at query `q`
    swapped for a reachable -inf position it left out: a finite pick (replace_finite) or a -inf one."""
    pre, dec, tp, td = cs._both_orders(stack, x)
    rec = [r for r in td.attention if r.layer == layer][q]  # decode: one record per position
    row, sel = rec.index_scores[0, 0], rec.selected[0, 0]
    assert (row > -torch.inf).sum() < stack.cfg.index_topk < row.numel()  # a pool smaller than k
    picked = set(sel[sel >= 0].tolist())
    spare = [t for t in range(row.numel()) if t not in picked and row[t] == -torch.inf]
    out = [t for t in sorted(picked) if (row[t] > -torch.inf) == replace_finite]
    assert spare and out
    rec.selected = rec.selected.clone()  # records of a forward are inference tensors: doctor a copy
    rec.selected[0, 0, (sel == out[0]).nonzero()[0, 0]] = spare[0]
    return pre, dec, tp, td


@pytest.mark.parametrize("replace_finite", [True, False])
def test_a_finite_pick_difference_inside_a_small_pool_is_not_a_tie(monkeypatch, replace_finite):
    # layer 6 ranks inside layer 4's pool of at most 4 blocks of 2 positions; at index_topk 16 a
    # query at position 20 reaches 21 positions, so topk fills its 16 picks with -inf spares. The
    # k-th and (k+1)-th scores of that row are both -inf, which once excused any difference.
    stack = AttentionStack(
        TINY.replace(index_topk=16), max_seq_len=28, seed=0, numerics=Numerics(fix_stale_index_keys=True)
    )
    x = _x(28, seed=20)
    honest = cs.prefill_decode_divergence(stack, x)
    assert honest.n_differ == honest.n_ties
    doctored = _doctored_decode_pick(stack, x, 6, 20, replace_finite)
    monkeypatch.setattr(cs, "_both_orders", lambda *_: doctored)
    d = cs.prefill_decode_divergence(stack, x)
    assert (6, 20, not replace_finite) in d.differ_at  # only swapping one -inf spare for another is a tie
    assert d.n_differ - d.n_ties == int(replace_finite)
    others = [e for e in d.differ_at if e[:2] != (6, 20)]
    assert others == [e for e in honest.differ_at if e[:2] != (6, 20)]  # nothing else moved


def test_block_ties_explain_pools_that_differ():
    # at index_topk 8 the candidate source's block cut ties (ReLU'd scores are often exactly 0) and
    # the two orders keep different pools; those differences count as ties, and only those
    stack = AttentionStack(TINY, max_seq_len=28, seed=2, numerics=Numerics(fix_stale_index_keys=True))
    d = cs.prefill_decode_divergence(stack, _x(28, seed=20))
    assert d.n_differ == d.n_ties
    by_layer = {r["layer"]: r for r in d.layers}
    assert by_layer[6]["n_block_ties"] > 0
    assert all(r["n_block_ties"] == 0 for r in d.layers if r["layer"] != 6)  # only layer 6 ranks inside a pool


def test_stale_key_comparison(model):
    x = cs.embed(model, [(7 * i) % 1000 + 3 for i in range(28)])
    sk = cs.stale_key_comparison(model, x)
    assert sk.prefill_identical
    assert sk.expected_keys_from == {2: 2, 4: 4, 6: 4}
    # layer 2 (ratio 2) completes a group on odd positions; on even ones it scores layer 4's keys
    assert sk.stale[2] == list(range(2, 28, 2)) and sk.stale[4] == sk.stale[6] == []
    assert all(sk.keys_from[2][p] == 4 for p in sk.stale[2]) and set(sk.keys_from_fixed[2][1:]) == {2}
    assert sk.changed[2] and set(sk.changed[2]) <= set(sk.stale[2])
    assert sk.changed[3] == sk.changed[2]  # its Reuse reader follows
    assert all((p + 1) // 2 > TINY.index_topk for p in sk.changed[2])  # only where the top-k truncates
    assert not any(sk.changed[layer] for layer in (0, 1, 4, 5, 6, 7))


def test_layer_map_table_rows_name_what_each_layer_writes_and_reads():
    roles = cs.layer_map(TINY)
    rows = [r.table_row() for r in roles]
    assert [row["layer"] for row in rows] == list(range(TINY.n_layers))
    window_only = next(r for r in roles if not r.ratio)
    assert rows[window_only.layer]["reads (<- from layer)"] == "own window only"
    assert rows[window_only.layer]["YaRN"] is False and rows[window_only.layer]["RoPE base"] == int(TINY.rope_theta)
    full = next(r for r in roles if r.mode == "full")
    assert rows[full.layer]["writes"] == ", ".join(full.writes)
    assert "compressed KV <- own" in rows[full.layer]["reads (<- from layer)"]
    reader = next(r for r in roles if r.ratio and r.reads["compressed KV"] != r.layer)
    assert f"compressed KV <- {reader.reads['compressed KV']}" in rows[reader.layer]["reads (<- from layer)"]


def test_positions_differing_gathers_the_chosen_layers():
    d = cs.Divergence(
        index_topk=1,
        n_tokens=3,
        layers=[{"layer": 0, "output_diff": [0.0, 1e-3, 0.0]}, {"layer": 1, "output_diff": [2.0, 0.0, 5e-4]}],
    )
    assert d.positions_differing([0]) == [1] and d.positions_differing([1]) == [0, 2]
    assert d.positions_differing(range(2)) == [0, 1, 2] and d.positions_differing([]) == []


def test_prefill_then_decode_leaves_what_token_by_token_decoding_leaves():
    x = _x(12, seed=3)
    timed, decoded = (AttentionStack(TINY, max_seq_len=12, seed=0) for _ in range(2))
    cs.prefill_then_decode(timed, x)
    with torch.no_grad():
        decoded.reset_state()
        for p in range(12):
            decoded.forward_each(x[:, p : p + 1], p)
    pairs = list(zip(timed.named_buffers(), decoded.named_buffers()))
    assert pairs and all(a == b and torch.equal(u, v) for (a, u), (b, v) in pairs)
