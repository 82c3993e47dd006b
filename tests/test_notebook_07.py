"""Notebook 07 (vision) executed in smoke mode on the embedded default, with assertions on the
numbers its sidecars carry; the expected values are derived from the plan's formulas here."""

import pytest
from conftest import notebook_group, run_notebooks_smoke, sidecar

from dsv41.core.config import TINY
from dsv41.model import vision

pytestmark = notebook_group("07")

FIGURES = ("resize_plan", "patch_grid", "span_layout", "routing_image_tokens", "bias_vl", "engram_mask")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_checkpoint):
    run, summary = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, "07")
    outputs = sorted(summary["notebooks"][0]["outputs"])
    assert outputs == sorted(
        [f"07_{stem}.{ext}" for stem in FIGURES for ext in ("json", "png", "svg")] + ["07_vision_facts.json"]
    )
    return run


@pytest.mark.slow
def test_plans_and_span_follow_the_formulas(smoke_run):
    facts = sidecar(smoke_run, "07_vision_facts")
    assert facts["smoke"] is True
    for size, row in facts["plans"].items():
        w, h = (int(v) for v in size.split("x"))
        p = vision.plan(w, h, TINY)
        assert row == {
            "pixels": [p.pixel_width, p.pixel_height],
            "vit": [p.vit_rows, p.vit_cols],
            "llm": [p.llm_rows, p.llm_cols],
            "span": p.llm_rows * (p.llm_cols + 1) + 2,
        }
        assert row["span"] <= TINY.vision_max_n_token
    # the smoke image is 120 x 80: 9 x 6 patches (126 x 84 px), 3 x 2 cells, a span of 2 * 4 + 2 = 10
    span = facts["span"]
    assert span["llm_grid"] == [2, 3] and span["length"] == 10
    assert span["counts"] == {
        "text": span["positions"] - 10,
        "image start": 1,
        "image cell": 6,
        "row newline": 2,
        "image end": 1,
    }
    # in general: rows x (cols + 1 newline) + start and end, and the placeholder became the span
    rows, cols = span["llm_grid"]
    assert span["length"] == rows * (cols + 1) + 2 and span["counts"]["image cell"] == rows * cols
    assert span["positions"] == span["text_positions"] + span["length"]
    patches = facts["patches"]
    assert patches["count"] == patches["plan_patches"] and -1 <= patches["min"] <= patches["max"] <= 1
    # the token budget curve never passes the budget
    plan = sidecar(smoke_run, "07_resize_plan")
    assert facts["curve_max"] == max(max(v) for v in plan["curves"].values()) <= TINY.vision_max_n_token
    layout = sidecar(smoke_run, "07_span_layout")
    assert layout["token_types"][span["start"] : span["start"] + 10] == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    assert set(layout["ids"][span["start"] : span["start"] + 10]) == {TINY.image_token_id}


@pytest.mark.slow
def test_routing_and_engram_mask_sidecars(smoke_run):
    facts = sidecar(smoke_run, "07_vision_facts")
    routing, length = facts["routing"], facts["span"]["length"]
    assert routing["image_tokens"] == 10 == length and routing["layers"] == list(range(TINY.n_layers))
    assert routing["image_tokens"] + routing["text_tokens"] == routing["n_tokens"]
    assert routing["vision_s_positive"] is True
    assert routing["bias_vl"]["image_tokens"] == [length] * len(routing["layers"])
    assert all(0 <= c <= length * routing["top_k"] for c in routing["bias_vl"]["changed_selections"])
    assert facts["engram"]["dead_positions"] == length
    assert facts["engram"]["gate_zero_on_dead"] and facts["engram"]["gate_open_on_text"]
    vl = sidecar(smoke_run, "07_bias_vl")
    assert vl["image_tokens"] == [10] * TINY.n_layers
    assert all(0 <= c <= 10 * TINY.n_activated_experts for c in vl["changed_selections"])
    mask = sidecar(smoke_run, "07_engram_mask")
    assert sum(mask["dead"]) == 10 and set(mask["gates"]) == {str(i) for i in TINY.engram_layer_ids}
    for gate in mask["gates"].values():
        assert all(g == 0 for g, dead in zip(gate, mask["dead"]) if dead)
        assert all(g > 0 for g, dead in zip(gate, mask["dead"]) if not dead)
