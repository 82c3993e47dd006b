"""Plain data a forward fills when handed a trace object; nothing here reaches into modules.

Pass a `Trace` to a forward (`AttentionStack.forward(x, pos, trace=t)`, `Attention.forward(...,
trace=t)`); each attention layer call appends one `AttentionRecord`. Tensors are detached CPU
copies, so a trace can be kept across calls, pickled or plotted without holding the model's
memory. Repeated calls (a prefill, then decode steps) append records in call order; use
`Trace.attention_by_layer` to regroup them per layer and query position.

`ForwardTrace` is the Trace the whole backbone fills: also a `RoutingRecord` per MoE layer call
and an `EngramRecord` per Engram layer call. `GenerationTrace` is what a traced `generate` run
returns: that ForwardTrace, a `StepRecord` per produced token and the expert-cache accounting;
`GenerationTrace.save(path)` / `GenerationTrace.load(path)` keep one in a file without pickle (an
NPZ archive of plain arrays and a JSON manifest), so a trace recorded on the real checkpoint can be
replayed (`dsv41.cache_policy`) anywhere. This module imports no model code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class AttentionRecord:
    """One attention layer's forward over queries at positions start_pos .. start_pos + s - 1.

    Score fields are float32 [b, s]; index fields int [b, s, width] with -1 for "none".
    `kth_score` / `next_score` are the k-th and (k+1)-th largest index scores among the
    positions the query can reach (k = index_topk); both are NaN where the query reaches no more
    than k positions. That is "nothing truncated" except inside a candidate pool smaller than k,
    where the spare picks are unreachable (-inf) positions and the ranked row is wider than the
    reachable one (dsv41.csa2_stats classifies ties on the ranked row). kth == next is a tie at the cut: which of
    the tied positions survive is up to the top-k implementation, and can differ between a
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
            for name in ("selected", "kth_score", "next_score", "candidate_blocks",
                         "candidate_kth_score", "candidate_next_score", "output"):
                parts = [getattr(r, name) for r in recs]
                if all(p is not None for p in parts):
                    fields[name] = _cat_queries(parts)
            if all(r.reachable is not None for r in recs):
                fields["reachable"] = torch.cat([r.reachable for r in recs])
            out[layer] = fields
        return out

    def clear(self) -> None:
        self.attention.clear()


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

    def routing_by_layer(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per layer: 'positions' [n], 'expert_ids' [b, n, k], 'weights' [b, n, k] over all calls;
        'image_mask' [b, n] (image-span tokens) and 'text_bias_ids' [b, n, k] (the text bias's choice,
        the same as expert_ids outside image spans) when any call held image tokens."""
        out = _by_layer(self.routing, ("expert_ids", "weights"))
        if any(r.image_mask is not None for r in self.routing):
            for layer, fields in out.items():
                recs = [r for r in self.routing if r.layer == layer]
                fields["image_mask"] = torch.cat([r.image_mask if r.image_mask is not None else
                                                  torch.zeros(r.expert_ids.shape[:2], dtype=torch.bool)
                                                  for r in recs], dim=1)
                fields["text_bias_ids"] = torch.cat([r.expert_ids if r.text_bias_ids is None else r.text_bias_ids
                                                     for r in recs], dim=1)
        return out

    def engram_by_layer(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per Engram layer: 'positions' [n], 'gate' [b, n, hc] over all calls."""
        return _by_layer(self.engram, ("gate",))


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


@dataclass
class GenerationTrace:
    """Everything a traced run recorded, as plain data.

    forward: the backbone's ForwardTrace (attention records: indexer selections and candidate blocks;
    routing records: expert ids and weights per layer and token; Engram gate values); steps: per
    produced token its logit margin; cache: per forward call the expert-cache hits and misses by layer;
    meta: plain facts about the run a reader of a saved trace needs (`n_routed_experts`,
    `expert_cache`, the checkpoint, the prompt...), JSON values only, kept by `save` / `load`."""

    forward: ForwardTrace
    steps: list[StepRecord] = field(default_factory=list)
    cache: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def margins(self) -> list[float]:
        return [s.margin for s in self.steps]

    def routing(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.forward.routing_by_layer()

    def engram_gates(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.forward.engram_by_layer()

    def attention(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.forward.attention_by_layer()

    def to_dict(self) -> dict:
        """Nested lists and numbers only (JSON-ready)."""
        def plain(groups):
            return {str(layer): {k: v.tolist() for k, v in fields.items()} for layer, fields in groups.items()}

        return {"steps": [vars(s) for s in self.steps], "cache": self.cache,
                "routing": plain(self.routing()), "engram": plain(self.engram_gates()),
                "attention": plain(self.attention())}

    # ------------------------------------------------------------------ files (no pickle)
    def save(self, path, meta: Optional[dict] = None) -> str:
        """Write the whole trace to `path` (an NPZ archive, whatever the name): every record of the
        ForwardTrace with its options, the steps, the per-call cache counts and `meta` (updated with
        `meta` if given). Tensors are stored as plain arrays with their torch dtype named (bf16 and
        FP8 as same-width integers), everything else in a JSON manifest; `load` reads it back with
        `allow_pickle=False`. Returns the path."""
        return save_trace(self, path, meta)

    @classmethod
    def load(cls, path) -> "GenerationTrace":
        """A trace written by `save`. TraceFileError (a ValueError) when the file is not one;
        FileNotFoundError when it does not exist."""
        return load_trace(path)


# ---------------------------------------------------------------------- trace files
TRACE_FORMAT = "dsv41.GenerationTrace"
TRACE_VERSION = 1
_MANIFEST = "manifest"
# torch dtypes numpy has no type for, stored as the same bytes in an integer of their width
_VIEW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
if hasattr(torch, "float8_e8m0fnu"):
    _VIEW_AS[torch.float8_e8m0fnu] = torch.uint8
_RECORDS = {"attention": AttentionRecord, "routing": RoutingRecord, "engram": EngramRecord, "finite": FiniteRecord}


class TraceFileError(ValueError):
    """A file that is not a trace `GenerationTrace.save` wrote (or one from a newer version)."""


def save_trace(trace: GenerationTrace, path, meta: Optional[dict] = None) -> str:
    import numpy as np

    path = os.fspath(path)
    arrays: dict[str, Any] = {}

    def tensor(t: torch.Tensor) -> dict:
        key = f"t{len(arrays)}"
        t = t.detach().cpu().contiguous()
        stored = t.view(_VIEW_AS[t.dtype]) if t.dtype in _VIEW_AS else t
        arrays[key] = stored.numpy()
        return {"tensor": key, "dtype": str(t.dtype).removeprefix("torch.")}

    def value(v):
        if isinstance(v, torch.Tensor):
            return tensor(v)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"a trace record holds a {type(v).__name__}, which a trace file cannot keep")

    def record(rec) -> dict:
        return {f.name: value(getattr(rec, f.name)) for f in dataclasses.fields(rec)}

    fwd = trace.forward
    manifest = {
        "format": TRACE_FORMAT, "version": TRACE_VERSION,
        "forward": {"class": type(fwd).__name__,
                    "options": {"keep_index_scores": fwd.keep_index_scores, "keep_outputs": fwd.keep_outputs,
                                "check_finite": getattr(fwd, "check_finite", False)},
                    **{name: [record(r) for r in getattr(fwd, name, [])] for name in _RECORDS}},
        "steps": [record(s) for s in trace.steps],
        "cache": [{**{k: v for k, v in step.items() if k != "layers"},
                   "layers": [[int(layer), [int(c) for c in counts]] for layer, counts in step.get("layers", {}).items()]}
                  for step in trace.cache],
        "meta": {**trace.meta, **(meta or {})},
    }
    try:
        text = json.dumps(manifest, allow_nan=True)
    except TypeError as exc:
        raise TypeError(f"the trace's meta or cache holds something JSON cannot keep: {exc}") from None
    arrays[_MANIFEST] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # the archive np.savez_compressed writes, with a fixed date on every member, so the same trace
    # gives the same bytes (and the name stays as given: numpy would append ".npz")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for key, array in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)
    return path


def load_trace(path) -> GenerationTrace:
    import numpy as np

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise TraceFileError(f"{path} is a folder, not a trace file")
    try:
        with open(path, "rb") as f:
            blob = f.read()
        if not zipfile.is_zipfile(io.BytesIO(blob)):
            raise TraceFileError(f"{path} is not a trace written by GenerationTrace.save (not an NPZ archive)")
        archive = np.load(io.BytesIO(blob), allow_pickle=False)
        if not hasattr(archive, "files") or _MANIFEST not in archive.files:
            raise TraceFileError(f"{path} is not a trace written by GenerationTrace.save (no manifest)")
        manifest = json.loads(archive[_MANIFEST].tobytes().decode("utf-8"))
        arrays = {k: archive[k] for k in archive.files if k != _MANIFEST}
    except TraceFileError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, UnicodeDecodeError, EOFError) as exc:
        raise TraceFileError(f"{path} is not a trace written by GenerationTrace.save ({_reason(exc)})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != TRACE_FORMAT:
        raise TraceFileError(f"{path} is not a trace written by GenerationTrace.save (its manifest names no "
                             f"{TRACE_FORMAT})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > TRACE_VERSION:
        raise TraceFileError(f"{path} is a trace file of version {version!r}; this dsv41 reads version "
                             f"{TRACE_VERSION} and older")
    try:
        return _from_manifest(manifest, arrays)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise TraceFileError(f"{path} is a damaged trace file ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().rstrip(".") or type(exc).__name__
    if "pickle" in text:
        return "it holds pickled objects, which are never loaded"
    return text.splitlines()[0]


def _from_manifest(manifest: dict, arrays: dict) -> GenerationTrace:
    def value(v):
        if isinstance(v, dict) and "tensor" in v:
            dtype = getattr(torch, v["dtype"])
            t = torch.from_numpy(arrays[v["tensor"]].copy())
            return t.view(dtype) if dtype in _VIEW_AS else t.to(dtype)
        return v

    def record(cls, fields: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: value(v) for k, v in fields.items() if k in known})

    fwd = manifest["forward"]
    forward = ForwardTrace(**fwd.get("options", {}))
    for name, cls in _RECORDS.items():
        getattr(forward, name).extend(record(cls, r) for r in fwd.get(name, []))
    steps = [record(StepRecord, s) for s in manifest.get("steps", [])]
    cache = [{**{k: v for k, v in step.items() if k != "layers"},
              "layers": {int(layer): list(counts) for layer, counts in step.get("layers", [])}}
             for step in manifest.get("cache", [])]
    return GenerationTrace(forward, steps, cache, dict(manifest.get("meta", {})))
