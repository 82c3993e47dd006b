"""CSA2 facts as numbers: who writes and reads which cache, what the caches cost per token, what a
compressor does call by call, and where prefill and decode part ways.

Notebooks 03 and 04 plot these; each is also a plain API:

- `layer_map(cfg)`             per layer: mode, ratio, caches written and read (and from which layer),
                               RoPE base and whether YaRN applies;
- `measured_cache_bytes(cfg, max_seq_len)`  KV-cache bytes by component measured from the buffers
                               an AttentionStack of that geometry allocates (built on the meta device:
                               any size, no memory); the formula's prediction is
                               `attention.kv_cache_bytes(cfg)`;
- `allocated_cache_bytes(stack)`  a built stack's cache buffers by kind;
- `attention_stack(model)`     an `AttentionStack` carrying a loaded checkpoint's attention weights,
                               optionally over a changed config (e.g. another `index_topk`);
- `compressor_trace(layer, x, prefill)`  groups pooled, held and emitted per call, and the position
                               each latent and index key was rotated at;
- `candidate_pin_effect(...)`  where the pinned (still filling) candidate block would have lost;
- `prefill_decode_divergence(stack, x)`  differing selections, how many are top-k ties, output gap;
- `prefill_then_decode(stack, x)`  the two orders it compares, untraced (for timing them);
- `topk_sweep(model, x, widths)`  that divergence over a range of `index_topk`;
- `numerics_comparison(model, x)`  that divergence under each `window_layout` and `pad_f32_rows`;
- `stale_key_comparison(model, x)`  the reference's stale index keys against the opt-in fix.

Everything here reads traces and buffers; nothing hooks into modules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F

from ..core.config import Config
from ..core.numerics import WINDOW_LAYOUTS, Numerics
from ..kernels import fp4_act_quant
from ..model.attention import (
    COMPRESSED_KV,
    COMPRESSOR_TAILS,
    INDEX_FP4_BLOCK,
    INDEX_KEYS,
    KV_FP4_BLOCK,
    WINDOW_RING,
    Attention,
    AttentionRuntime,
    CacheBytes,
    KVCacheBytes,
    candidate_block_scores,
    check_cache_format,
    select_candidate_blocks,
)
from ..model.hooks import sites_of
from ..model.layers import apply_rotary_emb, parameters_on_meta
from ..model.trace import Trace
from .csa2_stack import AttentionStack

if TYPE_CHECKING:  # annotations only
    from ..model.model import Model

WINDOW, COMPRESSED, TOPK, CANDIDATES = WINDOW_RING, COMPRESSED_KV, "top-k", "candidate blocks"


# ---------------------------------------------------------------------------------- layer map
@dataclass(frozen=True)
class LayerRole:
    """One backbone layer's part in CSA2. `reads` maps a shared cache to the layer that wrote it
    (the layer itself for its own); a pure window layer reads only its own window ring."""

    layer: int
    mode: str  # 'full' | 'reindex' | 'reuse'
    ratio: int
    writes: tuple[str, ...]
    reads: dict
    rope_base: float
    yarn: bool

    def table_row(self) -> dict:
        """This layer as a row of notebook 03's layer-map table: the caches it writes, and the ones it
        reads from another layer with that layer's number ("own" for its own)."""
        reads = ", ".join(
            f"{name} <- {'own' if src == self.layer else src}" for name, src in self.reads.items() if name != WINDOW
        )
        return {
            "layer": self.layer,
            "mode": self.mode,
            "ratio": self.ratio,
            "writes": ", ".join(self.writes),
            "reads (<- from layer)": reads or "own window only",
            "RoPE base": int(self.rope_base),
            "YaRN": self.yarn,
        }


def layer_map(cfg: Config) -> list[LayerRole]:
    """Per backbone layer: mode, compress ratio, the caches it writes and reads (with the writing
    layer), its RoPE base and whether YaRN applies (layers reading compressed positions only).

    Index keys are read from the latest Full layer at or before the layer: what it scores against
    on every prefill, and on every decode step with `fix_stale_index_keys=True` (without it, see
    `stale_key_comparison`)."""
    cand = cfg.candidate_source_layer if cfg.candidate_source_layer is not None else -1
    roles = []
    for layer in range(cfg.n_layers):
        ratio = cfg.compress_ratios[layer]
        mode = cfg.layer_mode(layer)
        writes, reads = [WINDOW], {WINDOW: layer}
        if mode == "full":
            writes += [COMPRESSED, INDEX_KEYS]
        if mode in ("full", "reindex"):
            writes.append(TOPK)
        if layer == cand:
            writes.append(CANDIDATES)
        if ratio:
            kv_src = cfg.source_at_or_before(layer, cfg.kv_source_layers)
            reads[COMPRESSED] = kv_src
            if mode in ("full", "reindex"):
                reads[INDEX_KEYS] = kv_src
                if 0 <= cand < layer:
                    reads[CANDIDATES] = cand
            reads[TOPK] = cfg.source_at_or_before(layer, cfg.index_source_layers)
        roles.append(
            LayerRole(
                layer=layer,
                mode=mode,
                ratio=ratio,
                writes=tuple(writes),
                reads=reads,
                rope_base=float(cfg.compress_rope_theta if ratio else cfg.rope_theta),
                yarn=bool(ratio),
            )
        )
    return roles


def mode_partition(cfg: Config) -> dict[str, list[int]]:
    """{'full': [...], 'reindex': [...], 'reuse': [...]} over the backbone layers."""
    out: dict[str, list[int]] = {"full": [], "reindex": [], "reuse": []}
    for layer, mode in enumerate(cfg.layer_modes):
        out[mode].append(layer)
    return out


# ---------------------------------------------------------------------------------- cache bytes
# the prediction from a config (`kv_cache_bytes`, `KVCacheBytes`, `HOLDING`) is attention's own byte
# model (`attention.caches`); the measurements below read built stacks


def allocated_cache_bytes(stack: AttentionStack) -> dict[str, int]:
    """Bytes of the cache buffers a stack actually allocated (RoPE tables excluded), by kind, read
    off its named buffers (`stack.cache_bytes().components` must agree)."""
    kinds = {
        "window_kv_cache": WINDOW,
        "compress_kv_cache": COMPRESSED,
        "indexer.k_cache": INDEX_KEYS,
        "compressor.kv_state": COMPRESSOR_TAILS,
        "compressor.score_state": COMPRESSOR_TAILS,
    }
    out = {name: 0 for name in (WINDOW, COMPRESSED, INDEX_KEYS, COMPRESSOR_TAILS)}
    for layer in stack.layers:
        for name, buf in layer.named_buffers():
            if name == "freqs_cis":
                continue
            owner = name.rsplit(".", 1)[0] if name.endswith((".values", ".scales")) else name
            out[kinds[owner]] += buf.numel() * buf.element_size()
    return out


def bytes_by_kind(formula: KVCacheBytes, max_seq_len: int) -> dict[str, int]:
    """The formula's bytes for a stack sized `max_seq_len`, by the kinds `allocated_cache_bytes`
    reads off the buffers (its Full layers' compressed KV and index keys summed), so the two compare
    key for key."""
    parts = formula.components(max_seq_len)
    return {
        WINDOW: parts[WINDOW],
        COMPRESSOR_TAILS: parts[COMPRESSOR_TAILS],
        COMPRESSED: sum(v for k, v in parts.items() if k.endswith(COMPRESSED)),
        INDEX_KEYS: sum(v for k, v in parts.items() if k.endswith(INDEX_KEYS)),
    }


def measured_cache_bytes(
    cfg: Config, max_seq_len: int, *, cache_format: str = "packed", max_batch_size: int = 1
) -> CacheBytes:
    """`CacheBytes` of an AttentionStack of `cfg` sized for `max_seq_len` positions, measured from
    the buffers it allocates. The stack is built on the meta device: every buffer has its shape
    and dtype, so its byte count, and no memory is taken (the released geometry at a million
    positions costs nothing to measure)."""
    check_cache_format(cache_format)
    with torch.device("meta"):
        stack = AttentionStack(cfg, max_seq_len=max_seq_len, max_batch_size=max_batch_size, cache_format=cache_format)
    return stack.cache_bytes()


# ---------------------------------------------------------------------------------- weights
def attention_stack(
    model: Model,
    *,
    numerics: Numerics = Numerics(),
    max_seq_len: Optional[int] = None,
    cache_format: Optional[str] = None,
    **config_changes,
) -> AttentionStack:
    """An AttentionStack holding the attention weights of a loaded `dsv41.load` model, over
    `model.cfg` with `config_changes` (e.g. index_topk=4, window_size=72); changes that alter a
    weight's shape are refused by the state-dict copy. `numerics` is the stack's (the reference's
    by default, whatever the model was loaded with); max_seq_len and cache_format default to the
    model's."""
    cfg = model.cfg.replace(**config_changes) if config_changes else model.cfg
    with parameters_on_meta():  # the stack shares the model's weights: no copy of them
        stack = AttentionStack(
            cfg,
            numerics=numerics,
            max_seq_len=max_seq_len or model.backbone.max_seq_len,
            cache_format=cache_format or model.backbone.cache_format,
        )
    weights = {
        f"layers.{i}.{name}": t
        for i, block in enumerate(model.backbone.layers)
        for name, t in block.attn.named_parameters()
        if name in dict(stack.layers[i].named_parameters())
    }
    with torch.no_grad():
        stack.load_state_dict(weights, strict=True, assign=True)
    return stack


def embed(model: Model, token_ids: Sequence[int]) -> torch.Tensor:
    """[1, s, dim] in the activation dtype: the checkpoint's embeddings of `token_ids`, RMS-normalized
    (parameter-free) as an attention layer's input is."""
    with torch.no_grad():
        x = model.backbone.embed(torch.as_tensor([list(token_ids)], dtype=torch.long))
        return F.rms_norm(x.float(), (x.size(-1),), eps=model.cfg.norm_eps).to(x.dtype)


# ---------------------------------------------------------------------------------- compressor
@dataclass
class CompressorTrace:
    """What a Full layer's compressor did over a prefill of `prefill` tokens and one-token calls
    after it. calls: per call, the groups it emitted and the positions left waiting in the tail.
    groups: per emitted group, its tokens, the softmax gate weight of each token (mean over
    channels; 1.0 at ratio 1), the call and position that emitted it, and the positions whose
    rotation reproduces the cached latent and index key exactly (expected: the group's first)."""

    layer: int
    ratio: int
    n_tokens: int
    prefill: int
    calls: list = field(default_factory=list)
    groups: list = field(default_factory=list)

    @property
    def held_after_prefill(self) -> list[int]:
        return self.calls[0]["held"]


def _rotated_matches(
    row: torch.Tensor, pre_rope: torch.Tensor, freqs: torch.Tensor, positions, rd: int, block: int, scale_dtype
) -> list[int]:
    """Positions p at which rotating `pre_rope` [dim] and FP4-quantizing it gives `row` exactly."""
    hits = []
    for p in positions:
        v = pre_rope.clone()[None, None]  # [1, 1, dim]
        apply_rotary_emb(v[..., -rd:], freqs[p : p + 1])
        fp4_act_quant(v, block, inplace=True, scale_dtype=scale_dtype)
        if torch.equal(v[0, 0], row):
            hits.append(int(p))
    return hits


@torch.no_grad()
def compressor_trace(layer: Attention, x: torch.Tensor, prefill: int) -> CompressorTrace:
    """Run Full layer `layer` (reset first) over x[:, :prefill] and then one token per call, and
    report what its compressor pooled, held and emitted (batch row 0). Leaves the layer reset."""
    if layer.compressor is None:
        raise ValueError(f"layer {layer.layer} is a {layer.mode} layer: it has no compressor")
    ratio, rd, n = layer.ratio, layer.rope_head_dim, x.size(1)
    probe = copy.deepcopy(layer)  # same weights: recomputes the pre-RoPE latents and keys
    probe.reset_state()
    layer.reset_state()
    runtime, wrote = AttentionRuntime(), []  # per call: whether the compressor completed a group
    out = CompressorTrace(layer=layer.layer, ratio=ratio, n_tokens=n, prefill=prefill)
    emitted_by: dict[int, tuple[int, int]] = {}
    calls = [(0, prefill)] + [(p, 1) for p in range(prefill, n)]
    with sites_of(layer).hooks({"*compressor": lambda name, latent, context: wrote.append(latent is not None)}):
        for k, (start, length) in enumerate(calls):
            before = layer.compress_kv_cache.read(1)[0].clone()  # decoded: the values a reader gets
            layer(x[:, start : start + length], start, runtime)
            changed = (layer.compress_kv_cache.read(1)[0] != before).any(-1).nonzero().flatten().tolist()
            end = start + length
            held = list(range(end - end % ratio, end)) if ratio > 1 else []
            held_ok = True
            if held:  # the tail holds exactly the un-pooled projections of those tokens
                kv = layer.compressor.wkv(x[:, held].float())[0]
                held_ok = torch.allclose(
                    layer.compressor.kv_state[0, [p % ratio for p in held]], kv, rtol=1e-5, atol=1e-6
                )
            out.calls.append(
                {
                    "call": k,
                    "start_pos": start,
                    "tokens": length,
                    "emitted_groups": changed,
                    "wrote_compressed": wrote[-1],
                    "held": held,
                    "held_state_matches": held_ok,
                }
            )
            for g in changed:
                emitted_by[g] = (k, end - 1)

    n_groups = n // ratio
    latents = probe.compressor(x[:, : n_groups * ratio], 0)  # [1, groups, head_dim], pre-RoPE
    keys = probe.indexer.k_norm(probe.indexer.wk(latents)) if latents is not None else None
    if ratio > 1:
        x32 = x[0, : n_groups * ratio].float()
        gate = layer.compressor.wgate(x32).unflatten(0, (n_groups, ratio)).softmax(dim=1).mean(-1)  # [groups, ratio]
    else:
        gate = torch.ones(n_groups, 1)
    cached_kv, cached_keys = layer.compress_kv_cache.read(1)[0], layer.indexer.k_cache.read(1)[0]
    for g in range(n_groups):
        tokens = list(range(g * ratio, (g + 1) * ratio))
        candidates = range(g * ratio, min(n, (g + 1) * ratio + 1))  # the group's tokens and the next
        out.groups.append(
            {
                "group": g,
                "tokens": tokens,
                "gate_weights": [float(w) for w in gate[g]],
                "emitted_at_call": emitted_by.get(g, (None, None))[0],
                "emitted_at_position": emitted_by.get(g, (None, None))[1],
                "kv_rotated_at": _rotated_matches(
                    cached_kv[g], latents[0, g], layer.freqs_cis, candidates, rd, KV_FP4_BLOCK, torch.float8_e4m3fn
                ),
                "key_rotated_at": _rotated_matches(
                    cached_keys[g], keys[0, g], layer.freqs_cis, candidates, rd, INDEX_FP4_BLOCK, torch.float8_e8m0fnu
                ),
            }
        )
    layer.reset_state()
    return out


# ---------------------------------------------------------------------------------- candidates
def raw_block_scores(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., T] -> [..., n_blocks]: each block's best position, with no block pinned."""
    # attention's own block scoring, told the newest reachable position lies past the last block
    # (compress_len = T + block_size puts it in block ceil(T / block_size), one past the end), so
    # the pin matches no block and every block keeps its best position
    return candidate_block_scores(scores, scores.size(-1) + block_size, block_size)


def candidate_pin_effect(scores: torch.Tensor, reachable, topk_blocks: int, block_size: int) -> dict:
    """For queries scores [s, T] (-inf where unreachable) reaching reachable [s] positions: the
    blocks kept with the newest-block pin (what select_candidate_blocks does) and by plain ranking
    on each block's best position, and whether the pin kept a newest block the ranking drops.

    Returns lists per query: newest_block, filling (newest block not yet full), kept, kept_unpinned,
    pin_mattered, displaced (blocks the pin pushed out), block_scores (raw, -inf unreachable)."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    if scores.dim() == 1:
        scores = scores[None]
    reach = torch.as_tensor(reachable).reshape(-1)
    if reach.numel() == 1 and scores.size(0) > 1:
        reach = reach.expand(scores.size(0))
    kept = select_candidate_blocks(scores, reach.unsqueeze(-1), topk_blocks, block_size)[..., ::block_size]
    raw = raw_block_scores(scores, block_size)
    n_blocks = raw.size(-1)
    top = raw.topk(min(topk_blocks, n_blocks), dim=-1)
    unpinned = torch.zeros_like(raw, dtype=torch.bool).scatter_(-1, top.indices, top.values > -torch.inf)
    out = {
        k: []
        for k in (
            "reachable",
            "newest_block",
            "filling",
            "kept",
            "kept_unpinned",
            "pin_mattered",
            "displaced",
            "block_scores",
        )
    }
    for q in range(scores.size(0)):
        r = int(reach[q])
        newest = (r - 1) // block_size if r > 0 else None
        keep = kept[q].nonzero().flatten().tolist()
        plain = unpinned[q].nonzero().flatten().tolist()
        out["reachable"].append(r)
        out["newest_block"].append(newest)
        out["filling"].append(r > 0 and r % block_size != 0)
        out["kept"].append(keep)
        out["kept_unpinned"].append(plain)
        out["pin_mattered"].append(newest is not None and newest not in plain)
        out["displaced"].append(sorted(set(plain) - set(keep)))
        out["block_scores"].append(raw[q].tolist())
    return out


# ---------------------------------------------------------------------------------- divergence
def prefill_then_decode(stack: AttentionStack, x: torch.Tensor) -> None:
    """x [1, s, dim] through the stack as one prefill and then one token per call, each from a reset
    state, nothing traced: the work `prefill_decode_divergence` compares, for timing it."""
    with torch.no_grad():
        stack.reset_state()
        stack.forward_each(x, 0)
        stack.reset_state()
        for p in range(x.size(1)):
            stack.forward_each(x[:, p : p + 1], p)


def _both_orders(stack: AttentionStack, x: torch.Tensor):
    """(prefill out, decode out, prefill trace, decode trace) of forward_each, each from a reset
    state: every layer sees the same input, so a difference in one layer cannot leak into the next."""
    tp, td = Trace(keep_index_scores=True), Trace(keep_index_scores=True)
    with torch.no_grad():
        stack.reset_state()
        with tp.recording(stack.sites):
            pre = stack.forward_each(x, 0)  # [layers, b, s, dim]
        stack.reset_state()
        with td.recording(stack.sites):
            dec = torch.cat([stack.forward_each(x[:, p : p + 1], p) for p in range(x.size(1))], dim=2)
        stack.reset_state()
    return pre, dec, tp, td


@dataclass
class Divergence:
    """Prefill vs token-by-token decode of one stack over one input, per layer and in total.

    A differing selection is a *tie* only when the difference is how a tie was broken, checked on
    the rows the two `topk` calls actually ranked (the index source's scores, -inf where a position
    is unreachable or outside the candidate pool; a prefill row also holds the not-yet-reachable
    positions at -inf):

    - at the index cut: both rows are cut at the same score, both selections hold the same
      positions scoring above it, and every position one selection holds and the other does not
      scores exactly the cut in both rows. Where a candidate pool leaves fewer than k finite scores
      the cut is -inf, so the finite picks must be equal and only the -inf spare picks may differ
      (this case has no `kth_score` in the trace: it is NaN when the query reaches no more than
      k positions);
    - or upstream, at the candidate block cut (for a source ranking inside a candidate pool): the
      two pools differ by the same rule on the candidate source's block scores (pin included), and
      the two ranked rows agree everywhere outside the blocks the pools disagree on.

    Any other difference (say, scores that differ between the orders) is not a tie. `differ_at`
    lists (layer, position, tie) for every differing selection; a layer's `n_block_ties` counts
    the ties explained only at the block cut; `n_truncated` counts the (query, layer) pairs whose
    selection, in either order, leaves out a reachable position; its `output_diff` is the max
    |prefill - decode| output per position. `numerics`: the stack's window_layout and
    pad_f32_rows (outside "uniform" and True, outputs may also part by rounding)."""

    index_topk: int
    n_tokens: int
    layers: list = field(default_factory=list)  # one dict per backbone layer
    differ_at: list = field(default_factory=list)
    numerics: dict = field(default_factory=dict)

    @property
    def n_differ(self) -> int:
        return sum(r["n_differ"] for r in self.layers)

    @property
    def n_ties(self) -> int:
        return sum(r["n_ties"] for r in self.layers)

    @property
    def n_truncated(self) -> int:
        return sum(r["n_truncated"] for r in self.layers)

    @property
    def max_output_diff(self) -> float:
        return max(r["max_output_diff"] for r in self.layers)

    @property
    def n_output_differ_without_selection(self) -> int:
        return sum(r["n_output_differ_without_selection"] for r in self.layers)

    @property
    def identical(self) -> bool:
        return self.n_differ == 0 and self.max_output_diff == 0.0

    def positions_differing(self, layers) -> list[int]:
        """The query positions whose output differs in any of `layers`, ascending."""
        return sorted({p for r in self.layers if r["layer"] in layers for p, v in enumerate(r["output_diff"]) if v > 0})

    def summary(self) -> dict:
        return {
            "index_topk": self.index_topk,
            "n_tokens": self.n_tokens,
            **self.numerics,
            "n_truncated": self.n_truncated,
            "n_differ": self.n_differ,
            "n_ties": self.n_ties,
            "max_output_diff": self.max_output_diff,
            "n_output_differ_without_selection": self.n_output_differ_without_selection,
            "identical": self.identical,
        }


def _ranked_rows(trace: Trace, layer: int) -> list[Optional[torch.Tensor]]:
    """Per query of `layer`, in call order: the row its topk ranked (index_scores [T] float32),
    None where nothing was reachable yet."""
    rows: list[Optional[torch.Tensor]] = []
    for rec in trace.attention:
        if rec.layer == layer:
            rows.extend([None] * rec.seqlen if rec.index_scores is None else rec.index_scores[0].unbind(0))
    return rows


def _at(row: Optional[torch.Tensor], t: int) -> float:
    """row[t], -inf past the row's end (a narrower decode row) or for no row."""
    return float(row[t]) if row is not None and t < row.numel() else -float("inf")


def _cut(row: Optional[torch.Tensor], k: int) -> float:
    """The score topk(k) cuts `row` at: its k-th largest entry (its smallest when it has <= k)."""
    if row is None or row.numel() == 0:
        return -float("inf")
    return float(row.topk(min(k, row.numel())).values[-1])


def _tie_broken(picks_a: set, picks_b: set, row_a, row_b, k: int) -> bool:
    """Whether top-k picks of rows a and b differ only in how a tie at the cut was broken: same cut
    score, the same picks above it, and every pick one makes and the other does not scores exactly
    the cut in both rows. A cut at -inf (fewer than k finite scores) thus lets only -inf picks differ."""
    cut = _cut(row_a, k)
    if cut != _cut(row_b, k):
        return False
    if {t for t in picks_a if _at(row_a, t) > cut} != {t for t in picks_b if _at(row_b, t) > cut}:
        return False
    return all(_at(row_a, t) == cut == _at(row_b, t) for t in picks_a ^ picks_b)


def _picks(selection: torch.Tensor) -> set:
    """Positions a selection row holds (-1 = none), or the True indices of a block mask row."""
    if selection.dtype == torch.bool:
        return set(selection.nonzero().flatten().tolist())
    return set(selection[selection >= 0].tolist())


def prefill_decode_divergence(stack: AttentionStack, x: torch.Tensor) -> Divergence:
    """Run `stack` (forward_each) as one prefill and as one token per call over x [1, s, dim] and
    compare, per layer and query: selection, whether a differing one is a tie (see `Divergence`),
    output. Leaves the stack reset."""
    cfg = stack.cfg
    pre, dec, tp, td = _both_orders(stack, x)
    a, b = tp.attention_by_layer(), td.attention_by_layer()
    cand = cfg.candidate_source_layer if cfg.candidate_source_layer is not None else -1
    rows_p: dict[int, list] = {}
    rows_d: dict[int, list] = {}

    def rows(layer: int) -> tuple[list, list]:
        if layer not in rows_p:
            rows_p[layer], rows_d[layer] = _ranked_rows(tp, layer), _ranked_rows(td, layer)
        return rows_p[layer], rows_d[layer]

    def pool_tie(src: int, q: int) -> bool:
        """The two candidate pools of query q differ only by a tie at the block cut, and the source's
        ranked rows agree outside the blocks they disagree on."""
        pool_p, pool_d = _picks(a[src]["candidate_blocks"][0, q]), _picks(b[src]["candidate_blocks"][0, q])
        if pool_p == pool_d:
            return False
        bs = cfg.candidate_block_size
        cp, cd = (r[q] for r in rows(cand))
        reach_c = int(a[cand]["reachable"][q])
        blocks_p, blocks_d = (None if r is None else candidate_block_scores(r, reach_c, bs) for r in (cp, cd))
        if not _tie_broken(pool_p, pool_d, blocks_p, blocks_d, cfg.candidate_topk_blocks):
            return False
        apart = {t for blk in pool_p ^ pool_d for t in range(blk * bs, (blk + 1) * bs)}
        sp, sd = (r[q] for r in rows(src))
        return all(_at(sp, t) == _at(sd, t) for t in range(int(a[src]["reachable"][q])) if t not in apart)

    result = Divergence(
        index_topk=cfg.index_topk,
        n_tokens=x.size(1),
        numerics={"window_layout": stack.numerics.window_layout, "pad_f32_rows": stack.numerics.pad_f32_rows},
    )
    for layer in range(cfg.n_layers):
        ratio = cfg.compress_ratios[layer]
        out_diff = (pre[layer, 0].float() - dec[layer, 0].float()).abs().amax(-1)  # [s]
        row = {
            "layer": layer,
            "mode": cfg.layer_mode(layer),
            "ratio": ratio,
            "source": None,
            "n_truncated": 0,
            "n_differ": 0,
            "n_ties": 0,
            "n_block_ties": 0,
            "max_output_diff": float(out_diff.max()),
            "output_diff": out_diff.tolist(),
            "n_output_differ_without_selection": int((out_diff > 0).sum()),
        }
        if ratio:
            src = cfg.source_at_or_before(layer, cfg.index_source_layers)
            sel_p, sel_d = a[layer]["selected"][0], b[layer]["selected"][0]  # [s, index_topk]
            sel_diff = (sel_p != sel_d).any(-1)  # [s]
            # truncated: a selection (either order) leaves out a reachable position
            reach = a[layer]["reachable"]
            truncated = ((sel_p >= 0).sum(-1) < reach) | ((sel_d >= 0).sum(-1) < reach)
            n_ties = n_block_ties = 0
            for q in sel_diff.nonzero().flatten().tolist():
                ranked_p, ranked_d = (r[q] for r in rows(src))
                tie = _tie_broken(_picks(sel_p[q]), _picks(sel_d[q]), ranked_p, ranked_d, cfg.index_topk)
                if not tie and 0 <= cand < src:  # the source ranked inside the candidate pool
                    tie = pool_tie(src, q)
                    n_block_ties += tie
                n_ties += tie
                result.differ_at.append((layer, q, bool(tie)))
            row.update(
                source=src,
                n_truncated=int(truncated.sum()),
                n_differ=int(sel_diff.sum()),
                n_ties=int(n_ties),
                n_block_ties=int(n_block_ties),
                n_output_differ_without_selection=int(((out_diff > 0) & ~sel_diff).sum()),
            )
        result.layers.append(row)
    return result


def untruncated_topk(cfg: Config, n_tokens: int) -> int:
    """The smallest index_topk that keeps every reachable compressed position of `n_tokens` tokens."""
    return max(n_tokens // r for r in cfg.compress_ratios[: cfg.n_layers] if r)


def untruncated_positions(cfg: Config) -> int:
    """How many leading positions no indexer or candidate top-k cuts. The query at position p of a
    ratio-r index source reaches (p + 1) // r compressed positions and is cut once that exceeds
    index_topk, from p = (index_topk + 1) * r - 1 on; the candidate source likewise once its
    reachable positions fill more than candidate_topk_blocks blocks."""
    limits = [(cfg.index_topk + 1) * cfg.compress_ratios[layer] - 1 for layer in cfg.index_source_layers]
    cand = cfg.candidate_source_layer
    if cand is not None and cand >= 0:
        kept = cfg.candidate_topk_blocks * cfg.candidate_block_size
        limits.append((kept + 1) * cfg.compress_ratios[cand] - 1)
    return min(limits)


def topk_sweep(
    model: Model, x: torch.Tensor, widths: Sequence[int], *, numerics: Numerics = Numerics(), **config_changes
) -> list[Divergence]:
    """`prefill_decode_divergence` of the model's attention weights at each index_topk in `widths`,
    under `numerics` with fix_stale_index_keys=True, so prefill and decode score the same keys:
    under `Numerics.parity()` only ties remain; with the reference's arithmetic rounding may add
    output differences (see `numerics_comparison`)."""
    numerics = numerics.with_options(fix_stale_index_keys=True)
    results = []
    for k in widths:
        stack = attention_stack(model, numerics=numerics, max_seq_len=x.size(1), index_topk=k, **config_changes)
        results.append(prefill_decode_divergence(stack, x))
    return results


def numerics_comparison(model: Model, x: torch.Tensor, **config_changes) -> dict[tuple[str, bool], Divergence]:
    """`prefill_decode_divergence` of the model's attention weights (fix_stale_index_keys=True)
    under every window_layout and pad_f32_rows, keyed (window_layout, pad_f32_rows): which of the
    two opt-ins a bit-identical prefill and decode rests on, at the geometry `config_changes` set."""
    return {
        (layout, pad): prefill_decode_divergence(
            attention_stack(
                model,
                numerics=Numerics(fix_stale_index_keys=True, window_layout=layout, pad_f32_rows=pad),
                max_seq_len=x.size(1),
                **config_changes,
            ),
            x,
        )
        for layout in WINDOW_LAYOUTS
        for pad in (False, True)
    }


# ---------------------------------------------------------------------------------- stale keys
@dataclass
class StaleKeys:
    """Token-by-token decode with the reference's stale index keys (default) against
    `fix_stale_index_keys=True`, per layer and position. keys_from[layer][p]: whose index keys the
    layer's indexer scored at position p (None: nothing reachable yet); expected_keys_from[layer]:
    the latest Full layer at or before it; stale[layer]: positions where the default scored other
    keys; output_diff / selection_differs: default vs fix."""

    n_tokens: int
    index_topk: int
    prefill_identical: bool
    keys_from: dict = field(default_factory=dict)
    keys_from_fixed: dict = field(default_factory=dict)
    expected_keys_from: dict = field(default_factory=dict)
    stale: dict = field(default_factory=dict)
    selection_differs: dict = field(default_factory=dict)
    output_diff: dict = field(default_factory=dict)
    changed: dict = field(default_factory=dict)  # {layer: positions whose output differs}


def stale_key_comparison(model: Model, x: torch.Tensor, **config_changes) -> StaleKeys:
    """Decode x [1, s, dim] one token per call with fix_stale_index_keys False and True (and
    prefill once each) over the model's attention weights; see `StaleKeys`."""
    runs = {}
    for fix in (False, True):
        stack = attention_stack(
            model, numerics=Numerics(fix_stale_index_keys=fix), max_seq_len=x.size(1), **config_changes
        )
        runs[fix] = _both_orders(stack, x)
    cfg = stack.cfg
    out = StaleKeys(
        n_tokens=x.size(1),
        index_topk=cfg.index_topk,
        prefill_identical=bool(torch.equal(runs[False][0], runs[True][0])),
    )
    dec_stale, dec_fix = runs[False][1], runs[True][1]
    by_stale, by_fix = runs[False][3].attention_by_layer(), runs[True][3].attention_by_layer()
    for layer in range(cfg.n_layers):
        diff = (dec_stale[layer, 0].float() - dec_fix[layer, 0].float()).abs().amax(-1)
        out.output_diff[layer] = diff.tolist()
        out.changed[layer] = (diff > 0).nonzero().flatten().tolist()
        if cfg.compress_ratios[layer]:
            sel = (by_stale[layer]["selected"] != by_fix[layer]["selected"]).any(-1)[0]
            out.selection_differs[layer] = sel.tolist()
        if cfg.layer_mode(layer) in ("full", "reindex"):
            for store, trace in ((out.keys_from, runs[False][3]), (out.keys_from_fixed, runs[True][3])):
                store[layer] = [r.index_keys_from for r in trace.attention if r.layer == layer]
            expected = cfg.source_at_or_before(layer, cfg.kv_source_layers)
            out.expected_keys_from[layer] = expected
            out.stale[layer] = [p for p, src in enumerate(out.keys_from[layer]) if src is not None and src != expected]
    return out
