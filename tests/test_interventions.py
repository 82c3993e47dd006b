"""Interventions at the named sites (`dsv41.model.interventions`, `Model.intervene`): with none the forward
is bit for bit the registry-free one, an fn that returns its value unchanged is too (under both
numerics, prefill and decode), a replacement flows on and observers and traces see it, each site's
replacement is checked against its form, and the registry is left empty after a block."""

import json

import pytest
import torch

from dsv41.generation.generate import generate
from dsv41.model.hooks import HookError, UnknownSiteError, site, without_sites
from dsv41.model.interventions import InterventionError, open_labels
from dsv41.model.trace import ForwardTrace, GenerationTrace

PROMPT = [0, 5, 17, 9, 33, 2, 40, 41, 7, 11, 12, 13, 14, 15, 16, 18, 19, 20]
STEPS = [21, 22, 23]


def _identity(name, value, context):
    return value


def _run(model):
    """The prompt's logits (every position) and those of a few decode steps after it."""
    logits = [model(PROMPT, 0, all_positions=True)]
    logits += [model([token], len(PROMPT) + i) for i, token in enumerate(STEPS)]
    return logits


def _registry_free(model):
    """The same run with no site registry at all: every module's site lookup answers None (and so
    no draft stack, which the sites feed)."""
    draft, feeds = model.draft_stack, model.backbone.feeds_draft
    try:
        model.draft_stack, model.backbone.feeds_draft = None, False
        with without_sites(model.backbone):
            assert all(site(block.ffn, "gate") is None for block in model.backbone.layers)
            return _run(model)
    finally:
        model.draft_stack, model.backbone.feeds_draft = draft, feeds


def _empty(model) -> bool:
    return all(not site.observers and not site.interventions for site in model.sites.values())


def _replaceable(model) -> list[str]:
    return [name for name, site in model.sites.items() if site.replaceable]


@pytest.mark.parametrize("numerics", ["reference", "parity"])
def test_no_intervention_and_identity_interventions_are_bit_identical(numerics, reference, parity):
    model = reference if numerics == "reference" else parity
    free = _registry_free(model)
    assert all(torch.equal(a, b) for a, b in zip(_run(model), free))  # the registry with nothing registered
    with model.intervene(dict.fromkeys(_replaceable(model), _identity)):
        assert all(s.interventions for s in model.sites.values() if s.replaceable)
        identity = _run(model)
    assert all(torch.equal(a, b) for a, b in zip(identity, free))
    assert _empty(model)


def test_the_sites_that_take_replacements(reference):
    names = _replaceable(reference)
    layer = reference.cfg.engram_layer_ids[0]
    for local in ("resid_pre", "resid_mid", "resid_post", "hc_attn", "hc_ffn", "attn", "ffn", "ffn.gate"):
        assert f"layers.3.{local}" in names
    assert f"layers.{layer}.engram" in names and "embed" in names and "head" in names
    sparse = [i for i, r in enumerate(reference.cfg.compress_ratios[: reference.cfg.n_layers]) if r]
    assert [n for n in names if n.endswith(".attn.topk")] == [f"layers.{i}.attn.topk" for i in sparse]
    fixed = [n for n in reference.sites if n not in names]
    assert fixed and all(n.endswith((".compressor", ".indexer")) for n in fixed)
    with pytest.raises(HookError, match="observed but not replaced"):
        with reference.intervene({"layers.*.attn.indexer": _identity}):
            pass
    with pytest.raises(UnknownSiteError):
        with reference.intervene({"layers.3.nothing": _identity}):
            pass
    with pytest.raises(HookError, match="not a callable"):
        with reference.intervene({"head": 3}):
            pass
    with pytest.raises(HookError, match="takes a mapping"):
        with reference.intervene([("head", _identity)]):
            pass
    assert _empty(reference)


def test_a_replacement_flows_on_and_observers_and_traces_see_it(reference):
    model = reference
    base = model(PROMPT, 0, all_positions=True)
    seen = []

    def zero(name, value, context):
        assert context["start_pos"] == 0
        return torch.zeros_like(value)

    trace = ForwardTrace()
    with model.intervene({"layers.3.ffn": zero}):
        with model.hooks({"layers.3.ffn": lambda name, value, context: seen.append(value)}):
            changed = model(PROMPT, 0, all_positions=True, trace=trace)
    assert not torch.equal(changed, base)
    assert seen and not seen[0].any()  # the observer saw what flowed
    assert trace.interventions == ["layers.3.ffn: zero"]
    assert _empty(model) and torch.equal(model(PROMPT, 0, all_positions=True), base)

    # two fns at one site: in registration order, each handed the previous one's value
    order = []

    def first(name, value, context):
        order.append((name, "first"))
        return value * 0

    def second(name, value, context):
        order.append((name, "second", bool(value.any())))
        return value

    with model.intervene({"layers.3.attn": first}), model.intervene({"layers.*.attn": second}):
        model(PROMPT, 0)
    at_3 = [entry for entry in order if entry[0] == "layers.3.attn"]
    assert at_3 == [("layers.3.attn", "first"), ("layers.3.attn", "second", False)]


def test_the_gate_site_decides_which_experts_run(reference):
    model = reference
    k = model.cfg.n_activated_experts
    wanted = torch.arange(k)  # every token to experts 0..k-1, equal weights

    def fixed(name, value, context):
        weights, ids = value
        return torch.full_like(weights, 1.0 / k), wanted.expand_as(ids).clone()

    trace = ForwardTrace()
    with model.intervene({"layers.2.ffn.gate": fixed}):
        model(PROMPT, 0, trace=trace)
    routed = trace.routing_by_layer()[2]
    assert torch.equal(routed["expert_ids"][0], wanted.expand(len(PROMPT), k))
    assert routed["weights"].eq(1.0 / k).all()
    fetched = model.backbone.layers[2].ffn.experts.last_fetch
    assert fetched.hits + fetched.misses == k  # the store was asked for those experts alone


@pytest.mark.parametrize(
    ("site", "bad", "message"),
    [
        ("layers.3.resid_post", lambda v: v[..., :-1], "tensor"),
        ("layers.3.attn", lambda v: v.float(), "torch.float32 tensor"),
        ("layers.3.ffn", lambda v: None, "not a tensor"),
        ("layers.3.hc_attn", lambda v: v[:2], "tuple of 3"),
        ("layers.3.ffn.gate", lambda v: (v[0], v[1] + 10_000), "experts 0 to"),
        ("layers.3.ffn.gate", lambda v: (v[0].double(), v[1]), "weights of torch.float64"),
        ("layers.4.attn.topk", lambda v: v + 1000, "past its query's reach"),
        ("layers.4.attn.topk", lambda v: v.float(), "not an integer tensor"),
    ],
)
def test_a_replacement_of_the_wrong_form_is_one_sentence_and_undone(reference, site, bad, message):
    model = reference
    model(PROMPT, 0)
    before = (model.position, model.token_ids.clone())
    with pytest.raises(InterventionError, match=message) as caught:
        with model.intervene({site: lambda name, value, context: bad(value)}):
            model(STEPS[:1], len(PROMPT))
    assert site in str(caught.value) and "\n" not in str(caught.value)
    assert (model.position, model.token_ids.tolist()) == (before[0], before[1].tolist())  # the call undone
    assert _empty(model) and not open_labels()


def test_a_selection_may_be_narrower_or_wider_than_the_top_k(parity):
    model = parity
    layer = next(i for i, r in enumerate(model.cfg.compress_ratios[: model.cfg.n_layers]) if r)
    base = model(PROMPT, 0, all_positions=True)

    def none(name, value, context):
        return value[..., :0]  # no compressed position at all: the window alone

    with model.intervene({f"layers.{layer}.attn.topk": none}):
        windowed = model(PROMPT, 0, all_positions=True)
    assert windowed.isfinite().all() and not torch.equal(windowed, base)


def test_figures_made_under_an_intervention_say_so(reference, tmp_path):
    from dsv41.observe import viz

    fig, ax = viz.new_figure()
    ax.plot([0, 1], [0, 1])
    plain = viz.export_figure(fig, "plain", str(tmp_path), {"x": [0, 1]})
    assert "interventions" not in json.loads(open(plain["json"]).read())
    with reference.intervene({"head": _identity}):
        fig, ax = viz.new_figure()
        ax.plot([0, 1], [0, 1])
        under = viz.export_figure(fig, "under", str(tmp_path), {"x": [0, 1]})
    assert json.loads(open(under["json"]).read())["interventions"] == ["head: _identity"]
    assert any("made under interventions: head: _identity" in t.get_text() for t in fig.texts)
    # a trace's own list says so after the block has closed
    fig, ax = viz.new_figure()
    traced = viz.export_figure(fig, "traced", str(tmp_path), {"interventions": ["layers.1.engram: Engram off"]})
    assert json.loads(open(traced["json"]).read())["interventions"] == ["layers.1.engram: Engram off"]


def test_a_saved_trace_keeps_its_interventions(reference, tmp_path):
    result = generate(reference, PROMPT, max_new_tokens=2, trace=True)
    assert result.trace.forward.interventions == []
    with reference.intervene({"layers.0.resid_post": _identity}):
        result = generate(reference, PROMPT, max_new_tokens=2, trace=True)
    assert result.trace.forward.interventions == ["layers.0.resid_post: _identity"]
    path = result.trace.save(tmp_path / "t.npz")
    assert GenerationTrace.load(path).forward.interventions == ["layers.0.resid_post: _identity"]
