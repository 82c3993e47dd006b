"""Expert-cache policy lab: a trace's recorded routing replayed through LRU, LFU, a static top-N and
Belady's optimum, at every cache size at once, with the disk bytes each size would read.

Offloaded experts are how this model runs on small hardware: each MoE layer keeps a few packed
experts and reads the rest from disk. The loader's `ExpertCache.fetch` looks up, on every forward
call and layer, the *distinct* experts the call's tokens chose, in ascending id order; each lookup
hits or misses. Everything here works on those lookups alone (no model, no weights), so one
traced run, saved with `GenerationTrace.save`, answers "what would another policy or another
cache size have done" on any machine:

- `routing_calls(source)`    per MoE layer, per forward call: start position, tokens, the lookups
                             (distinct ids, ascending), tokens per chosen expert, the recorded counts;
- `replay(policy, lookups, capacity)`  hit / miss per lookup through one cache (a direct simulation);
- `hit_depths(policy, lookups)`  one pass for every size: lookup i hits at capacity c exactly when
                             depth[i] <= c (None: a miss at every size). LRU, LFU and Belady are stack
                             algorithms (Mattson et al., 1970) and come from one priority stack;
                             static is its fixed ranking;
- `policy_data(source)`      hit rate vs capacity per policy, overall and per layer, and the disk
                             bytes per token at each capacity (what `dsv41.widgets.policy` plots);
- `pool_hit_rates(steps, capacity)`  one pool shared by every layer through LRU, decay (the
                             running `SlotCache`'s own `eviction.Residency`) and Belady;
- `expert_bytes(cfg)`        the stored bytes of one routed expert, from the tensor inventory: what
                             one miss reads (18,800,640 bytes, 17.93 MiB, on the release);
- `cli_main(argv)`           `dsv41 replay TRACE --capacity 4,8,16,32 [--policy ...] [--json OUT]`.

The policies, all starting cold and reading an expert on every miss:

- lru: evict the least recently used (what `ExpertCache` does: its counters are reproduced exactly;
  the rule is `eviction.LruRule`, the running `SlotCache`'s too);
- lfu: evict the least frequently looked-up so far (counts kept across evictions), the least
  recent among equals;
- static: a fixed top-N per layer, ranked by how many tokens chose each expert in a warm-up (the
  first calls of the trace, by default its prefill, or a second trace); a ranked expert is kept from
  its first read on, any other is read and dropped;
- belady: evict the expert used again farthest in the future (it knows the future): no policy that
  reads on demand misses less, so it bounds the others at every size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Iterable, NamedTuple, Optional, Sequence

from ..checkpoint.eviction import LruRule, replay_calls
from ..core.config import Config
from ..core.config_fields import VALUE_BOUNDS

POLICIES = ("lru", "lfu", "static", "belady")
# the most routed experts a layer of any config may have: what a replay sizes its per-expert tables by
MAX_EXPERTS = VALUE_BOUNDS["n_routed_experts"][1]
POLICY_NAMES = {"lru": "LRU", "lfu": "LFU", "static": "static top-N", "belady": "Belady (optimal)"}
MIB = 1 << 20


# ---------------------------------------------------------------------- what a miss reads
def expert_tensors(cfg: Optional[Config] = None, layer: int = 0, expert: int = 0) -> list:
    """The inventory's tensors of one routed expert (`TensorSpec`s: w1, w2, w3 and their scales),
    on `cfg` (default: the released config)."""
    from ..checkpoint.inventory import expected_tensors
    from ..core.config import RELEASED

    cfg = RELEASED if cfg is None else cfg
    prefix = f"layers.{layer}.ffn.experts.{expert}."
    try:
        specs = [s for s in expected_tensors(cfg) if s.name.startswith(prefix)]
    except ValueError:
        # a preset that leaves the Engram row counts to the writer (TINY): the inventory's own rule
        # for one routed expert, which needs none of them
        from ..checkpoint.inventory import _Builder

        builder = _Builder(cfg)
        builder.expert(prefix.rstrip("."), "fp4")
        specs = builder.out
    if not specs:
        raise ValueError(
            f"the inventory of {cfg.source or 'this config'} has no routed expert {expert} in layer {layer}"
        )
    return specs


def expert_bytes(cfg: Optional[Config] = None) -> int:
    """Bytes one routed-expert miss reads from disk: the three packed matrices and their scales as
    the checkpoint stores them (default: the released geometry, 18,800,640 bytes = 17.93 MiB)."""
    return sum(s.nbytes for s in expert_tensors(cfg))


def geometry(cfg: Optional[Config] = None) -> dict:
    """The numbers `expert_bytes` comes from, for a sidecar: dim, moe_inter_dim, per tensor its
    dtype, shape and bytes."""
    from ..core.config import RELEASED

    cfg = RELEASED if cfg is None else cfg
    specs = expert_tensors(cfg)
    return {
        "dim": cfg.dim,
        "moe_inter_dim": cfg.moe_inter_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "n_layers": cfg.n_layers,
        "expert_dtype": cfg.expert_dtype,
        "tensors": [
            {"name": s.name.split("experts.0.", 1)[1], "dtype": s.dtype, "shape": list(s.shape), "bytes": s.nbytes}
            for s in specs
        ],
        "bytes_per_expert": sum(s.nbytes for s in specs),
    }


# ---------------------------------------------------------------------- routing -> lookups
class Call(NamedTuple):
    """One MoE layer's part of one forward call, as the expert cache saw it."""

    start_pos: int
    seqlen: int  # tokens in the call
    lookups: tuple  # distinct expert ids the tokens chose, ascending: what ExpertCache.fetch looks up
    choices: dict  # expert id -> how many tokens (all batch rows) chose it
    hits: int = 0  # what the run's cache recorded for this call
    misses: int = 0

    @property
    def decode(self) -> bool:
        return self.start_pos > 0


def call_lookups(expert_ids) -> list[int]:
    """The lookups one forward call makes in one layer: the distinct chosen ids, ascending (nested
    lists or a tensor of any shape)."""
    flat = expert_ids.flatten().tolist() if hasattr(expert_ids, "flatten") else _flatten(expert_ids)
    return sorted({int(e) for e in flat})


def _flatten(rows) -> list:
    out = []
    for row in rows:
        if isinstance(row, (list, tuple)):
            out += _flatten(row)
        else:
            out.append(row)
    return out


def routing_calls(source) -> dict[int, list[Call]]:
    """Per MoE layer (ascending), its forward calls in call order. `source`: a traced
    GenerationResult, a GenerationTrace or ForwardTrace, a path to a saved trace, or this function's
    own output (returned as is)."""
    if isinstance(source, dict):
        return {
            int(layer): [c if isinstance(c, Call) else Call(**c) for c in calls]
            for layer, calls in sorted(source.items(), key=lambda kv: int(kv[0]))
        }
    import torch

    records = _routing_records(source)
    out: dict[int, list[Call]] = {}
    for rec in records:
        ids = rec.expert_ids
        # the distinct ids and their counts, never a Python object per routed token
        distinct, counts = torch.unique(ids.reshape(-1), sorted=True, return_counts=True)
        choices = dict(zip(distinct.tolist(), counts.tolist()))
        seqlen = int(ids.shape[1]) if ids.dim() >= 3 else int(ids.shape[0])
        out.setdefault(int(rec.layer), []).append(
            Call(int(rec.start_pos), seqlen, tuple(choices), choices, int(rec.cache_hits), int(rec.cache_misses))
        )
    return dict(sorted(out.items()))


def _loaded(source):
    """A path read as a saved GenerationTrace; anything else as it is."""
    if isinstance(source, (str, os.PathLike)):
        from ..model.trace import GenerationTrace

        return GenerationTrace.load(source)
    return source


def _routing_records(source):
    source = _loaded(source)
    trace = getattr(source, "trace", source)  # a GenerationResult carries its trace
    if trace is None:
        raise ValueError("this GenerationResult has no trace; generate with trace=True")
    forward = getattr(trace, "forward", trace)
    routing = getattr(forward, "routing", None)
    if routing is None:
        raise ValueError(
            f"a {type(source).__name__} holds no routing records; pass a traced GenerationResult, "
            "a GenerationTrace or the path of a saved one"
        )
    return routing


def experts_per_layer(source, n_experts: Optional[int] = None, *, calls: Optional[dict] = None) -> int:
    """`n_experts` when given, else the trace's meta `n_routed_experts`, else its largest routed id + 1
    (`calls`: the source's `routing_calls`, when already at hand); ValueError past MAX_EXPERTS, the
    most any config may have."""
    if n_experts:
        return _check_experts(n_experts, "n_experts")
    stated = _source_meta(source).get("n_routed_experts")
    if stated is not None:
        return _check_experts(stated, "the trace's n_routed_experts")
    calls = routing_calls(source) if calls is None else calls
    seen = max((e for per in calls.values() for c in per for e in c.lookups), default=-1)
    if seen >= MAX_EXPERTS:
        raise ValueError(
            f"the trace routes to expert {seen:,}, past the {MAX_EXPERTS:,} routed experts a config may have"
        )
    return seen + 1


def _check_experts(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_EXPERTS:
        shown = f"{n:,}" if isinstance(n, int) and not isinstance(n, bool) else repr(n)
        raise ValueError(f"{what} is {shown}; a layer has from 1 to {MAX_EXPERTS:,} routed experts")
    return n


def _source_meta(source) -> dict:
    trace = getattr(source, "trace", source)
    meta = getattr(trace, "meta", None)
    return dict(meta) if isinstance(meta, dict) else {}


# ---------------------------------------------------------------------- the policies, one cache
def lru_replay(lookups: Iterable[int], capacity: int) -> list[bool]:
    """Hit (True) or miss per lookup through an LRU holding `capacity` items, starting empty; a hit
    moves the item to most recent, a miss inserts it and evicts the least recent beyond capacity;
    capacity 0 keeps nothing, as the loader's ExpertCache (the same rule as `dsv41.widgets.cache`)."""
    _check_capacity(capacity)
    rule, held, out = LruRule(), set(), []
    for t, item in enumerate(lookups):
        hit = item in held
        out.append(hit)
        if not hit and capacity:
            if len(held) >= capacity:
                victim = rule.victim(held, ())  # every key the rule knows is held here
                held.discard(victim)
                rule.forget(victim)
            held.add(item)
        if hit or capacity:
            rule.used(item, t)
    return out


def lfu_replay(lookups: Iterable[int], capacity: int) -> list[bool]:
    """Perfect LFU: every lookup counts for its item (counts outlive evictions); a miss on a full
    cache evicts the cached item with the fewest lookups so far, the least recently used among equals."""
    _check_capacity(capacity)
    count: dict = {}
    last: dict = {}
    cached: set = set()
    out = []
    for t, item in enumerate(lookups):
        hit = item in cached
        out.append(hit)
        if not hit and capacity:
            if len(cached) >= capacity:
                cached.remove(min(cached, key=lambda e: (count[e], last[e])))
            cached.add(item)
        count[item] = count.get(item, 0) + 1
        last[item] = t
    return out


def belady_replay(lookups: Sequence[int], capacity: int) -> list[bool]:
    """Belady's optimum: it reads the whole sequence ahead and keeps, of what it holds plus the
    expert just read, the `capacity` looked up again soonest (one never looked up again is dropped at
    once). Like static it may read an expert without keeping it, so no policy holding at most
    `capacity` experts, on demand or not, hits more."""
    import heapq

    _check_capacity(capacity)
    lookups = list(lookups)
    following = _next_uses(lookups)
    never = len(lookups) + 1
    cached: dict = {}  # item -> its next lookup
    farthest: list = []  # (-next lookup, item), stale entries skipped
    out = []
    for t, item in enumerate(lookups):
        hit = item in cached
        out.append(hit)
        nxt = following[t]
        if hit:
            del cached[item]
        if not capacity or nxt == never:
            continue
        if len(cached) >= capacity:
            while cached.get(farthest[0][1]) != -farthest[0][0]:
                heapq.heappop(farthest)
            if -farthest[0][0] < nxt:
                continue  # everything held is needed sooner: read it, keep it not
            del cached[heapq.heappop(farthest)[1]]
        cached[item] = nxt
        heapq.heappush(farthest, (-nxt, item))
    return out


def static_replay(lookups: Iterable[int], capacity: int, ranking: Sequence[int]) -> list[bool]:
    """A fixed set, the first `capacity` experts of `ranking`: a ranked expert is kept from its first
    read on (that read is a miss), any other is read and dropped (always a miss)."""
    _check_capacity(capacity)
    pinned = set(list(ranking)[:capacity])
    seen: set = set()
    out = []
    for item in lookups:
        out.append(item in pinned and item in seen)
        seen.add(item)
    return out


def replay(policy: str, lookups: Sequence[int], capacity: int, ranking: Optional[Sequence[int]] = None) -> list[bool]:
    """Hit or miss per lookup through one cache of `capacity` under `policy` (see POLICIES); static
    needs its `ranking`."""
    policy = _check_policy(policy)
    if policy == "lru":
        return lru_replay(lookups, capacity)
    if policy == "lfu":
        return lfu_replay(lookups, capacity)
    if policy == "belady":
        return belady_replay(lookups, capacity)
    if ranking is None:
        raise ValueError("the static policy needs a ranking (experts in the order they are kept)")
    return static_replay(lookups, capacity, ranking)


# ---------------------------------------------------------------------- every size in one pass
def hit_depths(policy: str, lookups: Sequence[int], ranking: Optional[Sequence[int]] = None) -> list[Optional[int]]:
    """Per lookup, the smallest cache size at which it hits (None: it misses at every size), so
    `replay(policy, lookups, c)[i] == (depth[i] is not None and depth[i] <= c)` for every c.

    LRU, LFU and Belady keep, at every size, the top of one priority stack (Mattson, Gecsei, Slutz
    and Traiger 1970); the looked-up item's depth is where it starts to hit. The items above its old
    place are then passed one comparison at a time, the less urgent carried down, the carried item
    ending in the old place (urgency: recency for LRU, (lookups so far, recency) for LFU, the sooner
    next lookup for Belady). LRU and LFU read on demand: the looked-up item goes on top and the carry
    starts with the old top. Belady may decline to keep what it read: the carry starts with the
    looked-up item itself, so at every size below its depth the least urgent of the cache and the new
    item is the one left out. Static hits a ranked expert's repeat lookups from its rank on."""
    policy = _check_policy(policy)
    lookups = list(lookups)
    if policy == "static":
        if ranking is None:
            raise ValueError("the static policy needs a ranking (experts in the order they are kept)")
        rank = {e: i for i, e in enumerate(ranking)}
        seen: set = set()
        out = []
        for item in lookups:
            out.append(rank[item] + 1 if item in seen and item in rank else None)
            seen.add(item)
        return out
    if policy == "lru":
        stack: list = []
        out = []
        for item in lookups:
            try:
                d = stack.index(item)
            except ValueError:
                out.append(None)
            else:
                out.append(d + 1)
                del stack[d]
            stack.insert(0, item)
        return out
    n = len(lookups)
    following = _next_uses(lookups) if policy == "belady" else None
    key: dict = {}  # larger: more urgent to keep
    count: dict = {}
    stack: list = []
    out = []
    for t, item in enumerate(lookups):
        try:
            d = stack.index(item)
            out.append(d + 1)
        except ValueError:
            d = len(stack)
            stack.append(item)  # a place holder at the bottom; the carry lands there
            out.append(None)
        if policy == "lfu":
            count[item] = count.get(item, 0) + 1
            new_key = count[item] * (n + 1) + t
        else:  # the sooner the next lookup, the more urgent (never again: least)
            new_key = -following[t]
        if policy == "belady":
            carry, kc, begin = item, new_key, 0
        else:  # on demand: the looked-up item goes on top, the old top is carried
            carry, begin = stack[0], 1
            kc = key.get(carry)
            stack[0] = item
        for i in range(begin, d):
            y = stack[i]
            ky = key[y]
            if ky < kc:  # y is less urgent: it moves down, the carried item takes its place
                stack[i] = carry
                carry, kc = y, ky
        stack[d] = carry
        key[item] = new_key
    return out


def _next_uses(lookups: Sequence[int]) -> list[int]:
    """Per position, the position of the same item's next lookup (len(lookups) + 1 when never)."""
    never = len(lookups) + 1
    nxt: dict = {}
    out = [never] * len(lookups)
    for t in range(len(lookups) - 1, -1, -1):
        out[t] = nxt.get(lookups[t], never)
        nxt[lookups[t]] = t
    return out


def replay_counts(
    calls: Sequence[Sequence[int]], capacity: int, policy: str = "lru", ranking: Optional[Sequence[int]] = None
) -> list[list[int]]:
    """[hits, misses] per call for per-call lookup lists replayed through one cache of `capacity`."""
    hits = replay(policy, [e for call in calls for e in call], capacity, ranking)
    out, k = [], 0
    for call in calls:
        part = hits[k : k + len(call)]
        k += len(call)
        out.append([sum(part), len(part) - sum(part)])
    return out


def pool_steps(source, expert_map=None) -> list[list[list[tuple]]]:
    """Per forward call of a trace (or its routing records), per MoE layer in fetch order, the
    (layer, expert) keys it looked up (distinct ids ascending); a call starts where a layer comes
    again. `expert_map(layer, expert) -> (layer, expert)` renames keys (a miniature's routing
    spread over a larger layer), the lookups then taken distinct again."""
    steps, last = [], None
    for rec in _routing_records(source):
        if last is None or rec.layer <= last:
            steps.append([])
        last = rec.layer
        ids = call_lookups(rec.expert_ids)
        keys = [(rec.layer, e) for e in ids] if expert_map is None else sorted({expert_map(rec.layer, e) for e in ids})
        steps[-1].append(keys)
    return steps


def pool_hit_rates(
    steps: Sequence[Sequence[Sequence[tuple]]],
    capacity: int,
    policies: Sequence[str] = ("lru", "decay", "belady"),
    half_life: Optional[float] = None,
) -> dict:
    """One pool of `capacity` experts shared by every layer, as `stores.SlotCache` keeps it:
    `steps` per forward call, per layer in fetch order, the (layer, expert) keys it looks up
    (`pool_steps`); one tick per forward call. lru and decay run through `eviction.Residency` (the
    running cache's own bookkeeping), belady over the same keys; per policy {"hits", "misses",
    "hit_rate"}."""
    from ..checkpoint.eviction import DEFAULT_HALF_LIFE

    out = {}
    for policy in policies:
        if policy == "belady":
            flat = [key for step in steps for layer in step for key in layer]
            hits = sum(belady_replay(flat, capacity))
            total = len(flat)
        else:
            counts = replay_calls(
                ((t + 1, layer) for t, step in enumerate(steps) for layer in step),
                capacity,
                policy,
                half_life or DEFAULT_HALF_LIFE,
            )
            hits, total = sum(c[0] for c in counts), sum(c[0] + c[1] for c in counts)
        out[policy] = {"hits": hits, "misses": total - hits, "hit_rate": hits / total if total else None}
    return out


def static_ranking(calls: Sequence[Call], n_experts: int) -> list[int]:
    """All experts 0 .. n_experts - 1, the most chosen first: by the tokens that chose each over
    `calls`, then by the calls that looked each up, then by id."""
    tokens: dict[int, int] = {}
    looked: dict[int, int] = {}
    for call in calls:
        for e, n in call.choices.items():
            if 0 <= int(e) < n_experts:
                tokens[int(e)] = tokens.get(int(e), 0) + int(n)
                looked[int(e)] = looked.get(int(e), 0) + 1
    # the experts seen are ranked; the rest (no tokens, no calls) follow in id order
    chosen = sorted(tokens, key=lambda e: (-tokens[e], -looked[e], e))
    return chosen + [e for e in range(n_experts) if e not in tokens]


# ---------------------------------------------------------------------- the lab
def policy_data(
    source,
    *,
    policies: Sequence[str] = POLICIES,
    capacities: Optional[Sequence[int]] = None,
    n_experts: Optional[int] = None,
    warmup=1,
    cfg: Optional[Config] = None,
    capacity: Optional[int] = None,
) -> dict:
    """Plain data (JSON-ready) for the policy figure and the `replay` command.

    `source`: what `routing_calls` takes. `capacities`: cache sizes per layer (default 0 ..
    n_experts); `n_experts`: the routed experts per layer (default: the trace's meta
    `n_routed_experts`, else the largest routed id + 1). `warmup`: the static policy's warm-up, the
    first N calls of each layer (default 1, the prefill) or a second source. `cfg`: the geometry a
    miss is priced on (default the released one). `capacity`: the size the run used, marked in the
    figure (default the trace's meta `expert_cache`).

    Keys: policies, layers, n_experts, capacities, hits / hit_rate_by_layer [policy][layer][size],
    hit_rate [policy][size], misses and decode_misses [policy][size] (summed over layers),
    disk_bytes_per_token / disk_mib_per_token (every call's misses over every token) and
    disk_bytes_per_decode_token / disk_mib_per_decode_token (decode calls only: the steady state)
    [policy][size], bytes_per_miss and geometry, lookups / decode_lookups / distinct per layer,
    tokens / decode_tokens, warmup (its source and calls, the ranking per layer), recorded (the run's
    own hits and misses per layer) and capacity."""
    policies, calls, layers, n_experts, sizes, capacity = _replay_inputs(
        source, policies, capacities, n_experts, capacity
    )
    rankings, warm_desc = _warmup_rankings(warmup, calls, layers, n_experts)

    flat = {layer: [e for c in calls[layer] for e in c.lookups] for layer in layers}
    is_decode = {layer: [c.decode for c in calls[layer] for _ in c.lookups] for layer in layers}
    lookups = [len(flat[layer]) for layer in layers]
    decode_lookups = [sum(is_decode[layer]) for layer in layers]
    first = calls[layers[0]]
    tokens = sum(c.seqlen for c in first)
    decode_tokens = sum(c.seqlen for c in first if c.decode)
    hits, decode_hits = _replayed_hits(policies, layers, flat, is_decode, rankings, sizes)

    bytes_per_miss = expert_bytes(cfg)
    total, total_decode = sum(lookups), sum(decode_lookups)
    data = {
        "policies": policies,
        "policy_names": {p: POLICY_NAMES[p] for p in policies},
        "layers": layers,
        "n_experts": n_experts,
        "capacities": sizes,
        "capacity": capacity,
        "calls": len(first),
        "tokens": tokens,
        "decode_tokens": decode_tokens,
        "lookups": lookups,
        "decode_lookups": decode_lookups,
        "distinct": [len(set(flat[layer])) for layer in layers],
        "bytes_per_miss": bytes_per_miss,
        "mib_per_miss": bytes_per_miss / MIB,
        "geometry": geometry(cfg),
        "warmup": {**warm_desc, "ranking": {str(layer): rankings[layer] for layer in layers}},
        "hits": hits,
        "hit_rate_by_layer": {
            p: [[h / n if n else None for h in row] for row, n in zip(hits[p], lookups)] for p in policies
        },
        "hit_rate": {
            p: [sum(row[i] for row in hits[p]) / total if total else None for i in range(len(sizes))] for p in policies
        },
        "misses": {p: [total - sum(row[i] for row in hits[p]) for i in range(len(sizes))] for p in policies},
        "decode_misses": {
            p: [total_decode - sum(row[i] for row in decode_hits[p]) for i in range(len(sizes))] for p in policies
        },
        "recorded": {
            "hits": [sum(c.hits for c in calls[layer]) for layer in layers],
            "misses": [sum(c.misses for c in calls[layer]) for layer in layers],
        },
    }
    _add_disk_bytes(data, policies, bytes_per_miss, tokens, decode_tokens)
    recorded = sum(data["recorded"]["hits"]) + sum(data["recorded"]["misses"])
    data["recorded_hit_rate"] = sum(data["recorded"]["hits"]) / recorded if recorded else None
    return data


def _replay_inputs(source, policies, capacities, n_experts, capacity):
    """`policy_data`'s arguments checked against the trace: (policies, calls per layer, layers,
    experts per layer, ascending cache sizes, the size the run used)."""
    policies = [_check_policy(p) for p in policies]
    if not policies:
        raise ValueError("name at least one policy")
    source = _loaded(source)
    meta = _source_meta(source)
    calls = routing_calls(source)
    if not calls:
        raise ValueError("the trace holds no routing records (no MoE layer ran)")
    layers = list(calls)
    seen = max((e for per in calls.values() for c in per for e in c.lookups), default=-1)
    lowest = min((e for per in calls.values() for c in per for e in c.lookups), default=0)
    n_experts = experts_per_layer(source, n_experts, calls=calls)
    if lowest < 0:
        raise ValueError(f"the trace routes to expert {lowest:,}; expert ids start at 0")
    if seen >= n_experts:
        raise ValueError(f"the trace routes to expert {seen}, beyond the {n_experts} experts per layer given")
    sizes = sorted({int(c) for c in (capacities if capacities is not None else range(n_experts + 1))})
    for c in sizes:
        _check_capacity(c)
    if capacity is None and isinstance(meta.get("expert_cache"), int):
        capacity = meta["expert_cache"]
    return policies, calls, layers, n_experts, sizes, capacity


def _warmup_rankings(warmup, calls, layers, n_experts):
    """(the static policy's ranking per layer, a description of the calls it was ranked on)."""
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        warm_calls = routing_calls(_loaded(warmup))
        warm_desc = {
            "source": "a second trace",
            "calls": {str(layer): len(warm_calls.get(layer, [])) for layer in layers},
        }
    else:
        if warmup < 1:
            raise ValueError(f"the warm-up is the first N >= 1 calls of the trace, got {warmup}")
        warm_calls = {layer: calls[layer][:warmup] for layer in layers}
        warm_desc = {
            "source": f"the first {warmup} call{'s' if warmup > 1 else ''} of this trace",
            "calls": {str(layer): len(warm_calls[layer]) for layer in layers},
        }
    rankings = {layer: static_ranking(warm_calls.get(layer, []), n_experts) for layer in layers}
    return rankings, warm_desc


def _replayed_hits(policies, layers, flat, is_decode, rankings, sizes):
    """(hits, decode hits) [policy][layer][size]: each layer's lookups replayed through each policy."""
    hits: dict[str, list[list[int]]] = {}
    decode_hits: dict[str, list[list[int]]] = {}
    for policy in policies:
        hits[policy], decode_hits[policy] = [], []
        for layer in layers:
            depths = hit_depths(policy, flat[layer], rankings[layer])
            all_row, dec_row = (
                _hits_by_size(depths, sizes),
                _hits_by_size([d for d, dec in zip(depths, is_decode[layer]) if dec], sizes),
            )
            hits[policy].append(all_row)
            decode_hits[policy].append(dec_row)
    return hits, decode_hits


def _add_disk_bytes(data: dict, policies, bytes_per_miss: int, tokens: int, decode_tokens: int) -> None:
    """The disk bytes (and MiB) per token and per decode token each policy and size would read."""
    data["disk_bytes_per_token"] = {
        p: [m * bytes_per_miss / tokens if tokens else None for m in data["misses"][p]] for p in policies
    }
    data["disk_bytes_per_decode_token"] = {
        p: [m * bytes_per_miss / decode_tokens if decode_tokens else None for m in data["decode_misses"][p]]
        for p in policies
    }
    for unit in ("token", "decode_token"):
        data[f"disk_mib_per_{unit}"] = {
            p: [None if b is None else b / MIB for b in data[f"disk_bytes_per_{unit}"][p]] for p in policies
        }


def _hits_by_size(depths: Sequence[Optional[int]], sizes: Sequence[int]) -> list[int]:
    """How many lookups hit at each size: those whose depth is at most the size."""
    hist: dict[int, int] = {}
    for d in depths:
        if d is not None:
            hist[d] = hist.get(d, 0) + 1
    order = sorted(hist)
    out, k, running = [], 0, 0
    for size in sizes:  # ascending
        while k < len(order) and order[k] <= size:
            running += hist[order[k]]
            k += 1
        out.append(running)
    return out


def at_capacity(data: dict, policy: str, capacity: int) -> dict:
    """One row of `policy_data`: hit rate, misses and disk bytes per token at `capacity` (one of its sizes)."""
    i = data["capacities"].index(capacity)
    return {
        "policy": policy,
        "capacity": capacity,
        "hit_rate": data["hit_rate"][policy][i],
        "misses": data["misses"][policy][i],
        "decode_misses": data["decode_misses"][policy][i],
        "disk_mib_per_token": data["disk_mib_per_token"][policy][i],
        "disk_mib_per_decode_token": data["disk_mib_per_decode_token"][policy][i],
    }


def _check_capacity(capacity) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")


def _check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; the policies are {', '.join(POLICIES)}")
    return policy


# ---------------------------------------------------------------------- dsv41 replay
def _int_list(text: str, what: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated whole numbers like 4,8,16,32, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"{what} takes cache sizes >= 0, got {text!r}")
    return values


def _replay_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv41 replay",
        description=(
            "Replay a saved trace's routing (GenerationTrace.save) through expert-cache policies: hit rate and the "
            "disk bytes per token each policy and cache size (experts per layer) would read, a miss priced at one "
            "routed expert of the released geometry (or --config's)."
        ),
    )
    parser.add_argument("trace", metavar="TRACE", help="a trace file written by GenerationTrace.save")
    parser.add_argument(
        "--capacity",
        default="4,8,16,32",
        metavar="LIST",
        help="comma-separated cache sizes per layer (default 4,8,16,32)",
    )
    parser.add_argument(
        "--policy",
        default=",".join(POLICIES),
        metavar="LIST",
        help=f"comma-separated policies among {','.join(POLICIES)} (default all)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="static policy: rank experts on the first N calls of the trace (default 1: the prefill)",
    )
    parser.add_argument(
        "--warmup-trace", metavar="FILE", help="static policy: rank experts on this other trace instead"
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=None,
        metavar="N",
        help="routed experts per layer (default: the trace's, else its largest id + 1)",
    )
    parser.add_argument(
        "--config", metavar="PATH", help="price a miss on this config's geometry (default: the release)"
    )
    parser.add_argument("--json", metavar="OUT", help="also write every size's numbers as JSON here")
    return parser


def _replay_choices(args) -> tuple[list[int], list[str]]:
    """(the cache sizes to print, the policies) from the command line; ValueError on a bad value."""
    wanted = _int_list(args.capacity, "--capacity")
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise ValueError(f"--policy takes some of {','.join(POLICIES)}, got {args.policy!r}")
    if args.warmup < 1:
        raise ValueError(f"--warmup must be at least 1, got {args.warmup}")
    if args.experts is not None and not 1 <= args.experts <= MAX_EXPERTS:
        raise ValueError(
            f"--experts must be from 1 to {MAX_EXPERTS:,} (the most routed experts a config may "
            f"have), got {args.experts:,}"
        )
    return wanted, policies


def _print_replay(trace_path: str, data: dict, policies: list[str], wanted: list[int]) -> None:
    print(
        f"{trace_path}: {len(data['layers'])} MoE layers, {data['calls']} calls, {data['tokens']} tokens "
        f"({data['decode_tokens']} decoded), {sum(data['lookups']):,} lookups of {data['n_experts']} experts "
        f"per layer; "
        f"a miss reads {data['bytes_per_miss']:,} bytes ({data['mib_per_miss']:.2f} MiB)"
    )
    header = f"{'policy':<8} {'capacity':>8} {'hit rate':>9} {'misses':>9} {'MiB/token':>10} {'MiB/decode token':>17}"
    print(header)
    print("-" * len(header))
    for policy in policies:
        for c in wanted:
            row = at_capacity(data, policy, c)
            print(
                f"{policy:<8} {c:>8} {_fmt(row['hit_rate'], '.4f'):>9} {row['misses']:>9,} "
                f"{_fmt(row['disk_mib_per_token'], ',.1f'):>10} {_fmt(row['disk_mib_per_decode_token'], ',.1f'):>17}"
            )


def _write_replay_json(path: str, data: dict, wanted: list[int]) -> None:
    from .viz import to_jsonable

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_jsonable({**data, "requested_capacities": wanted}), f, indent=2, sort_keys=True)
        f.write("\n")


def cli_main(argv: list[str]) -> int:
    args = _replay_parser().parse_args(argv)

    def usage(message: str) -> int:
        print(f"dsv41 replay: {message} (see --help)", file=sys.stderr)
        return 2

    def fail(message: str) -> int:
        print(f"dsv41 replay: {message}", file=sys.stderr)
        return 1

    try:
        wanted, policies = _replay_choices(args)
    except ValueError as exc:
        return usage(str(exc))

    from ..model.trace import GenerationTrace, TraceFileError

    try:
        trace = GenerationTrace.load(args.trace)
        warm = GenerationTrace.load(args.warmup_trace) if args.warmup_trace else args.warmup
        cfg = None
        if args.config:
            from ..core.config import load_config

            cfg = load_config(args.config)
        n_experts = experts_per_layer(trace, args.experts)
        data = policy_data(
            trace,
            policies=policies,
            capacities=sorted(set(range(n_experts + 1)) | set(wanted)),
            n_experts=n_experts,
            warmup=warm,
            cfg=cfg,
        )
    except FileNotFoundError as exc:
        return fail(str(exc))
    except (TraceFileError, ValueError, OSError) as exc:
        return fail(str(exc).rstrip("."))
    except MemoryError:
        return fail(f"{args.trace} is too large to replay in this machine's memory")

    _print_replay(args.trace, data, policies, wanted)
    if args.json:
        try:
            _write_replay_json(args.json, data, wanted)
        except OSError as exc:
            return fail(f"cannot write {args.json}: {exc.strerror or exc}")
    return 0


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
