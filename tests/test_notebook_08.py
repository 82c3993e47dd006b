"""Notebook 08 (what the miniature learned) executed in smoke mode on the packaged miniature against
the random tiny checkpoint, with assertions on the numbers its sidecars carry."""

import pytest
from conftest import notebook_group, run_notebooks_smoke, sidecar

from dsv41.core.config import load_config

pytestmark = notebook_group("08")

FIGURES = ("routing", "router_scale", "engram", "indexer", "dspark", "cache", "ties")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, miniature_checkpoint, tiny_checkpoint):
    run, summary = run_notebooks_smoke(
        tmp_path_factory, miniature_checkpoint, "08", parameters={"comparison": str(tiny_checkpoint)}
    )
    outputs = sorted(summary["notebooks"][0]["outputs"])
    assert outputs == sorted(
        [f"08_{stem}.{ext}" for stem in FIGURES for ext in ("json", "png", "svg")] + ["08_learned_facts.json"]
    )
    return run


def test_the_pair_is_trained_against_random(smoke_run, miniature_checkpoint, tiny_checkpoint):
    facts = sidecar(smoke_run, "08_learned_facts")
    assert facts["smoke"] is True and facts["trained_vs_random"] is True
    assert facts["checkpoint"] == str(miniature_checkpoint)
    assert facts["comparison"].startswith("the random tiny checkpoint")  # named, not a machine-specific path
    assert facts["corpus"]["held_out"]["files"] > 0


def test_markdown_names_the_embedded_model(smoke_run):
    import nbformat

    nb = nbformat.read(str(smoke_run / "08_learned.ipynb"), as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "trained by `dsv41 train`" in text and "random tiny checkpoint" in text
    # the numbers are stated by code reading the sidecars, so they show as outputs
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "text/markdown" in o.get("data", {})]
    assert len(shown) == len(FIGURES)


def test_routing_sidecar(smoke_run, miniature_checkpoint):
    cfg = load_config(str(miniature_checkpoint))
    routing = sidecar(smoke_run, "08_routing")
    for name in ("trained", "random"):
        r = routing[name]
        assert r["layers"] == list(range(cfg.n_layers)) and r["n_experts"] == cfg.n_routed_experts
        assert len(r["class_share"]) == cfg.n_layers and all(len(m) == len(r["classes"]) for m in r["class_share"])
        assert all(0 < v <= 1 for v in r["affinity_spread"])
    # the trained router prefers some experts more sharply than the random one, in most layers
    below = sum(a < b for a, b in zip(routing["trained"]["affinity_spread"], routing["random"]["affinity_spread"]))
    assert below > cfg.n_layers // 2
    assert sum(routing["trained"]["affinity_spread"]) < sum(routing["random"]["affinity_spread"])  # sharper on average


def test_routing_figure_draws_chance_and_masks_small_classes(smoke_run, miniature_checkpoint):
    import math

    import numpy as np

    from dsv41.observe import learned

    facts = sidecar(smoke_run, "08_learned_facts")
    routing = sidecar(smoke_run, "08_routing")
    for name in ("trained", "random"):
        r = routing[name]
        E, k = r["n_experts"], r["top_k"]
        # the dotted load line: uniform random routing of each text's token count, averaged as load_spread is
        assert len(r["text_tokens"]) == r["texts"] == facts["n_texts"] and max(r["text_tokens"]) <= facts["n_tokens"]
        expected = np.mean([learned.spread(learned.uniform_routing_loads(n, E, k)).mean() for n in r["text_tokens"]])
        assert r["load_spread_chance"] == pytest.approx(expected, rel=1e-12)
        assert r["chance"] == {
            "shuffles": learned.MI_SHUFFLES,
            "draws": learned.CHANCE_DRAWS,
            "seed": learned.CHANCE_SEED,
        }
        # the black marks: the mutual information with the classes shuffled, the estimate's bias on
        # this many tokens, near Miller-Madow's (R - 1)(C - 1) / (2 N ln 2) over N = tokens x k pairs,
        # narrowed by (E - k) / (E - 1) since a token's k experts are distinct
        classes = sum(1 for n in r["class_tokens"] if n)
        bias = (classes - 1) * (E - 1) / (2 * sum(r["class_tokens"]) * k * math.log(2)) * (E - k) / (E - 1)
        assert len(r["mutual_information_shuffled_bits"]) == len(r["layers"])
        assert all(v == pytest.approx(bias, rel=0.4) for v in r["mutual_information_shuffled_bits"])
        assert facts["routing"]["mutual_information_shuffled_bits"][name] == r["mutual_information_shuffled_bits"]
        # the heat maps: white at top-k / E; the classes too small to colour are the ones named
        assert routing["masked_classes"][name] == [
            c for c, n in zip(r["classes"], r["class_tokens"]) if n < r["min_class_tokens"]
        ]
    assert (
        routing["colour_centre"]
        == routing["trained"]["uniform_class_share"]
        == routing["trained"]["top_k"] / routing["trained"]["n_experts"]
    )


def test_router_scale_sidecar(smoke_run):
    scale = sidecar(smoke_run, "08_router_scale")
    curve = scale["expected_affinity_spread"]
    assert scale["sigmas"][0] == 0 and curve[0] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(curve, curve[1:]))
    assert scale["sigmas"][0] < scale["sigma_for_0.9"] < scale["sigmas"][-1]
    routing = sidecar(smoke_run, "08_routing")
    t, n = routing["trained"], routing["random"]
    assert len(t["logit_std"]) == len(t["layers"]) and min(t["logit_std"]) > 0
    assert sum(t["logit_std"]) > sum(n["logit_std"])  # training widened the router logits
    assert all(v is None or t["token_spread_floor"] - 1e-12 <= v <= 1 for v in t["token_spread"] + n["token_spread"])


def test_indexer_recall_beats_chance(smoke_run, miniature_checkpoint):
    cfg = load_config(str(miniature_checkpoint))
    ix = sidecar(smoke_run, "08_indexer")
    t = ix["trained"]
    assert t["k"] == cfg.index_topk and t["layers"] == [
        l for l in range(cfg.n_layers) if cfg.layer_mode(l) in ("full", "reindex")
    ]
    assert all(0 < c < 1 for c in t["chance"])
    assert all(r > c for r, c in zip(t["recall"], t["chance"]))
    random = ix["random"]
    assert len(random["recall"]) == len(t["recall"]) and sum(t["recall"]) > sum(random["recall"])


def test_speculation_equals_greedy_and_counts_add_up(smoke_run):
    d = sidecar(smoke_run, "08_dspark")
    facts = sidecar(smoke_run, "08_learned_facts")
    for name in ("trained", "random"):
        s = d[name]
        assert s["equal_to_plain"] and all(s["equal_to_plain"])
        assert s["tokens"] == facts["n_prompts"] * (facts["new_tokens"] - 1)
        assert s["tokens_per_forward"] == pytest.approx(s["tokens"] / s["target_forwards"])
        assert all(a <= j for a, j in zip(s["accepted_by_position"], s["judged_by_position"]))
        assert sum(b["count"] for b in s["calibration"]) == sum(s["judged_by_position"])
    assert (
        d["trained"]["tokens_per_forward"] >= d["random"]["tokens_per_forward"]
    )  # the trained draft is right more often


def test_cache_and_engram_sidecars(smoke_run):
    c, e = sidecar(smoke_run, "08_cache"), sidecar(smoke_run, "08_engram")
    for name in ("trained", "random"):
        rates = c[name]["hit_rate"]
        for p in rates:
            assert all(h <= b + 1e-12 for h, b in zip(rates[p], rates["belady"])), p
        assert all(a <= b + 1e-12 for a, b in zip(rates["lru"], rates["lru"][1:]))
        assert all(sum(b["n"]) == e[name]["tokens"] for b in e[name]["bins"].values())


def test_mechanism_facts_hold_on_both_checkpoints(smoke_run):
    """What holds on any pair of checkpoints, trained or not."""
    facts = sidecar(smoke_run, "08_learned_facts")
    r, e, ix, c, ts = (sidecar(smoke_run, f"08_{name}") for name in ("routing", "engram", "indexer", "cache", "ties"))
    for name in ("trained", "random"):
        assert all(0 < v <= 1 for v in r[name]["affinity_spread"] + r[name]["load_spread"]), name
        assert all(
            v >= -1e-12 for v in r[name]["mutual_information_bits"] + r[name]["mutual_information_shuffled_bits"]
        ), name
        assert 0 < r[name]["load_spread_chance"] <= 1, name
        for share in r[name]["class_share"]:  # every token of a class chose top-k experts
            for row, count in zip(share, r[name]["class_tokens"]):
                assert count == 0 or abs(sum(row) - r[name]["top_k"]) < 1e-9, name
        assert all(0 <= v <= 1 for v in ix[name]["recall"] + ix[name]["mass"]), name
        assert ix[name]["chance"] == ix["trained"]["chance"]  # the same texts and formula, whatever the tokenizer
        for p, rates in c[name]["hit_rate"].items():  # Belady is optimal
            assert all(h <= b + 1e-12 for h, b in zip(rates, c[name]["hit_rate"]["belady"])), (name, p)
        assert ts[name]["parity"]["numerics"]["tie_break"] == "lowest", name
        assert ts[name]["reference"]["positions"] == ts["positions"] == 24, name  # smoke: 24 positions
    # the facts are the sidecars' numbers
    assert facts["routing"]["affinity_spread"] == {k: r[k]["affinity_spread"] for k in ("trained", "random")}
    assert facts["engram"]["trained"]["bins"] == e["trained"]["bins"] and facts["ties"] == ts


def test_at_the_released_layer_plan_each_checkpoint_is_drawn_at_its_own_layers(tmp_path_factory, tiny_checkpoint):
    """Pointed at a checkpoint of the released layer plan (40 layers, its own index and Engram layers,
    `make-synthetic --small`), notebook 08 still compares it with the random tiny checkpoint (8
    layers): it failed on the first per-layer figure at the full size; now each checkpoint is drawn
    at its own layer ids and the layer-by-layer counts pair only the layers both have."""
    from dsv41.checkpoint.released_synthetic import write_released_synthetic

    folder = str(tmp_path_factory.mktemp("released-plan") / "ck")
    write_released_synthetic(folder, small=True, progress=False, log=lambda _: None)
    run, summary = run_notebooks_smoke(tmp_path_factory, folder, "08", parameters={"comparison": str(tiny_checkpoint)})
    assert summary["notebooks"][0]["status"] == "ok", summary["notebooks"][0].get("error")
    routing = sidecar(run, "08_routing")
    assert len(routing["trained"]["layers"]) == load_config(folder).n_layers
    assert len(routing["random"]["layers"]) == load_config(str(tiny_checkpoint)).n_layers
    common = set(routing["trained"]["layers"]) & set(routing["random"]["layers"])
    facts = sidecar(run, "08_learned_facts")
    assert facts["trained_vs_random"] is False  # a synthetic checkpoint has no training manifest
    assert 0 <= facts["routing"]["layers_below_random"] <= len(common)
