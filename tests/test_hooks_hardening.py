"""The hook registry under hostile use (issue 33): observers cannot change what flows, however they
write into what they are handed; a registration is checked whole before anything is added and
leaves nothing behind; observers are removed by identity in constant time; a model refuses to be
called back from its own forward. The fuzz test drives random subscribe / remove / nested-block /
raising-observer programs and checks the registry ends empty and the logits never move."""

import time
from contextlib import ExitStack

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv41
from dsv41.core.errors import Dsv41Error
from dsv41.generation.generate import generate
from dsv41.model import sequence
from dsv41.model.hooks import ActivationCache, HookError, ReentrantCallError, Sites, UnknownSiteError, run_with_hooks

PROMPT, NEXT = [1, 2, 3], 4


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True)


@pytest.fixture(scope="module")
def plain(model):
    """The logits of the prompt (every position) and of one decode step after it, nobody listening."""
    return model(PROMPT, 0, all_positions=True), model([NEXT], len(PROMPT))


def _no_observers(model) -> bool:
    return all(not site.observers for site in model.sites.values())


def _run(model):
    return model(PROMPT, 0, all_positions=True), model([NEXT], len(PROMPT))


def _tensors(value):
    """Every tensor in a value or context as a site hands it (tuples and mappings opened)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "keys"):
        for key in value.keys():
            yield from _tensors(value[key])


def _numpy_view(tensor):
    """A writable numpy array over the tensor's own memory (bf16 read as int16 of the same bytes)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _zero_in_place(name, value, context):
    for t in (*_tensors(value), *_tensors(context)):
        t.zero_()


def _zero_through_numpy(name, value, context):
    for t in (*_tensors(value), *_tensors(context)):
        _numpy_view(t)[...] = 0


def _rewrite_routing(name, value, context):
    weights, ids = value  # [tokens, k] each: every token routed to the next token's experts
    ids.copy_(ids.roll(1, dims=0))
    weights.mul_(3)


# ---------------------------------------------------------------------- observers are read-only
@pytest.mark.parametrize(
    "pattern, observer",
    [
        ("layers.3.resid_post", lambda name, value, context: value.mul_(0.5)),
        ("head", lambda name, value, context: value.zero_()),
        ("head", lambda name, value, context: value.numpy().fill(0)),
        ("layers.*.ffn.gate", _rewrite_routing),
        ("*", _zero_in_place),
        ("*", _zero_through_numpy),
    ],
    ids=["halve-resid", "zero-head", "numpy-head", "rewrite-routing", "zero-everything", "numpy-everything"],
)
def test_an_observer_writing_into_what_it_is_handed_changes_nothing(model, plain, pattern, observer):
    with model.hooks({pattern: observer}):
        prefill, step = _run(model)
    assert torch.equal(prefill, plain[0]) and torch.equal(step, plain[1])
    assert _no_observers(model)


def test_each_observer_sees_what_the_forward_made_not_what_another_wrote(model, plain):
    seen = ActivationCache()
    with model.hooks({"head": lambda name, value, context: value.zero_()}):
        logits, cache = run_with_hooks(model, PROMPT, 0, all_positions=True, names=["head"], observers={"head": seen})
    assert torch.equal(logits, plain[0])
    assert torch.equal(cache.last("head"), plain[0]) and torch.equal(seen.last("head"), plain[0])
    cache.last("head").numpy().fill(0)  # what a cache holds is its own: writing into it reaches nothing else
    assert torch.equal(seen.last("head"), plain[0])


def test_a_context_is_copied_only_where_read_and_reads_as_a_mapping(model):
    seen = {}

    def read(name, value, context):
        seen["has_x"] = "x" in context
        seen["keys"] = sorted(context)
        seen["x"] = context["x"]
        assert context["x"] is seen["x"]  # one copy per observer and call, however often it reads

    with model.hooks({"layers.0.ffn": read}):
        model(PROMPT, 0)
    assert seen["has_x"] and {"x", "ids", "weights", "gate"} <= set(seen["keys"])
    assert seen["x"].shape == (1, len(PROMPT), model.cfg.dim)


def test_a_context_kept_past_its_call_refuses_what_was_not_read_in_it(model):
    kept = []
    with model.hooks({"layers.0.ffn": lambda name, value, context: kept.append((context, context["ids"]))}):
        model(PROMPT, 0)
    context, ids = kept[0]
    assert context["ids"] is ids and "x" in context  # what it read stays; its keys stay listed
    with pytest.raises(HookError, match="read after its observer returned"):
        context["x"]


# ---------------------------------------------------------------------- registrations
def test_a_registration_with_an_unknown_name_subscribes_nothing(model):
    for kw in (
        {"names": ["head", "nonexistent"]},
        {"names": ["head"], "observers": {"layers.0.ffn": print, "nothing.here": print}},
    ):
        with pytest.raises(UnknownSiteError, match="no site matches") as caught:
            run_with_hooks(model, PROMPT, 0, **kw)
        assert isinstance(caught.value, KeyError) and isinstance(caught.value, Dsv41Error)
        assert _no_observers(model)
    with pytest.raises(KeyError):
        with model.hooks({"head": print, "layers.*.nothing": print}):
            pass
    assert _no_observers(model)


def test_a_str_of_names_is_one_name(model):
    _, cache = run_with_hooks(model, PROMPT, 0, names="head")
    assert list(cache) == ["head"]
    _, cache = run_with_hooks(model, PROMPT, 0, names="layers.*.ffn.routed")
    assert set(cache) == {f"layers.{i}.ffn.routed" for i in range(model.cfg.n_layers)}


@pytest.mark.parametrize("names", [[None], ["head", 3], None, 7, b"head"])
def test_a_name_that_is_not_a_str_is_one_sentence(model, names):
    with pytest.raises(HookError) as caught:
        run_with_hooks(model, PROMPT, 0, names=names)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError) and "\n" not in message and "pattern" in message
    assert _no_observers(model)


@pytest.mark.parametrize(
    "call",
    [
        lambda model: model.hooks(None).__enter__(),
        lambda model: model.hooks([("head", print)]).__enter__(),
        lambda model: run_with_hooks(model, PROMPT, 0, observers=[print]),
    ],
)
def test_observers_not_given_as_a_mapping_are_one_sentence(model, call):
    with pytest.raises(HookError, match="mapping"):
        call(model)
    assert _no_observers(model)


def test_a_name_reached_twice_records_once(model):
    _, cache = run_with_hooks(model, PROMPT, 0, names=["head", "head", "*"])
    assert len(cache["head"]) == 1


@pytest.mark.parametrize(
    "observer",
    [5, "head", None, object(), type("OnlyData", (), {"exit": 3})()],
    ids=["int", "str", "None", "object", "exit-not-callable"],
)
def test_an_observer_that_cannot_be_called_is_refused_when_subscribed(model, observer):
    with pytest.raises(HookError, match="neither a callable") as caught:
        model.sites.subscribe("head", observer)
    assert "\n" not in str(caught.value)
    with pytest.raises(HookError):
        with model.hooks({"layers.0.ffn": print, "head": observer}):
            pass
    assert _no_observers(model)


def test_two_activation_caches_at_one_site_leave_independently(model, plain):
    mine = ActivationCache()
    with model.hooks({"head": mine}):
        logits, theirs = run_with_hooks(model, PROMPT, 0, all_positions=True, names=["head"])
        model(PROMPT, 0, all_positions=True)  # mine still listens after theirs has gone
    assert len(mine["head"]) == 2 and len(theirs["head"]) == 1 and _no_observers(model)
    # equal observers (two empty caches compare equal) are still two subscriptions
    sites = model.sites
    kept, other = ActivationCache(), ActivationCache()
    handle_kept = sites.subscribe("head", kept)
    sites.subscribe("head", other).remove()
    assert [s.observer for s in sites["head"].observers.values()] == [kept]
    assert all(s.observer is kept for s in sites["head"].observers.values())
    handle_kept.remove()
    handle_kept.remove()  # a second remove is nothing
    assert _no_observers(model)


class _NeverCompared:
    def __call__(self, name, value, context):
        pass

    def __eq__(self, other):
        raise AssertionError("the registry compared two observers")

    __hash__ = object.__hash__


def test_removing_many_observers_is_linear_and_by_identity():
    sites = Sites(head=dsv41.model.hooks.Site("head"))
    handles = [sites.subscribe("head", _NeverCompared()) for _ in range(2_000)]
    for handle in handles[::2] + handles[1::2]:
        handle.remove()
    assert not sites["head"]
    many = 100_000
    began = time.perf_counter()
    handles = [sites.subscribe("head", lambda name, value, context: None) for _ in range(many)]
    for handle in reversed(handles):  # the far end of a list each time: n**2 / 2 steps if it were one
        handle.remove()
    took = time.perf_counter() - began
    assert not sites["head"] and took < 20, f"{many:,} subscriptions and removals took {took:.1f} s"


def test_a_model_refuses_to_be_called_back_from_its_own_forward(model, plain):
    calls = [
        lambda: model([1, 2], 0),
        lambda: model.reset(),
        lambda: sequence.rollback(model, 1),
        lambda: sequence.snapshot(model),
        lambda: generate(model, "hi", max_new_tokens=1),
    ]
    for call in calls:
        model(PROMPT, 0)
        with pytest.raises(ReentrantCallError, match="re-entrancy is refused") as caught:
            with model.hooks({"layers.2.resid_mid": lambda name, value, context: call()}):
                model([NEXT], len(PROMPT))
        assert isinstance(caught.value, RuntimeError) and "\n" not in str(caught.value)
        assert model.position == len(PROMPT) and _no_observers(model)  # the refused call undone
        assert torch.equal(model([NEXT], len(PROMPT)), plain[1])


# ---------------------------------------------------------------------- fuzz
class _Boom(Exception):
    pass


class _Clock:
    def __init__(self):
        self.open = 0

    def enter(self, name):
        self.open += 1

    def exit(self, name, value, context):
        self.open -= 1


def _make(kind: str, sites: Sites):
    if kind == "record":
        return lambda name, value, context: None
    if kind == "clock":
        return _Clock()
    if kind == "zero":
        return _zero_in_place
    if kind == "numpy":
        return _zero_through_numpy
    if kind == "cache":
        return ActivationCache()
    if kind == "raise":

        def boom(name, value, context):
            raise _Boom(name)

        return boom
    assert kind == "churn"  # subscribes and removes another observer while the site calls it

    def churn(name, value, context):
        sites.subscribe("head", _zero_in_place).remove()
        sites.subscribe("*", ActivationCache()).remove()

    return churn


PATTERNS = [
    "head",
    "embed",
    "layers.3.resid_post",
    "layers.*.ffn.gate",
    "layers.*.attn.indexer",
    "layers.*.engram",
    "layers.*.ffn.routed",
    "*",
]
KINDS = ["record", "clock", "zero", "numpy", "cache", "raise", "churn"]
_OPS = st.one_of(
    st.tuples(st.just("subscribe"), st.sampled_from(PATTERNS), st.sampled_from(KINDS)),
    st.tuples(st.just("remove"), st.integers(0, 9)),
    st.tuples(st.just("open"), st.sampled_from(PATTERNS), st.sampled_from(KINDS)),
    st.tuples(st.just("close"), st.booleans()),
    st.tuples(st.just("forward")),
)


def _forward_as_expected(model, plain, kinds: list) -> None:
    """A prefill and a decode step with the logits of nobody listening, or, with a raising observer
    among `kinds`, the error, the failed call undone (back to its start, 0)."""
    if "raise" in kinds:
        with pytest.raises(_Boom):
            model(PROMPT, 0)
        assert model.position == 0 and model.token_ids.numel() == 0
    else:
        prefill, step = _run(model)
        assert torch.equal(prefill, plain[0]) and torch.equal(step, plain[1])


@settings(
    max_examples=14,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(program=st.lists(_OPS, max_size=10).filter(lambda ops: sum(op[0] == "forward" for op in ops) <= 1))
def test_fuzz_any_program_of_observers_leaves_the_registry_empty_and_the_logits_unmoved(model, plain, program):
    sites = model.sites
    handles: list = []  # (handle, kind)
    blocks: list = []  # (open hooks block, kind)
    with ExitStack() as cleanup:  # whatever an assertion leaves open is closed for the next example
        cleanup.callback(lambda: [handle.remove() for handle, _ in handles])
        cleanup.callback(lambda: [block.__exit__(None, None, None) for block, _ in reversed(blocks)])
        for op in program:
            if op[0] == "subscribe":
                handles.append((sites.subscribe(op[1], _make(op[2], sites)), op[2]))
            elif op[0] == "remove" and handles:
                handle, _ = handles.pop(op[1] % len(handles))
                handle.remove()
            elif op[0] == "open":
                block = sites.hooks({op[1]: _make(op[2], sites)})
                block.__enter__()
                blocks.append((block, op[2]))
            elif op[0] == "close" and blocks:
                block, _ = blocks.pop()
                error = _Boom("inside the block") if op[1] else None
                # an error inside the block reaches its exit, which removes the block's observers
                assert block.__exit__(type(error) if error else None, error, None) is False
            elif op[0] == "forward":
                _forward_as_expected(model, plain, [kind for _, kind in handles + blocks])
        _forward_as_expected(model, plain, [kind for _, kind in handles + blocks])  # what is left listens too
    assert _no_observers(model)
    assert torch.equal(model(PROMPT, 0, all_positions=True), plain[0])
