"""Where the forward reads what is not held as parameters: routed experts and Engram rows.

The model sees two protocols: an `ExpertStore` (`fetch(layer, expert_ids) -> FetchedExperts`, the
packed experts in the order asked with the call's cache hits and misses) and an `EngramTable`
(`gather(ids) -> (FP8 rows, E8M0 scales)`). The implementations:

- `ExpertCache`: experts read from the checkpoint on demand and kept packed (FP4 bytes and E8M0
  scales, never expanded) in a bounded LRU window per layer, counted in its `CacheCounters`;
- `SlotCache`: the memory-budget form (`load(memory=...)`): one preallocated pool of expert-sized
  byte slots shared by every layer, misses read with positioned reads straight into their slots by
  a few threads at once (the pages dropped from the page cache after), the slots freed by an
  `eviction` rule; `stream` hands a call its hits first, so they are computed while the misses read;
- `DictExpertStore`: experts already in memory (tests, benchmarks);
- `OwnedExpertStore`: one rank's share under expert parallelism, refusing any other expert;
- `OnDiskEngramTable`: rows read from the shard (positioned reads) on each forward;
- `ResidentEngramTable` / `TensorEngramTable`: a table in memory (`load(resident_engram=True)`, tests).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol, Sequence

import torch
from torch import nn

from ..kernels.experts import PackedExpert, device_for
from .checkpoint import Checkpoint, LoadError
from .eviction import DEFAULT_HALF_LIFE, DEFAULT_POLICY, Residency

# Default number of packed experts a layer keeps between forwards.
DEFAULT_EXPERT_CACHE = 16


# ---------------------------------------------------------------------- routed experts
class FetchedExperts(list):
    """What one `fetch` returns: the packed experts in the order asked, plus how many of them this
    call found in the store's cache (`hits`) and had to read (`misses`)."""

    def __init__(self, experts: Sequence[PackedExpert] = (), hits: int = 0, misses: int = 0):
        super().__init__(experts)
        self.hits, self.misses = hits, misses


class ExpertStore(Protocol):
    """What RoutedExperts reads packed experts from: `fetch`, every expert of a call at once in the
    order asked; `stream`, the same experts in batches {id: expert} as they are ready (each batch
    computed before the next is asked for), the call's (hits, misses) in `last_counts` once it is
    drained, `ahead` (next layer, guessed ids) what a store may start reading early."""

    last_counts: tuple[int, int]
    read_ahead: bool

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> FetchedExperts: ...

    def stream(self, layer: int, expert_ids: Sequence[int], ahead: Optional[tuple] = None) -> Iterator[dict]: ...


class WholeFetchStore:
    """`stream` for a store that has every expert of a call at once: one batch, from its `fetch`
    (so a subclass that changes `fetch` changes both); `ahead` is not used."""

    last_counts: tuple[int, int] = (0, 0)
    read_ahead = False

    def stream(self, layer: int, expert_ids: Sequence[int], ahead: Optional[tuple] = None) -> Iterator[dict]:
        fetched = self.fetch(layer, expert_ids)
        self.last_counts = (fetched.hits, fetched.misses)
        yield dict(zip((int(e) for e in expert_ids), fetched))


class DictExpertStore(WholeFetchStore):
    """A store over experts already in memory: {(layer, expert): PackedExpert}; every fetch hits."""

    def __init__(self, experts: dict[tuple[int, int], PackedExpert]):
        self.experts = experts

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> FetchedExperts:
        return FetchedExperts([self.experts[(layer, e)] for e in expert_ids], hits=len(expert_ids))


@dataclass
class CacheCounters:
    """Expert-cache hits and misses: totals per layer, and per step (one forward call)."""

    hits: dict[int, int] = field(default_factory=dict)
    misses: dict[int, int] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)  # {'start_pos', 'seqlen', 'layers': {layer: [hits, misses]}}
    bytes_read: int = 0  # what the misses read from disk (a SlotCache counts it; per step under 'bytes')

    def begin_step(self, start_pos: int, seqlen: int) -> None:
        self.steps.append({"start_pos": start_pos, "seqlen": seqlen, "layers": {}})

    def add_bytes(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self.steps:
            self.steps[-1]["bytes"] = self.steps[-1].get("bytes", 0) + nbytes

    def count(self, layer: int, hit: bool) -> None:
        bucket = self.hits if hit else self.misses
        bucket[layer] = bucket.get(layer, 0) + 1
        if self.steps:
            per = self.steps[-1]["layers"].setdefault(layer, [0, 0])
            per[0 if hit else 1] += 1

    def totals(self, layer: int) -> tuple[int, int]:
        return self.hits.get(layer, 0), self.misses.get(layer, 0)

    def reset(self) -> None:
        self.hits.clear()
        self.misses.clear()
        self.steps.clear()
        self.bytes_read = 0


class ExpertCache(WholeFetchStore):
    """Routed experts read from the checkpoint on demand, with a bounded LRU window per layer.

    Experts are kept exactly as stored: packed FP4 weights (viewed as float4_e2m1fn_x2) and E8M0
    scales, about a quarter of their bf16 size; `capacity` experts per layer (0 keeps none).
    `device` is one device or a list (as resolved by `kernels.experts.expert_devices`), and each
    expert is placed by `kernels.experts.device_for`. Each requested expert counts as a hit or a miss
    for its layer and the current step, and `fetch` returns the call's own counts."""

    def __init__(
        self, checkpoint: Checkpoint, capacity: int = DEFAULT_EXPERT_CACHE, device="cpu", n_layers: Optional[int] = None
    ):
        if capacity < 0:
            raise ValueError(f"expert cache capacity must be >= 0, got {capacity}")
        specs = [device] if isinstance(device, (str, torch.device)) else list(device)
        if not specs:
            raise ValueError("the expert cache needs at least one device")
        self.checkpoint, self.capacity = checkpoint, int(capacity)
        self.n_layers = n_layers  # layers from n_layers on are the draft stages, stored as mtp.N
        self.devices = [torch.device(d) for d in specs]
        self.device = self.devices[0]
        self.counters = CacheCounters()
        self._lru: dict[int, OrderedDict] = {}

    def fetch(self, layer: int, expert_ids: Sequence[int]):
        """The packed experts `expert_ids` of `layer` (a `FetchedExperts`: a list, in the order
        asked, with this call's `hits` and `misses`)."""
        window = self._lru.setdefault(layer, OrderedDict())
        out = FetchedExperts()
        for e in expert_ids:
            packed = window.get(e)
            self.counters.count(layer, packed is not None)
            if packed is not None:
                out.hits += 1
                window.move_to_end(e)
            else:
                out.misses += 1
                packed = self._read(layer, e)
                if self.capacity:
                    window[e] = packed
                    while len(window) > self.capacity:
                        window.popitem(last=False)
            out.append(packed)
        return out

    def _read(self, layer: int, expert: int) -> PackedExpert:
        device = device_for(expert, self.devices)
        stage = layer - self.n_layers if self.n_layers is not None and layer >= self.n_layers else None
        prefix = f"layers.{layer}.ffn.experts.{expert}." if stage is None else f"mtp.{stage}.ffn.experts.{expert}."
        parts = []
        for w in ("w1", "w2", "w3"):
            weight, scale = self.checkpoint.read(prefix + w + ".weight"), self.checkpoint.read(prefix + w + ".scale")
            if weight.dtype in (torch.int8, torch.uint8):
                weight = weight.view(torch.float4_e2m1fn_x2)  # the stored bytes, two E2M1 values each
            parts += [weight.to(device), scale.to(device)]
        return PackedExpert(*parts)

    def cached(self, layer: int) -> list[int]:
        """Expert ids a layer currently holds, least recently used first."""
        return list(self._lru.get(layer, ()))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for window in self._lru.values() for p in window.values())

    def clear(self) -> None:
        """Start cold: drop every cached expert and zero the counters (what a sequence holds is
        not the store's, and stays)."""
        self._lru.clear()
        self.counters.reset()


# Misses are read in pieces of at most this many bytes, so even one expert keeps several reads in
# flight (the NVMe queue fills from a handful of threads).
READ_PIECE = 4 << 20
# A read ahead names at most slots // READ_AHEAD_SHARE experts: a decode step's guess (k per layer)
# fits many times over, a prefill's (most of a layer's experts) is left to the call itself.
READ_AHEAD_SHARE = 8
DEFAULT_IO_THREADS = 8
# "direct": O_DIRECT positioned reads straight into the slots, past the page cache (one copy of
# each byte, none kept by the system); "preadv": buffered positioned reads, the range then dropped
# from the page cache; "pread": the same through a bytes copy. "auto" is "direct" where the system
# has O_DIRECT, else "preadv".
READERS = ("direct", "preadv", "pread")
# O_DIRECT wants file offsets, lengths and memory aligned to the device's logical block: 4 KiB
# covers every common one.
DIRECT_ALIGN = 4096
# "auto" reads directly only where widening every range of an expert to DIRECT_ALIGN boundaries
# grows its slot by at most this share: the released experts (one 17.93 MiB range) by 0.04%, a
# miniature's 13 KiB experts in six ranges by several times, which a budget's slot count never priced.
DIRECT_SLACK = 0.01


@dataclass
class StreamStats:
    """What the misses cost: bytes read, pieces read, seconds some read was in flight (per call from
    the first submit to the last completion) and seconds the forward waited on them; experts read
    ahead on a guess (`SlotCache.read_ahead`), and how many of them the next call used."""

    bytes_read: int = 0
    reads: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    read_ahead: int = 0
    read_ahead_used: int = 0

    def as_dict(self) -> dict:
        return dict(
            bytes_read=self.bytes_read,
            reads=self.reads,
            read_seconds=self.read_seconds,
            wait_seconds=self.wait_seconds,
            read_ahead=self.read_ahead,
            read_ahead_used=self.read_ahead_used,
        )


class _Layout(list):
    """One expert's six tensors in its shard: [(shard, file offset, nbytes, dtype, shape)] in
    PackedExpert order, and the byte ranges to read ([(shard, file offset, nbytes, slot offset)],
    adjacent tensors joined). For a direct read: `spans` [(shard, file offset, nbytes, slot offset,
    bytes that matter)], each range widened to DIRECT_ALIGN boundaries and laid end to end in the
    slot (so each starts aligned), and `direct_at` each tensor's byte in the slot they fill. In the
    release layout an expert's six tensors are one range, so one span, a few KiB wider than it."""

    def __init__(self, parts):
        super().__init__(parts)
        self.ranges, at = [], 0
        for shard, offset, nbytes, _, _ in parts:
            last = self.ranges[-1] if self.ranges else None
            if last is not None and last[0] == shard and last[1] + last[2] == offset:
                self.ranges[-1] = (shard, last[1], last[2] + nbytes, last[3])
            else:
                self.ranges.append((shard, offset, nbytes, at))
            at += nbytes
        self.nbytes = at
        self.spans, self.direct_at, slot_at = [], [0] * len(parts), 0
        for shard, offset, nbytes, _ in self.ranges:
            lead = offset % DIRECT_ALIGN
            span = -(-(lead + nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN
            self.spans.append((shard, offset - lead, span, slot_at, lead + nbytes))
            for i, (part_shard, part_offset, _, _, _) in enumerate(parts):
                if part_shard == shard and offset <= part_offset < offset + nbytes:
                    self.direct_at[i] = slot_at + lead + part_offset - offset
            slot_at += span


class SlotCache:
    """Routed experts in a fixed pool of `slots` byte slots, each one packed expert's size, shared by
    every layer (`load(memory=...)` sizes it from the budget; `budget.plan_budget`).

    A miss is read with positioned reads straight from its shard into its slot, in pieces of
    READ_PIECE bytes on `io_threads` threads, all the misses of a call at once. `reader` (READERS):
    "direct" opens the shards with O_DIRECT and reads each expert's aligned span (`_Layout.direct`)
    into its slot, which starts on a DIRECT_ALIGN boundary, past the page cache; "preadv" (or
    "pread" and a copy) reads through the page cache and drops each piece from it after
    (`posix_fadvise(DONTNEED)`, `drop_pages`: "auto" where the system has it, False to keep the
    pages); "auto" (the default) is "direct" where the system has O_DIRECT and the experts are large
    enough that widening them costs at most DIRECT_SLACK of a slot. Either way the slot is the only
    copy; `page_cache` says how. A shard the file system will not open for direct reads,
    or an expert whose tensors are not adjacent, is read the buffered way, and `page_cache` says so.
    On this project's machine direct reads measured faster both from a virtual disk (1.6-1.9 against
    0.8-1.3 GB/s) and from a sparse file's holes (17-19 against 2.2 GB/s: no page zeroing and copy).
    Which slot a miss takes is `eviction.Residency`'s choice under `policy` ("lru" or "decay",
    `half_life` in tokens). The experts handed out are views of the slots (FP4 bytes as
    float4_e2m1fn_x2, scales as E8M0): the arithmetic is the same as `ExpertCache`'s. Counts go to
    `counters` (hits, misses, bytes per step) and the read timing to `stats`. Host memory only.

    `read_ahead` (off by default; `load(read_ahead=True)`): a call may name the experts the next
    layer will probably want (`stream(..., ahead=(layer, ids))`, the next layer's router applied to
    this layer's input); those not held start reading once this call's own misses are queued, so
    they arrive while this layer computes. Only which slots fill and when changes, never the
    arithmetic; an expert read ahead counts as a miss of the call that uses it (it was not held
    before), and a wrong guess costs its read and a slot. A guess larger than
    `slots // READ_AHEAD_SHARE` is not read ahead (`RoutedExperts` guesses on one-token calls only)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        slots: int,
        *,
        policy: str = DEFAULT_POLICY,
        half_life: float = DEFAULT_HALF_LIFE,
        n_layers: Optional[int] = None,
        io_threads: int = DEFAULT_IO_THREADS,
        reader: str = "auto",
        drop_pages="auto",
        read_ahead: bool = False,
    ):
        if reader not in READERS + ("auto",):
            raise ValueError(f"reader must be auto or one of {', '.join(READERS)}, got {reader!r}")
        asked = reader
        if reader in ("auto", "direct"):
            reader = "direct" if hasattr(os, "O_DIRECT") and hasattr(os, "preadv") else "preadv"
        if reader == "preadv" and not hasattr(os, "preadv"):
            reader = "pread"
        self.checkpoint, self.n_layers = checkpoint, n_layers
        self.residency = Residency(int(slots), policy, half_life)
        self.capacity = self.slots = int(slots)
        self.policy, self.half_life, self.reader = policy, half_life, reader
        self.devices = [torch.device("cpu")]
        self.device = self.devices[0]
        self.counters = CacheCounters()
        self.stats = StreamStats()
        can_drop = hasattr(os, "posix_fadvise")
        self.drop_pages = can_drop if drop_pages == "auto" else bool(drop_pages) and can_drop
        buffered = (
            "each read range dropped from the page cache (posix_fadvise DONTNEED)"
            if self.drop_pages
            else "page cache left as the system keeps it (no posix_fadvise here, or asked not to)"
        )
        self.page_cache = "read past the page cache (O_DIRECT)" if reader == "direct" else buffered
        self._buffered_shards: set = set()  # shards the file system would not read directly
        self._first_refusal: Optional[str] = None
        self._layouts: dict = {}
        self.slot_bytes = self._layout(0, 0).nbytes
        # a direct read fills aligned spans: a slot holds them whatever the experts' offsets (each
        # tensor its own span at worst), and starts on an aligned boundary
        widest = sum(
            -(-(nbytes + DIRECT_ALIGN - 1) // DIRECT_ALIGN) * DIRECT_ALIGN for _, _, nbytes, _, _ in self._layout(0, 0)
        )
        if asked == "auto" and reader == "direct" and widest > self.slot_bytes * (1 + DIRECT_SLACK):
            # small experts in many pieces (a miniature's): the widening would outgrow the budget
            reader = self.reader = "preadv"
            self.page_cache = f"{buffered}; experts of {self.slot_bytes:,} bytes are too small for direct reads"
        self._stride = widest if reader == "direct" else self.slot_bytes
        try:  # pages fault in as slots fill
            flat = torch.empty(self.slots * self._stride + DIRECT_ALIGN, dtype=torch.uint8)
        except (RuntimeError, MemoryError):  # the allocator refused the whole pool at once
            raise LoadError(
                f"could not reserve {self.slots * self._stride:,} bytes for {self.slots:,} expert "
                f"slots of {self.slot_bytes:,} bytes: the system refused that much memory; give a "
                f"smaller memory budget"
            ) from None
        skip = -flat.data_ptr() % DIRECT_ALIGN
        self._pool = flat[skip : skip + self.slots * self._stride].view(self.slots, self._stride)
        self._pool_np = self._pool.numpy()
        self._views: dict = {}  # slot -> (key, PackedExpert)
        self._direct_slots: set = set()  # slots last filled by a direct read (see _Layout.direct_at)
        self._fds: dict = {}  # (shard, direct) -> descriptor
        self.io_threads = max(1, int(io_threads))
        self._io = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="dsv41-read")
        self._lock = threading.Lock()
        self._step, self._tick = None, 0
        self.last_counts, self._overflow = (0, 0), False
        self.read_ahead = bool(read_ahead)
        self._pending: dict = {}  # slot -> its read ahead still in flight (futures, began, bytes)
        self._ahead: set = set()  # keys read ahead that no call has asked for yet

    def set_io_threads(self, n: int) -> None:
        """Read with `n` threads from now on (the reads in flight at once)."""
        self._io.shutdown(wait=True)
        self.io_threads = max(1, int(n))
        self._io = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="dsv41-read")

    # -- layout and reads
    def _layout(self, layer: int, expert: int) -> _Layout:
        key = (layer, expert)
        got = self._layouts.get(key)
        if got is None:
            stage = layer - self.n_layers if self.n_layers is not None and layer >= self.n_layers else None
            prefix = f"layers.{layer}.ffn.experts.{expert}." if stage is None else f"mtp.{stage}.ffn.experts.{expert}."
            parts = []
            for w in ("w1", "w2", "w3"):
                for leaf, dtype in (("weight", torch.float4_e2m1fn_x2), ("scale", torch.float8_e8m0fnu)):
                    name = prefix + w + "." + leaf
                    if name not in self.checkpoint:
                        raise LoadError(f"{self.checkpoint.path}: no tensor {name} for the expert cache to read")
                    shard, entry, start = self.checkpoint.entries[name]
                    parts.append((shard, start + entry.begin, entry.nbytes, dtype, entry.shape))
            got = self._layouts[key] = _Layout(parts)
            if self._layouts and len(self._layouts) > 1 and got.nbytes != self.slot_bytes:
                raise LoadError(
                    f"{self.checkpoint.path}: expert {expert} of layer {layer} holds {got.nbytes:,} bytes, "
                    f"not the {self.slot_bytes:,} of a slot; one pool needs experts of one size"
                )
        return got

    def _fd(self, shard: str, direct: bool = False) -> int:
        key = (shard, direct)
        fd = self._fds.get(key)
        if fd is None:
            with self._lock:
                fd = self._fds.get(key)
                if fd is None:
                    fd = self._fds[key] = os.open(shard, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        return fd

    def _direct(self, layout: _Layout) -> bool:
        """Whether this expert is read directly: the reader is, and its shards open for direct
        reads (the first refusal is remembered and said in `page_cache`)."""
        if self.reader != "direct":
            return False
        for shard in {span[0] for span in layout.spans}:
            if shard in self._buffered_shards:
                return False
            try:
                self._fd(shard, direct=True)
            except OSError as exc:  # EINVAL: a file system without O_DIRECT (tmpfs, some overlays)
                self._refused(shard, f"would not open that way ({exc.strerror or exc})")
                return False
        return True

    def _refused(self, shard: str, why: str) -> None:
        """Read `shard` buffered from now on; `page_cache` names the first such shard and counts them."""
        self._buffered_shards.add(shard)
        if self._first_refusal is None:
            self._first_refusal = f"{shard} {why}"
        n = len(self._buffered_shards)
        self.page_cache = (
            f"read past the page cache (O_DIRECT) where the file system allows; {n} shard{'s' if n > 1 else ''} "
            f"read buffered, each range then dropped ({self._first_refusal})"
        )

    def _read_direct(self, shard: str, offset: int, slot: int, at: int, nbytes: int, need: int) -> float:
        """An aligned piece of a direct read: bytes [offset, offset + nbytes) of `shard` into slot
        `slot` at byte `at`; the file may end inside the piece, past the `need` bytes that matter."""
        fd, view = self._fd(shard, direct=True), memoryview(self._pool_np[slot, at : at + nbytes])
        got = 0
        while got < need:
            try:
                n = os.preadv(fd, [view[got:]], offset + got)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise LoadError(
                        f"{shard}: reading a routed expert at byte {offset + got:,} failed: {exc}"
                    ) from None
                self._refused(shard, f"opened for direct reads but refused one ({exc.strerror or exc})")
                return self._read_piece(shard, offset + got, slot, at + got, need - got)
            if n == 0:
                raise LoadError(
                    f"{shard}: ended at byte {offset + got:,} inside a routed expert; the shard is "
                    "truncated, download it again"
                )
            if n % DIRECT_ALIGN and got + n < need:  # a short read off the block grid: go on buffered
                return self._read_piece(shard, offset + got, slot, at + got, need - got)
            got += n
        return time.perf_counter()

    def _read_piece(self, shard: str, offset: int, slot: int, at: int, nbytes: int) -> float:
        """Read bytes [offset, offset + nbytes) of `shard` into slot `slot` at byte `at`; returns when it ended."""
        fd, view = self._fd(shard), memoryview(self._pool_np[slot, at : at + nbytes])
        got = 0
        while got < nbytes:
            try:
                if self.reader != "pread":
                    n = os.preadv(fd, [view[got:]], offset + got)
                else:
                    data = os.pread(fd, nbytes - got, offset + got)
                    n = len(data)
                    view[got : got + n] = data
            except OSError as exc:
                raise LoadError(f"{shard}: reading a routed expert at byte {offset + got:,} failed: {exc}") from None
            if n == 0:
                raise LoadError(
                    f"{shard}: ended at byte {offset + got:,} inside a routed expert; the shard is "
                    "truncated, download it again"
                )
            got += n
        if self.drop_pages:
            try:
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
            except OSError:
                self.drop_pages = False
                self.page_cache = "page cache left as the system keeps it (posix_fadvise refused here)"
        return time.perf_counter()

    def _submit(self, misses) -> tuple:
        """Start reading every (key, slot) of `misses`: (futures, when the first was submitted, bytes)."""
        futures, began, total = [], time.perf_counter(), 0
        for (layer, expert), slot in misses:
            self._settle(slot)  # a slot read ahead on a wrong guess: its read ends before another starts
            self._views.pop(slot, None)
            layout = self._layout(layer, expert)
            if self._direct(layout):
                for shard, offset, span, slot_at, need in layout.spans:  # need: the bytes up to the range's end
                    for piece in range(0, span, READ_PIECE):
                        size, wanted = min(READ_PIECE, span - piece), min(READ_PIECE, need - piece)
                        if wanted > 0:
                            futures.append(
                                self._io.submit(
                                    self._read_direct, shard, offset + piece, slot, slot_at + piece, size, wanted
                                )
                            )
                total += layout.nbytes
                self._direct_slots.add(slot)
                continue
            self._direct_slots.discard(slot)
            for shard, offset, nbytes, at in layout.ranges:
                for piece in range(0, nbytes, READ_PIECE):
                    size = min(READ_PIECE, nbytes - piece)
                    futures.append(self._io.submit(self._read_piece, shard, offset + piece, slot, at + piece, size))
                    total += size
        self.stats.bytes_read += total
        self.stats.reads += len(futures)
        self.counters.add_bytes(total)
        return futures, began, total

    def _wait(self, pending) -> None:
        futures, began, total = pending
        if not futures:
            return
        waited = time.perf_counter()
        ended = max(f.result() for f in futures)  # a failed read raises here
        now = time.perf_counter()
        self.stats.wait_seconds += now - waited
        self.stats.read_seconds += ended - began

    def _settle(self, slot: int) -> None:
        """Wait for a read ahead into `slot`, if one is in flight (its time is waiting time)."""
        pending = self._pending.pop(slot, None)
        if pending is not None:
            self._wait(pending)

    def _read_ahead(self, layer: int, expert_ids: Sequence[int], keep) -> None:
        """Start reading the experts `expert_ids` of `layer` that the pool does not hold, into slots
        no key of `keep` (the running call's) occupies."""
        keys = [(layer, int(e)) for e in expert_ids if (layer, int(e)) not in self.residency.slot_of]
        if not keys or len(keys) > max(1, self.slots // READ_AHEAD_SHARE) or len(keys) + len(keep) > self.slots:
            return
        for key, slot in self.residency.plan(keys, self._tick, keep=keep).misses:
            self._pending[slot] = self._submit([(key, slot)])
            self._ahead.add(key)
            self.stats.read_ahead += 1

    def _expert(self, key, slot: int) -> PackedExpert:
        self._settle(slot)
        held = self._views.get(slot)
        if held is not None and held[0] == key:
            return held[1]
        layout, row, parts, at = self._layout(*key), self._pool[slot], [], 0
        for i, (_, _, nbytes, dtype, shape) in enumerate(layout):
            if slot in self._direct_slots:  # the slot holds the shard's stretch as it lies in the file
                at = layout.direct_at[i]
            parts.append(row[at : at + nbytes].view(dtype).view(shape))  # the slot's bytes, as stored
            at += nbytes
        packed = PackedExpert(*parts)
        self._views[slot] = (key, packed)
        return packed

    # -- the store
    def stream(self, layer: int, expert_ids: Sequence[int], ahead: Optional[tuple] = None) -> Iterator[dict]:
        """The packed experts `expert_ids` of `layer` in batches {id: PackedExpert}: first those held
        (their misses already reading), then the misses. A batch stays valid until the next is asked
        for, so the caller computes each before it takes the next. Counts go to `counters`.
        `ahead`: (next layer, its guessed expert ids), read ahead (see the class) when `read_ahead`."""
        step = self.counters.steps[-1] if self.counters.steps else None
        if step is not self._step:  # a new forward call: one tick of the decay clock
            self._step, self._tick = step, self._tick + 1
        keys = [(layer, int(e)) for e in expert_ids]
        plan = self.residency.plan(keys, self._tick)
        read_ahead_hits = [key for key, _ in plan.hits if key in self._ahead]
        self._ahead.difference_update([key for key in self._ahead if key[0] == layer])  # used, or guessed wrong
        self.stats.read_ahead_used += len(read_ahead_hits)
        for key, _ in plan.hits:
            self.counters.count(layer, key not in read_ahead_hits)
        for _key, _ in plan.misses:
            self.counters.count(layer, False)
        n_held = len(plan.hits) - len(read_ahead_hits)
        self.last_counts, self._overflow = (n_held, len(plan.misses) + len(read_ahead_hits)), bool(plan.chunk)
        if not plan.chunk:
            pending = self._submit(plan.misses)
            if ahead is not None and self.read_ahead:
                self._read_ahead(*ahead, keep=keys)
            hits = {key[1]: self._expert(key, slot) for key, slot in plan.hits}  # a read ahead ends first
            if hits:
                yield hits
            self._wait(pending)
            if plan.misses:
                yield {key[1]: self._expert(key, slot) for key, slot in plan.misses}
            return
        hits = {key[1]: self._expert(key, slot) for key, slot in plan.hits}
        if hits:  # an overflow call: its hits may give up their slots once computed
            yield hits
        chunks = [plan.misses[i : i + plan.chunk] for i in range(0, len(plan.misses), plan.chunk)]
        pending = self._submit(chunks[0])
        for i, chunk in enumerate(chunks):
            self._wait(pending)
            if plan.buffers == 2 and i + 1 < len(chunks):
                pending = self._submit(chunks[i + 1])  # read the next chunk while this one is computed
            yield {key[1]: self._expert(key, slot) for key, slot in chunk}
            if plan.buffers == 1 and i + 1 < len(chunks):
                pending = self._submit(chunks[i + 1])

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> FetchedExperts:
        """The packed experts `expert_ids` of `layer`, in the order asked (views of the slots, valid
        until the next fetch; a call larger than the pool gets copies)."""
        got: dict = {}
        for batch in self.stream(layer, expert_ids):
            if self._overflow:  # a later batch reuses earlier batches' slots
                batch = {e: PackedExpert(*(t.clone() for t in p)) for e, p in batch.items()}
            got.update(batch)
        hits, misses = self.last_counts
        return FetchedExperts([got[int(e)] for e in expert_ids], hits=hits, misses=misses)

    def cached(self, layer: int) -> list[int]:
        """Expert ids of `layer` the pool holds now, ascending."""
        return sorted(e for (lay, e) in self.residency.slot_of if lay == layer)

    @property
    def nbytes(self) -> int:
        return len(self.residency.slot_of) * self.slot_bytes

    @property
    def pool_bytes(self) -> int:  # a direct reader's slots hold an aligned span: a few KiB more each
        return self.slots * self._stride

    def clear(self) -> None:
        """Start cold, as `ExpertCache.clear`: every slot free, the counters zeroed."""
        for slot in list(self._pending):
            self._settle(slot)
        self._ahead.clear()
        self.residency.clear()
        self._views.clear()
        self.counters.reset()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._pending.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the descriptors go with the process
            pass


class ExpertOwnership(Protocol):
    """What `OwnedExpertStore` asks of the group (`distributed.RankView`, described here rather than
    imported: storage sits below the model layer): `owns(expert)` is the rule and `refusal(layer,
    experts)` the error it raises."""

    def owns(self, expert: int) -> bool: ...

    def refusal(self, layer: int, foreign: Sequence[int]) -> Exception: ...


class OwnedExpertStore(WholeFetchStore):
    """A store that refuses any expert this rank does not own: the one place the ownership rule
    is enforced, so a routing mistake is an error instead of a silent read of another rank's share.
    `ranks` is the group's `distributed.RankView`: `owns(expert)` is the rule and `refusal(layer,
    experts)` the error it raises."""

    def __init__(self, store, ranks: ExpertOwnership):
        self.store, self.ranks = store, ranks

    def fetch(self, layer: int, expert_ids: Sequence[int]):
        foreign = [e for e in expert_ids if not self.ranks.owns(e)]
        if foreign:
            raise self.ranks.refusal(layer, foreign)
        return self.store.fetch(layer, expert_ids)

    def __getattr__(self, name):  # counters, clear, cached, nbytes: the wrapped cache's
        if name in ("store", "stream"):  # store: not set yet (a copy being built), no recursion through the
            raise AttributeError(name)  # lookup below; stream: every read goes through fetch's ownership check
        return getattr(self.store, name)


# ---------------------------------------------------------------------- Engram tables
class EngramTable(Protocol):
    """Where an Engram layer's rows live: `gather(ids) -> (FP8 rows [..., D], E8M0 scales [..., D/32])`
    (a `MasterEngramTable` gives float32 values and None)."""

    def gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TensorEngramTable:
    """An Engram table already in memory (resident, or a test's)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        self.weight, self.scale = weight, scale

    def gather(self, ids: torch.Tensor):
        return self.weight[ids], self.scale[ids]


class MasterEngramTable(nn.Module):
    """An Engram table of float32 master rows (training): `weight` [V, D], named as the checkpoint
    names the table, filled for each call by `dsv41.train.masters.holding`; gathers values, so
    there is no scale to decode."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim), requires_grad=False)

    def gather(self, ids: torch.Tensor):
        return self.weight[ids], None


class OnDiskEngramTable:
    """An Engram table left in its shard: each gather reads only the rows asked for."""

    def __init__(self, checkpoint: Checkpoint, layer: int):
        self.checkpoint = checkpoint
        self.weight_name = f"layers.{layer}.engram.embed.weight"
        self.scale_name = f"layers.{layer}.engram.embed.scale"
        self.rows_read = 0

    def gather(self, ids: torch.Tensor):
        idx = ids.detach().cpu().numpy()
        self.rows_read += idx.size
        return self.checkpoint.rows(self.weight_name, idx), self.checkpoint.rows(self.scale_name, idx)


class ResidentEngramTable:
    """An Engram table copied into RAM once (`resident_engram=True`); gathers are plain indexing."""

    def __init__(self, checkpoint: Checkpoint, layer: int):
        self.weight = checkpoint.read(f"layers.{layer}.engram.embed.weight")
        self.scale = checkpoint.read(f"layers.{layer}.engram.embed.scale")
        self.rows_read = 0

    def gather(self, ids: torch.Tensor):
        ids = ids.to(torch.long).cpu()
        self.rows_read += ids.numel()
        return self.weight[ids], self.scale[ids]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes
