"""Notebook 09 (experiments: what each mechanism is worth) executed in smoke mode on the packaged
miniature, with assertions on the numbers its sidecars carry: the studies' shapes and intervals, and
what the trained miniature measurably relies on."""

import numpy as np
import pytest
from conftest import notebook_group, run_notebooks_smoke, sidecar

from dsv41.checkpoint.miniature import read_manifest
from dsv41.core.config import load_config
from dsv41.observe.experiments import spaced
from dsv41.observe.learned import TOKEN_CLASSES

pytestmark = notebook_group("09")

FIGURES = ("engram", "indexer", "experts", "hyper_connections", "patching", "summary")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, miniature_checkpoint):
    run, summary = run_notebooks_smoke(tmp_path_factory, miniature_checkpoint, "09")
    outputs = sorted(summary["notebooks"][0]["outputs"])
    assert outputs == sorted(
        [f"09_{stem}.{ext}" for stem in FIGURES for ext in ("json", "png", "svg")] + ["09_experiments_facts.json"]
    )
    return run


@pytest.fixture(scope="module")
def cfg(miniature_checkpoint):
    return load_config(str(miniature_checkpoint))


def _consistent(result: dict) -> None:
    """A compared result: its difference inside its interval, and spans_zero saying whether zero is."""
    low, high = result["interval"]
    assert low <= result["difference"] <= high
    assert result["spans_zero"] == (low <= 0 <= high)
    assert result["bits_per_byte"] - result["base_bits_per_byte"] == pytest.approx(result["difference"], abs=1e-12)


def test_the_windows_and_the_unablated_run(smoke_run, miniature_checkpoint):
    facts = sidecar(smoke_run, "09_experiments_facts")
    assert facts["smoke"] is True and facts["embedded"] is True
    assert facts["n_windows"] == len(facts["window_starts"]) == 4 and facts["window_tokens"] == 64
    assert facts["window_starts"] == sorted(facts["window_starts"]) and facts["bytes"] > 0
    held = read_manifest(miniature_checkpoint)["held_out"]
    assert facts["stated_bits_per_byte"] == held["release_format"]["bits_per_byte"]
    # 64-target windows give less context than the training's 256, yet far better than random weights
    assert held["release_format"]["bits_per_byte"] < facts["baseline_bits_per_byte"]
    assert facts["baseline_bits_per_byte"] < held["random_initialization"]["bits_per_byte"]


def test_engram_off_costs_the_trained_miniature(smoke_run, cfg):
    e = sidecar(smoke_run, "09_engram")
    assert e["layers"] == list(cfg.engram_layer_ids) and len(e["each"]) == len(e["layers"])
    for result in (e["all"], *e["each"]):
        _consistent(result)
        assert set(result["by_class"]) <= set(TOKEN_CLASSES)
        for part in result["by_class"].values():
            _consistent(part)
    # the trained model leans on its n-gram memory: off on every layer costs more than either alone
    assert e["all"]["interval"][0] > 0
    assert e["all"]["difference"] > max(r["difference"] for r in e["each"])


def test_the_indexer_study(smoke_run, cfg):
    ix = sidecar(smoke_run, "09_indexer")
    assert ix["layers"] == [i for i, r in enumerate(cfg.compress_ratios[: cfg.n_layers]) if r]
    assert ix["index_topk"] == cfg.index_topk
    for name in ("dense", "random", "sparse_vs_dense"):
        _consistent(ix[name])
    assert ix["sparse_vs_dense"]["difference"] == pytest.approx(-ix["dense"]["difference"], abs=1e-12)


def test_the_expert_map(smoke_run, cfg):
    x = sidecar(smoke_run, "09_experts")
    runs = sidecar(smoke_run, "09_experiments_facts")["max_expert_runs"]
    assert runs == 8  # smoke mode: at the released size each removal is a forward of a minute or more
    # fewer runs than one layer's experts: the first layer, its lowest expert ids
    assert x["layers"] == spaced(range(cfg.n_layers), max(1, runs // cfg.n_routed_experts)) == [0]
    assert x["experts"] == list(range(min(runs, cfg.n_routed_experts)))
    diff = np.array(x["difference"])
    interval = np.array(x["interval"])  # [L, E, 2]
    assert diff.shape == (len(x["layers"]), len(x["experts"])) and interval.shape == (*diff.shape, 2)
    assert (interval[..., 0] <= diff).all() and (diff <= interval[..., 1]).all()
    assert np.array_equal(np.array(x["spans_zero"]), (interval[..., 0] <= 0) & (0 <= interval[..., 1]))
    assert np.array(x["by_class"]).shape == (*diff.shape, len(x["classes"]))
    # removing one of 16 experts, each replaced by the router's next choice, costs the model on average
    assert diff.mean() > 0 and diff.max() > 0


def test_hyper_connections_carry_work(smoke_run, cfg):
    h = sidecar(smoke_run, "09_hyper_connections")
    assert h["hc_mult"] == cfg.hc_mult
    _consistent(h["plain_residual"])
    assert h["plain_residual"]["interval"][0] > 0  # the learned mixes are worth bits on the trained model


def test_patching_finds_the_renamed_argument(smoke_run, cfg):
    p = sidecar(smoke_run, "09_patching")
    rec, low, high = (np.array(p[k], dtype=float) for k in ("recovered", "interval_low", "interval_high"))
    facts = sidecar(smoke_run, "09_experiments_facts")
    most = facts["max_patch_layers"]
    assert most == 2 and p["layers"] == spaced(range(cfg.n_layers), most) == [0, cfg.n_layers - 1]
    assert rec.shape == (most, len(p["tokens"])) == low.shape == high.shape
    assert len(p["pairs"]) == 4 and p["names"][:2] == p["pairs"][0]
    renamed = p["renamed_positions"]  # where the pairs' prompts differ: every place the name is written
    assert len(renamed) == p["template"].count("{name}")
    assert [p["tokens"][i].strip() for i in renamed] == [p["names"][0]] * len(renamed)
    first = renamed[0]
    assert not rec[:, :first].any()  # before the rename both runs hold the same stream
    # smoke mode patches the renamed positions and the last; a cell after the rename elsewhere is not measured
    assert facts["patch_positions"] == p["positions"] == "renamed"
    assert p["patched_positions"] == [*renamed, len(p["tokens"]) - 1]
    unmeasured = np.argwhere(np.isnan(rec))
    assert unmeasured.size and all(q > first and q not in p["patched_positions"] for _, q in unmeasured)
    assert np.array_equal(np.isnan(low), np.isnan(rec)) and np.array_equal(np.isnan(high), np.isnan(rec))
    assert p["gap_interval"][0] > 0 and not p["gap_spans_zero"]  # the trained model tells the names apart
    # the last layer's input at the last position carries most of it; layer 0's there, none
    assert rec[-1, -1] > 0.5 and rec[0, -1] == 0


def test_the_closing_note_names_solid_and_noise(smoke_run):
    import nbformat

    facts = sidecar(smoke_run, "09_experiments_facts")
    headlines = facts["headlines"]
    assert set(facts["solid"]) | set(facts["noise"]) == set(headlines)
    assert all(headlines[k]["spans_zero"] for k in facts["noise"])
    assert not any(headlines[k]["spans_zero"] for k in facts["solid"])
    nb = nbformat.read(str(smoke_run / "09_experiments.ipynb"), as_version=4)
    shown = [
        "".join(o["data"]["text/markdown"])
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "text/markdown" in o.get("data", {})
    ]
    assert len(shown) == 7  # the unablated run, one per study, the closing note
    assert all(label in shown[-1] for label in headlines)
    assert ("spans zero" in shown[-1]) == bool(facts["noise"])
