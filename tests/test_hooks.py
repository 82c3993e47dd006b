"""The named sites of a forward (`dsv41.model.hooks`): what they are called, that observers see values
without changing them and are gone after their call, and that the trace, the finite check, the
draft feed and the benchmarks' clocks are observers like any other."""

import pytest
import torch

import dsv41
from dsv41.model.hooks import ActivationCache, Sites, run_with_hooks


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True)


def _no_observers(model) -> bool:
    return all(not site.observers for site in model.sites.values())


def test_sites_are_named_after_the_modules_in_forward_order(model):
    names = list(model.sites)
    assert names[0] == "embed" and names[-1] == "head"
    for local in ("resid_pre", "attn", "resid_mid", "ffn", "ffn.gate", "ffn.routed", "ffn.shared", "resid_post"):
        assert f"layers.3.{local}" in names
    engram = [n for n in names if n.endswith(".engram")]
    assert engram == [f"layers.{i}.engram" for i in model.cfg.engram_layer_ids]
    assert names.index("layers.0.resid_post") < names.index("layers.1.resid_pre")


def test_run_with_hooks_returns_the_plain_logits_and_the_named_activations(model):
    ids = torch.tensor(model.encode("The capital of France is"))
    plain = model(ids, 0, all_positions=True)
    logits, cache = run_with_hooks(model, ids, 0, all_positions=True)
    assert torch.equal(logits, plain)  # observing changes no arithmetic
    assert torch.equal(cache.last("head"), plain)
    assert set(cache) == set(model.sites)  # every site ran once
    assert cache.last("layers.3.resid_post").shape == (1, len(ids), model.cfg.hc_mult, model.cfg.dim)
    weights, expert_ids = cache.last("layers.2.ffn.gate")
    assert expert_ids.shape == (len(ids), model.cfg.n_activated_experts)
    assert _no_observers(model)
    # a pattern picks the sites; a decode step appends
    _, routed = run_with_hooks(model, [5], len(ids), names=["layers.*.ffn.routed"])
    assert set(routed) == {f"layers.{i}.ffn.routed" for i in range(model.cfg.n_layers)}
    assert all(len(v) == 1 and v[0].shape == (1, model.cfg.dim) for v in routed.values())


def test_observers_leave_with_their_block_even_on_an_error(model):
    seen = []
    with pytest.raises(RuntimeError):
        with model.hooks({"head": lambda name, value, context: seen.append(name)}):
            model([1, 2], 0)
            raise RuntimeError("inside")
    assert seen == ["head"] and _no_observers(model)
    handle = model.sites.subscribe("layers.*.attn", ActivationCache())
    assert all(len(model.sites[f"layers.{i}.attn"].observers) == 1 for i in range(model.cfg.n_layers))
    handle.remove()
    assert _no_observers(model)
    with pytest.raises(KeyError, match="no site matches"):
        model.sites.subscribe("layers.*.nothing", print)


def test_an_observer_with_enter_and_exit_brackets_each_span(model):
    events = []

    class Clock:
        def enter(self, name):
            events.append(("enter", name))

        def exit(self, name, value, context):
            events.append(("exit", name))

    with model.hooks({"layers.0.ffn.routed": Clock(), "layers.0.ffn.shared": Clock()}):
        model([1, 2, 3], 0)
    assert events == [
        ("enter", "layers.0.ffn.routed"),
        ("exit", "layers.0.ffn.routed"),
        ("enter", "layers.0.ffn.shared"),
        ("exit", "layers.0.ffn.shared"),
    ]


def test_a_forward_trace_fills_its_records_through_the_sites(model):
    from dsv41.model.trace import ForwardTrace

    trace = ForwardTrace(check_finite=True)
    model([1, 2, 3], 0, trace=trace)
    cfg = model.cfg
    assert [r.layer for r in trace.routing] == list(range(cfg.n_layers))
    assert [r.layer for r in trace.engram] == list(cfg.engram_layer_ids)
    sites = [(r.layer, r.site) for r in trace.finite]
    assert sites[0] == (None, "embedding") and sites[-1] == (None, "head")
    assert sites[1:3] == [(0, "attention"), (0, "ffn")]
    engram_layer = cfg.engram_layer_ids[0]  # its Engram update is checked before its attention site
    assert sites.index((engram_layer, "engram")) + 1 == sites.index((engram_layer, "attention"))
    assert all(r.finite for r in trace.finite) and all(r.start_pos == 0 for r in trace.finite)
    assert _no_observers(model)


def test_the_phase_clock_subscribes_and_leaves(model):
    from dsv41.bench import PhaseClock

    clock = PhaseClock(("attention", "routed experts", "shared expert", "Engram", "head"))
    with clock.timing(model):
        model([1, 2, 3], 0)
    assert all(seconds > 0 for seconds in clock.seconds.values())
    assert {layer for layer, _ in clock.by_layer} == set(range(model.cfg.n_layers))
    assert _no_observers(model)


def test_the_draft_stack_is_fed_through_the_sites(model):
    assert model.draft_stack is not None
    model([1, 2, 3, 4], 0)
    targets = [b for b in model.backbone.layers if b.feeds_draft]
    assert model.backbone.main_hidden.shape == (1, 4, model.cfg.dim * len(targets))
    assert _no_observers(model)


def test_an_empty_registry_refuses_an_unknown_site():
    with pytest.raises(KeyError):
        Sites().subscribe("head", print)


def test_attention_names_its_parts_where_the_layer_has_them(model):
    cfg, names = model.cfg, set(model.sites)
    for layer in range(cfg.n_layers):
        mode, ratio = cfg.layer_mode(layer), cfg.compress_ratios[layer]
        assert f"layers.{layer}.attn" in names
        assert (f"layers.{layer}.attn.topk" in names) == bool(ratio)
        assert (f"layers.{layer}.attn.compressor" in names) == (mode == "full")
        assert (f"layers.{layer}.attn.indexer" in names) == (mode in ("full", "reindex"))


def test_an_attention_stack_is_traced_through_sites_named_as_a_models(model):
    from dsv41.model.trace import Trace
    from dsv41.observe import csa2_stats

    stack = csa2_stats.attention_stack(model, max_seq_len=16)
    assert {n for n in stack.sites} == {n for n in model.sites if ".attn" in n}
    x = csa2_stats.embed(model, model.encode("The capital of France is"))
    plain = stack.forward_each(x, 0)
    stack.reset_state()
    trace = Trace(keep_outputs=True)
    with trace.recording(stack.sites):
        traced = stack.forward_each(x, 0)
    assert torch.equal(plain, traced)  # recording changes no arithmetic
    assert [r.layer for r in trace.attention] == list(range(model.cfg.n_layers))
    assert all(torch.equal(r.output, traced[r.layer]) for r in trace.attention)
    assert all(not site.observers for site in stack.sites.values())


def test_a_call_refuses_a_trace_that_is_not_one(model):
    with pytest.raises(TypeError, match="Trace"):
        model([1, 2], 0, trace=True)


def test_the_modules_read_the_verified_view():
    from dsv41.core.config import TINY
    from dsv41.model.model import runtime_config

    silent = TINY.replace(
        engram_num_embeddings=(1009,) * 6,
        engram_compressed_vocab_size=1000,
        swiglu_limit=None,
        norm_topk_prob=None,
        candidate_source_layer=None,
    )
    runtime = runtime_config(silent)
    assert (runtime.swiglu_limit, runtime.norm_topk_prob, runtime.candidate_source_layer) == (0.0, True, -1)
    assert runtime.layer_mode(2) == silent.layer_mode(2)  # still a Config: its derived facts at hand
