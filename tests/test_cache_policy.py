"""dsv41.observe.cache_policy and dsv41.widgets.policy: each policy's one-pass depths against its direct
simulation, Belady against every policy and against an exhaustive optimum, LRU against
dsv41.widgets.cache and the real ExpertCache on a generation from the embedded checkpoint, the bytes a
miss reads against the formula, trace files round-tripping without pickle, the `replay` command,
and the figure."""

import itertools
import json
import math
import random

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from dsv41 import widgets
from dsv41.core.config import RELEASED, TINY
from dsv41.generation.generate import generate
from dsv41.model.trace import (
    AttentionRecord,
    FiniteRecord,
    ForwardTrace,
    GenerationTrace,
    RoutingRecord,
    StepRecord,
    TraceFileError,
)
from dsv41.observe import cache_policy as cp
from dsv41.observe import viz

pytestmark = pytest.mark.usefixtures("one_thread")


def _sequences(n_cases, seed=0, max_experts=10, max_len=60):
    rng = random.Random(seed)
    for _ in range(n_cases):
        n_experts = rng.randint(1, max_experts)
        n = rng.randint(0, max_len)
        if rng.random() < 0.5:
            seq = [rng.randrange(n_experts) for _ in range(n)]
        else:  # skewed: a few hot experts, as routing is
            seq = [min(n_experts - 1, int(rng.expovariate(0.5))) for _ in range(n)]
        ranking = list(range(n_experts))
        rng.shuffle(ranking)
        yield n_experts, seq, ranking


# ---------------------------------------------------------------------- the bytes a miss reads
def test_a_miss_reads_one_routed_expert_as_stored_on_the_release(tiny_checkpoint):
    from dsv41.core.config import load_config

    dim, inter = RELEASED.dim, RELEASED.moe_inter_dim
    # w1 and w3 [inter, dim], w2 [dim, inter]: FP4 two per byte, one E8M0 byte per 32 values
    formula = 3 * (inter * dim // 2 + inter * dim // 32)
    assert cp.expert_bytes() == cp.expert_bytes(RELEASED) == formula == 18_800_640
    assert round(cp.expert_bytes() / 2**20, 1) == 17.9
    g = cp.geometry()
    assert [t["name"] for t in g["tensors"]] == [
        "w1.weight",
        "w1.scale",
        "w2.weight",
        "w2.scale",
        "w3.weight",
        "w3.scale",
    ]
    assert sum(t["bytes"] for t in g["tensors"]) == g["bytes_per_expert"] == formula
    tiny = TINY.dim * TINY.moe_inter_dim
    assert cp.expert_bytes(TINY) == cp.expert_bytes(load_config(tiny_checkpoint)) == 3 * (tiny // 2 + tiny // 32)


# ---------------------------------------------------------------------- the policies by hand
def test_hand_worked_sequences():
    seq = [1, 2, 1, 3, 2, 1]
    assert cp.lru_replay(seq, 2) == [False, False, True, False, False, False]
    # LFU at 2: 1m 2m 1h (1:2, 2:1); 3m evicts 2 (fewest); 2m evicts 3 (1 lookup, less recent than... 3 has
    # 1 lookup, 1 has 2); 1h
    assert cp.lfu_replay(seq, 2) == [False, False, True, False, False, True]
    # Belady at 2: 1m 2m 1h; 3m: 3 is never looked up again, so it is read and not kept; 2h 1h
    assert cp.belady_replay(seq, 2) == [False, False, True, False, True, True]
    # static at 1 on ranking [1, ...]: only 1 is kept, from its first read
    assert cp.static_replay(seq, 1, [1, 2, 3]) == [False, False, True, False, False, True]
    for policy in cp.POLICIES:
        assert cp.replay(policy, seq, 0, [1, 2, 3]) == [False] * 6  # capacity 0 keeps nothing
    with pytest.raises(ValueError, match="capacity"):
        cp.replay("lru", seq, -1)
    with pytest.raises(ValueError, match="unknown policy"):
        cp.replay("fifo", seq, 2)
    with pytest.raises(ValueError, match="ranking"):
        cp.replay("static", seq, 2)


@pytest.mark.parametrize("policy", cp.POLICIES)
def test_one_pass_depths_equal_the_direct_simulation_at_every_size(policy):
    for n_experts, seq, ranking in _sequences(400, seed=1):
        depths = cp.hit_depths(policy, seq, ranking)
        for capacity in range(n_experts + 2):
            assert [d is not None and d <= capacity for d in depths] == cp.replay(policy, seq, capacity, ranking), (
                policy,
                capacity,
                seq,
            )


def _plain_lru(seq, capacity: int) -> list[bool]:
    """LRU written the obvious way, as the loader's ExpertCache keeps a layer's window."""
    from collections import OrderedDict

    window, hits = OrderedDict(), []
    for e in seq:
        hits.append(e in window)
        if e in window:
            window.move_to_end(e)
        elif capacity:
            window[e] = True
            if len(window) > capacity:
                window.popitem(last=False)
    return hits


def test_lru_is_a_plain_lru_and_the_widgets_use_it():
    assert widgets.cache.replay_counts is cp.replay_counts  # the cache view replays through the one home
    for n_experts, seq, _ in _sequences(300, seed=2):
        for capacity in range(n_experts + 2):
            assert cp.lru_replay(seq, capacity) == _plain_lru(seq, capacity), (capacity, seq)


def test_no_policy_beats_belady_on_random_traces():
    for n_experts, seq, ranking in _sequences(600, seed=3):
        for capacity in range(n_experts + 2):
            best = sum(cp.belady_replay(seq, capacity))
            for policy in cp.POLICIES:
                assert sum(cp.replay(policy, seq, capacity, ranking)) <= best, (policy, capacity, seq)
            # a static top-N on the best ranking the future allows, too
            counts = [seq.count(e) for e in range(n_experts)]
            oracle = sorted(range(n_experts), key=lambda e: -counts[e])
            assert sum(cp.static_replay(seq, capacity, oracle)) <= best


def _exhaustive_optimum(seq, capacity):
    """The most hits any policy holding at most `capacity` items can have: after each lookup it may
    keep any subset of what it held plus the item just read."""
    best = {frozenset(): 0}
    for item in seq:
        nxt: dict = {}
        for held, hits in best.items():
            gained = hits + (item in held)
            pool = sorted(held | {item})
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    key = frozenset(keep)
                    if nxt.get(key, -1) < gained:
                        nxt[key] = gained
        best = nxt
    return max(best.values())


def test_belady_is_the_optimum():
    for n_experts, seq, _ in _sequences(150, seed=4, max_experts=4, max_len=11):
        for capacity in range(n_experts + 1):
            assert sum(cp.belady_replay(seq, capacity)) == _exhaustive_optimum(seq, capacity), (capacity, seq)


def test_static_ranking_counts_tokens_then_calls_then_id():
    calls = [cp.Call(0, 3, (0, 2, 5), {0: 1, 2: 3, 5: 2}), cp.Call(3, 1, (0, 5), {0: 1, 5: 1})]
    # tokens: 2 -> 3, 5 -> 3, 0 -> 2; 5 was looked up in two calls, 2 in one
    assert cp.static_ranking(calls, 6) == [5, 2, 0, 1, 3, 4]


# ---------------------------------------------------------------------- traces by hand
def _trace(calls, n_experts=None, capacity=None):
    """A GenerationTrace whose one-token-per-row routing is `calls` [layer][call] -> [[ids per token]]."""
    forward = ForwardTrace()
    pos = 0
    for c in range(len(calls[0])):
        s = len(calls[0][c])
        for layer, per in enumerate(calls):
            ids = torch.tensor([per[c]], dtype=torch.long)
            forward.routing.append(RoutingRecord(layer, pos, ids, torch.ones(ids.shape)))
        pos += s
    meta = {k: v for k, v in (("n_routed_experts", n_experts), ("expert_cache", capacity)) if v is not None}
    return GenerationTrace(forward, meta=meta)


def test_policy_data_by_hand():
    # one layer, prefill of two tokens (experts 0 1 | 1 2), then decode calls
    trace = _trace([[[[0, 1], [1, 2]], [[1, 3]], [[0, 1]], [[1, 2]]]], n_experts=4, capacity=2)
    data = cp.policy_data(trace)
    assert data["capacities"] == [0, 1, 2, 3, 4] and data["n_experts"] == 4 and data["capacity"] == 2
    assert data["tokens"] == 5 and data["decode_tokens"] == 3 and data["calls"] == 4
    # lookups: [0 1 2] [1 3] [0 1] [1 2]
    assert data["lookups"] == [9] and data["decode_lookups"] == [6] and data["distinct"] == [4]
    lru = [sum(cp.lru_replay([0, 1, 2, 1, 3, 0, 1, 1, 2], c)) for c in range(5)]
    assert data["hits"]["lru"] == [lru]
    assert data["hit_rate"]["lru"] == [h / 9 for h in lru]
    assert data["hits"]["belady"][0][-1] == 9 - 4  # enough room: only the first reads miss
    b = cp.expert_bytes()
    assert data["disk_bytes_per_token"]["lru"][0] == 9 * b / 5
    assert data["disk_bytes_per_decode_token"]["lru"][0] == 6 * b / 3
    assert data["disk_mib_per_decode_token"]["lru"][0] == 6 * b / 3 / 2**20
    # static: warm-up is the prefill, where 1 got two tokens: ranking 1, then 0, 2 (one each), 3
    assert data["warmup"]["ranking"] == {"0": [1, 0, 2, 3]}
    for p in cp.POLICIES:
        rates = data["hit_rate"][p]
        assert rates[0] == 0.0 and all(a <= b for a, b in zip(rates, rates[1:]))
        assert all(h <= hb for h, hb in zip(data["hits"][p][0], data["hits"]["belady"][0]))
    json.dumps(viz.to_jsonable(data), allow_nan=False)
    # a second trace as the warm-up, and checks on the arguments
    warm = _trace([[[[3, 2], [3, 0]]]])
    assert cp.policy_data(trace, warmup=warm)["warmup"]["ranking"] == {"0": [3, 0, 2, 1]}
    with pytest.raises(ValueError, match="warm-up"):
        cp.policy_data(trace, warmup=0)
    with pytest.raises(ValueError, match="beyond"):
        cp.policy_data(trace, n_experts=3)
    with pytest.raises(ValueError, match="unknown policy"):
        cp.policy_data(trace, policies=["lru", "mru"])


# ---------------------------------------------------------------------- on a real generation
@pytest.fixture(scope="module")
def run(tiny_checkpoint):
    """A freshly loaded model (its counters hold only this run) and a traced generation."""
    from dsv41.runtime.loader import load

    model = load(tiny_checkpoint, expert_cache=5, quiet=True)
    result = generate(
        model, "Which experts stay in the cache, and for how long?", max_new_tokens=6, trace=True, stop_at_eos=False
    )
    return model, result


def test_lru_is_the_real_expert_cache(run):
    model, result = run
    cfg = model.cfg
    data = cp.policy_data(result, n_experts=cfg.n_routed_experts, capacity=model.experts.capacity)
    assert data["layers"] == list(range(cfg.n_layers)) and data["capacities"] == list(range(cfg.n_routed_experts + 1))
    at = data["capacities"].index(5)
    calls = cp.routing_calls(result)
    for i, layer in enumerate(data["layers"]):
        hits, misses = model.experts.counters.totals(layer)
        assert data["hits"]["lru"][i][at] == hits and data["lookups"][i] - hits == misses, layer
        assert (data["recorded"]["hits"][i], data["recorded"]["misses"][i]) == (hits, misses)
        # call by call, as the routing records have them
        per_call = cp.replay_counts([c.lookups for c in calls[layer]], 5, "lru")
        assert per_call == [[c.hits, c.misses] for c in calls[layer]], layer
    assert data["hit_rate"]["lru"][at] == data["recorded_hit_rate"]
    # the same curve as dsv41.widgets.cache's replay, at every size
    cache = widgets.cache_data(result, capacity=5, n_experts=cfg.n_routed_experts)
    assert cache["replay_sizes"] == data["capacities"]
    assert cache["replay_hit_rate"] == pytest.approx(data["hit_rate"]["lru"], abs=1e-15)
    assert data["tokens"] == len(result.all_ids) - 1 and data["decode_tokens"] == len(result.ids) - 1
    for p in cp.POLICIES:
        assert all(h <= b for row, brow in zip(data["hits"][p], data["hits"]["belady"]) for h, b in zip(row, brow))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and (
                torch.equal(a, b)
                if not a.is_floating_point()
                else bool(((a == b) | (torch.isnan(a.float()) & torch.isnan(b.float()))).all())
            )
        )
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b and type(a) is type(b)


def _records_equal(xs, ys):
    import dataclasses

    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert type(x) is type(y)
        for f in dataclasses.fields(x):
            assert _same(getattr(x, f.name), getattr(y, f.name)), (type(x).__name__, f.name)


def test_a_trace_round_trips_through_a_file(run, tmp_path):
    model, result = run
    trace = result.trace
    path = trace.save(
        tmp_path / "run.trace",
        meta={"n_routed_experts": model.cfg.n_routed_experts, "expert_cache": model.experts.capacity},
    )
    assert path == str(tmp_path / "run.trace")  # the name as given, no suffix added
    back = GenerationTrace.load(path)
    for name in ("attention", "routing", "engram", "finite"):
        _records_equal(getattr(trace.forward, name), getattr(back.forward, name))
    assert back.forward.keep_index_scores == trace.forward.keep_index_scores
    _records_equal(trace.steps, back.steps)
    assert back.cache == trace.cache and back.meta == {"n_routed_experts": 16, "expert_cache": 5}
    assert trace.meta == {}  # save's meta goes to the file, not into the trace
    assert json.dumps(back.to_dict()) == json.dumps(trace.to_dict())
    # what the replay reads is the same from the file, and the file states the run's size
    loaded = cp.policy_data(path)
    assert loaded == cp.policy_data(result, n_experts=16, capacity=5) and loaded["capacity"] == 5
    # nothing in the file needs pickle, and the same trace gives the same bytes
    with np.load(path, allow_pickle=False) as archive:
        assert all(archive[k].dtype != object for k in archive.files)
    assert open(back.save(tmp_path / "again.npz"), "rb").read() == open(path, "rb").read()


def test_a_trace_file_keeps_dtypes_numpy_lacks(tmp_path):
    forward = ForwardTrace(keep_outputs=True, check_finite=True)
    out = torch.randn(1, 2, 4).to(torch.bfloat16)
    forward.attention.append(
        AttentionRecord(
            3,
            "reuse",
            4,
            5,
            2,
            selected=torch.tensor([[[0, -1], [1, 0]]]),
            selected_by=2,
            kth_score=torch.tensor([[float("nan"), 1.5]]),
            candidate_blocks=torch.tensor([[[True, False], [True, True]]]),
            output=out,
            wrote_compressed=True,
        )
    )
    forward.finite.append(FiniteRecord(None, "head", 5, True))
    trace = GenerationTrace(
        forward,
        [StepRecord(6, 17, float("inf"), 0.25)],
        [{"start_pos": 5, "seqlen": 2, "layers": {3: [1, 2]}}],
        {"note": "by hand"},
    )
    back = GenerationTrace.load(trace.save(tmp_path / "t.npz"))
    _records_equal(trace.forward.attention, back.forward.attention)
    _records_equal(trace.forward.finite, back.forward.finite)
    _records_equal(trace.steps, back.steps)
    assert back.forward.attention[0].output.dtype == torch.bfloat16 and back.forward.check_finite
    assert back.cache == trace.cache and back.meta == {"note": "by hand"}


def test_what_is_not_a_trace_file_is_one_sentence(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        GenerationTrace.load(tmp_path / "absent.npz")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    plain = tmp_path / "plain.npz"
    np.savez(plain, x=np.arange(3))
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, manifest=np.array([{"format": "dsv41.GenerationTrace"}], dtype=object))
    for path in (text, plain, pickled, tmp_path):
        with pytest.raises(TraceFileError) as caught:
            GenerationTrace.load(path)
        message = str(caught.value)
        assert str(path) in message and "\n" not in message


# ---------------------------------------------------------------------- dsv41 replay
@pytest.fixture(scope="module")
def saved(run, tmp_path_factory):
    model, result = run
    return result.trace.save(
        tmp_path_factory.mktemp("replay") / "run.npz",
        meta={"n_routed_experts": model.cfg.n_routed_experts, "expert_cache": 5},
    )


def test_replay_command_prints_and_writes_json(saved, tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert cp.cli_main([saved, "--capacity", "4,8,16,32", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "18,800,640 bytes (17.93 MiB)" in printed
    rows = [ln.split() for ln in printed.splitlines() if ln.split() and ln.split()[0] in cp.POLICIES]
    assert [(r[0], int(r[1])) for r in rows] == [(p, c) for p in cp.POLICIES for c in (4, 8, 16, 32)]
    data = json.loads(out.read_text())
    assert data["requested_capacities"] == [4, 8, 16, 32] and 32 in data["capacities"]
    lru = data["hit_rate"]["lru"]
    assert lru[data["capacities"].index(32)] == lru[data["capacities"].index(16)]  # all 16 fit
    for row in rows:
        i = data["capacities"].index(int(row[1]))
        assert row[2] == f"{data['hit_rate'][row[0]][i]:.4f}"
    assert cp.cli_main([saved, "--capacity", "2", "--policy", "belady"]) == 0
    assert [ln.split()[0] for ln in capsys.readouterr().out.splitlines()[3:]] == ["belady"]


@pytest.mark.parametrize(
    "args, code, says",
    [
        (["{missing}"], 1, "no such file"),
        (["{text}"], 1, "is not a trace"),
        (["{saved}", "--capacity", "4,x"], 2, "--capacity takes"),
        (["{saved}", "--capacity", "-4"], 2, "--capacity takes"),
        (["{saved}", "--capacity", ""], 2, "--capacity takes"),
        (["{saved}", "--policy", "lru,mru"], 2, "--policy takes"),
        (["{saved}", "--warmup", "0"], 2, "--warmup"),
        (["{saved}", "--experts", "4"], 1, "beyond the 4 experts"),
    ],
)
def test_replay_command_refuses_bad_input_in_one_sentence(saved, tmp_path, capsys, args, code, says):
    text = tmp_path / "notes.txt"
    text.write_text("not a trace")
    argv = [a.format(missing=tmp_path / "absent.npz", text=text, saved=saved) for a in args]
    assert cp.cli_main(argv) == code
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("dsv41 replay: ") and "\n" not in err and "Traceback" not in err


# ---------------------------------------------------------------------- the figure
def _plain():
    return cp.policy_data(
        _trace(
            [[[[0, 1], [1, 2]], [[1, 3]], [[0, 1]], [[1, 2]]], [[[2, 3], [3, 0]], [[0, 3]], [[2, 0]], [[3, 1]]]],
            n_experts=4,
            capacity=2,
        )
    )


def test_render_draws_every_policy_with_a_legend():
    data = _plain()
    fig = widgets.policy.render(data)
    assert isinstance(fig, Figure)
    ax_rate, ax_layer, ax_disk = fig.axes
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_legend() is not None
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == [ln.get_label() for ln in ax.get_lines()]  # every line is in the legend
    names = [cp.POLICY_NAMES[p] for p in cp.POLICIES]
    assert [ln.get_label() for ln in ax_rate.get_lines()][:4] == names
    for p, line in zip(cp.POLICIES, ax_rate.get_lines()):
        assert list(line.get_ydata()) == data["hit_rate"][p]
    at = data["capacities"].index(2)
    for p, line in zip(cp.POLICIES, ax_layer.get_lines()):
        assert list(line.get_xdata()) == data["layers"] and list(line.get_ydata()) == [
            r[at] for r in data["hit_rate_by_layer"][p]
        ]
    for p, line in zip(cp.POLICIES, ax_disk.get_lines()):
        assert list(line.get_ydata()) == pytest.approx(data["disk_mib_per_decode_token"][p])
    assert "disk MiB per decode token" == ax_disk.get_ylabel()
    # the recorded run is marked only when the trace recorded its cache (this one did not)
    assert "recorded run" not in " ".join(ln.get_label() for ln in ax_rate.get_lines())
    picked = widgets.policy.render(data, policies=["belady"], capacity=3)
    assert [ln.get_label() for ln in picked.axes[1].get_lines()] == ["Belady (optimal)"]
    assert "3 experts cached" in picked.axes[1].get_title()


def test_view_picks_policies_and_exports_identical_bytes(tmp_path):
    view = widgets.PolicyView(_plain())
    assert view.options == {"policies": list(cp.POLICIES), "capacity": 2}
    controls, image = view.widget.children
    picker, slider = controls.children
    before = bytes(image.value)
    picker.value = ("lru", "belady")  # what a person picking two policies does
    assert view.options["policies"] == ["lru", "belady"] and bytes(image.value) != before
    assert [ln.get_label() for ln in view.figure.axes[1].get_lines()] == ["LRU", "Belady (optimal)"]
    slider.value = 3
    assert view.options["capacity"] == 3 and bytes(image.value) == viz.png_bytes(view.figure)
    first = view.export("policy", str(tmp_path / "a"))
    again = widgets.PolicyView(_plain(), policies=["lru", "belady"], capacity=3).export("policy", str(tmp_path / "b"))
    for ext in ("png", "svg", "json"):
        assert open(first[ext], "rb").read() == open(again[ext], "rb").read(), ext
    sidecar = json.loads(open(first["json"]).read())
    assert sidecar["options"] == {"policies": ["lru", "belady"], "capacity": 3}
    assert sidecar["hit_rate"]["lru"] == _plain()["hit_rate"]["lru"]
    picker.value = ()
    assert any("no policy picked" in t.get_text() for t in view.figure.axes[0].texts)
