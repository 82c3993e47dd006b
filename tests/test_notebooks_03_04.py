"""Notebooks 03 (CSA2 modes, KV bytes, compressor) and 04 (indexer scores, candidate blocks, ties)
executed in smoke mode on the embedded default, with assertions on the numbers their sidecars carry.
The expected numbers are derived here from the formulas and the released geometry, not copied
from a run."""

import pytest
import torch
from conftest import notebook_group, run_notebooks_smoke, sidecar

from dsv41.core.config import RELEASED, TINY, load_config
from dsv41.core.numerics import WINDOW_LAYOUTS
from dsv41.kernels import SPARSE_ATTN_CHUNK
from dsv41.observe import csa2_stats as cs

SMOKE_NOTEBOOKS = "03,04"
pytestmark = notebook_group(SMOKE_NOTEBOOKS)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_checkpoint):
    """Notebooks 03 and 04 executed in smoke mode on the session's tiny checkpoint (the embedded
    default, written into a pytest temp folder, never the user cache), once for these tests."""
    run, summary = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, SMOKE_NOTEBOOKS)
    assert [n["name"] for n in summary["notebooks"]] == ["03_csa2_modes", "04_candidate_blocks"]
    return run


_sidecar = sidecar


# ---------------------------------------------------------------------- 03
@pytest.mark.slow
def test_layer_map_numbers(smoke_run):
    facts = _sidecar(smoke_run, "03_csa2_facts")
    assert facts["smoke"] is True
    released = facts["released"]
    assert released["counts"] == {"full": 4, "reindex": 4, "reuse": 32}
    assert released["partition"]["full"] == [2, 8, 14, 20] == list(RELEASED.kv_source_layers)
    assert released["partition"]["reindex"] == [24, 28, 32, 36]
    assert released["window_only"] == [0, 1]

    figure = _sidecar(smoke_run, "03_layer_map")
    rel = figure["released"]
    assert rel["ratios"] == list(RELEASED.compress_ratios[:40])
    assert rel["yarn"] == [r > 0 for r in rel["ratios"]]
    assert rel["rope_base"] == [160000.0 if r else 10000.0 for r in rel["ratios"]]
    # each reader takes the top-k of the latest index source and the KV of the latest Full layer
    assert rel["topk_from"][19] == 14 and rel["topk_from"][21] == 20 and rel["topk_from"][39] == 36
    assert rel["compressed_kv_from"][39] == 20 and rel["compressed_kv_from"][7] == 2
    assert rel["candidates_from"][24] == 20 and rel["candidates_from"][20] is None
    assert rel["topk_from"][:2] == [None, None]
    tiny = figure["this checkpoint"]
    assert tiny["modes"] == ["reuse", "reuse", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert tiny["ratios"] == list(TINY.compress_ratios[:8])
    assert tiny["index_keys_from"][6] == 4 and tiny["candidates_from"][6] == 4
    assert tiny["writes"][4][-1] == "candidate blocks"
    # every layer of both geometries: YaRN and the RoPE base follow its ratio, only Full layers write
    # compressed KV, and what a layer reads was written at its own ratio
    for name, cfg in (("released", RELEASED), ("this checkpoint", load_config(facts["checkpoint"]))):
        roles = figure[name]
        assert len(roles["modes"]) == cfg.n_layers
        for layer, (mode, ratio) in enumerate(zip(roles["modes"], roles["ratios"])):
            assert roles["yarn"][layer] == bool(ratio), (name, layer)
            assert roles["rope_base"][layer] == (cfg.compress_rope_theta if ratio else cfg.rope_theta), (name, layer)
            assert ("compressed KV" in roles["writes"][layer]) == (mode == "full"), (name, layer)
            if ratio:
                assert (
                    cfg.compress_ratios[roles["compressed_kv_from"][layer]]
                    == ratio
                    == cfg.compress_ratios[roles["topk_from"][layer]]
                ), (name, layer)


@pytest.mark.slow
def test_kv_bytes_per_token_from_the_formula(smoke_run):
    kv = _sidecar(smoke_run, "03_kv_bytes")
    d, di, win = kv["head_dim"], kv["index_head_dim"], kv["window_size"]
    assert (d, di, win, kv["n_layers"]) == (512, 128, 128, 40)
    kv_entry = d * 4 // 8 + d // 16  # FP4 E2M1 + one E4M3 scale per 16
    key_entry = di * 4 // 8 + di // 32  # FP4 E2M1 + one E8M0 scale per 32
    assert (kv_entry, key_entry) == (288, 68)
    sources = {s["layer"]: s for s in kv["sources"]}
    assert sorted(sources) == [2, 8, 14, 20]
    for layer, s in sources.items():
        assert s["ratio"] == RELEASED.compress_ratios[layer]
        assert s["kv_data"] + s["kv_scales"] == kv_entry and s["key_data"] + s["key_scales"] == key_entry
        assert s["per_token"] == (kv_entry + key_entry) / s["ratio"]
    assert kv["per_token"] == sum((kv_entry + key_entry) / s["ratio"] for s in sources.values()) == 890
    # the stacked bar's components add up to each layer's bar
    for i, layer in enumerate(sorted(sources)):
        assert sum(part[i] for part in kv["per_token_by_component"].values()) == sources[layer]["per_token"]
    assert kv["window_entry"] == d + d // 32 == 528
    assert kv["window_ring_bytes"] == 40 * win * 528
    assert kv["fixed"] == kv["window_ring_bytes"] + 3 * 2 * 2 * d * 4  # three ratio-2 float32 tails
    for context, total in zip(kv["contexts"], kv["total"]):
        assert total == kv["fixed"] + sum((context // s["ratio"]) * (kv_entry + key_entry) for s in sources.values())

    facts = _sidecar(smoke_run, "03_csa2_facts")
    held = facts["runtime_bytes"]
    assert held["allocated"] == held["predicted"] and all(v > 0 for v in held["allocated"].values())
    assert held["released_per_token"] == 3 * (2 * d + 2 * di) / 2 + (2 * d + 2 * di) == 3200  # BF16, no scales


@pytest.mark.slow
def test_kv_bytes_per_token_measured_from_the_allocated_buffers(smoke_run):
    """The packed caches allocate what the formula counts: 890 B per token measured on a
    released-size stack, and this checkpoint's buffers equal the stored formula byte for byte."""
    kv = _sidecar(smoke_run, "03_kv_bytes")
    measured = kv["measured"]
    assert measured["cache_format"] == "packed" and measured["max_seq_len"] == 4096
    assert measured["per_token"]["total"] == kv["per_token"] == 890
    kv_entry, key_entry = 512 // 2 + 512 // 16, 128 // 2 + 128 // 32
    assert measured["per_token"]["compressed KV"] == 3 * kv_entry / 2 + kv_entry
    assert measured["per_token"]["index keys"] == 3 * key_entry / 2 + key_entry
    assert {int(k): v for k, v in measured["per_token_by_source"].items()} == {
        s["layer"]: s["per_token"] for s in kv["sources"]
    }
    assert measured["total_at_contexts"] == kv["total"]  # formula and buffers agree at every context
    # the allocated parts: one E4M3 scale per 16 latent channels and one E8M0 per 32 key channels
    parts, rows = measured["parts"], 3 * 4096 // 2 + 4096
    assert (parts["compressed KV data"], parts["compressed KV scales"]) == (rows * 256, rows * 32)
    assert (parts["index key data"], parts["index key scales"]) == (rows * 64, rows * 4)
    assert (parts["window ring data"], parts["window ring scales"]) == (40 * 128 * 512, 40 * 128 * 16)

    facts = _sidecar(smoke_run, "03_csa2_facts")
    packed = facts["packed_bytes"]
    assert packed["allocated"] == packed["predicted"] and all(v > 0 for v in packed["allocated"].values())
    assert packed["allocated"]["compressed KV"] < facts["runtime_bytes"]["allocated"]["compressed KV"]
    assert packed["model_per_token"] == packed["model_formula_per_token"] == (32 + 4 + 16 + 1) / 2 + (32 + 4 + 16 + 1)
    m = facts["measured"]
    assert m["released_per_token"] == m["formula_per_token"] == 890 and m["released_per_token_bf16"] == 3200
    assert m["context"] == 2**20
    fixed = 40 * 128 * 528 + 3 * 2 * 2 * 512 * 4  # FP8 window rings + float32 ratio-2 compressor tails
    assert m["context_fixed_bytes"]["packed"] == fixed
    assert m["context_bytes"]["packed"] == 890 * 2**20 + fixed == 935_960_576
    assert m["context_bytes"]["bf16"] == 3200 * 2**20 + 40 * 128 * 1024 + 3 * 2 * 2 * 512 * 4


@pytest.mark.slow
def test_compressor_trace_numbers(smoke_run):
    trace = _sidecar(smoke_run, "03_compressor_trace")
    n, prefill = trace["n_tokens"], trace["prefill"]
    assert (n, prefill) == (9, 5)
    r2, r1 = trace["traces"]["2"], trace["traces"]["4"]
    assert (r2["ratio"], r1["ratio"]) == (2, 1)
    # ratio 2: the prefill pools (0,1), (2,3) and holds 4; then a group completes on every odd position
    assert [c["emitted_groups"] for c in r2["calls"]] == [[0, 1], [2], [], [3], []]
    assert [c["held"] for c in r2["calls"]] == [[4], [], [6], [], [8]]
    assert all(c["held_state_matches"] for c in r2["calls"])
    assert [c["emitted_groups"] for c in r1["calls"]] == [[0, 1, 2, 3, 4], [5], [6], [7], [8]]
    for t in (r2, r1):
        for g in t["groups"]:
            first = g["group"] * t["ratio"]
            assert g["tokens"] == list(range(first, first + t["ratio"]))
            assert g["kv_rotated_at"] == [first] and g["key_rotated_at"] == [first]
            assert abs(sum(g["gate_weights"]) - 1) < 1e-5
    assert _sidecar(smoke_run, "03_csa2_facts")["compressor"]["2"]["rotated_at_first"] is True
    # the same rules at any prefill length and ratio: groups in order, the prefill pools its whole
    # groups and holds the rest, and a one-token call emits exactly when it completes a group
    facts = _sidecar(smoke_run, "03_csa2_facts")["compressor"]
    assert sorted(facts) == sorted(trace["traces"])
    for layer, t in trace["traces"].items():
        ratio = t["ratio"]
        assert facts[layer]["held_state_matches"] and facts[layer]["rotated_at_first"], layer
        assert all(c["held_state_matches"] for c in t["calls"]), layer
        assert [g["group"] for g in t["groups"]] == list(range(n // ratio)), layer
        assert t["calls"][0]["emitted_groups"] == list(range(prefill // ratio)), layer
        assert facts[layer]["held_after_prefill"] == list(range(prefill - prefill % ratio, prefill)), layer
        assert all(
            c["emitted_groups"] == ([c["start_pos"] // ratio] if (c["start_pos"] + 1) % ratio == 0 else [])
            for c in t["calls"][1:]
        ), layer


# ---------------------------------------------------------------------- 04
@pytest.mark.slow
def test_topk_sweep_every_divergence_a_tie_and_parity_untruncated(smoke_run):
    sweep = _sidecar(smoke_run, "04_topk_sweep")
    n = sweep["n_tokens"]
    assert n == 24 and sweep["untruncated_width"] == n  # ratio-1 layers reach every position
    assert sweep["widths"] == [2, TINY.index_topk, n] and sweep["config_width"] == TINY.index_topk
    for width, differ, ties, elsewhere in zip(
        sweep["widths"], sweep["n_differ"], sweep["n_ties"], sweep["n_output_differ_without_selection"]
    ):
        assert differ == ties, width
        assert elsewhere == 0, width
    last = sweep["widths"].index(n)
    assert sweep["identical"][last] and sweep["n_differ"][last] == 0 and sweep["max_output_diff"][last] == 0.0
    assert sweep["n_truncated"][last] == 0
    # the narrower widths do truncate, and prefill and decode do part there (on ties)
    assert all(t > 0 for t in sweep["n_truncated"][:last])
    assert sum(sweep["n_differ"][:last]) > 0 and max(sweep["max_output_diff"][:last]) > 0
    assert all(tie for _, _, tie in sweep["differ_at_config_width"])
    facts = _sidecar(smoke_run, "04_candidate_facts")["sweep"]
    assert facts["all_divergences_ties"] is True and facts["parity_untruncated"] is True


@pytest.mark.slow
def test_candidate_blocks_and_the_pin(smoke_run):
    blocks = _sidecar(smoke_run, "04_candidate_blocks")
    assert (blocks["layer"], blocks["topk_blocks"], blocks["block_size"]) == (4, 4, 2)
    assert blocks["kept"] == blocks["kept_in_trace"]
    for reach, newest, kept in zip(blocks["reachable"], blocks["newest_block"], blocks["kept"]):
        assert newest == (reach - 1) // 2 and newest in kept
        assert len(kept) == min(4, -(-reach // 2))
    assert any(blocks["pin_mattered"])
    for mattered, newest, plain in zip(blocks["pin_mattered"], blocks["newest_block"], blocks["kept_unpinned"]):
        assert mattered == (newest not in plain)

    constructed = _sidecar(smoke_run, "04_filling_block")
    assert constructed["block_scores"] == [5.0, 9.0, 7.0, 0.5]
    assert constructed["filling"] is True and constructed["newest_block"] == 3
    assert constructed["kept"] == [1, 3] and constructed["kept_unpinned"] == [1, 2] and constructed["displaced"] == [2]


@pytest.mark.slow
def test_index_scores_of_one_query(smoke_run):
    scores = _sidecar(smoke_run, "04_index_scores")
    q, k = scores["query"], scores["index_topk"]
    assert q == 23 and scores["layers"] == [2, 4, 6] and scores["ratios"] == [2, 1, 1]
    for layer, ratio in zip(scores["layers"], scores["ratios"]):
        row = [float(v) for v in scores["scores"][str(layer)]]
        kept, reach = scores["kept"][str(layer)], scores["reachable"][str(layer)]
        assert reach == (q + 1) // ratio and len(row) == 24 // ratio
        assert len(kept) == min(k, reach) and all(0 <= p < reach for p in kept)
        kth = float(scores["kth_score"][str(layer)])
        assert all(row[p] >= kth for p in kept)  # every kept position scores at least the k-th
        dropped = [row[p] for p in range(reach) if p not in kept]
        assert all(v <= kth for v in dropped)


@pytest.mark.slow
def test_stale_keys_default_vs_fix(smoke_run):
    stale = _sidecar(smoke_run, "04_stale_keys")
    n, k = stale["n_tokens"], stale["index_topk"]
    assert stale["prefill_identical"] is True
    assert stale["expected_keys_from"] == {"2": 2, "4": 4, "6": 4}
    # layer 2 (ratio 2) republishes only on odd positions; on even ones it scores layer 4's keys
    assert stale["stale"]["2"] == list(range(2, n, 2)) and stale["stale"]["4"] == stale["stale"]["6"] == []
    assert all(stale["keys_from"]["2"][p] == 4 for p in stale["stale"]["2"])
    assert set(stale["keys_from_fixed"]["2"][1:]) == {2}
    changed = stale["changed"]
    assert changed["2"] and set(changed["2"]) <= set(stale["stale"]["2"])
    assert changed["3"] == changed["2"]  # the Reuse reader of layer 2's top-k follows it
    assert all((p + 1) // 2 > k for p in changed["2"])  # only where the ratio-2 top-k truncates
    assert not any(changed[str(layer)] for layer in (0, 1, 4, 5, 6, 7))
    # in any layer: an output changed only at a step where its index source scored other keys, and
    # there its selection differs
    for layer, positions in changed.items():
        source = TINY.source_at_or_before(int(layer), TINY.index_source_layers)
        assert set(positions) <= set(stale["stale"].get(str(source), [])), layer
        assert all(stale["selection_differs"][layer][p] for p in positions), layer


@pytest.mark.slow
def test_reference_numerics_against_the_parity_options(smoke_run):
    num = _sidecar(smoke_run, "04_numerics")
    chunk, win, n = num["chunk"], num["window"], num["n_tokens"]
    assert chunk == SPARSE_ATTN_CHUNK and TINY.window_size <= chunk
    assert win == chunk + TINY.window_size and n == win + TINY.window_size  # the ring fills, then wraps
    assert num["index_topk"] == n  # ratio-1 layers keep every reachable position: nothing truncated
    settings = [tuple(s) for s in num["settings"]]
    assert sorted(settings) == sorted((layout, pad) for layout in WINDOW_LAYOUTS for pad in (False, True))
    assert num["n_differ"] == [0] * len(settings)  # no selection differs: every difference is rounding
    window_layers = [layer for layer, ratio in enumerate(num["ratios"]) if not ratio]
    for (layout, pad), per_layer, diffs in zip(settings, num["max_output_diff"], num["output_diff"]):
        if layout == "uniform":  # one layout for prefill and decode: bit for bit, padded or not
            assert per_layer == [0.0] * len(per_layer), pad
            continue
        # the reference's decode row ends its present positions at the last window column while the
        # ring fills: a pure window layer's sums move only where they straddle the chunk boundary
        # elsewhere than the prefill row's, and nowhere once the ring is full
        moved = {p for layer in window_layers for p, v in enumerate(diffs[layer]) if v > 0}
        assert moved and moved <= set(range(win - chunk, win - 1)), (layout, pad)
        assert all(max(row[win - 1 :]) == 0.0 for row in diffs), (layout, pad)

    # the whole model at the checkpoint's own geometry, over positions no top-k cuts
    assert 0 < num["logit_positions"] <= cs.untruncated_positions(TINY)
    assert num["checkpoint_window"] == TINY.window_size and num["checkpoint_index_topk"] == TINY.index_topk
    whole = dict(zip(settings, zip(num["logit_max_abs_diff"], num["max_abs_logit"], num["first_argmax_divergence"])))
    assert [(o["window_layout"], o["pad_f32_rows"]) for o in num["numerics"]] == settings
    assert num["selection_partings"] == num["routing_partings"] == [{}] * len(settings)
    assert all(first is None for _, _, first in whole.values())  # no greedy token moves
    # unpadded float32 GEMMs take another BLAS kernel for a decode step's single row (measured on
    # this torch build's MKL): logits part by rounding, within a bf16 step of their scale
    for layout in WINDOW_LAYOUTS:
        diffs, scale, _ = whole[(layout, False)]
        assert 0 < max(diffs) <= torch.finfo(torch.bfloat16).eps * scale, layout
    # padded, the layouts agree too: this checkpoint's rows (window + index_topk) fit one chunk
    assert TINY.window_size + TINY.index_topk <= chunk
    assert whole[("uniform", True)][0] == whole[("reference", True)][0] == [0.0] * num["logit_positions"]
    facts = _sidecar(smoke_run, "04_candidate_facts")
    assert facts["numerics"]["attention_identical"] == {
        "reference, False": False,
        "reference, True": False,
        "uniform, False": True,
        "uniform, True": True,
    }
    assert facts["sweep"]["numerics"] == {"window_layout": "uniform", "pad_f32_rows": True}
    # the whole-model loads come after the first model and every attention stack sharing its weights
    # are gone: at the released size holding them beside a second model went 23% past the budget
    assert facts["weights_freed_before_reload"] is True


@pytest.mark.slow
def test_tie_break_lowest_leaves_no_prefill_decode_parting(smoke_run):
    from dsv41.core.numerics import Numerics

    tie = _sidecar(smoke_run, "04_tie_break")
    sweep = _sidecar(smoke_run, "04_topk_sweep")
    n = tie["n_tokens"]
    assert n == sweep["n_tokens"] == 24 and tie["widths"] == sweep["widths"] == [2, TINY.index_topk, n]
    assert tie["numerics"] == {
        "topk": Numerics.parity().with_options(tie_break="topk").as_dict(),
        "lowest": Numerics.parity().as_dict(),
    }
    assert tie["numerics"]["lowest"]["tie_break"] == "lowest" and sweep["tie_break"] == "topk"
    # torch.topk's order: the sweep of section 4, every parting a tie, some at the truncating widths
    assert tie["n_differ"]["topk"] == sweep["n_differ"] == tie["n_ties"]["topk"]
    assert sum(tie["n_differ"]["topk"][:-1]) > 0 and max(tie["max_output_diff"]["topk"][:-1]) > 0
    # one tie rule: the same widths truncate the same (query, layer) pairs, and nothing parts at any of them
    assert tie["n_truncated"]["lowest"] == tie["n_truncated"]["topk"] and all(
        t > 0 for t in tie["n_truncated"]["lowest"][:-1]
    )
    assert tie["n_differ"]["lowest"] == tie["n_ties"]["lowest"] == [0, 0, 0]
    assert tie["max_output_diff"]["lowest"] == [0.0, 0.0, 0.0] and tie["identical"]["lowest"] == [True, True, True]
    facts = _sidecar(smoke_run, "04_candidate_facts")["tie_break"]
    assert facts["all_identical_lowest"] is True and facts["n_differ"] == tie["n_differ"]
    assert tie["timed"]["repeats"] == facts["timing_repeats"] == 3 and tie["timed"]["index_topk"] == TINY.index_topk


@pytest.mark.slow
def test_tie_break_time_ratio_is_measured_and_shown(smoke_run):
    # wall clock, so it lives in the executed notebook's table, not in a sidecar (those are byte-identical run to run)
    import math
    import re

    import nbformat

    nb = nbformat.read(str(smoke_run / "04_candidate_blocks.ipynb"), as_version=4)
    texts = [
        o.get("data", {}).get("text/plain", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    ]
    ratios = [float(m.group(1)) for t in texts for m in [re.search(r"lowest / topk = ([0-9.eE+-]+)", t)] if m]
    assert len(ratios) == 1 and math.isfinite(ratios[0]) and ratios[0] > 0, ratios
