"""Named interventions: each a mapping {site pattern: fn} for `model.intervene` (`interventions`),
a few lines over the form its sites take.

- `engram_off(layers)`: an Engram layer adds nothing (its site passes on the stream it was given).
- `remove_experts({layer: experts})`: those routed experts are gone, and the router's next choices
  take their places, as a model pruned of them would route (the selection bias of a removed expert
  is -inf; the weights are the chosen experts' own, normalized as the gate does);
  `zero_experts` keeps the routing and zeroes the removed experts' weights instead.
- `dense_selection(layers)`: every compressed position a query reaches is read, instead of the
  indexer's top-k; `random_selection(seed, layers)`: as many positions as the indexer chose, drawn
  at random from those the query reaches (a hash of seed, layer, query and key positions, so the
  same query draws the same positions in any call shape: chunked, decoded, rolled back).
- `plain_residual(layers)`: the hyper-connections collapsed to a plain residual: each site's mixes
  become pre = 1 / hc on every copy, post = 1, comb = the identity: each sublayer reads the mean
  of the copies and adds its output to every copy, so copies that start equal stay equal but for
  what Engram's per-copy gates add (with Engram off too, one stream throughout).
- `patch(clean, positions)`: activation patching: the values of a clean run (`clean_activations`)
  written over a corrupted run's at chosen sites and positions.

Each fn carries a `label` that traces and figures show. Layers are ints; None means every layer that
has the site. A request that cannot mean anything (an expert a layer does not have, more experts
removed than leave a top-k, a patch at a site without positions) is an `AblationError` in one
sentence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Optional

import torch

from ..core.errors import Dsv41Error
from ..core.text import brief
from .hooks import run_with_hooks
from .moe import route

if TYPE_CHECKING:  # annotations only
    from .model import Model

# the sites whose value is [batch, positions, ...]: what a patch can write positions of
PATCHABLE = ("embed", "engram", "resid_pre", "resid_mid", "resid_post", "attn", "ffn")


class AblationError(Dsv41Error, ValueError):
    """A named ablation asked for something a model cannot do; the message says what and why."""


def _layers(layers: Optional[Iterable[int]], what: str) -> Optional[list[int]]:
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise AblationError(f"{what} takes a list of layer numbers (or None: every layer), got {brief(layers)}")
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise AblationError(f"{what}: a layer is a whole number >= 0, got {brief(layer)}")
        out.append(int(layer))
    if not out:
        raise AblationError(f"{what} got an empty list of layers; name at least one, or None for every layer")
    return sorted(set(out))


def _at(layers: Optional[list[int]], local: str) -> list[str]:
    return [f"layers.*.{local}"] if layers is None else [f"layers.{layer}.{local}" for layer in layers]


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])


# ---------------------------------------------------------------------- Engram
class _EngramOff:
    label = "Engram off"

    def __call__(self, name: str, value: torch.Tensor, context) -> torch.Tensor:
        return context["x"]  # the stream as it came in: no contribution


def engram_off(layers: Optional[Iterable[int]] = None) -> dict:
    """Engram on `layers` (None: every Engram layer) adds nothing to the stream."""
    return dict.fromkeys(_at(_layers(layers, "engram_off"), "engram"), _EngramOff())


# ---------------------------------------------------------------------- experts
def _removed(experts: Mapping[int, Iterable[int]], what: str) -> dict[int, list[int]]:
    if not isinstance(experts, Mapping) or not experts:
        raise AblationError(f"{what} takes {{layer: [expert ids]}} with at least one layer, got {brief(experts)}")
    out = {}
    for layer, ids in experts.items():
        _layers([layer], what)
        ids = [ids] if isinstance(ids, int) else list(ids)
        if not ids or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
            raise AblationError(f"{what}: layer {layer}'s experts must be whole numbers >= 0, got {brief(ids)}")
        out[int(layer)] = sorted(set(ids))
    return out


def _gone_mask(name: str, experts: list[int], n_experts: int, topk: int) -> torch.Tensor:
    if experts[-1] >= n_experts:
        raise AblationError(f"{name} has routed experts 0 to {n_experts - 1}; expert {experts[-1]} is not one of them")
    if n_experts - len(experts) < topk:
        raise AblationError(
            f"{name}: removing {len(experts)} of {n_experts} experts leaves fewer than the {topk} each token routes to"
        )
    gone = torch.zeros(n_experts, dtype=torch.bool)
    gone[experts] = True
    return gone


class _Reroute:
    def __init__(self, experts: list[int]):
        self.experts = experts
        self.label = f"experts {', '.join(map(str, experts))} removed (the router's next choices in their place)"

    def __call__(self, name: str, value, context):
        gate, x = context["gate"], context["x"]
        gone = _gone_mask(name, self.experts, gate.weight.size(0), gate.topk)
        bias = gate.selection_bias(context["image_mask"]).masked_fill(gone.to(gate.bias.device), -torch.inf)
        return route(gate.scores(x), bias, gate.topk, gate.norm_topk_prob, gate.route_scale)


class _ZeroWeight:
    def __init__(self, experts: list[int]):
        self.experts = experts
        self.label = f"experts {', '.join(map(str, experts))} weighted zero"

    def __call__(self, name: str, value, context):
        weights, ids = value
        n_experts = context["gate"].weight.size(0)
        _gone_mask(name, self.experts, n_experts, 0)
        removed = torch.isin(ids, torch.tensor(self.experts, device=ids.device))
        return weights.masked_fill(removed, 0.0), ids


def remove_experts(experts: Mapping[int, Iterable[int]]) -> dict:
    """{layer: expert ids} removed from routing: each token routes to its top-k among the rest."""
    return {f"layers.{layer}.ffn.gate": _Reroute(ids) for layer, ids in _removed(experts, "remove_experts").items()}


def zero_experts(experts: Mapping[int, Iterable[int]]) -> dict:
    """{layer: expert ids} kept in the routing with weight 0 (the other chosen experts' weights
    unchanged, so a token's routed output shrinks by what they gave)."""
    return {f"layers.{layer}.ffn.gate": _ZeroWeight(ids) for layer, ids in _removed(experts, "zero_experts").items()}


# ---------------------------------------------------------------------- the indexer's selection
def _reach(context, seqlen: int, device) -> tuple[torch.Tensor, int]:
    """(how many compressed positions each query of the call reaches [s], the call's width T)."""
    start, ratio = context["start_pos"], context["compress_ratio"]
    positions = torch.arange(start, start + seqlen, device=device)
    return (positions + 1) // ratio, (start + seqlen) // ratio


class _Dense:
    label = "every reachable compressed position read"

    def __call__(self, name: str, value: torch.Tensor, context) -> torch.Tensor:
        b, s = value.shape[:2]
        reach, width = _reach(context, s, value.device)
        keys = torch.arange(width, device=value.device)
        selected = torch.where(keys < reach.unsqueeze(-1), keys, -1)  # [s, T], ascending then -1
        return selected.unsqueeze(0).expand(b, s, width).to(value.dtype)


_HASH_MASK = (1 << 31) - 1


def _hash(seed: int, layer: int, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A 31-bit hash of (seed, layer, query position [s, 1], key position [T]) -> [s, T] int64:
    the same numbers for a query in any call. Every product stays below 2**62."""
    h = torch.full((), (seed * 1_000_003 + layer) & _HASH_MASK, dtype=torch.int64)
    for part in (query, key):
        h = ((h * 69069 + part) ^ (h >> 13)) & _HASH_MASK
        for _ in range(2):  # mix so that neighbouring positions land far apart
            h = ((h ^ (h >> 16)) * 0x45D9F3B) & _HASH_MASK
    return h ^ (h >> 16)


class _Random:
    def __init__(self, seed: int):
        self.seed = seed
        self.label = f"a random selection of the indexer's size (seed {seed})"

    def __call__(self, name: str, value: torch.Tensor, context) -> torch.Tensor:
        b, s = value.shape[:2]
        reach, width = _reach(context, s, value.device)
        count = (value >= 0).sum(-1)  # [b, s]: how many positions the indexer chose
        queries = torch.arange(context["start_pos"], context["start_pos"] + s, device=value.device).unsqueeze(-1)
        keys = torch.arange(width, device=value.device)
        draw = _hash(self.seed, _layer_of(name), queries, keys)
        draw = torch.where(keys < reach.unsqueeze(-1), draw, -1)  # an unreachable key is never drawn first
        order = draw.argsort(dim=-1, descending=True, stable=True)[:, : value.size(-1)]  # [s, k]
        picked = order.unsqueeze(0).expand(b, s, -1)
        kept = torch.arange(picked.size(-1), device=value.device) < count.unsqueeze(-1)  # [b, s, k]
        # ascending positions, then -1, as the indexer lists them
        ordered = torch.where(kept, picked, width).sort(dim=-1).values
        return torch.where(ordered < width, ordered, -1).to(value.dtype)


def dense_selection(layers: Optional[Iterable[int]] = None) -> dict:
    """The attention layers `layers` (None: every one reading compressed positions) read every
    compressed position each query reaches."""
    return dict.fromkeys(_at(_layers(layers, "dense_selection"), "attn.topk"), _Dense())


def random_selection(seed: int = 0, layers: Optional[Iterable[int]] = None) -> dict:
    """Each query of `layers` reads as many compressed positions as its indexer chose, drawn at
    random (seeded) from those it reaches."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise AblationError(f"random_selection's seed is a whole number, got {brief(seed)}")
    return dict.fromkeys(_at(_layers(layers, "random_selection"), "attn.topk"), _Random(seed))


# ---------------------------------------------------------------------- hyper-connections
class _Plain:
    label = "hyper-connections collapsed to a plain residual"

    def __call__(self, name: str, value, context):
        pre, post, comb = value  # [b, s, hc], [b, s, hc], [b, s, hc, hc]
        hc = pre.size(-1)
        eye = torch.eye(hc, dtype=comb.dtype, device=comb.device).expand_as(comb)
        return torch.full_like(pre, 1.0 / hc), torch.ones_like(post), eye.clone()


def plain_residual(layers: Optional[Iterable[int]] = None) -> dict:
    """The mixes of `layers` (None: every block) collapsed to a plain residual (see the module)."""
    layers = _layers(layers, "plain_residual")
    return {pattern: _Plain() for local in ("hc_attn", "hc_ffn") for pattern in _at(layers, local)}


# ---------------------------------------------------------------------- activation patching
def clean_activations(model: Model, ids, sites: Iterable[str], **call_kw) -> dict[str, torch.Tensor]:
    """One run of `ids` from position 0 (`model(ids, 0, **call_kw)`), recording `sites`:
    {site: its value over every position, [b, positions, ...]}, what `patch` writes from. The
    model's sequence is left as that run leaves it."""
    sites = list(sites)
    _check_patchable(sites)
    _, cache = run_with_hooks(model, ids, 0, names=sites, **call_kw)
    return {name: torch.cat(values, dim=1) for name, values in cache.items()}


def _check_patchable(names: Iterable[str]) -> None:
    for name in names:
        if not isinstance(name, str) or name.rsplit(".", 1)[-1] not in PATCHABLE:
            raise AblationError(
                f"{brief(name)} is not a site whose value has a position axis; patch one of the "
                f"{', '.join(PATCHABLE)} sites (e.g. layers.3.resid_pre)"
            )


class _Patch:
    def __init__(self, clean: torch.Tensor, positions: Optional[list[int]]):
        self.clean, self.positions = clean, positions
        where = "every position" if positions is None else f"positions {', '.join(map(str, positions))}"
        self.label = f"patched from a clean run at {where}"

    def __call__(self, name: str, value: torch.Tensor, context) -> torch.Tensor:
        start, s = context["start_pos"], value.size(1)
        clean = self.clean
        if clean.size(0) != value.size(0) or clean.shape[2:] != value.shape[2:]:
            raise AblationError(
                f"the clean run's {name} is {list(clean.shape)}, this run's {list(value.shape)}: patch "
                "between runs of the same batch and model"
            )
        wanted = (
            range(start, start + s) if self.positions is None else [p for p in self.positions if start <= p < start + s]
        )
        wanted = list(wanted)
        if not wanted:
            return value
        if wanted[-1] >= clean.size(1):
            raise AblationError(
                f"position {wanted[-1]} of {name} is past the clean run's {clean.size(1)} positions; "
                "record a clean run at least as long"
            )
        out = value.clone()
        at = torch.tensor(wanted, device=value.device)
        out[:, at - start] = clean[:, at].to(value.device, value.dtype)
        return out


def patch(clean: Mapping[str, torch.Tensor], positions: Optional[Iterable[int]] = None) -> dict:
    """At each site of `clean` ({site: [b, positions, ...]}, from `clean_activations`), the values
    at `positions` (None: every position) written over what a run computes there, whichever call
    of the run holds them (a prefill, its chunks, decode steps)."""
    if not isinstance(clean, Mapping) or not clean:
        raise AblationError(f"patch takes {{site: clean values}} from clean_activations, got {brief(clean)}")
    _check_patchable(clean)
    if positions is not None:
        positions = sorted({int(p) for p in positions})
        if positions and positions[0] < 0:
            raise AblationError(f"patch positions are whole numbers >= 0, got {positions[0]}")
    return {name: _Patch(values, positions) for name, values in clean.items()}
