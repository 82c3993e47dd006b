"""Where the forward reads what is not held as parameters: routed experts and Engram rows.

The model sees two protocols: an `ExpertStore` (`fetch(layer, expert_ids) -> FetchedExperts`, the
packed experts in the order asked with the call's cache hits and misses) and an `EngramTable`
(`gather(ids) -> (FP8 rows, E8M0 scales)`). The implementations:

- `ExpertCache`: experts read from the checkpoint on demand and kept packed (FP4 bytes and E8M0
  scales, never expanded) in a bounded LRU window per layer, counted in its `CacheCounters`;
- `DictExpertStore`: experts already in memory (tests, benchmarks);
- `OwnedExpertStore`: one rank's share under expert parallelism, refusing any other expert;
- `MappedEngramTable`: rows gathered from the mapped shard on each forward;
- `ResidentEngramTable` / `TensorEngramTable`: a table in memory (`load(resident_engram=True)`, tests).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from .checkpoint import Checkpoint
from .kernels.experts import PackedExpert, device_for

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
    """What RoutedExperts reads packed experts from (the loader's cache, or a dict in tests)."""

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> FetchedExperts: ...


class DictExpertStore:
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

    def begin_step(self, start_pos: int, seqlen: int) -> None:
        self.steps.append({"start_pos": start_pos, "seqlen": seqlen, "layers": {}})

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


class ExpertCache:
    """Routed experts read from the checkpoint on demand, with a bounded LRU window per layer.

    Experts are kept exactly as stored: packed FP4 weights (viewed as float4_e2m1fn_x2) and E8M0
    scales, about a quarter of their bf16 size; `capacity` experts per layer (0 keeps none).
    `device` is one device or a list (as resolved by `kernels.experts.expert_devices`), and each
    expert is placed by `kernels.experts.device_for`. Each requested expert counts as a hit or a miss
    for its layer and the current step, and `fetch` returns the call's own counts."""

    def __init__(self, checkpoint: Checkpoint, capacity: int = DEFAULT_EXPERT_CACHE, device="cpu",
                 n_layers: Optional[int] = None):
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
        self._lru.clear()


class OwnedExpertStore:
    """A store that refuses any expert this rank does not own: the one place the ownership rule
    is enforced, so a routing mistake is an error instead of a silent read of another rank's share.
    `ranks` is the group's `distributed.RankView`: `owns(expert)` is the rule and `refusal(layer,
    experts)` the error it raises."""

    def __init__(self, store, ranks: RankView):
        self.store, self.ranks = store, ranks

    def fetch(self, layer: int, expert_ids: Sequence[int]):
        foreign = [e for e in expert_ids if not self.ranks.owns(e)]
        if foreign:
            raise self.ranks.refusal(layer, foreign)
        return self.store.fetch(layer, expert_ids)

    def __getattr__(self, name):  # counters, clear, cached, nbytes: the wrapped cache's
        if name == "store":  # not set yet (a copy being built): no recursion through the lookup below
            raise AttributeError(name)
        return getattr(self.store, name)


# ---------------------------------------------------------------------- Engram tables
class EngramTable(Protocol):
    """Where an Engram layer's rows live: `gather(ids) -> (FP8 rows [..., D], E8M0 scales [..., D/32])`."""

    def gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TensorEngramTable:
    """An Engram table already in memory (resident, or a test's)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        self.weight, self.scale = weight, scale

    def gather(self, ids: torch.Tensor):
        return self.weight[ids], self.scale[ids]


class MappedEngramTable:
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
