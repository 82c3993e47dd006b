"""The plain records a forward's observers fill, and the recorder that fills them; nothing here
reaches into modules.

A `Trace` subscribes to the named sites of a model or an attention stack (`hooks`) for a call
(`with trace.recording(stack.sites):`, or `model(ids, pos, trace=t)`), and each attention layer
call appends one `AttentionRecord` (the recorder, `_Recorder`, assembles it from the layer's
compressor, indexer, top-k and own sites). Tensors are detached CPU copies, so a trace can be kept
across calls, saved or plotted without holding the model's memory. Repeated calls (a prefill, then
decode steps) append records in call order; use `Trace.attention_by_layer` to regroup them per layer
and query position.

`ForwardTrace` is the Trace the whole backbone fills: also a `RoutingRecord` per MoE layer call
and an `EngramRecord` per Engram layer call. A `StepRecord` is one token a traced `generate` run
produced (`generation.GenerationTrace` holds them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class AttentionRecord:
    """One attention layer's forward over queries at positions start_pos .. start_pos + s - 1.

    Score fields are float32 [b, s]; index fields int [b, s, width] with -1 for "none".
    `kth_score` / `next_score` are the k-th and (k+1)-th largest index scores among the
    positions the query can reach (k = index_topk); both are NaN where the query reaches no more
    than k positions. That is "nothing truncated" except inside a candidate pool smaller than k,
    where the spare picks are unreachable (-inf) positions and the ranked row is wider than the
    reachable one (dsv41.observe.csa2_stats classifies ties on the ranked row). kth == next is a tie at the cut: which
    of the tied positions survive is up to the top-k implementation, and can differ between a
    prefill and the same tokens decoded one at a time.
    """

    layer: int
    mode: str  # 'full' | 'reindex' | 'reuse'
    compress_ratio: int
    start_pos: int
    seqlen: int
    # compressed positions each query attends to (no window offset), padded with -1 to index_topk
    selected: Optional[torch.Tensor] = None
    # the layer whose indexer produced `selected` (itself for Full / Reindex layers)
    selected_by: Optional[int] = None
    # how many compressed positions each query can reach: (position + 1) // ratio, [s]
    reachable: Optional[torch.Tensor] = None
    # --- index-source layers only
    kth_score: Optional[torch.Tensor] = None
    next_score: Optional[torch.Tensor] = None
    index_scores: Optional[torch.Tensor] = None  # [b, s, T] float32, when Trace.keep_index_scores
    # the layer whose published index keys were scored against (differs from the owner on the
    # reference's stale-key decode steps)
    index_keys_from: Optional[int] = None
    # --- the candidate source and the Reindex layers reading its mask
    candidate_blocks: Optional[torch.Tensor] = None  # [b, s, n_blocks] bool, blocks kept
    candidates_from: Optional[int] = None
    # candidate source only: k-th / (k+1)-th block scores (k = candidate_topk_blocks), NaN where
    # the query reaches no more than k blocks; the pinned (still filling) block scores +inf
    candidate_kth_score: Optional[torch.Tensor] = None
    candidate_next_score: Optional[torch.Tensor] = None
    # whether this layer's compressor completed a group (wrote compressed KV) in this call
    wrote_compressed: bool = False
    output: Optional[torch.Tensor] = None  # [b, s, dim], when Trace.keep_outputs

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start_pos, self.start_pos + self.seqlen)

    def ties(self) -> Optional[torch.Tensor]:
        """bool [b, s]: the k-th and (k+1)-th index scores are equal (a tie at the top-k cut)."""
        if self.kth_score is None:
            return None
        return self.kth_score == self.next_score  # NaN compares unequal: no truncation, no tie

    def candidate_ties(self) -> Optional[torch.Tensor]:
        if self.candidate_kth_score is None:
            return None
        return self.candidate_kth_score == self.candidate_next_score


@dataclass
class Trace:
    """What a forward records when asked. Options say how much to keep."""

    keep_index_scores: bool = False
    keep_outputs: bool = False
    attention: list[AttentionRecord] = field(default_factory=list)
    # "site: label" of each intervention active in a recorded call (`interventions.intervene`),
    # once each, in the order first met: what the records show is the intervened forward's
    interventions: list[str] = field(default_factory=list)

    def attention_by_layer(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per layer, the records' per-query fields concatenated along the query axis (in call
        order): {'positions': [n], 'selected': [b, n, k], 'kth_score': [b, n], ...}. Fields a
        layer never filled are absent."""
        grouped: dict[int, list[AttentionRecord]] = {}
        for rec in self.attention:
            grouped.setdefault(rec.layer, []).append(rec)
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer, recs in grouped.items():
            fields: dict[str, torch.Tensor] = {"positions": torch.cat([r.positions for r in recs])}
            for name in (
                "selected",
                "kth_score",
                "next_score",
                "candidate_blocks",
                "candidate_kth_score",
                "candidate_next_score",
                "output",
            ):
                parts = [getattr(r, name) for r in recs]
                if all(p is not None for p in parts):
                    fields[name] = _cat_queries(parts)
            if all(r.reachable is not None for r in recs):
                fields["reachable"] = torch.cat([r.reachable for r in recs])
            out[layer] = fields
        return out

    def clear(self) -> None:
        self.attention.clear()
        self.interventions.clear()

    def observers(self, start_pos: int = 0) -> dict:
        """{site pattern: observer} that fill this trace from one call at `start_pos` (`hooks`):
        here the attention records, from each attention layer's sites."""
        return dict.fromkeys(_ATTENTION_SITES, _Recorder(self, start_pos))

    def recording(self, sites, start_pos: int = 0):
        """`with trace.recording(stack.sites):` this trace filled from every call in the block (its
        patterns a model or stack lacks skipped); `Model(..., trace=)` does this for its call. The
        interventions registered at `sites` when it starts are noted in `interventions`."""
        for name, fn in sites.active_interventions():
            entry = f"{name}: {getattr(fn, 'label', None) or type(fn).__name__}"
            if entry not in self.interventions:
                self.interventions.append(entry)
        return sites.hooks(self.observers(start_pos), strict=False)


def _cat_queries(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate [b, s, ...] along s, right-padding a trailing width that grows between calls
    (candidate block masks widen as the context grows) with False / -1 / NaN."""
    if parts[0].dim() <= 2:
        return torch.cat(parts, dim=1)
    width = max(p.size(-1) for p in parts)
    padded = []
    for p in parts:
        if p.size(-1) < width:
            fill = False if p.dtype == torch.bool else (float("nan") if p.is_floating_point() else -1)
            grown = p.new_full((*p.shape[:-1], width), fill)
            grown[..., : p.size(-1)] = p
            p = grown
        padded.append(p)
    return torch.cat(padded, dim=1)


# ---------------------------------------------------------------------- trace records
@dataclass
class RoutingRecord:
    """One MoE layer's routing for one forward call: expert ids and weights per token."""

    layer: int
    start_pos: int
    expert_ids: torch.Tensor  # [b, s, k] int64
    weights: torch.Tensor  # [b, s, k] float32 (normalized and scaled)
    cache_hits: int = 0
    cache_misses: int = 0
    # calls that held image-span tokens: which they were ([b, s] bool; they chose with bias_vl), and
    # the experts the text bias would have chosen for every token ([b, s, k]), to count what bias_vl changed
    image_mask: Optional[torch.Tensor] = None
    text_bias_ids: Optional[torch.Tensor] = None


@dataclass
class EngramRecord:
    """One Engram layer's gate values for one forward call."""

    layer: int
    start_pos: int
    gate: torch.Tensor  # [b, s, hc_mult] float32 in (0, 1); 0 where the token mask shuts it


@dataclass
class FiniteRecord:
    """Whether one site's output held only finite values (`ForwardTrace.check_finite`)."""

    layer: Optional[int]  # None for the embedding and the head
    site: str  # 'embedding' | 'engram' | 'attention' | 'ffn' | 'head'
    start_pos: int
    finite: bool


@dataclass
class ForwardTrace(Trace):
    """A Trace that the backbone also fills: routing per MoE layer and gate values per Engram layer,
    on top of the attention records; with `check_finite`, one FiniteRecord per site (embedding,
    each block's Engram, attention and FFN sites, head), which is how a NaN is traced to where it
    began. Records append in call order (a prefill, then decode steps)."""

    routing: list[RoutingRecord] = field(default_factory=list)
    engram: list[EngramRecord] = field(default_factory=list)
    check_finite: bool = False
    finite: list[FiniteRecord] = field(default_factory=list)

    def first_non_finite(self) -> Optional[FiniteRecord]:
        return next((r for r in self.finite if not r.finite), None)

    def clear(self) -> None:
        super().clear()
        self.routing.clear()
        self.engram.clear()
        self.finite.clear()

    def observers(self, start_pos: int) -> dict:
        """{site pattern: observer} that fill this trace's routing and Engram records (and, with
        check_finite, its finite records) from one forward at `start_pos` (`hooks`)."""
        recorder = _Recorder(self, start_pos)
        patterns = [*_ATTENTION_SITES, "layers.*.ffn", "layers.*.engram"]
        if self.check_finite:
            patterns += ["embed", "layers.*.resid_mid", "layers.*.resid_post", "head"]
        return dict.fromkeys(patterns, recorder)

    def routing_by_layer(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per layer: 'positions' [n], 'expert_ids' [b, n, k], 'weights' [b, n, k] over all calls;
        'image_mask' [b, n] (image-span tokens) and 'text_bias_ids' [b, n, k] (the text bias's choice,
        the same as expert_ids outside image spans) when any call held image tokens."""
        out = _by_layer(self.routing, ("expert_ids", "weights"))
        if any(r.image_mask is not None for r in self.routing):
            for layer, fields in out.items():
                recs = [r for r in self.routing if r.layer == layer]
                fields["image_mask"] = torch.cat(
                    [
                        r.image_mask
                        if r.image_mask is not None
                        else torch.zeros(r.expert_ids.shape[:2], dtype=torch.bool)
                        for r in recs
                    ],
                    dim=1,
                )
                fields["text_bias_ids"] = torch.cat(
                    [r.expert_ids if r.text_bias_ids is None else r.text_bias_ids for r in recs], dim=1
                )
        return out

    def engram_by_layer(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per Engram layer: 'positions' [n], 'gate' [b, n, hc] over all calls."""
        return _by_layer(self.engram, ("gate",))


# site (the last part of its name) -> the FiniteRecord site it is checked as
_FINITE_SITES = {
    "embed": "embedding",
    "engram": "engram",
    "resid_mid": "attention",
    "resid_post": "ffn",
    "head": "head",
}
# an attention layer's own site (its record completes there) and its parts' (they add to it)
_ATTENTION_SITES = ("layers.*.attn", "layers.*.attn.compressor", "layers.*.attn.indexer", "layers.*.attn.topk")


class _Recorder:
    """A trace's observer for one call: an attention record per attention layer (its parts' sites
    first, then its own), routing at each MoE's site, gates at each Engram's, and a finite check
    wherever it is subscribed among `_FINITE_SITES`."""

    def __init__(self, trace: Trace, start_pos: int):
        self.trace, self.start_pos = trace, start_pos
        self.attention_parts: dict[str, dict] = {}  # attention site -> record fields its parts gave

    def __call__(self, name: str, value, context: dict) -> None:
        parts = name.split(".")
        kind = parts[-1]
        if kind in _ATTENTION_PARTS:
            fields = self.attention_parts.setdefault(name.rsplit(".", 1)[0], {})
            _ATTENTION_PARTS[kind](self.trace, fields, value, context)
            return
        if kind == "attn":
            self.trace.attention.append(
                _attention_record(self.trace, self.attention_parts.pop(name, {}), value, context)
            )
            return
        layer = int(parts[1]) if parts[0] == "layers" else None
        if kind == "ffn":
            self.trace.routing.append(_routing_record(layer, self.start_pos, context))
        elif kind == "engram":
            self.trace.engram.append(EngramRecord(layer, self.start_pos, context["gate"].detach().cpu()))
        if getattr(self.trace, "check_finite", False) and kind in _FINITE_SITES:
            self.trace.finite.append(
                FiniteRecord(layer, _FINITE_SITES[kind], self.start_pos, bool(torch.isfinite(value).all()))
            )


def _attention_record(trace: Trace, fields: dict, out: torch.Tensor, context: dict) -> AttentionRecord:
    """One attention call's record from its own site (see `attention.Attention`) and what its
    compressor, indexer and top-k sites gave."""
    start_pos, seqlen, ratio = context["start_pos"], out.size(1), context["compress_ratio"]
    if "selected" in fields:
        fields["reachable"] = (torch.arange(start_pos, start_pos + seqlen) + 1) // ratio
    if trace.keep_outputs:
        fields["output"] = out.detach().cpu()
    return AttentionRecord(
        layer=context["layer"], mode=context["mode"], compress_ratio=ratio, start_pos=start_pos, seqlen=seqlen, **fields
    )


def _compressor_fields(trace: Trace, fields: dict, latent, context: dict) -> None:
    fields["wrote_compressed"] = latent is not None


def _topk_fields(trace: Trace, fields: dict, selected: torch.Tensor, context: dict) -> None:
    fields["selected"] = selected.cpu()
    fields["selected_by"] = context["selected_by"]


def _indexer_fields(trace: Trace, fields: dict, selected: torch.Tensor, context: dict) -> None:
    """The cut scores (and the block cut's, at the candidate source), whose keys were scored, the
    candidate blocks, optionally every score (`Indexer`'s site)."""
    score = context["score"]
    if score is None:  # nothing reachable yet, so nothing truncated
        fields["kth_score"] = torch.full(selected.shape[:2], float("nan"))
        fields["next_score"] = fields["kth_score"].clone()
        return
    indexer, reachable, mask = context["indexer"], context["reachable"], context["mask"]
    fields["index_keys_from"] = context["index_keys_from"]
    fields["kth_score"], fields["next_score"] = (t.cpu() for t in _cut_scores(score, reachable, indexer.index_topk))
    if trace.keep_index_scores:
        fields["index_scores"] = score.float().cpu()
    if indexer.is_candidate_source:
        # the block scores are taken before any candidate mask (this layer makes the mask)
        block_scores = indexer.block_scores(score, reachable)
        reach_blocks = -(-reachable // indexer.candidate_block_size)
        fields["candidate_kth_score"], fields["candidate_next_score"] = (
            t.cpu() for t in _cut_scores(block_scores, reach_blocks, indexer.candidate_topk_blocks)
        )
    if mask is not None:
        fields["candidate_blocks"] = mask[..., :: indexer.candidate_block_size].cpu()
        fields["candidates_from"] = context["candidates_from"]


_ATTENTION_PARTS = {"compressor": _compressor_fields, "indexer": _indexer_fields, "topk": _topk_fields}


def _cut_scores(scores: torch.Tensor, reachable: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k-th and (k+1)-th largest of `scores` [b, s, T] (unreachable entries -inf), float32 [b, s];
    NaN where the query reaches no more than k entries (`reachable` [s])."""
    b, s, width = scores.shape
    nan = scores.new_full((b, s), float("nan"), dtype=torch.float32)
    if width <= k:
        return nan, nan.clone()
    top = scores.float().topk(k + 1, dim=-1).values  # sorted, descending
    truncated = (reachable > k).view(1, s)
    return (torch.where(truncated, top[..., k - 1], nan), torch.where(truncated, top[..., k], nan))


def _routing_record(layer: int, start_pos: int, context: dict) -> RoutingRecord:
    """One MoE call's record from its site's context (see `moe.MoE`)."""
    x, ids, weights, image_mask = context["x"], context["ids"], context["weights"], context["image_mask"]
    lead = x.shape[:-1]  # [b, s]
    fetched = getattr(context["experts"], "last_fetch", None)  # None: a stand-in without counts
    images = image_mask is not None and bool(image_mask.any())
    return RoutingRecord(
        layer,
        start_pos,
        ids.reshape(*lead, -1).cpu(),
        weights.reshape(*lead, -1).detach().cpu(),
        cache_hits=fetched.hits if fetched is not None else 0,
        cache_misses=fetched.misses if fetched is not None else 0,
        image_mask=image_mask.reshape(lead).cpu() if images else None,
        # a second routing with the text bias, for the record only: the forward used the first
        text_bias_ids=context["gate"](x.reshape(-1, x.shape[-1]))[1].reshape(*lead, -1).cpu() if images else None,
    )


def _by_layer(records, names) -> dict[int, dict[str, torch.Tensor]]:
    grouped: dict[int, list] = {}
    for rec in records:
        grouped.setdefault(rec.layer, []).append(rec)
    out = {}
    for layer, recs in sorted(grouped.items()):
        positions = [torch.arange(r.start_pos, r.start_pos + getattr(r, names[0]).size(1)) for r in recs]
        out[layer] = {"positions": torch.cat(positions)}
        for name in names:
            out[layer][name] = torch.cat([getattr(r, name) for r in recs], dim=1)
    return out


# ---------------------------------------------------------------------- generation records
@dataclass
class StepRecord:
    """One produced token: the position it was predicted at, its id, and the logit margin there."""

    position: int  # position of the logits row it was taken from (the token goes at position + 1)
    token: int
    margin: float  # top-1 minus top-2 logit
    seconds: float
