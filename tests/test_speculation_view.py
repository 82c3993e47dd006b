"""The speculation view over a speculative run, and the prompt probe's speculative mode."""

import pytest

import dsv41
from dsv41 import widgets
from dsv41.core.numerics import Numerics
from dsv41.generation.generate import generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())


@pytest.fixture(scope="module")
def run(model):
    return generate(
        model,
        "The capital of France is",
        max_new_tokens=10,
        stop_at_eos=False,
        trace=True,
        speculative=True,
        min_confidence=0.0,
    )


def test_data_follows_the_steps(run):
    data = widgets.speculation_data(run)
    steps = run.speculation.steps
    assert data["accepted"] == [s.accepted for s in steps] and data["kept"] == [s.kept for s in steps]
    assert data["tokens"] == sum(len(s.committed) for s in steps) == len(run.ids) - 1
    # position 0 is judged at every step that kept a proposal
    assert data["judged_by_position"][0] == sum(1 for s in steps if s.kept)
    assert sum(b["count"] for b in data["calibration"]) == sum(min(s.kept, s.accepted + 1) for s in steps)


def test_render_draws_three_panels(run):
    fig = widgets.speculation.render(widgets.speculation_data(run))
    assert len(fig.axes) == 3


def test_a_plain_run_has_no_speculation(model):
    plain = generate(model, "hi", max_new_tokens=3, trace=True)
    with pytest.raises(ValueError, match="not a speculative run"):
        widgets.speculation_data(plain)


def test_probe_adds_and_refreshes_the_speculation_tab(model, run, monkeypatch):
    monkeypatch.setenv("DSV41_HEADLESS", "1")
    view = widgets.SpeculationView(widgets.speculation_data(run))
    probe = widgets.PromptProbe(model, "hello", 4, compare=False, refresh=[view], background=False)
    assert "speculation" not in probe.views
    before = view.data
    probe.speculate.value = True
    probe.text.value = "Once upon a time"
    probe.on_run()
    assert "speculation" in probe.views and probe.runs == 1
    assert view.data is not before and view.data["tokens"] == len(probe.result.ids) - 1
    assert probe.result.speculation is not None
