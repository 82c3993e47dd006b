"""dsv41/widgets/: each render over hand-made plain data, the LRU replay against a hand-worked sequence,
the adapters on a real tiny generation, byte-identical export, and the prompt probe's run handler
(built and driven without a kernel)."""

import json
import math
import time

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from dsv41 import widgets
from dsv41.core.numerics import Numerics
from dsv41.generation.generate import compare_prefill_decode, generate
from dsv41.observe import viz
from dsv41.observe.cache_policy import call_lookups, lru_replay, replay_counts

pytestmark = pytest.mark.usefixtures("one_thread")  # the shared fixture in conftest.py


# ---------------------------------------------------------------------- the LRU replay
def test_lru_replay_matches_a_hand_worked_sequence():
    seq = [1, 2, 1, 3, 2, 1]
    # capacity 2: 1 miss [1]; 2 miss [1 2]; 1 hit [2 1]; 3 miss, evicts 2 [1 3]; 2 miss, evicts 1 [3 2];
    # 1 miss, evicts 3 [2 1]
    assert lru_replay(seq, 2) == [False, False, True, False, False, False]
    # capacity 3: nothing is evicted until 3 arrives, and then nothing that comes back
    assert lru_replay(seq, 3) == [False, False, True, False, True, True]
    assert lru_replay(seq, 1) == [False] * 6
    assert lru_replay(seq, 0) == [False] * 6  # keeps nothing, as ExpertCache(capacity=0)
    assert lru_replay([5, 5, 5], 1) == [False, True, True]
    # recency, not insertion order: the hit on 1 saves it from the eviction that takes 2
    assert lru_replay([1, 2, 1, 3, 1, 2], 2) == [False, False, True, False, True, False]
    with pytest.raises(ValueError):
        lru_replay(seq, -1)


def test_replay_counts_keep_call_boundaries():
    assert call_lookups([[3, 1], [1, 2]]) == [1, 2, 3]  # a call looks each distinct expert up once
    # calls [1 2] | [1 3] | [1 2] through capacity 2: 1m 2m | 1h 3m(evicts 2) | 1h 2m(evicts 3)
    assert replay_counts([[1, 2], [1, 3], [1, 2]], 2) == [[0, 2], [1, 1], [1, 1]]
    assert replay_counts([[1, 2], [1, 3], [1, 2]], 3) == [[0, 2], [1, 1], [2, 0]]
    assert replay_counts([], 4) == []


# ---------------------------------------------------------------------- renders over plain data
def _routing_plain():
    load_pre = [[2, 1, 1, 0], [4, 0, 0, 0]]
    load_dec = [[0, 1, 1, 0], [0, 1, 1, 0]]
    load_all = [[a + b for a, b in zip(p, d)] for p, d in zip(load_pre, load_dec)]
    mean = lambda loads: [[0.5 if n else None for n in row] for row in loads]
    n_tokens = {"all": 3, "prefill": 2, "decode": 1}
    return {
        "layers": [0, 1],
        "n_experts": 4,
        "top_k": 2,
        "n_tokens": n_tokens,
        "load": {"all": load_all, "prefill": load_pre, "decode": load_dec},
        "weight_sum": {},
        "weight_mean": {"all": mean(load_all), "prefill": mean(load_pre), "decode": mean(load_dec)},
        "balance": {
            "all": widgets.balance(load_all),
            "prefill": widgets.balance(load_pre),
            "decode": widgets.balance(load_dec),
        },
        "chance": {phase: widgets.chance_balance(n, 4, 2) for phase, n in n_tokens.items()},
    }


def _bars(ax) -> list[float]:
    """The bar heights of a panel (its BarContainer; reference bands are patches too)."""
    return [b.get_height() for b in ax.containers[0]]


def _routing_layers(n_layers: int):
    """_routing_plain's two layers repeated to `n_layers` (the released model has 40)."""
    data = _routing_plain()
    rows = lambda grid: [grid[i % 2] for i in range(n_layers)]
    load = {phase: rows(grid) for phase, grid in data["load"].items()}
    return {
        **data,
        "layers": list(range(n_layers)),
        "load": load,
        "weight_mean": {phase: rows(grid) for phase, grid in data["weight_mean"].items()},
        "balance": {phase: widgets.balance(grid) for phase, grid in load.items()},
    }


def test_routing_render_at_forty_layers_labels_what_fits():
    """The released model's 40 layers: tick labels thinned to about a dozen, and the entropy values
    (in the sidecar) not written over 40 narrow bars, where they overprinted one another."""
    fig = widgets.routing.render(_routing_layers(40), phase="prefill")
    ax_load, ax_w, ax_max, ax_ent = fig.axes[:4]
    for ax in (ax_max, ax_ent):
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert 6 <= len(ticks) <= 13 and ticks[0] == "0"
    assert len([t.get_text() for t in ax_load.get_yticklabels()]) <= 13
    assert not ax_ent.texts and len(_bars(ax_ent)) == 40
    few = widgets.routing.render(_routing_layers(8), phase="prefill")
    assert len(few.axes[3].texts) == 8 and len(few.axes[2].get_xticklabels()) == 8


def test_balance_by_hand():
    even, one = widgets.balance([[2, 2, 2, 2], [8, 0, 0, 0]]), widgets.balance([[0, 0, 0, 0]])
    assert even["max_over_mean"] == [1.0, 4.0] and even["unused"] == [0, 3]
    assert math.isclose(even["entropy"][0], 1.0) and even["entropy"][1] == 0.0
    assert one == {"max_over_mean": [None], "entropy": [None], "unused": [4]}


def test_routing_render_draws_the_data():
    data = _routing_plain()
    fig = widgets.routing.render(data, phase="prefill")
    assert isinstance(fig, Figure)
    ax_load, ax_w, ax_max, ax_ent = fig.axes[:4]
    assert len(fig.axes) == 6  # four panels and two colorbars
    assert np.array_equal(ax_load.get_images()[0].get_array(), np.array(data["load"]["prefill"]))
    assert _bars(ax_max) == data["balance"]["prefill"]["max_over_mean"]
    # the entropy as its distance from even, on an axis from 0, with the entropy written on each bar
    entropy = data["balance"]["prefill"]["entropy"]
    assert _bars(ax_ent) == pytest.approx([1 - h for h in entropy]) and ax_ent.get_ylim()[0] == 0
    assert [t.get_text() for t in ax_ent.texts] == [f"{h:.2f}" for h in entropy]
    # chance, the numbers drawn: uniform random routing of the phase's 2 tokens
    chance = data["chance"]["prefill"]
    dotted = {ax: [ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_linestyle() == ":"] for ax in (ax_max, ax_ent)}
    assert dotted[ax_max] == [chance["max_over_mean"]["mean"]]
    assert dotted[ax_ent] == pytest.approx([1 - chance["entropy"]["mean"]])
    assert f"chance {chance['max_over_mean']['mean']:.2f}" in ax_max.get_title()
    assert ax_w.get_images()[0].get_array().mask.tolist() == [[False, False, False, True], [False, True, True, True]]
    assert "2 tokens" in fig._suptitle.get_text()
    decode = widgets.routing.render(data, phase="decode")
    assert np.array_equal(decode.axes[0].get_images()[0].get_array(), np.array(data["load"]["decode"]))
    with pytest.raises(ValueError):
        widgets.routing.render(data, phase="later")


def test_chance_balance_is_uniform_random_routing_of_as_many_tokens():
    from dsv41.observe.learned import uniform_routing_loads

    # one token to k of E experts: every draw has max / mean E / k and entropy log k / log E, exactly
    one = widgets.chance_balance(1, 16, 4)
    assert one["max_over_mean"] == {"mean": 4.0, "low": 4.0, "high": 4.0}
    assert one["entropy"]["mean"] == pytest.approx(math.log(4) / math.log(16))
    # more tokens: the mean of balance() over the fixed-seed draws, between the 5th and 95th percentiles
    chance = widgets.chance_balance(62, 16, 4)
    drawn = widgets.balance(uniform_routing_loads(62, 16, 4).tolist())
    for key in ("max_over_mean", "entropy"):
        assert chance[key]["mean"] == pytest.approx(float(np.mean(drawn[key])))
        assert chance[key]["low"] < chance[key]["mean"] < chance[key]["high"]
    assert chance["max_over_mean"]["mean"] > 1.2 and chance["entropy"]["mean"] < 1  # never even by luck
    assert widgets.chance_balance(0, 16, 4) is None


def _cache_plain():
    return {
        "layers": [0, 1],
        "n_experts": 3,
        "capacity": 1,
        "steps": [{"start_pos": 0, "seqlen": 4}, {"start_pos": 4, "seqlen": 1}],
        "hits": [[0, 1], [0, 0]],
        "misses": [[3, 1], [2, 2]],
        "recorded_hit_rate": 1 / 8,
        "lookups": [5, 4],
        "distinct": [3, 3],
        "lookup_ids": {},
        "replay_sizes": [0, 1, 2, 3],
        "replay_hit_rate": [0.0, 0.125, 0.25, 0.25],
        "replay_hit_rate_by_layer": [[0.0, 0.2, 0.4, 0.4], [0.0, 0.0, 0.0, 0.0]],
    }


def test_cache_render_draws_the_data():
    data = _cache_plain()
    fig = widgets.cache.render(data, highlight=2)
    assert isinstance(fig, Figure)
    ax_map, ax_curve = fig.axes[:2]
    rate = ax_map.get_images()[0].get_array()
    assert rate.tolist() == [[0.0, 0.5], [0.0, 0.0]]
    lines = ax_curve.get_lines()
    overall = [ln for ln in lines if ln.get_label() == "LRU replay, all layers"][0]
    assert list(overall.get_ydata()) == data["replay_hit_rate"]
    star = [ln for ln in lines if ln.get_label().startswith("recorded")][0]
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([1], [0.125])
    grey = [ln for ln in lines if ln.get_color() == "#bbbbbb"]
    assert len(grey) == 2 and grey[0].get_label() == "LRU replay, each layer"  # one per layer, one legend entry
    assert len([ln for ln in lines if ln.get_label().startswith("_")]) == 1 + 1  # the other layer, the highlight
    assert any(t.get_text() == "size 2: 0.250" for t in ax_curve.texts)
    assert [t.get_text() for t in ax_map.get_xticklabels()] == ["prefill", "1"]


def _ties_plain(comparison=True):
    nan = None
    data = {
        "positions": [0, 1, 2, 3, 4, 5],
        "prompt_tokens": 4,
        "layers": [0, 1, 2],
        "rows": ["1 index", "1 blocks"],
        "row_layers": [1, 1],
        "gap": [[nan, nan, 0.5, 0.0, 0.2, 0.0], [nan, nan, nan, 0.1, 0.0, 0.3]],
        "ties": [2, 1],
        "first_cut": 2,
        "margin_positions": [3, 4, 5],
        "margins": [0.0, 0.3, 0.05],
        "tokens": [7, 8, 9],
        "comparison": None,
    }
    if comparison:
        data["comparison"] = {
            "positions": 5,
            "max_abs_diff": [0.0, 0.0, 0.0, 0.4, 0.1],
            "max_abs_logit": 3.0,
            "first_logit_divergence": 3,
            "first_argmax_divergence": None,
            "selection_parting": {"1": [3], "2": [3, 4]},
            "routing_parting": {"2": [4]},
            "numerics": Numerics().as_dict(),
        }
    return data


def test_tie_render_draws_the_data():
    fig = widgets.ties.render(_ties_plain(), tol=0.0)
    assert isinstance(fig, Figure)
    ax_gap, ax_part, ax_diff, ax_margin = fig.axes[:4]
    assert len(fig.axes) == 5  # four rows and the gap colorbar
    ties = [ln for ln in ax_gap.get_lines() if ln.get_label().startswith("tie")][0]
    assert sorted(zip(ties.get_xdata(), ties.get_ydata())) == [(3, 0), (4, 1), (5, 0)]  # (position, row)
    gap = ax_gap.get_images()[0].get_array()
    assert gap.mask[:, :2].all() and not gap.mask[0, 2:].any()  # nothing cut before position 2
    sel = [ln for ln in ax_part.get_lines() if ln.get_label() == "selections part"][0]
    assert sorted(zip(sel.get_xdata(), sel.get_ydata())) == [(3, 1), (3, 2), (4, 2)]
    assert list(ax_diff.get_lines()[0].get_ydata()) == [0.0, 0.0, 0.0, 0.4, 0.1]
    assert [b.get_height() for b in ax_margin.patches] == [0.0, 0.3, 0.05]
    assert [b.get_facecolor() for b in ax_margin.patches] == [
        to_rgba(c) for c in (viz.PALETTE[3], viz.PALETTE[2], viz.PALETTE[2])
    ]
    # a looser tolerance marks near-ties too: gaps 0.1 and margin 0.05
    loose = widgets.ties.render(_ties_plain(), tol=0.1)
    ties = [ln for ln in loose.axes[0].get_lines() if ln.get_label().startswith("tie")][0]
    assert len(ties.get_xdata()) == 4


def test_tie_render_reads_for_a_person():
    data = _ties_plain()
    data["rows"].append("2 index")  # a top-k that never cut over these positions
    data["row_layers"].append(2)
    data["gap"].append([None] * 6)
    data["ties"].append(0)
    fig = widgets.ties.render(data)
    ax_gap = fig.axes[0]
    # the all-grey row is not drawn; the title names it
    assert [t.get_text() for t in ax_gap.get_yticklabels()] == ["1 index", "1 blocks"]
    assert ax_gap.get_images()[0].get_array().shape == (2, 6) and "not drawn: layer 2 index" in ax_gap.get_title()
    assert widgets.ties.never_cut(data["rows"], data["gap"]) == ["2 index"]
    # the tie marks: white with a dark outline, legible on viridis's dark and light ends alike
    marks = [ln for ln in ax_gap.get_lines() if ln.get_label().startswith("tie")][0]
    assert to_rgba(marks.get_color()) == to_rgba("white") and marks.get_path_effects()
    # the title is words, not option names
    title = fig._suptitle.get_text()
    assert "the released model's arithmetic" in title and not any(k in title for k in Numerics().as_dict())
    data["comparison"]["numerics"] = Numerics.parity().as_dict()
    assert "independent of how the tokens are split" in widgets.ties.render(data)._suptitle.get_text()
    data["comparison"]["numerics"] = Numerics().with_options(tie_break="lowest").as_dict()
    assert widgets.ties.render(data)._suptitle.get_text().endswith("With ties to the lower position")


def test_tie_render_without_a_comparison_says_so():
    fig = widgets.ties.render(_ties_plain(comparison=False))
    assert any("no prefill / decode comparison" in t.get_text() for t in fig.axes[1].texts)
    assert all(len(ln.get_xdata()) == 2 for ln in fig.axes[2].get_lines())  # only the vertical markers, no curve


def test_export_twice_gives_identical_bytes(tmp_path):
    view = widgets.CacheView(_cache_plain())
    first = view.export("cache", str(tmp_path / "a"))
    again = view.export("cache", str(tmp_path / "b"))
    fresh = widgets.CacheView(_cache_plain()).export("cache", str(tmp_path / "c"))  # a new figure, same data
    for ext in ("png", "svg", "json"):
        data = open(first[ext], "rb").read()
        assert data == open(again[ext], "rb").read() == open(fresh[ext], "rb").read(), ext
    sidecar = json.loads(open(first["json"]).read())
    assert sidecar["replay_hit_rate"] == [0.0, 0.125, 0.25, 0.25] and sidecar["options"] == {"highlight": 1}


def test_view_controls_re_render_without_a_kernel():
    view = widgets.CacheView(_cache_plain())
    box = view.widget
    slider, image = box.children
    before = bytes(image.value)
    slider.value = 3  # what a person dragging the slider does
    assert view.options["highlight"] == 3 and bytes(image.value) != before
    assert any(t.get_text() == "size 3: 0.250" for t in view.figure.axes[1].texts)
    # the widget shows the PNG export_figure writes: one renderer, dsv41.observe.viz.png_bytes
    assert bytes(image.value) == viz.png_bytes(view.figure)


def test_widget_image_is_the_exported_png(tmp_path):
    view = widgets.CacheView(_cache_plain())
    exported = open(view.export("cache", str(tmp_path))["png"], "rb").read()
    assert bytes(view.widget.children[-1].value) == exported


# ---------------------------------------------------------------------- adapters on a real generation
@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from dsv41.runtime.loader import load

    return load(tiny_checkpoint, expert_cache=5, quiet=True)


@pytest.fixture(scope="module")
def run(model):
    """A cold-cache traced generation and the comparison over its first 12 traced positions."""
    model.experts.clear()
    result = generate(
        model, "Routing, caching and ties on the tiny model", max_new_tokens=4, trace=True, stop_at_eos=False
    )
    comparison = compare_prefill_decode(model, widgets.traced_ids(result, 12))
    return result, comparison


def test_routing_adapter_on_a_generation(model, run):
    result, _ = run
    cfg = model.cfg
    data = widgets.routing_data(result, n_experts=cfg.n_routed_experts)
    n = len(result.prompt_ids) + len(result.ids) - 1
    assert data["layers"] == list(range(cfg.n_layers)) and data["top_k"] == cfg.n_activated_experts
    assert data["n_tokens"] == {"all": n, "prefill": len(result.prompt_ids), "decode": len(result.ids) - 1}
    for phase in ("all", "prefill", "decode"):
        assert [sum(row) for row in data["load"][phase]] == [
            data["n_tokens"][phase] * cfg.n_activated_experts
        ] * cfg.n_layers
    ids = result.trace.routing()[3]["expert_ids"][0]
    assert data["load"]["all"][3] == torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts).tolist()
    # chance for each phase and token type: uniform random routing of that many tokens
    for part in (data, data["by_tokens"]["text"], data["by_tokens"]["image"]):
        for phase, n_tokens in part["n_tokens"].items():
            assert part["chance"][phase] == widgets.chance_balance(
                n_tokens, cfg.n_routed_experts, cfg.n_activated_experts
            )
    assert data["chance"]["all"]["n_tokens"] == n and data["by_tokens"]["image"]["chance"]["all"] is None
    json.dumps(viz.to_jsonable(data), allow_nan=False)


def test_cache_adapter_replays_the_recorded_cache(model, run):
    result, _ = run
    data = widgets.cache_data(result, capacity=5, n_experts=model.cfg.n_routed_experts)
    assert data["replay_sizes"] == list(range(17)) and len(data["steps"]) == len(result.ids)
    for i, layer in enumerate(data["layers"]):
        recorded = [[h, m] for h, m in zip(data["hits"][i], data["misses"][i])]
        assert data["replay_at_capacity"][str(layer)] == recorded, layer  # call by call
        assert sum(map(sum, recorded)) == data["lookups"][i]
    assert data["replay_hit_rate"][5] == data["recorded_hit_rate"]
    assert data["replay_hit_rate"][0] == 0.0 and data["replay_hit_rate"][-1] == pytest.approx(
        1 - sum(data["distinct"]) / sum(data["lookups"])
    )
    rates = data["replay_hit_rate"]
    assert all(a <= b for a, b in zip(rates, rates[1:]))  # LRU is a stack algorithm
    # the first call is the prefill: a cold cache misses on every distinct expert
    assert [row[0] for row in data["hits"]] == [0] * len(data["layers"])


def test_cache_accounting_agrees_three_ways_and_with_the_replay(tiny_checkpoint):
    from dsv41.generation.generate import cache_accounting
    from dsv41.runtime.loader import load

    model = load(tiny_checkpoint, expert_cache=5, quiet=True)  # fresh: its counters hold only what follows
    result = generate(model, "Counting the expert cache", max_new_tokens=3, trace=True, stop_at_eos=False)
    acc = cache_accounting(result, model)
    assert acc["counters_only_this_run"] and acc["capacity"] == 5 and acc["calls"] == 3
    replay = widgets.replay_accounting(widgets.cache_data(result, capacity=5, n_experts=model.cfg.n_routed_experts))
    assert sorted(acc["per_layer"], key=int) == sorted(replay, key=int) == [str(i) for i in range(model.cfg.n_layers)]
    k = model.cfg.n_activated_experts
    for layer, row in acc["per_layer"].items():
        assert (
            (row["hits"], row["misses"])
            == (row["record_hits"], row["record_misses"])
            == (row["counter_hits"], row["counter_misses"])
            == (replay[layer]["replay_hits"], replay[layer]["replay_misses"])
        )
        assert row["hits"] + row["misses"] == row["lookups"] <= row["token_choices"] == (len(result.all_ids) - 1) * k
        assert replay[layer]["replay_per_call_equal"] and replay[layer]["distinct"] <= row["lookups"]
    # a later call on the same model: the counters now hold more than this run, and say so
    generate(model, "again", max_new_tokens=1)
    later = cache_accounting(result, model)
    assert not later["counters_only_this_run"]
    assert {k: v for k, v in later.items() if k not in ("counters_only_this_run", "per_layer")} == {
        k: v for k, v in acc.items() if k not in ("counters_only_this_run", "per_layer")
    }
    assert sum(r["counter_hits"] + r["counter_misses"] for r in later["per_layer"].values()) > sum(
        r["hits"] + r["misses"] for r in later["per_layer"].values()
    )
    with pytest.raises(ValueError, match="replay at the run's capacity"):
        widgets.replay_accounting(widgets.cache_data(result))


def test_tie_adapter_on_a_generation(model, run):
    result, comparison = run
    data = widgets.tie_data(result, comparison)
    n = len(result.prompt_ids) + len(result.ids) - 1
    assert data["positions"] == list(range(n))
    assert "2 index" in data["rows"] and f"{model.cfg.candidate_source_layer} blocks" in data["rows"]
    # index_topk 8 at compress ratio 1: the first cut is at position 8, nothing before it
    assert data["first_cut"] == model.cfg.index_topk
    for row in data["gap"]:
        assert all(g is None for g in row[: data["first_cut"]])
        assert all(g >= 0 for g in row if g is not None)
    assert data["margins"] == result.trace.margins and data["tokens"] == result.ids
    assert data["never_cut"] == [row for row, gap in zip(data["rows"], data["gap"]) if all(g is None for g in gap)]
    cmp = data["comparison"]
    # the model keeps the reference's arithmetic: before the first cut the logits part by rounding
    # only (see test_generate), within a bf16 step of their scale
    assert cmp["positions"] == 12
    assert max(cmp["max_abs_diff"][:8]) <= torch.finfo(torch.bfloat16).eps * cmp["max_abs_logit"]
    partings = [p for positions in cmp["selection_parting"].values() for p in positions]
    assert all(p >= 8 for p in partings)
    json.dumps(viz.to_jsonable(data), allow_nan=False)


def test_adapters_refuse_an_untraced_result(model):
    result = generate(model, "no trace", max_new_tokens=1)
    with pytest.raises(ValueError, match="trace=True"):
        widgets.routing_data(result)


# ---------------------------------------------------------------------- the prompt probe
def test_prompt_probe_run_handler_refreshes_the_views(model):
    probe = widgets.PromptProbe(model, "Once upon a time", 2, compare_limit=10)
    box = probe.widget  # build every widget, as a notebook would
    images = [view.widget.children[-1] for view in probe.views.values()]
    before = {name: view.data for name, view in probe.views.items()}
    pictures = [bytes(im.value) for im in images]
    assert probe.views["ties"].data["comparison"]["positions"] == min(len(probe.result.prompt_ids) + 1, 10)

    probe.text.value = "A different prompt, somewhat longer than the first one"
    probe.tokens.value = 3
    probe.on_run(probe.button)
    assert probe.runs == 1 and not probe.button.disabled and "not run" not in probe.status.value
    after = {name: view.data for name, view in probe.views.items()}
    for name in before:
        assert after[name] != before[name], name
    assert after["routing"]["n_tokens"]["decode"] == 2
    assert after["ties"]["comparison"]["positions"] == 10  # compare_limit
    assert after["cache"]["replay_hit_rate"][model.experts.capacity] == after["cache"]["recorded_hit_rate"]
    assert all(bytes(im.value) != old for im, old in zip(images, pictures))
    assert len(box.children[-1].children) == 3

    probe.text.value = "  "
    probe.on_run(probe.button)  # a bad prompt: one line in the status, the views keep the last run
    assert "not run" in probe.status.value and "empty" in probe.status.value
    probe.text.value, probe.tokens.value = "too many", 4096
    probe.on_run(probe.button)  # generate's own refusal, shown the same way
    assert "not run" in probe.status.value and "max_seq_len" in probe.status.value and not probe.button.disabled
    assert probe.runs == 1 and probe.views["routing"].data is after["routing"]


def test_prompt_probe_counts_tokens_and_refreshes_the_views_handed_to_it(model):
    probe0 = widgets.PromptProbe(model, "Once upon a time", 2, compare=False)
    above = [
        widgets.RoutingView(probe0.views["routing"].data),
        widgets.CacheView(probe0.views["cache"].data),
        widgets.TieView(probe0.views["ties"].data),
    ]
    probe = widgets.PromptProbe(model, "Once upon a time", 2, compare=False, result=probe0.result, refresh=above)
    probe.text.value, probe.tokens.value = "Something else entirely", 5
    probe.on_run()
    assert probe.progress.value == probe.progress.max == 5 and probe.progress.description == "done"
    assert "5 generated" in probe.status.value
    assert [v.data for v in above] == [probe.views[n].data for n in ("routing", "cache", "ties")]
    assert above[0].data is not probe0.views["routing"].data
    with pytest.raises(TypeError, match="refreshes routing, cache, tie and speculation views"):
        widgets.PromptProbe(model, "x", 1, compare=False, result=probe0.result, refresh=[object()])


def test_prompt_probe_stop_button_ends_a_background_run_early(model):
    probe = widgets.PromptProbe(model, "Once upon a time", 1, compare=False, background=True)
    probe.tokens.value = 400
    probe.on_run()
    assert probe.button.disabled and not probe.stop_button.disabled
    deadline = time.monotonic() + 60
    while probe.progress.value < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    probe.stop()
    probe.wait(60)
    assert probe.runs == 1 and probe.result.finish_reason == "callback" and len(probe.result.ids) < 400
    assert "stopped" in probe.status.value and not probe.button.disabled and probe.stop_button.disabled


def test_a_budgeted_runs_cache_view_is_its_shared_pool(tiny_checkpoint):
    """Under a memory budget the experts sit in one pool of slots for every layer: the view says
    so, marks the run at the pool's share per layer, and replays the pool through the running
    cache's own bookkeeping, which gives the recorded counts (no per-layer LRU claims them)."""
    from dsv41.runtime.budget import plan_budget
    from dsv41.runtime.loader import load

    probe = load(tiny_checkpoint, quiet=True, threads=1)
    plan = plan_budget(probe.cfg, 1 << 40, max_seq_len=64)
    slots = 40
    model = load(
        tiny_checkpoint,
        quiet=True,
        threads=1,
        max_seq_len=64,
        memory=plan.budget_for(slots),
    )
    assert model.experts.slots == slots
    result = generate(model, "a pool of slots for every layer", max_new_tokens=4, trace=True, stop_at_eos=False)
    pool = {"slots": model.experts.slots, "policy": model.experts.policy, "half_life": model.experts.half_life}
    data = widgets.cache_data(result, capacity=model.experts.capacity, n_experts=model.cfg.n_routed_experts, pool=pool)
    got = data["pool"]
    assert got["replay_equals_recorded"] and got["replay_hit_rate"] == pytest.approx(data["recorded_hit_rate"])
    assert got["layers_sharing"] == model.cfg.n_layers and got["share_per_layer"] == slots / model.cfg.n_layers
    assert 0 < data["recorded_hit_rate"] < 1  # the pool both hit and missed
    with pytest.raises(ValueError, match="pooled run"):
        widgets.replay_accounting(data)
    fig = widgets.cache.render(data)
    title = fig.axes[0].get_title()
    assert f"{slots} slots for {model.cfg.n_layers} layers" in title and "per layer" not in title
    labels = fig.axes[1].get_legend_handles_labels()[1]
    assert any(f"a pool of {slots}" in label for label in labels) and any("pool replayed" in label for label in labels)
