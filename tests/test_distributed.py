"""Expert parallelism: N ranks give one process's tokens and logits bit for bit, and a failing rank
ends the group with one clear line.

The group tests start real groups with torchrun (gloo on loopback, CPU only) and run this file as
each rank's script (`python tests/test_distributed.py --rank-run OUT MODE CHECKPOINT`); each rank
writes what it computed as a safetensors file that the test compares with the same run in this
process without a group. The start-up tests set each rank's environment themselves (loopback only,
short join timeouts) to give ranks bad variables, an unresolvable master or different requests."""

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import dsv41
from dsv41 import Numerics
from dsv41.kernels.experts import routed_experts
from dsv41.model.trace import ForwardTrace
from dsv41.runtime.distributed import (
    DEFAULT_TIMEOUT_S,
    ExpertParallelError,
    RankView,
    agree,
    combine_pairs,
    init,
    owned_pairs,
    pair_outputs,
    shutdown,
)

REPO = Path(dsv41.__file__).resolve().parent.parent
# A prompt long enough that prefill gives several experts more than 8 tokens (the other GEMM path)
PROMPT = (
    "The capital of France is a city on the river, and the river runs to the sea past the old "
    "harbour where the boats come in at night with the tide and leave again at dawn"
)
DECODE_STEPS = 6
NUMERICS = {"reference": Numerics(), "parity": Numerics.parity()}
GROUP_TIMEOUT_S = 120  # a generous bound on one torchrun group here (each takes a few seconds)
FAILING_LAYER, FAILING_CALL = 1, 3  # the failure test: the last rank's fetch in layer 1 raises on call 3
FAILURE_TEXT = "simulated read failure"
BROKEN_TIMEOUT_S = 10  # the group timeout of the broken-group test's ranks


def greedy_run(model) -> dict:
    """Prefill PROMPT and decode DECODE_STEPS greedy tokens: every step's logits, the tokens and
    the routing of every layer (ids and weights) as tensors."""
    trace = ForwardTrace()
    ids = model.encode(PROMPT)
    logits = [model(ids, 0, trace=trace)[0]]
    tokens = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(model([tokens[-1]], model.position, trace=trace)[0])
    out = {"logits": torch.stack(logits), "tokens": torch.tensor(tokens)}
    for layer, record in trace.routing_by_layer().items():
        out[f"routing.{layer}.expert_ids"] = record["expert_ids"].contiguous()
        out[f"routing.{layer}.weights"] = record["weights"].contiguous()
    return out


def single_process(checkpoint: str) -> dict:
    out = {}
    for name, numerics in NUMERICS.items():
        run = greedy_run(dsv41.load(checkpoint, numerics=numerics, quiet=True))
        out.update({f"{name}.{key}": value for key, value in run.items()})
    return out


# ---------------------------------------------------------------------- the combination, in process
def test_pairs_combined_in_order_equal_routed_experts_for_any_world(tiny_checkpoint, one_thread):
    """Every simulated world size's pair outputs, added in ascending expert id, are the single
    call's sums bit for bit, for decode-sized and prefill-sized token counts and both arithmetics."""
    model = dsv41.load(tiny_checkpoint, quiet=True)
    generator = torch.Generator().manual_seed(0)
    for n in (1, 7, 64):
        for layer in (0, model.cfg.n_layers - 1):
            moe = model.backbone.layers[layer].ffn
            x = (torch.randn(n, model.cfg.dim, generator=generator) * 0.5).to(torch.bfloat16)
            weights, ids = moe.gate(x)
            selected = torch.unique(ids).tolist()
            experts = dict(zip(selected, model.experts.fetch(layer, selected)))
            for batch_invariant in (False, True):
                want = routed_experts(x, ids, weights, experts, moe.swiglu_limit, batch_invariant=batch_invariant)
                for world in (1, 2, 3, model.cfg.n_routed_experts + 1):
                    rows = torch.full((ids.numel(), model.cfg.dim), float("nan"), dtype=x.dtype)
                    shares = [owned_pairs(ids, RankView(rank, world)) for rank in range(world)]
                    assert sorted(torch.cat(shares).tolist()) == list(range(ids.numel()))  # each pair once
                    for rank, pairs in enumerate(shares):
                        assert all(e % world == rank for e in ids.reshape(-1)[pairs].tolist())
                        rows[pairs] = pair_outputs(x, ids, weights, pairs, experts, moe.swiglu_limit, batch_invariant)
                    got = combine_pairs(ids, rows)
                    assert torch.equal(got, want), (n, layer, batch_invariant, world)


def test_rank_view_owns_experts_round_robin():
    view = RankView(rank=1, world_size=3)
    assert view.owned(10) == [1, 4, 7]
    assert [view.owns(e) for e in range(4)] == [False, True, False, False]
    assert not view.is_main and RankView().is_main


def test_the_owned_expert_store_serves_this_ranks_share_and_refuses_the_rest():
    from dsv41.checkpoint.stores import DictExpertStore, OwnedExpertStore

    view = RankView(rank=1, world_size=2)
    store = OwnedExpertStore(DictExpertStore({(0, 1): "one", (0, 3): "three", (0, 2): "two"}), view)
    assert list(store.fetch(0, [1, 3])) == ["one", "three"]
    with pytest.raises(
        ExpertParallelError,
        match=r"^rank 1 of 2 .* was asked for layer 0's experts \[2\], "
        r"which rank 0 holds$",
    ):
        store.fetch(0, [1, 2])


def test_without_a_group_the_error_says_how_to_start_one(monkeypatch):
    for variable in LAUNCH_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ExpertParallelError, match="torchrun"):
        init()
    with pytest.raises(ExpertParallelError, match="torchrun"):
        dsv41.load(expert_parallel=True, quiet=True)
    with pytest.raises(ValueError, match="backend"):
        init(backend="mpi")


# ---------------------------------------------------------------------- start-up: environment, master, join
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SHORT_JOIN_TIMEOUT_S = 3  # the join timeout of the tests that wait for it to pass
STARTUP_BOUND_S = 60  # a process refusing up front ends far sooner (importing torch takes seconds)
UNRESOLVABLE = "nonexistent.invalid"  # the .invalid TLD never resolves (RFC 2606)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch_env(rank: int, world: int, port: int, **overrides) -> dict:
    """A worker's environment as torchrun sets it, on loopback, but with rank 0 hosting the group's
    store itself (no torchrun agent); an override of None removes the variable."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DSV41_JOIN_TIMEOUT_S=str(SHORT_JOIN_TIMEOUT_S),
    )
    for variable in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_WORLD_SIZE"):
        env.pop(variable, None)
    for variable, value in overrides.items():
        if value is None:
            env.pop(variable, None)
        else:
            env[variable] = str(value)
    return env


def _generate_command(checkpoint: str, prompt: str = PROMPT, *extra: str) -> list:
    return [
        sys.executable,
        "-m",
        "dsv41",
        "generate",
        "--expert-parallel",
        "--checkpoint",
        checkpoint,
        "--prompt",
        prompt,
        "--max-new-tokens",
        "2",
        "--quiet",
        *extra,
    ]


def _run_generate(checkpoint: str, env: dict):
    """One `dsv41 generate --expert-parallel` process -> (the finished process, its wall seconds)."""
    began = time.monotonic()
    done = subprocess.run(
        _generate_command(checkpoint), capture_output=True, text=True, timeout=STARTUP_BOUND_S, env=env, cwd=str(REPO)
    )
    return done, time.monotonic() - began


@pytest.fixture
def refuse_joining(monkeypatch):
    """Joining fails the test: what `init` checks must be refused before any store or group."""
    import torch.distributed as dist

    def joined(*args, **kwargs):
        raise AssertionError("joined the group")

    monkeypatch.setattr(dist, "TCPStore", joined)
    monkeypatch.setattr(dist, "init_process_group", joined)


def _set_launch_env(monkeypatch, env: dict) -> None:
    for variable in (*LAUNCH_VARIABLES, "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "DSV41_JOIN_TIMEOUT_S"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, str(value))


GOOD_ENV = {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}
ENV = "torchrun's environment is not usable: "


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"RANK": 5}, "RANK must lie in [0, 1] for WORLD_SIZE 2, got 5"),
        ({"RANK": -1}, "RANK must lie in [0, 1] for WORLD_SIZE 2, got -1"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be a whole number, got 'two'"),
        ({"WORLD_SIZE": 0}, "WORLD_SIZE must be at least 1, got 0"),
        ({"LOCAL_RANK": 2}, "LOCAL_RANK must lie in [0, 1] for WORLD_SIZE 2, got 2"),
        ({"LOCAL_WORLD_SIZE": 1}, "LOCAL_RANK must lie in [0, 0] for LOCAL_WORLD_SIZE 1, got 1"),
        ({"MASTER_PORT": 70000}, "MASTER_PORT must lie in [1, 65535], got 70000"),
        ({"MASTER_PORT": "29500x"}, "MASTER_PORT must be a whole number, got '29500x'"),
        (
            {"LOCAL_RANK": None},
            "LOCAL_RANK is not set (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR "
            "and MASTER_PORT for every rank)",
        ),
        (
            {"RANK": None, "MASTER_ADDR": ""},
            "RANK and MASTER_ADDR are not set (torchrun sets RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every rank)",
        ),
        ({"MASTER_ADDR": UNRESOLVABLE}, f"MASTER_ADDR {UNRESOLVABLE!r} does not resolve"),
    ],
)
def test_the_environment_is_refused_in_one_sentence_before_joining(monkeypatch, refuse_joining, changes, message):
    env = {k: v for k, v in {**GOOD_ENV, **changes}.items() if v is not None}
    _set_launch_env(monkeypatch, env)
    with pytest.raises(ExpertParallelError) as caught:
        init()
    assert str(caught.value).startswith(ENV + message), str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_the_join_timeout_must_be_a_positive_number_of_seconds(monkeypatch, refuse_joining, value):
    _set_launch_env(monkeypatch, {**GOOD_ENV, "DSV41_JOIN_TIMEOUT_S": value})
    with pytest.raises(
        ExpertParallelError,
        match=rf"^DSV41_JOIN_TIMEOUT_S must be a number of seconds above 0, "
        rf"got '{value}'$",
    ):
        init()


def test_a_rank_outside_the_world_is_one_line_from_generate(tiny_checkpoint):
    done, seconds = _run_generate(tiny_checkpoint, _launch_env(5, 2, _free_port()))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"dsv41 generate: {ENV}RANK must lie in [0, 1] for WORLD_SIZE 2, got 5"]
    assert seconds < STARTUP_BOUND_S


def test_an_unresolvable_master_is_one_line_from_generate_before_any_join(tiny_checkpoint):
    join_timeout_s = 30  # a join would take this long; the resolution check refuses it first
    env = _launch_env(0, 2, _free_port(), MASTER_ADDR=UNRESOLVABLE, DSV41_JOIN_TIMEOUT_S=join_timeout_s)
    done, seconds = _run_generate(tiny_checkpoint, env)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"dsv41 generate: {ENV}MASTER_ADDR {UNRESOLVABLE!r} does not resolve"
    ), done.stderr[-3000:]
    assert seconds < join_timeout_s


@pytest.mark.parametrize(
    "rank, why",
    [
        (1, "nothing answered at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT)"),  # no master listens
        (0, "1 of 2 ranks arrived at 127.0.0.1:{port}"),  # the master, its peer never started
    ],
)
def test_a_join_that_cannot_complete_ends_after_the_stated_timeout(tiny_checkpoint, rank, why):
    port = _free_port()
    done, seconds = _run_generate(tiny_checkpoint, _launch_env(rank, 2, port))
    assert done.returncode == 1
    want = (
        f"dsv41 generate: rank {rank} could not join the expert-parallel group within {SHORT_JOIN_TIMEOUT_S} s "
        f"(DSV41_JOIN_TIMEOUT_S): {why.format(port=port)}"
    )
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(want), done.stderr[-3000:]
    assert SHORT_JOIN_TIMEOUT_S <= seconds < STARTUP_BOUND_S


def test_under_torchrun_a_rank_whose_peers_never_arrive_ends_the_join_after_the_timeout(monkeypatch):
    """torchrun's agent hosts the store and every rank is its client: the join waits for all ranks
    at the store itself, within the timeout, before any process group starts."""
    import torch.distributed as dist

    port = _free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    _set_launch_env(
        monkeypatch,
        {**GOOD_ENV, "RANK": 0, "LOCAL_RANK": 0, "MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "True"},
    )
    began = time.monotonic()
    with pytest.raises(
        ExpertParallelError,
        match=rf"^rank 0 could not join the expert-parallel group within 1 s "
        rf"\(DSV41_JOIN_TIMEOUT_S\): 1 of 2 ranks arrived at "
        rf"127.0.0.1:{port}$",
    ):
        init(join_timeout_s=1)
    assert 1 <= time.monotonic() - began < 20
    assert not dist.is_initialized()
    del agent_store


# ---------------------------------------------------------------------- real groups
def _torchrun(nproc: int, args: list[str], timeout: float = GROUP_TIMEOUT_S):
    """torchrun `args` on `nproc` local ranks -> (the finished process, its wall seconds)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))
    return done, time.monotonic() - began


@pytest.fixture(scope="module")
def reference_run(tiny_checkpoint):
    torch.set_num_threads(1)  # what each rank runs on (OMP_NUM_THREADS=1)
    return single_process(tiny_checkpoint)


@pytest.mark.parametrize("nproc", [2, 3])
def test_ranks_give_the_single_process_tokens_logits_and_routing(tiny_checkpoint, reference_run, tmp_path, nproc):
    from safetensors.torch import load_file

    done, _ = _torchrun(nproc, [__file__, "--rank-run", str(tmp_path), "ok", tiny_checkpoint])
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(nproc):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert got.keys() == reference_run.keys()
        for key, want in reference_run.items():
            assert torch.equal(got[key], want), f"rank {rank} of {nproc}: {key} differs"
        held = [int(e) for e in (tmp_path / f"rank{rank}.held").read_text().split()]
        assert held and all(e % nproc == rank for e in held), held  # its own experts, and only those
        fields = [int(v) for v in (tmp_path / f"rank{rank}.report").read_text().split()]
        report_rank, world, tensors, total_tensors, nbytes, total_bytes, n_experts, n_layers = fields
        assert (report_rank, world) == (rank, nproc)
        owned = len(range(rank, n_experts, nproc))
        assert total_tensors == n_experts * n_layers * 6  # w1, w2, w3 and their scales per expert
        assert tensors == owned * n_layers * 6
        assert nbytes * n_experts == total_bytes * owned  # every expert the same size


def test_a_failing_rank_ends_the_group_with_one_line_on_rank_0(tiny_checkpoint, tmp_path):
    nproc = 3
    done, seconds = _torchrun(nproc, [__file__, "--rank-run", str(tmp_path), "fail", tiny_checkpoint])
    assert done.returncode != 0
    assert seconds < GROUP_TIMEOUT_S
    want = f"rank {nproc - 1} failed in layer {FAILING_LAYER}'s routed experts: RuntimeError: {FAILURE_TEXT}"
    for rank in range(nproc):  # every rank raised the same error, naming the failing rank
        assert (tmp_path / f"rank{rank}.error").read_text() == want
    lines = [line for line in done.stderr.splitlines() if "failed in layer" in line]
    assert lines == [f"rank 0: {want}"], done.stderr[-3000:]


def test_a_rank_failing_outside_its_experts_ends_the_group_within_the_timeout(tiny_checkpoint, tmp_path):
    """The others are waiting in an expert exchange the failing rank never joins: it times out, and
    each rank says what it saw, the failing one its own error."""
    nproc = 2
    done, seconds = _torchrun(nproc, [__file__, "--rank-run", str(tmp_path), "dense-fail", tiny_checkpoint])
    assert done.returncode != 0
    assert seconds < 6 * BROKEN_TIMEOUT_S + 30  # a timeout or two, plus starting and loading; far under the default
    own = (tmp_path / f"rank{nproc - 1}.error").read_text()
    assert own == f"rank {nproc - 1} failed generating: RuntimeError: {FAILURE_TEXT}"
    seen = (tmp_path / "rank0.error").read_text()
    assert seen.startswith(f"rank 0: layer {FAILING_LAYER}'s expert exchange broke"), seen
    assert "\n" not in seen


def test_generate_command_prints_once_what_one_process_prints(tiny_checkpoint):
    args = ["--checkpoint", tiny_checkpoint, "--prompt", PROMPT, "--max-new-tokens", "5", "--quiet"]
    single = subprocess.run(
        [sys.executable, "-m", "dsv41", "generate", *args],
        capture_output=True,
        text=True,
        timeout=GROUP_TIMEOUT_S,
        cwd=str(REPO),
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
    )
    assert single.returncode == 0, single.stderr
    done, _ = _torchrun(2, ["-m", "dsv41", "generate", "--expert-parallel", *args])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == single.stdout and single.stdout.strip()


def test_bench_experts_across_ranks_counts_the_bytes_it_exchanges(tmp_path):
    import json

    from dsv41.bench import TOPK

    nproc, dim, tokens = 2, 64, [1, 9]
    report_file = tmp_path / "report.json"
    done, _ = _torchrun(
        nproc,
        [
            "-m",
            "dsv41",
            "bench",
            "experts",
            "--expert-parallel",
            "--tokens",
            ",".join(map(str, tokens)),
            "--dims",
            f"{dim},32",
            "--experts",
            "8",
            "--repeats",
            "1",
            "--json",
            str(report_file),
        ],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["world_size"] == nproc
    for shape, t in zip(report["shapes"], tokens):
        assert shape["tokens"] == t and shape["bit_identical"]
        ranks = shape["ranks"]
        assert sum(r["pairs"] for r in ranks) == t * TOPK  # every (token, expert) pair computed once
        for r in ranks:  # bf16 values: each rank's pairs and one status value, to and from every peer
            others = t * TOPK - r["pairs"]
            assert r["bytes_sent"] == (nproc - 1) * (r["pairs"] * dim + 1) * 2
            assert r["bytes_received"] == (others * dim + nproc - 1) * 2


def _run_ranks(commands: list) -> tuple[list, list]:
    """Each command as one rank of a group on loopback (rank 0 hosting the store) -> (exit codes,
    (stdout, stderr) per rank)."""
    port = _free_port()
    ranks = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(REPO),
            env=_launch_env(rank, len(commands), port, DSV41_JOIN_TIMEOUT_S=STARTUP_BOUND_S),
        )
        for rank, command in enumerate(commands)
    ]
    try:
        outputs = [rank.communicate(timeout=STARTUP_BOUND_S) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    return [rank.returncode for rank in ranks], outputs


def test_ranks_given_different_requests_stop_with_one_line_on_rank_0(tiny_checkpoint):
    """Rank 1 is given another prompt and token count: the ranks compare their requests before the
    first exchange, so every rank exits 1 and rank 0 names the differences, nothing from gloo."""
    codes, outputs = _run_ranks(
        [
            _generate_command(tiny_checkpoint),
            _generate_command(tiny_checkpoint, "A different prompt", "--max-new-tokens", "3"),
        ]
    )
    assert codes == [1, 1], outputs
    lines = outputs[0][1].splitlines()
    assert len(lines) == 1, outputs[0][1][-3000:]
    assert lines[0].startswith("dsv41 generate: rank 1's request differs from rank 0's: --prompt "), lines[0]
    assert lines[0].endswith("; --max-new-tokens 3 against 2"), lines[0]
    assert outputs[1][1] == "" and outputs[0][0] == outputs[1][0] == ""


def test_a_rank_whose_prompt_cannot_be_prepared_stops_every_rank_at_once(tiny_checkpoint, tmp_path):
    """Rank 1's image does not exist: the ranks prepare their prompts as one step, so no rank is
    left waiting in an exchange for the group's timeout."""
    missing = tmp_path / "missing.png"
    began = time.monotonic()
    codes, outputs = _run_ranks(
        [_generate_command(tiny_checkpoint), _generate_command(tiny_checkpoint, PROMPT, "--image", str(missing))]
    )
    assert codes == [1, 1], outputs
    lines = outputs[0][1].splitlines()
    want = "dsv41 generate: rank 1 failed preparing the prompt: ImageError: "
    assert len(lines) == 1 and lines[0].startswith(want), outputs[0][1][-3000:]
    assert str(missing) in lines[0] and outputs[1][1] == ""
    assert time.monotonic() - began < DEFAULT_TIMEOUT_S


def test_agree_in_a_group_of_one_names_the_failure():
    import torch.distributed as dist

    assert not dist.is_initialized()  # the tests above run their groups in other processes
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert agree(lambda: 7, "adding") == 7
        with pytest.raises(ExpertParallelError, match=r"^rank 0 failed adding: ValueError: bad$"):
            agree(lambda: (_ for _ in ()).throw(ValueError("bad\nmore")), "adding")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- one rank of a group
class _FailingFetch:
    """Wraps a store: raises on the `call`-th fetch of `layer`."""

    def __init__(self, store, layer: int, call: int):
        self.store, self.layer, self.call, self.calls = store, layer, call, 0

    def fetch(self, layer, expert_ids):
        if layer == self.layer:
            self.calls += 1
            if self.calls == self.call:
                raise RuntimeError(FAILURE_TEXT)
        return self.store.fetch(layer, expert_ids)


def _failing_after(forward, call: int):
    """`forward`, raising RuntimeError(FAILURE_TEXT) on its `call`-th call."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(FAILURE_TEXT)
        return forward(*args, **kwargs)

    return wrapped


def _rank_main(out: str, mode: str, checkpoint: str) -> int:
    from safetensors.torch import save_file

    ranks = init(timeout_s=BROKEN_TIMEOUT_S if mode == "dense-fail" else DEFAULT_TIMEOUT_S)
    results = {}
    try:
        for name, numerics in NUMERICS.items():
            model = dsv41.load(checkpoint, numerics=numerics, expert_parallel=True, quiet=True)
            if mode == "fail" and ranks.rank == ranks.world_size - 1:
                experts = model.backbone.layers[FAILING_LAYER].ffn.experts
                experts.store = _FailingFetch(experts.store, FAILING_LAYER, FAILING_CALL)
            if mode == "dense-fail" and ranks.rank == ranks.world_size - 1:
                attention = model.backbone.layers[FAILING_LAYER].attn
                attention.forward = _failing_after(attention.forward, FAILING_CALL)
            run = agree(lambda: greedy_run(model), "generating")
            results.update({f"{name}.{key}": value for key, value in run.items()})
            held = sorted({e for layer in range(model.cfg.n_layers) for e in model.experts.cached(layer)})
            Path(out, f"rank{ranks.rank}.held").write_text(" ".join(map(str, held)))
            r = model.report
            Path(out, f"rank{ranks.rank}.report").write_text(
                " ".join(
                    map(
                        str,
                        (
                            r.rank,
                            r.world_size,
                            r.routed_tensors_held,
                            r.routed_tensors_total,
                            r.routed_bytes_held,
                            r.routed_bytes_total,
                            model.cfg.n_routed_experts,
                            model.cfg.n_layers,
                        ),
                    )
                )
            )
    except ExpertParallelError as exc:
        Path(out, f"rank{ranks.rank}.error").write_text(str(exc))
        if ranks.is_main:
            print(f"rank 0: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown()
    save_file(results, str(Path(out, f"rank{ranks.rank}.safetensors")))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--rank-run"]:
    torch.set_num_threads(1)
    sys.exit(_rank_main(*sys.argv[2:5]))
