"""Expert parallelism over torch.distributed: each rank holds and computes a share of the routed
experts, every rank runs everything else, and the result does not depend on how many ranks there are.

A group of `world_size` processes (started by torchrun; gloo between CPU hosts, NCCL between GPUs)
each load the model with `load(path, expert_parallel=True)`. Rank `r` holds the routed experts `e`
with `e % world_size == r` (its own expert cache, on its own GPU where it has one); the dense part,
the router, the shared experts and the Engram tables are the same on every rank, so every rank
routes every token to the same experts. An MoE layer then runs in three steps
(`ExpertParallelExperts.forward`):

    1. each rank computes the (token, slot) pairs whose expert it owns, every pair's output kept
       apart (bf16, the kernels' own rounding of an expert's output) instead of summed;
    2. one all-to-all of exact sizes hands every rank every other rank's pair outputs (each
       rank's share is known to all from the routing; one status value rides at the end of each
       share, so a rank whose expert fetch failed is known to all of them in the same collective);
    3. every rank adds a token's pair outputs into a float32 zero in ascending expert id, the order
       the single-process path (`kernels.experts.routed_experts`) adds them in.

Float addition is not associative, so a reduction of per-rank partial sums (an all-reduce) would
give results that depend on the world size and the reduction tree; gathering the pairs and adding
them in one fixed order gives the single process's logits bit for bit for any world size. It costs
more traffic than an all-reduce of float32 partial sums: per token and layer every rank receives
the pairs it does not own (on average topk x (world_size - 1) / world_size x dim x 2 bytes,
against dim x 4 for the sums).

Errors: a failure inside a rank's experts is caught there, flagged in the exchange and its one
line exchanged, and every rank raises the same `ExpertParallelError` naming the rank; `agree`
does the same for any step (loading, a whole generation). A rank that dies outright breaks the
collective for the others, which raise within the group's timeout (`init(timeout_s=...)`).
Start-up is checked before it can hang: `init` refuses a bad torchrun environment and an
unresolvable MASTER_ADDR in one sentence, and bounds the join (reaching the store, every rank
arriving) by its own timeout; `agree_on_request` stops ranks asked for different computations
before their first exchange.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..checkpoint.stores import FetchedExperts
from ..core.errors import Dsv41Error
from ..kernels.experts import routed_experts

# How long a collective waits for a silent peer before every rank gives up.
DEFAULT_TIMEOUT_S = 120
# How long joining may take (the master's store answering, every rank arriving at it): ranks start
# within seconds of each other, so a join still waiting after a minute is not going to complete.
DEFAULT_JOIN_TIMEOUT_S = 60
JOIN_TIMEOUT_VARIABLE = "DSV41_JOIN_TIMEOUT_S"
# torchrun sets these in every worker's environment.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("auto", "gloo", "nccl")

T = TypeVar("T")


class ExpertParallelError(Dsv41Error, RuntimeError):
    """A rank of the expert-parallel group failed; the message (one line) names the rank and why.
    `agreed`: every rank of the group raised this same error (False: the group broke before the
    ranks could agree, so each says what it saw)."""

    def __init__(self, message: str, agreed: bool = True):
        super().__init__(message)
        self.agreed = agreed


@dataclass(frozen=True)
class RankView:
    """Where this process stands in the group: `rank` of `world_size`, `local_rank` on its host
    (its GPU's index), the `backend`. Rank r owns the routed experts e with e % world_size == r."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "gloo"

    def owns(self, expert: int) -> bool:
        return expert % self.world_size == self.rank

    def owned(self, n_experts: int) -> list[int]:
        return list(range(self.rank, n_experts, self.world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        """Where collectives' tensors must live: the rank's GPU under NCCL, the CPU under gloo."""
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} ({self.backend}, local rank {self.local_rank})"

    def refusal(self, layer: int, foreign: Sequence[int]) -> "ExpertParallelError":
        """The error `stores.OwnedExpertStore` raises when asked for experts this rank does not own."""
        return ExpertParallelError(
            f"{self.describe()} was asked for layer {layer}'s experts {list(foreign)}, "
            f"which rank {foreign[0] % self.world_size} holds"
        )


@dataclass(frozen=True)
class LaunchEnvironment:
    """torchrun's description of this worker, checked (`launch_environment`)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launched_by_torchrun() -> bool:
    """Whether any of torchrun's variables is set: the process means to join a group, so a missing
    or wrong one is an error to name rather than a reason to say "start it under torchrun"."""
    return any(os.environ.get(v, "").strip() for v in TORCHRUN_VARIABLES)


def _environment_error(problem: str) -> ExpertParallelError:
    return ExpertParallelError(f"torchrun's environment is not usable: {problem}", agreed=False)


def launch_environment(environ=None) -> LaunchEnvironment:
    """torchrun's variables, each present, a whole number where it is one, and in range; else one
    sentence naming the first that is not (torch itself would only fail minutes later)."""
    environ = os.environ if environ is None else environ
    missing = [v for v in TORCHRUN_VARIABLES if not environ.get(v, "").strip()]
    if missing:
        names = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
        every = ", ".join(TORCHRUN_VARIABLES[:-1]) + f" and {TORCHRUN_VARIABLES[-1]}"
        raise _environment_error(
            f"{names} {'is' if len(missing) == 1 else 'are'} not set (torchrun sets {every} for every rank)"
        )

    def whole(name: str) -> int:
        text = environ[name]
        try:
            return int(text.strip())
        except ValueError:
            raise _environment_error(f"{name} must be a whole number, got {text!r}") from None

    def within(name: str, value: int, size: int, size_name: str) -> None:
        if not 0 <= value < size:
            raise _environment_error(f"{name} must lie in [0, {size - 1}] for {size_name} {size}, got {value}")

    world = whole("WORLD_SIZE")
    if world < 1:
        raise _environment_error(f"WORLD_SIZE must be at least 1, got {world}")
    rank, local = whole("RANK"), whole("LOCAL_RANK")
    within("RANK", rank, world, "WORLD_SIZE")
    within("LOCAL_RANK", local, world, "WORLD_SIZE")
    if environ.get("LOCAL_WORLD_SIZE", "").strip():  # torchrun sets it too; older launchers may not
        local_world = whole("LOCAL_WORLD_SIZE")
        if local_world < 1:
            raise _environment_error(f"LOCAL_WORLD_SIZE must be at least 1, got {local_world}")
        within("LOCAL_RANK", local, local_world, "LOCAL_WORLD_SIZE")
    port = whole("MASTER_PORT")
    if not 1 <= port <= 65535:
        raise _environment_error(f"MASTER_PORT must lie in [1, 65535], got {port}")
    return LaunchEnvironment(rank, world, local, environ["MASTER_ADDR"].strip(), port)


def join_timeout(environ=None) -> float:
    """Seconds the join may take: $DSV41_JOIN_TIMEOUT_S, else DEFAULT_JOIN_TIMEOUT_S."""
    environ = os.environ if environ is None else environ
    text = environ.get(JOIN_TIMEOUT_VARIABLE, "")
    if not text.strip():
        return DEFAULT_JOIN_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ExpertParallelError(
            f"{JOIN_TIMEOUT_VARIABLE} must be a number of seconds above 0, got {text!r}", agreed=False
        )
    return seconds


def resolve_master(addr: str, port: int, timeout_s: float) -> None:
    """Refuse a MASTER_ADDR that names no address, before any rank waits on it (the store would
    retry it until its timeout). The lookup runs in a thread, so a silent DNS server is bounded too."""
    outcome: dict = {}

    def lookup():
        try:
            outcome["addresses"] = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:  # UnicodeError: a name no DNS label can hold
            outcome["error"] = exc

    resolver = threading.Thread(target=lookup, name="dsv41-resolve-master", daemon=True)
    resolver.start()
    resolver.join(timeout_s)
    if resolver.is_alive():
        raise _environment_error(
            f"MASTER_ADDR {addr!r} did not resolve within {timeout_s:g} s ({JOIN_TIMEOUT_VARIABLE})"
        )
    error = outcome.get("error")
    if error is not None:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise _environment_error(
            f"MASTER_ADDR {addr!r} does not resolve ({reason}): set it to rank 0's host name or address"
        )


def _first_answer(addr: str, port: int, deadline: float) -> Optional[OSError]:
    """Wait until something accepts a connection at addr:port (None), or the deadline passes (the
    last error). A plain socket, because TCPStore's own retries print C++ frames on every attempt."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return None
        except OSError as exc:
            last = exc
        if time.monotonic() + 0.25 >= deadline:
            return last
        time.sleep(0.25)


_joins_begun = 0  # groups this process started joining: each counts its arrivals under its own key


def join_store(env: LaunchEnvironment, join_timeout_s: float, timeout_s: float):
    """The group's store, once every rank has arrived at it, within join_timeout_s; else one
    ExpertParallelError. Rank 0 hosts the store, or under torchrun its agent does and every rank is
    a client (TORCHELASTIC_USE_AGENT_STORE), as torch's env:// rendezvous decides."""
    global _joins_begun
    deadline = time.monotonic() + join_timeout_s
    where = f"{env.master_addr}:{env.master_port}"

    def failed(why: str) -> ExpertParallelError:
        return ExpertParallelError(
            f"rank {env.rank} could not join the expert-parallel group within "
            f"{join_timeout_s:g} s ({JOIN_TIMEOUT_VARIABLE}): {why}",
            agreed=False,
        )

    store_timeout = timedelta(seconds=join_timeout_s)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if env.rank == 0 and not agent_hosts_store:
        try:  # not waiting for the workers here: the count below does, and says how many came
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                True,
                timeout=store_timeout,
                wait_for_workers=False,
                multi_tenant=True,
            )
        except Exception as exc:  # the port taken, or MASTER_ADDR not this host's
            raise ExpertParallelError(
                f"rank 0 could not host the group's store at {where} (MASTER_ADDR:MASTER_PORT): {one_line(exc)}",
                agreed=False,
            ) from None
    else:
        unanswered = _first_answer(env.master_addr, env.master_port, deadline)
        if unanswered is not None:
            raise failed(f"nothing answered at {where} (MASTER_ADDR:MASTER_PORT): {one_line(unanswered)}")
        try:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout=store_timeout)
        except Exception as exc:
            raise failed(f"the store at {where} did not answer as one: {one_line(exc)}") from None

    _joins_begun += 1
    key = f"dsv41/joined/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_joins_begun}"
    try:
        arrived = store.add(key, 1)
        while arrived < env.world_size:
            if time.monotonic() >= deadline:
                raise failed(f"{arrived} of {env.world_size} ranks arrived at {where}")
            time.sleep(0.05)
            arrived = store.add(key, 0)
    except ExpertParallelError:
        raise
    except Exception as exc:  # the host of the store went away while this rank waited
        raise failed(f"the store at {where} went away: {one_line(exc)}") from None
    store.set_timeout(timedelta(seconds=timeout_s))  # from here on it serves the group's collectives
    return store


def init(
    backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: Optional[float] = None
) -> RankView:
    """The process group this process belongs to: the one already initialized, else one started
    from torchrun's environment ("auto": NCCL when every rank can have its own GPU, gloo
    otherwise). timeout_s bounds every collective; join_timeout_s (default $DSV41_JOIN_TIMEOUT_S,
    else 60 s) bounds the join. Raises ExpertParallelError outside torchrun with no group, on a bad
    environment or MASTER_ADDR (before joining), and when the join does not complete in time."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if dist.is_available() and dist.is_initialized():
        return view()
    if not dist.is_available():
        raise ExpertParallelError("this torch build has no torch.distributed; expert parallelism needs it")
    if not launched_by_torchrun():
        raise ExpertParallelError(
            "expert parallelism needs a process group: start the command under torchrun "
            "(torchrun --nproc-per-node N -m dsv41 ...) or call "
            "torch.distributed.init_process_group first"
        )
    env = launch_environment()
    if join_timeout_s is None:
        join_timeout_s = join_timeout()
    elif not (math.isfinite(join_timeout_s) and join_timeout_s > 0):
        raise ValueError(f"join_timeout_s must be a number of seconds above 0, got {join_timeout_s!r}")
    resolve_master(env.master_addr, env.master_port, join_timeout_s)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and env.local_rank < torch.cuda.device_count() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    store = join_store(env, join_timeout_s, timeout_s)
    try:
        dist.init_process_group(
            backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s)
        )
    except Exception as exc:  # every rank reached the store, but they could not connect to each other
        raise ExpertParallelError(
            f"rank {env.rank} could not start the {backend} group: {one_line(exc)}", agreed=False
        ) from None
    return view()


def view(group=None) -> RankView:
    """This process's RankView in the initialized group (ExpertParallelError when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ExpertParallelError(
            "no torch.distributed process group is initialized (see dsv41.runtime.distributed.init)"
        )
    return RankView(
        rank=dist.get_rank(group),
        world_size=dist.get_world_size(group),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        backend=str(dist.get_backend(group)),
    )


def shutdown() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def agree(step: Callable[[], T], what: str, group=None) -> T:
    """Run `step` on every rank and exchange the outcome: each rank gets its own result back, or,
    when any rank raised, every rank raises one ExpertParallelError naming the first failing rank
    and its error (so rank 0 can print another rank's failure). `what` names the step."""
    try:
        result, failure = step(), None
    except ExpertParallelError as exc:  # already names its rank
        if not exc.agreed:
            raise  # the group is broken: no exchange would complete
        result, failure = None, str(exc)
    except Exception as exc:  # any failure of the step is reported, not only ours
        result, failure = None, one_line(exc)
    ranks = view(group)
    if ranks.world_size == 1:
        if failure is not None:
            raise ExpertParallelError(f"rank 0 failed {what}: {failure}")
        return result
    failures: list = [None] * ranks.world_size
    try:
        dist.all_gather_object(failures, failure, group=group)
    except Exception as exc:  # the group broke (a peer exited, or is stuck past the timeout elsewhere)
        if failure is not None:
            raise ExpertParallelError(
                failure if failure.startswith("rank ") else f"rank {ranks.rank} failed {what}: {failure}", agreed=False
            ) from None
        raise ExpertParallelError(
            f"rank {ranks.rank}: the group broke while {what}: {one_line(exc)}", agreed=False
        ) from None
    for rank, message in enumerate(failures):
        if message is not None:
            if message.startswith("rank "):
                raise ExpertParallelError(message)
            raise ExpertParallelError(f"rank {rank} failed {what}: {message}")
    return result


def main_first(step: Callable[[], T], group=None) -> T:
    """Run `step` on rank 0 first, then on the others (a shared cache is built once, not raced)."""
    ranks = view(group)
    if ranks.world_size == 1:
        return step()
    if not ranks.is_main:
        dist.barrier(group=group)
        return step()
    try:
        result, failure = step(), None
    except Exception as exc:  # released to the others first, then raised here
        result, failure = None, exc
    dist.barrier(group=group)
    if failure is not None:
        raise failure
    return result


def fingerprint(*parts) -> str:
    """A short digest of bytes, text, int sequences or tensors, for comparing requests across ranks."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            part = part.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        elif isinstance(part, str):
            part = part.encode("utf-8", "surrogatepass")
        elif not isinstance(part, bytes):
            part = repr(part).encode()
        digest.update(len(part).to_bytes(8, "little") + part)  # lengths keep ("ab", "c") apart from ("a", "bc")
    return f"sha256 {digest.hexdigest()[:12]}"


def agree_on_request(request: dict, group=None) -> None:
    """Every rank must be asked for the same computation (its routing decides every exchange's
    sizes, and gloo aborts the process on a mismatch): compare each rank's `request` (name -> a
    short text, `fingerprint` for large values) with rank 0's before the first exchange. On a
    difference every rank raises one ExpertParallelError naming the first rank that differs and how."""
    ranks = view(group)
    if ranks.world_size == 1:
        return
    requests: list = [None] * ranks.world_size
    try:
        dist.all_gather_object(requests, dict(request), group=group)
    except Exception as exc:
        raise ExpertParallelError(
            f"rank {ranks.rank}: the group broke while comparing requests: {one_line(exc)}", agreed=False
        ) from None
    first = requests[0]
    for rank, other in enumerate(requests[1:], start=1):
        names = list(first) + [name for name in other if name not in first]
        differences = [
            f"{name} {other.get(name, '(not given)')} against {first.get(name, '(not given)')}"
            for name in names
            if other.get(name) != first.get(name)
        ]
        if differences:
            raise ExpertParallelError(f"rank {rank}'s request differs from rank 0's: " + "; ".join(differences))


# ---------------------------------------------------------------------- the routed experts
@dataclass
class ExchangeCounters:
    """What the expert-parallel layers moved and how long they took, summed since the last reset:
    per layer [calls, pairs computed here, bytes sent, bytes received, seconds computing, seconds
    exchanging]. Bytes are the exchange's payload: this rank's share (pairs x dim values and its
    status) sent to each of the world_size - 1 peers, and their shares received."""

    layers: dict = field(default_factory=dict)

    def add(self, layer: int, pairs: int, sent: int, received: int, compute_s: float, exchange_s: float) -> None:
        row = self.layers.setdefault(layer, [0, 0, 0, 0, 0.0, 0.0])
        for i, v in enumerate((1, pairs, sent, received, compute_s, exchange_s)):
            row[i] += v

    def totals(self) -> dict:
        keys = ("calls", "pairs", "bytes_sent", "bytes_received", "compute_s", "exchange_s")
        return {k: sum(row[i] for row in self.layers.values()) for i, k in enumerate(keys)}

    def reset(self) -> None:
        self.layers.clear()


def owned_pairs(expert_ids: torch.Tensor, ranks: RankView) -> torch.Tensor:
    """expert_ids [n, k] -> the flat pair indices (token * k + slot) whose expert this rank owns,
    ascending, so each owned expert sees its tokens in ascending order as in the single process."""
    return torch.nonzero(expert_ids.reshape(-1) % ranks.world_size == ranks.rank).squeeze(1)


def pair_outputs(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    pairs: torch.Tensor,
    experts: dict,
    swiglu_limit: float,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The outputs of the (token, slot) pairs `pairs` (flat indices into expert_ids [n, k]), each
    on its own row: [len(pairs), dim] in x's dtype. One `routed_experts` call whose tokens are the
    pairs, each routed to its one expert: an expert sees the same tokens in the same order as in
    the single process, so its GEMMs give the same bytes, and a pair's row is 0 + its output."""
    k = expert_ids.size(1)
    pair_x = x[pairs // k]  # [p, dim]
    pair_ids = expert_ids.reshape(-1)[pairs].unsqueeze(1)  # [p, 1]
    pair_w = weights.reshape(-1)[pairs].unsqueeze(1).float()  # [p, 1]
    out = routed_experts(pair_x, pair_ids, pair_w, experts, swiglu_limit, batch_invariant=batch_invariant)
    return out.to(x.dtype)  # exact: each row is one expert's output, already rounded to x's dtype


def combine_pairs(expert_ids: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
    """pair_rows [n * k, dim] (every pair's output, pair = token * k + slot) -> float32 [n, dim]:
    each token's outputs added into a float32 zero in ascending expert id, the single process's order."""
    n, k = expert_ids.shape
    rows = pair_rows.reshape(n, k, -1)  # [n, k, dim]
    order = expert_ids.argsort(dim=1)  # [n, k]: a token's slots by ascending expert (ids are distinct)
    y = torch.zeros(n, rows.size(-1), dtype=torch.float32, device=rows.device)
    tokens = torch.arange(n, device=rows.device)
    for j in range(k):
        y += rows[tokens, order[:, j].to(rows.device)].float()
    return y


class ExpertParallelExperts:
    """`moe.RoutedExperts`' interface (`forward(x [n, dim], expert_ids [n, k], weights [n, k]) ->
    float32 [n, dim]`, `last_fetch`) over a group of ranks: this rank fetches and computes only the
    experts it owns (`store` holds only those), then the pairs are exchanged and added in the single
    process's order (see the module docstring). Every rank must call it with the same routing."""

    def __init__(
        self,
        layer: int,
        store,
        swiglu_limit: float,
        *,
        batch_invariant: bool = False,
        ranks: Optional[RankView] = None,
        group=None,
        counters: Optional[ExchangeCounters] = None,
    ):
        self.layer, self.store, self.swiglu_limit = layer, store, swiglu_limit
        self.batch_invariant, self.group = batch_invariant, group
        self.ranks = ranks or view(group)
        self.counters = counters if counters is not None else ExchangeCounters()
        self.last_fetch: Optional[FetchedExperts] = None

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = expert_ids.shape
        dim, world = x.size(-1), self.ranks.world_size
        if n == 0:
            return torch.zeros(0, dim, dtype=torch.float32, device=x.device)
        began = time.perf_counter()
        pairs = owned_pairs(expert_ids, self.ranks)
        failure, mine = None, None
        try:
            selected = torch.unique(expert_ids.reshape(-1)[pairs]).tolist()  # ascending, owned only
            fetched = self.store.fetch(self.layer, selected)
            self.last_fetch = fetched if isinstance(fetched, FetchedExperts) else FetchedExperts(fetched)
            mine = pair_outputs(
                x, expert_ids, weights, pairs, dict(zip(selected, fetched)), self.swiglu_limit, self.batch_invariant
            )  # [p, dim]
        except Exception as exc:  # reported to every rank below, never left to hang the others
            failure = one_line(exc)
        computed = time.perf_counter()
        if world == 1:
            if failure is not None:
                raise ExpertParallelError(f"rank 0 failed in layer {self.layer}'s routed experts: {failure}")
            pair_rows = torch.empty(n * k, dim, dtype=x.dtype, device=x.device)
            pair_rows[pairs] = mine.to(x.device)
            self.counters.add(self.layer, len(pairs), 0, 0, computed - began, 0.0)
            return combine_pairs(expert_ids, pair_rows)

        me = self.ranks.rank
        owner = (expert_ids.reshape(-1) % world).cpu()  # [n * k]: every rank knows every rank's share
        counts = torch.bincount(owner, minlength=world).tolist()
        sizes = [c * dim + 1 for c in counts]  # a rank's pairs flattened, then its status (1: failed)
        chunk = torch.zeros(sizes[me], dtype=x.dtype, device=self.ranks.comm_device)
        if failure is None:
            chunk[:-1] = mine.reshape(-1).to(chunk.device)
        else:
            chunk[-1] = 1
        # one all-to-all of exact sizes (no padding): this chunk to every peer, theirs back, nothing to itself
        send_splits = [0 if r == me else sizes[me] for r in range(world)]
        receive_splits = [0 if r == me else sizes[r] for r in range(world)]
        received = torch.empty(sum(receive_splits), dtype=x.dtype, device=chunk.device)
        try:
            dist.all_to_all_single(received, chunk.repeat(world - 1), receive_splits, send_splits, group=self.group)
        except Exception as exc:  # a peer exited or stayed silent past the group's timeout
            raise ExpertParallelError(
                f"rank {me}: layer {self.layer}'s expert exchange broke "
                f"(another rank exited or timed out): {one_line(exc)}",
                agreed=False,
            ) from None
        pieces = list(received.split(receive_splits))
        pieces[me] = chunk
        failed = [r for r, piece in enumerate(pieces) if piece[-1].item() != 0]
        if failed:
            messages: list = [None] * world
            dist.all_gather_object(messages, failure, group=self.group)
            raise ExpertParallelError(
                f"rank {failed[0]} failed in layer {self.layer}'s routed experts: {messages[failed[0]]}"
            )
        pair_rows = torch.empty(n * k, dim, dtype=x.dtype, device=x.device)  # [n * k, dim]
        for rank, piece in enumerate(pieces):
            pair_rows[(owner == rank).to(x.device)] = piece[:-1].view(counts[rank], dim).to(x.device)
        element = chunk.element_size()
        self.counters.add(
            self.layer,
            len(pairs),
            sum(send_splits) * element,
            sum(receive_splits) * element,
            computed - began,
            time.perf_counter() - computed,
        )
        return combine_pairs(expert_ids, pair_rows)

    __call__ = forward
