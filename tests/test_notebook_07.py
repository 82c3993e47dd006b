"""Notebook 07 (vision) executed in smoke mode on the embedded default, with assertions on the
numbers its sidecars carry; the expected values are derived from the plan's formulas here."""

import pytest

from dsv41 import vision
from dsv41.config import TINY

from conftest import notebook_group, run_notebooks_smoke, sidecar

pytestmark = notebook_group("07")

FIGURES = ("resize_plan", "patch_grid", "span_layout", "routing_image_tokens", "bias_vl", "engram_mask")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_checkpoint):
    run, summary = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, "07")
    outputs = sorted(summary["notebooks"][0]["outputs"])
    assert outputs == sorted([f"07_{stem}.{ext}" for stem in FIGURES for ext in ("json", "png", "svg")]
                             + ["07_vision_facts.json"])
    return run


@pytest.mark.slow
def test_plans_and_span_follow_the_formulas(smoke_run):
    facts = sidecar(smoke_run, "07_vision_facts")
    assert facts["smoke"] is True
    for size, row in facts["plans"].items():
        w, h = (int(v) for v in size.split("x"))
        p = vision.plan(w, h, TINY)
        assert row == {"pixels": [p.pixel_width, p.pixel_height], "vit": [p.vit_rows, p.vit_cols],
                       "llm": [p.llm_rows, p.llm_cols], "span": p.llm_rows * (p.llm_cols + 1) + 2}
        assert row["span"] <= TINY.vision_max_n_token
    # the smoke image is 120 x 80: 9 x 6 patches (126 x 84 px), 3 x 2 cells, a span of 2 * 4 + 2 = 10
    span = facts["span"]
    assert span["llm_grid"] == [2, 3] and span["length"] == 10
    assert span["counts"] == {"text": span["positions"] - 10, "image start": 1, "image cell": 6,
                              "row newline": 2, "image end": 1}
    layout = sidecar(smoke_run, "07_span_layout")
    assert layout["token_types"][span["start"]:span["start"] + 10] == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    assert set(layout["ids"][span["start"]:span["start"] + 10]) == {TINY.image_token_id}


@pytest.mark.slow
def test_routing_and_engram_mask_sidecars(smoke_run):
    facts = sidecar(smoke_run, "07_vision_facts")
    routing = facts["routing"]
    assert routing["image_tokens"] == 10 and routing["layers"] == list(range(TINY.n_layers))
    vl = sidecar(smoke_run, "07_bias_vl")
    assert vl["image_tokens"] == [10] * TINY.n_layers
    assert all(0 <= c <= 10 * TINY.n_activated_experts for c in vl["changed_selections"])
    mask = sidecar(smoke_run, "07_engram_mask")
    assert sum(mask["dead"]) == 10 and set(mask["gates"]) == {str(i) for i in TINY.engram_layer_ids}
    for gate in mask["gates"].values():
        assert all(g == 0 for g, dead in zip(gate, mask["dead"]) if dead)
        assert all(g > 0 for g, dead in zip(gate, mask["dead"]) if not dead)
