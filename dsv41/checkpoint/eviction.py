"""Which cached expert gives up its slot: the online eviction rules and the one bookkeeping of a
slot pool (`Residency`), shared by the running cache (`stores.SlotCache`) and the policy lab
(`cache_policy`), so a replay of a trace and a run of the model make the same choices.

Keys are any hashable (the running cache uses (layer, expert)); time is a tick the caller
advances once per forward call, so a decode token is one tick. The rules:

- lru: evict the least recently used;
- decay: frequency with exponential decay: each use adds 1 to a score that halves every
  `half_life` ticks; evict the lowest score, the least recently used among equals. Scores outlive
  evictions (a returning expert keeps its history, decayed).

A `Residency` call plan (`plan`) never evicts an expert the call itself still needs. A call whose
distinct experts do not fit the pool (a long prefill) is an overflow call: its hits are computed
first and may then be evicted, and its misses are read in chunks of half the pool, each chunk into
slots the chunk before last no longer needs, so one chunk is read while the other is computed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

from ..core.errors import Dsv41Error

EXPERT_POLICIES = ("lru", "decay")
DEFAULT_POLICY = "decay"
DEFAULT_HALF_LIFE = 64  # ticks (decode tokens)


class PolicyError(Dsv41Error, ValueError):
    """An eviction policy, half-life or pool size this module cannot run."""


def _check(policy: str, half_life: float) -> None:
    if policy not in EXPERT_POLICIES:
        raise PolicyError(f"expert policy must be one of {', '.join(EXPERT_POLICIES)}, got {policy!r}")
    if not (isinstance(half_life, (int, float)) and math.isfinite(half_life) and half_life > 0):
        raise PolicyError(f"the decay half-life must be a positive number of tokens, got {half_life!r}")


class LruRule:
    """Least recently used: an ordered record of the keys held, oldest first."""

    def __init__(self):
        self._order: OrderedDict = OrderedDict()

    def used(self, key: Hashable, tick: int) -> None:
        self._order[key] = tick
        self._order.move_to_end(key)

    def victim(self, held: Iterable[Hashable], exclude) -> Optional[Hashable]:
        for key in self._order:  # a key of this call not yet given a slot is used but not held
            if key in held and key not in exclude:
                return key
        return None

    def forget(self, key: Hashable) -> None:
        self._order.pop(key, None)


class DecayRule:
    """Frequency with exponential decay. A score s used last at tick t is kept as its anchor
    log2(s) + t / half_life: at any one tick the decayed scores of all keys compare as their
    anchors do, so nothing is rescaled as time passes."""

    def __init__(self, half_life: float = DEFAULT_HALF_LIFE):
        self.half_life = float(half_life)
        self._anchor: dict = {}
        self._last: dict = {}

    def used(self, key: Hashable, tick: int) -> None:
        now = tick / self.half_life
        old = self._anchor.get(key)
        decayed = 0.0 if old is None else 2.0 ** (old - now)  # the score at this tick
        self._anchor[key] = math.log2(decayed + 1.0) + now
        self._last[key] = tick

    def victim(self, held: Iterable[Hashable], exclude) -> Optional[Hashable]:
        best, best_key = None, None
        for key in held:
            if key in exclude:
                continue
            rank = (self._anchor[key], self._last[key])
            if best is None or rank < best:
                best, best_key = rank, key
        return best_key

    def forget(self, key: Hashable) -> None:
        pass  # the history outlives the eviction


def make_rule(policy: str, half_life: float = DEFAULT_HALF_LIFE):
    _check(policy, half_life)
    return LruRule() if policy == "lru" else DecayRule(half_life)


@dataclass
class CallPlan:
    """What one call does to the pool: `hits` [(key, slot)], `misses` [(key, slot)] in read order,
    and for an overflow call (`chunk` > 0) the chunk size its misses are read in and how many
    chunks may be in use at once (`buffers`: 2, one read while one is computed; 1 in a pool of one)."""

    hits: list = field(default_factory=list)
    misses: list = field(default_factory=list)
    chunk: int = 0
    buffers: int = 2


class Residency:
    """A pool of `capacity` slots and the rule that frees them: `plan(keys, tick)` says which keys
    hit, which miss and which slot each miss is read into, and updates the pool as if the call ran."""

    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY, half_life: float = DEFAULT_HALF_LIFE):
        if not isinstance(capacity, int) or capacity < 1:
            raise PolicyError(f"a slot pool needs at least one slot, got {capacity!r}")
        self.capacity, self.policy = capacity, policy
        self.rule = make_rule(policy, half_life)
        self.slot_of: dict = {}  # key -> slot
        # The free slots are those never used yet, [_unused, capacity), handed out in order: a slot
        # is only freed by its eviction, which gives it straight to the key that evicted it. A
        # counter, not a list, so a pool of millions of slots (a large budget) costs nothing here.
        self._unused = 0

    def plan(self, keys: Sequence[Hashable], tick: int, keep: Iterable[Hashable] = ()) -> CallPlan:
        """`keep`: keys another call still computes on, never chosen as victims (a read ahead
        planned while the current call runs)."""
        out = CallPlan()
        keep = set(keep)
        missed = []
        for key in keys:
            slot = self.slot_of.get(key)
            self.rule.used(key, tick)
            if slot is None:
                missed.append(key)
            else:
                out.hits.append((key, slot))
        if len(out.hits) + len(missed) > self.capacity:
            out.chunk, out.buffers = (self.capacity // 2, 2) if self.capacity >= 2 else (1, 1)
        for j, key in enumerate(missed):
            if out.chunk:  # the hits are computed first; then only the chunks in flight are in use
                first = (j // out.chunk - out.buffers + 1) * out.chunk
                busy = {k for k, _ in out.misses[max(0, first) :]}
            else:  # every key of the call is in use until the call is computed
                busy = set(keys) | keep
            slot = self._take(busy)
            self.slot_of[key] = slot
            out.misses.append((key, slot))
        return out

    def _take(self, busy) -> int:
        if self._unused < self.capacity:
            self._unused += 1
            return self._unused - 1
        victim = self.rule.victim(self.slot_of, busy)
        if victim is None:  # cannot happen with the chunking above; a plain message if it does
            raise PolicyError("every slot holds an expert this call still needs")
        self.rule.forget(victim)
        return self.slot_of.pop(victim)

    def clear(self) -> None:
        self.slot_of.clear()
        self._unused = 0
        self.rule = make_rule(self.policy, getattr(self.rule, "half_life", DEFAULT_HALF_LIFE))


def replay_calls(
    calls: Iterable[tuple[int, Sequence[Hashable]]],
    capacity: int,
    policy: str = DEFAULT_POLICY,
    half_life: float = DEFAULT_HALF_LIFE,
) -> list[list[int]]:
    """[hits, misses] per call for `calls` [(tick, keys)] through one `Residency`: exactly what the
    running cache counts on the same lookups."""
    pool = Residency(capacity, policy, half_life)
    out = []
    for tick, keys in calls:
        p = pool.plan(keys, tick)
        out.append([len(p.hits), len(p.misses)])
    return out
