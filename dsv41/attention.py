"""CSA2 attention: compressor, indexer, candidate blocks, the attention layer and its modes.

Every layer attends, in one `sparse_attn` call, over a sliding window of its own raw KV and, when
its compress ratio is non-zero, over `index_topk` compressed positions picked by an indexer. Who
produces what is the layer's mode (`Config.layer_mode`):

- full     owns the Compressor (writes compressed KV) and `indexer.wk` (writes index keys),
           runs its indexer and publishes KV, index keys and its top-k;
- reindex  has its own indexer queries (`indexer.wq_b`) and re-ranks against the published keys,
           inside the candidate blocks when a candidate source precedes it; publishes its top-k;
- reuse    reads the compressed KV and top-k the last source published (pure window layers,
           ratio 0, are also 'reuse' and read nothing).

What a layer publishes goes into an `AttentionRuntime` passed to every forward, one per stack,
so two stacks in a process never share state. Arithmetic, dtypes, quantization points and the
index rows handed to `sparse_attn` follow the released reference runtime (`inference/model.py`);
departures are named where they occur: one rank only, an explicit runtime, `reset_state`, and
the `Numerics` a layer is built with (`dsv41.numerics`; the reference's arithmetic by default):
its `fix_stale_index_keys` is read by the indexer, `window_layout` by `window_rows`, and
`pad_f32_rows` by the compressor's float32 projections.

A call takes any number of tokens at the sequence's next position: a prefill at 0, one token per
decode step, or a chunk of several (the reference has no chunked prefill; its window rows and
compressor groups are those of a one-shot prefill, see `window_rows` and `Compressor`).

The caches hold what the trained model's quantization produces (`QuantizedCache`): with
`cache_format="packed"` (the default) the bytes the model card counts, the window ring as FP8 E4M3
with one E8M0 scale per 32 channels, compressed KV as two FP4 E2M1 codes a byte with one E4M3 scale
per 16, index keys as FP4 with one E8M0 scale per 32, decoded when read; with "bf16" the same
values already rounded to those grids, held in the activation dtype. A read decodes to exactly the
values the quantizer's in-place form writes, so the two formats give bit-identical outputs;
`cache_bytes` measures what either allocates. Packed, a layer decodes only the compressed rows its
queries selected (`Attention._compressed_rows`, which renumbers the selections into those rows),
so a decode step decodes index_topk rows, not the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import act_quant, e8m0_decode, fp4_act_quant, fp4_to_float, sparse_attn
from .layers import (
    Linear,
    RMSNorm,
    activation_dtype,
    apply_rotary_emb,
    init_random_,
    linear_dtype,
    precompute_freqs_cis,
)
from .numerics import TIE_BREAKS, WINDOW_LAYOUTS, Numerics
from .trace import AttentionRecord, Trace

# Index-key and indexer-query FP4 blocks (E8M0 scales), compressed-KV FP4 blocks (E4M3 scales),
# and the sliding window's FP8 blocks: fixed by the trained model's fake quantization.
INDEX_FP4_BLOCK = 32
KV_FP4_BLOCK = 16
WINDOW_FP8_BLOCK = 32

# How the caches are held: "packed" (the stored formats, decoded when read) or "bf16" (the same
# values in the activation dtype, the reference runtime's buffers)
CACHE_FORMATS = ("packed", "bf16")
# The cache components, as `cache_bytes` and `csa2_stats` name them
WINDOW_RING, COMPRESSED_KV, INDEX_KEYS, COMPRESSOR_TAILS = (
    "window ring", "compressed KV", "index keys", "compressor tails")


def check_cache_format(cache_format: str) -> str:
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"cache_format must be one of {', '.join(map(repr, CACHE_FORMATS))}, got {cache_format!r}")
    return cache_format


# ---------------------------------------------------------------------------------- caches
@dataclass(frozen=True)
class CacheEncoding:
    """One cache's quantization: E4M3 (`value_bits` 8) or E2M1 (4) values, one `scale_dtype` scale
    per `block` channels (E8M0: a power of two; E4M3: amax / 6 rounded to E4M3)."""

    name: str
    value_bits: int
    block: int
    scale_dtype: torch.dtype

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> (values [..., dim * value_bits / 8], scales [..., dim / block]), both as
        raw uint8 bytes: the quantizers' own (codes, scales) output."""
        if self.value_bits == 8:
            codes, scales = act_quant(x, self.block, "ue8m0", self.scale_dtype)
        else:
            codes, scales = fp4_act_quant(x, self.block, scale_dtype=self.scale_dtype)
        return codes.view(torch.uint8), scales.view(torch.uint8)

    def fake_quantize_(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to the grid in place (the reference's quantization-aware form)."""
        if self.value_bits == 8:
            return act_quant(x, self.block, "ue8m0", self.scale_dtype, inplace=True)
        return fp4_act_quant(x, self.block, inplace=True, scale_dtype=self.scale_dtype)

    def decode(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The bytes `quantize` returned -> [..., dim] in `dtype`: the same float32 products the
        in-place form computes (code value x scale), rounded to `dtype` the same way, so equal to
        `fake_quantize_` bit for bit."""
        if self.value_bits == 8:
            grid = values.view(torch.float8_e4m3fn).float()
        else:
            grid = fp4_to_float(values)
        if self.scale_dtype == torch.float8_e8m0fnu:
            scale = e8m0_decode(scales)
        else:
            scale = scales.view(self.scale_dtype).float()
        return (grid.unflatten(-1, (-1, self.block)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)

    def row_bytes(self, dim: int) -> tuple[int, int]:
        """(value bytes, scale bytes) of one stored row of `dim` channels."""
        return dim * self.value_bits // 8, dim // self.block


WINDOW_ENCODING = CacheEncoding("FP8 E4M3 + E8M0 per 32", 8, WINDOW_FP8_BLOCK, torch.float8_e8m0fnu)
COMPRESSED_ENCODING = CacheEncoding("FP4 E2M1 + E4M3 per 16", 4, KV_FP4_BLOCK, torch.float8_e4m3fn)
INDEX_KEY_ENCODING = CacheEncoding("FP4 E2M1 + E8M0 per 32", 4, INDEX_FP4_BLOCK, torch.float8_e8m0fnu)

Rows = Union[slice, torch.Tensor]


class QuantizedCache(nn.Module):
    """A cache of `rows` rows of `dim` channels per batch row, holding values on an encoding's grid.

    cache_format "packed": buffers `values` (E4M3 bytes, or two E2M1 codes a byte, low nibble
    first) and `scales`, both raw uint8 (torch cannot index-assign float8_e8m0fnu or
    float4_e2m1fn_x2 tensors; `stored()` views them in their own dtypes); a read decodes.
    "bf16": one buffer `values` in `dtype` (the activation dtype) of the already-rounded values.
    Either way `quantize` rounds new rows onto the grid and gives back what a read of them
    returns; `write` stores them; `read`, `save`, `load` and `reset` act on rows.
    """

    def __init__(self, encoding: CacheEncoding, batch: int, rows: int, dim: int, dtype: torch.dtype,
                 cache_format: str = "packed"):
        super().__init__()
        self.encoding, self.dim, self.dtype = encoding, dim, dtype
        self.cache_format = check_cache_format(cache_format)
        if cache_format == "packed":
            value_bytes, scale_bytes = encoding.row_bytes(dim)
            self.register_buffer("values", torch.zeros(batch, rows, value_bytes, dtype=torch.uint8), persistent=False)
            self.register_buffer("scales", torch.zeros(batch, rows, scale_bytes, dtype=torch.uint8), persistent=False)
        else:
            self.register_buffer("values", torch.zeros(batch, rows, dim, dtype=dtype), persistent=False)

    @property
    def packed(self) -> bool:
        return self.cache_format == "packed"

    @property
    def rows(self) -> int:
        return self.values.size(1)

    def _buffers_(self) -> tuple[torch.Tensor, ...]:
        return (self.values, self.scales) if self.packed else (self.values,)

    def quantize(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """x [b, n, dim] -> (what `write` stores, x on the grid in `dtype`). The packed bytes
        decode to exactly the in-place quantizer's values; "bf16" rounds x in place (returned)."""
        if not self.packed:
            self.encoding.fake_quantize_(x)
            return (x,), x
        parts = self.encoding.quantize(x)
        return parts, self.encoding.decode(*parts, x.dtype)

    def write(self, rows: Rows, parts: tuple[torch.Tensor, ...]) -> None:
        """Store `quantize`'s parts [b, n, ...] at `rows` (a slice or positions) of batch rows :b."""
        for buf, part in zip(self._buffers_(), parts):
            buf[: part.size(0), rows] = part

    def read(self, bsz: int, n: Optional[int] = None) -> torch.Tensor:
        """Rows :n (all by default) of batch rows :bsz, [bsz, n, dim] in `dtype`."""
        if not self.packed:
            return self.values[:bsz, :n]
        return self.encoding.decode(self.values[:bsz, :n], self.scales[:bsz, :n], self.dtype)

    def gather(self, bsz: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (positions, any order) of batch rows :bsz, [bsz, len(rows), dim] in `dtype`."""
        rows = rows.long()
        if not self.packed:
            return self.values[:bsz, rows]
        return self.encoding.decode(self.values[:bsz, rows], self.scales[:bsz, rows], self.dtype)

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The buffers in their own dtypes: (E4M3 or float4_e2m1fn_x2 values, E8M0 or E4M3 scales)
        packed; (values,) in `dtype` for "bf16"."""
        if not self.packed:
            return (self.values,)
        value_dtype = torch.float8_e4m3fn if self.encoding.value_bits == 8 else torch.float4_e2m1fn_x2
        return self.values.view(value_dtype), self.scales.view(self.encoding.scale_dtype)

    def save(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        """Copies of `rows` of every batch row, for `load`."""
        return tuple(buf[:, rows].clone() for buf in self._buffers_())

    def load(self, rows: Rows, saved: tuple[torch.Tensor, ...]) -> None:
        for buf, part in zip(self._buffers_(), saved):
            buf[:, rows] = part

    def reset(self) -> None:
        """Every row back to zeros (a packed zero row decodes to +0.0, as a BF16 one holds)."""
        for buf in self._buffers_():
            buf.zero_()

    def nbytes(self) -> dict[str, int]:
        """Allocated bytes: {'data': values, 'scales': scales (0 for "bf16")}."""
        return {"data": self.values.numel() * self.values.element_size(),
                "scales": self.scales.numel() * self.scales.element_size() if self.packed else 0}

    def extra_repr(self) -> str:
        held = self.encoding.name if self.packed else f"{self.dtype} values on the {self.encoding.name} grid"
        return f"{self.rows} rows x {self.dim}, {held}"

class AttentionRuntime:
    """What the layers of one stack hand down instead of recomputing, plus who wrote it: per-call
    state only (how it is computed is each layer's `Numerics`).

    compress_kv / index_k: the caches (`QuantizedCache`, read through `read`) of the last Full
    layer that published them (they persist across calls, as caches do); topk: the last index
    source's selection for the current call, as compressed positions [b, s, index_topk] padded with
    -1; candidates: the candidate source's position mask [b, s, T] for the current call.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.compress_kv: Optional[torch.Tensor] = None
        self.compress_kv_from: Optional[int] = None
        self.index_k: Optional[torch.Tensor] = None
        self.index_k_from: Optional[int] = None
        self.topk: Optional[torch.Tensor] = None
        self.topk_from: Optional[int] = None
        self.topk_call: Optional[tuple[int, int]] = None  # (start_pos, seqlen) it was made for
        self.candidates: Optional[torch.Tensor] = None
        self.candidates_from: Optional[int] = None
        self.candidates_call: Optional[tuple[int, int]] = None

    def published(self) -> tuple:
        """What persists from call to call: which layers' caches were published last (the stale-key
        rule makes that part of the sequence's state). `republish` puts it back."""
        return self.compress_kv, self.compress_kv_from, self.index_k, self.index_k_from

    def republish(self, published: tuple) -> None:
        self.reset()
        self.compress_kv, self.compress_kv_from, self.index_k, self.index_k_from = published

    def __repr__(self) -> str:
        return (f"AttentionRuntime(compress_kv_from={self.compress_kv_from}, "
                f"index_k_from={self.index_k_from}, topk_from={self.topk_from}, "
                f"candidates_from={self.candidates_from})")


# ---------------------------------------------------------------------------------- compressor
class Compressor(nn.Module):
    """Pools `ratio` consecutive tokens into one KV latent [head_dim] with a learned softmax gate.

    Returns the normalized latents of the groups completed by this call, before RoPE (the
    indexer needs them unrotated), or None when no group completes. The trailing partial group
    waits in kv_state / score_state for the next call; a call of several tokens at a later
    position completes it first, so any split of a sequence into calls pools the same groups. Ratio 1 has no group to pool: no gate, a
    plain BF16 projection. Above ratio 1 the projections and pooling run in float32 (the weights
    are held in float32, as the reference runtime promotes them).
    """

    def __init__(self, cfg, layer: int, max_batch_size: int = 1, *, numerics: Numerics = Numerics()):
        super().__init__()
        pad_f32_rows = numerics.pad_f32_rows
        self.ratio = cfg.compress_ratios[layer]
        self.head_dim = cfg.head_dim
        act = activation_dtype(cfg)
        proj_dtype = torch.float32 if self.ratio > 1 else act
        self.wkv = Linear(cfg.dim, cfg.head_dim, dtype=proj_dtype, pad_f32_rows=pad_f32_rows)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype=act)
        if self.ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, dtype=torch.float32, pad_f32_rows=pad_f32_rows)
            state = (max_batch_size, self.ratio, cfg.head_dim)
            # the pooling runs in float32 whatever the caller's default dtype
            self.register_buffer("kv_state", torch.zeros(state, dtype=torch.float32), persistent=False)
            self.register_buffer("score_state", torch.full(state, -torch.inf, dtype=torch.float32), persistent=False)
        self.window = cfg.window_size
        # (start_pos, kv, score) of the last call of several rows, at most a window long: what
        # `truncate_state` rebuilds the partial group from when that call is cut short
        self.last_call: Optional[tuple] = None

    def reset_state(self) -> None:
        if self.ratio > 1:
            self.kv_state.zero_()
            self.score_state.fill_(-torch.inf)
        self.last_call = None

    def truncate_state(self, kv_state: torch.Tensor, score_state: torch.Tensor, start: int, keep_end: int) -> None:
        """The partial group as a call over [start, keep_end) would have left it, from the state
        before the last call (`kv_state`, `score_state`) and that call's own projections."""
        call_start, kv, score = self.last_call
        assert call_start == start, "truncate_state cuts the last call only"
        bsz, ratio, held = kv.size(0), self.ratio, start % self.ratio
        self.kv_state.copy_(kv_state)
        self.score_state.copy_(score_state)
        if keep_end - start == 1 and start > 0:  # as a one-token call: into its slot
            self.kv_state[:bsz, held] = kv[:, 0]
            self.score_state[:bsz, held] = score[:, 0]
            return
        rows = held + keep_end - start
        cut = rows // ratio * ratio
        kv = torch.cat([kv_state[:bsz, :held], kv[:, : keep_end - start]], dim=1)  # [b, held + kept, head_dim]
        score = torch.cat([score_state[:bsz, :held], score[:, : keep_end - start]], dim=1)
        self.kv_state[:bsz, : rows - cut] = kv[:, cut:]
        self.score_state[:bsz, : rows - cut] = score[:, cut:]

    def forward(self, x: torch.Tensor, start_pos: int) -> Optional[torch.Tensor]:
        """x [b, s, dim] -> latents [b, n_completed, head_dim] in x.dtype, or None."""
        bsz, seqlen, _ = x.shape
        ratio = self.ratio
        if ratio == 1:
            return self.norm(self.wkv(x))

        x32 = x.float()
        kv, score = self.wkv(x32), self.wgate(x32)  # [b, s, head_dim] float32 each
        self.last_call = (start_pos, kv, score) if 1 < seqlen <= self.window else None
        if start_pos == 0 or seqlen > 1:
            held = start_pos % ratio  # the partial group's earlier tokens, waiting in the state
            if held:  # [b, held + s, head_dim]: the group's held rows first, then this call's
                kv = torch.cat([self.kv_state[:bsz, :held], kv], dim=1)
                score = torch.cat([self.score_state[:bsz, :held], score], dim=1)
            rows = held + seqlen
            n_groups = rows // ratio
            cut = n_groups * ratio
            if rows > cut:  # the partial trailing group waits for the next call (slot = position % ratio)
                self.kv_state[:bsz, : rows - cut] = kv[:, cut:]
                self.score_state[:bsz, : rows - cut] = score[:, cut:]
            if n_groups == 0:
                return None
            kv = kv[:, :cut].unflatten(1, (n_groups, ratio))  # [b, groups, ratio, head_dim]
            score = score[:, :cut].unflatten(1, (n_groups, ratio))
            pooled = (kv * score.softmax(dim=2)).sum(dim=2)  # [b, groups, head_dim]
        else:  # one token at a later position: into its slot, pooled once the group is complete
            slot = start_pos % ratio
            self.kv_state[:bsz, slot] = kv[:, 0]
            self.score_state[:bsz, slot] = score[:, 0]
            if (start_pos + 1) % ratio:
                return None
            state_kv, state_score = self.kv_state[:bsz], self.score_state[:bsz]  # [b, ratio, head_dim]
            pooled = (state_kv * state_score.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(x.dtype))

    def _random_init_(self, gen: torch.Generator) -> None:
        pass  # only children hold parameters


# ---------------------------------------------------------------------------------- candidates
def candidate_block_scores(logits: torch.Tensor, compress_lens: torch.Tensor | int,
                           block_size: int) -> torch.Tensor:
    """[..., T] position scores -> [..., ceil(T / block_size)] block scores: a block's best
    position, -inf when none is reachable, and +inf for the block holding the query's newest
    reachable position (index compress_len - 1), which is pinned in."""
    width = logits.size(-1)
    padded = F.pad(logits, (0, -width % block_size), value=-torch.inf)
    scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)  # [..., n_blocks]
    # the newest block is usually still filling, so an older full block can out-score it on its
    # best position; it holds the most recent context, so it is kept regardless
    newest = (torch.as_tensor(compress_lens, device=logits.device) - 1) // block_size
    blocks = torch.arange(scores.size(-1), device=logits.device)
    return scores.masked_fill(blocks == newest, torch.inf)


def top_k(scores: torch.Tensor, k: int, tie_break: str = "topk") -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim. tie_break "topk" is torch.topk's own
    order among equal scores (the reference's; it follows memory layout, so a prefill row and a
    decode row may keep different ones of a tie); "lowest" keeps the lower position of equal scores
    (a stable sort), the same in any call shape."""
    if tie_break == "topk":
        top = scores.topk(k, dim=-1)
        return top.values, top.indices
    if tie_break != "lowest":
        raise ValueError(f"tie_break must be one of {', '.join(map(repr, TIE_BREAKS))}, got {tie_break!r}")
    order = scores.sort(dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def select_candidate_blocks(logits: torch.Tensor, compress_lens: torch.Tensor | int,
                            topk_blocks: int, block_size: int, tie_break: str = "topk") -> torch.Tensor:
    """Level one of the two-level top-k: a bool mask shaped like `logits` [..., T] keeping each
    query's `topk_blocks` best blocks of `block_size` compressed positions, the block holding its
    newest position always among them. `logits` must already be -inf where the query cannot
    reach; `compress_lens` (reachable count) is an int or broadcasts against logits[..., :1];
    `tie_break` as in `top_k`."""
    width = logits.size(-1)
    scores = candidate_block_scores(logits, compress_lens, block_size)
    values, indices = top_k(scores, min(topk_blocks, scores.size(-1)), tie_break)
    # with fewer reachable blocks than topk_blocks the spare picks are -inf: not kept
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, indices, values > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


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


# ---------------------------------------------------------------------------------- indexer
class Indexer(nn.Module):
    """Scores every reachable compressed position for each query and keeps the `index_topk` best.

    FP4 query heads (E8M0 over 32) against one shared index key per compressed position, rectified
    and mixed over heads by `weights_proj`. A Full layer owns `wk`/`k_norm` and the key cache:
    keys are wk of the compressor's latent before RoPE, then rotated at the group's first position
    and FP4-quantized. The candidate source publishes its block mask; later index sources score
    only inside it. The key cache `k_cache` holds FP4 E2M1 with one E8M0 scale per 32 (packed, the
    default) or the same values in BF16 (`cache_format="bf16"`).
    """

    def __init__(self, cfg, layer: int, max_batch_size: int = 1, max_seq_len: int = 4096, *,
                 numerics: Numerics = Numerics(), cache_format: str = "packed"):
        super().__init__()
        self.layer, self.numerics = layer, numerics
        self.ratio = cfg.compress_ratios[layer]
        self.owns_k = layer in cfg.kv_source_layers
        cand = cfg.candidate_source_layer if cfg.candidate_source_layer is not None else -1
        self.is_candidate_source = layer == cand
        self.uses_candidates = 0 <= cand < layer
        self.candidate_topk_blocks = cfg.candidate_topk_blocks
        self.candidate_block_size = cfg.candidate_block_size
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_head_dim = cfg.rope_head_dim
        self.index_topk = cfg.index_topk
        self.softmax_scale = self.head_dim ** -0.5
        act = activation_dtype(cfg)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=linear_dtype(cfg))
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype=act)
        if self.owns_k:
            self.wk = Linear(cfg.head_dim, self.head_dim, dtype=act)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype=act)
            self.k_cache = QuantizedCache(INDEX_KEY_ENCODING, max_batch_size, max_seq_len // self.ratio,
                                          self.head_dim, act, cache_format)

    def reset_state(self) -> None:
        if self.owns_k:
            self.k_cache.reset()

    def _random_init_(self, gen: torch.Generator) -> None:
        pass

    def forward(self, x: torch.Tensor, qr: torch.Tensor, latent: Optional[torch.Tensor], start_pos: int,
                freqs_cis: torch.Tensor, runtime: AttentionRuntime,
                record: Optional[AttentionRecord] = None, keep_scores: bool = False) -> torch.Tensor:
        """Compressed positions [b, s, min(index_topk, T)] per query, sorted, -1 where unreachable
        (T = (start_pos + s) // ratio). `latent` is this layer's pre-RoPE compressor output.
        Publishes keys and candidate blocks to `runtime` as the layer's role says; the
        arithmetic is `write_keys`, `scores` and `select`, the trace filling `_record`."""
        bsz, seqlen, _ = x.shape
        if self.owns_k:
            if latent is not None:
                self.write_keys(latent, start_pos, freqs_cis)
            # the reference republishes only when a group completed (stale keys otherwise)
            if latent is not None or self.numerics.fix_stale_index_keys:
                runtime.index_k, runtime.index_k_from = self.k_cache, self.layer
        if runtime.index_k is None:
            raise RuntimeError(f"layer {self.layer}: no index keys have been published; run the layers in "
                               f"order from a prefill at position 0 (and after reset_state)")

        width = (start_pos + seqlen) // self.ratio
        score, reachable = self.scores(x, qr, runtime.index_k.read(bsz, width), start_pos, freqs_cis)
        lens = reachable.unsqueeze(-1)  # [s, 1]
        if self.is_candidate_source:
            mask = select_candidate_blocks(score, lens, self.candidate_topk_blocks, self.candidate_block_size,
                                           self.numerics.tie_break)
            runtime.candidates, runtime.candidates_from = mask, self.layer
            runtime.candidates_call = (start_pos, seqlen)
        elif self.uses_candidates:
            if runtime.candidates is None or runtime.candidates_call != (start_pos, seqlen) \
                    or runtime.candidates.shape != score.shape:
                raise RuntimeError(f"layer {self.layer}: the candidate source has not run for this call "
                                   f"(or compresses at another ratio); run the layers in order")
            mask = runtime.candidates
            score = score.masked_fill(~mask, -torch.inf)
        else:
            mask = None

        selected = self.select(score, lens)
        if record is not None:
            self._record(record, score, reachable, mask, runtime, keep_scores)
        return selected

    def write_keys(self, latent: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor) -> None:
        """Index keys of the groups this call completed (latent [b, groups, head_dim], pre-RoPE)
        into the key cache: rotated at each group's first position, FP4-quantized."""
        first = start_pos // self.ratio
        k = self.k_norm(self.wk(latent))  # [b, groups, index_head_dim]
        group_pos = (first + torch.arange(k.size(1), device=k.device)) * self.ratio
        apply_rotary_emb(k[..., -self.rope_head_dim :], freqs_cis[group_pos])
        parts, _ = self.k_cache.quantize(k)  # FP4, one E8M0 scale per 32
        self.k_cache.write(slice(first, first + k.size(1)), parts)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, index_k: torch.Tensor, start_pos: int,
               freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index scores [b, s, T] in the activation dtype, -inf where a query cannot reach;
        reachable counts [s]) against keys index_k [b, >= T, index_head_dim]."""
        seqlen = x.size(1)
        end_pos = start_pos + seqlen
        width = end_pos // self.ratio
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [b, s, heads, index_head_dim]
        apply_rotary_emb(q[..., -self.rope_head_dim :], freqs_cis[start_pos:end_pos])
        fp4_act_quant(q, INDEX_FP4_BLOCK, inplace=True)

        weights = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)  # [b, s, heads]
        score = torch.einsum("bshd,btd->bsht", q, index_k[:, :width])
        score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, T], activation dtype

        # a compressed position is reachable once the query has passed its group's last token
        positions = torch.arange(start_pos, end_pos, device=x.device)
        reachable = (positions + 1) // self.ratio  # [s]
        score = score.masked_fill(torch.arange(width, device=x.device) >= reachable.unsqueeze(-1), -torch.inf)
        return score, reachable

    def select(self, score: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """The top `index_topk` positions of score [b, s, T], sorted, -1 past a query's reach."""
        k_sel = min(self.index_topk, score.size(-1))
        if self.numerics.tie_break == "topk":
            idx = score.topk(k_sel, dim=-1, sorted=False).indices.sort(dim=-1).values
        else:
            idx = top_k(score, k_sel, self.numerics.tie_break)[1].sort(dim=-1).values
        # A -inf pick at a reachable position is kept, as in the reference: where the candidate
        # pool holds fewer than index_topk positions, the remainder are positions outside it.
        return torch.where(idx < lens, idx, -1)

    def _record(self, record: AttentionRecord, score, reachable, mask, runtime: AttentionRuntime,
                keep_scores: bool) -> None:
        """What a trace keeps of this call: the cut scores (and the block cut's, at the candidate
        source), whose keys were scored, the candidate blocks, optionally every score."""
        record.index_keys_from = runtime.index_k_from
        record.kth_score, record.next_score = (t.cpu() for t in _cut_scores(score, reachable, self.index_topk))
        if keep_scores:
            record.index_scores = score.float().cpu()
        if self.is_candidate_source:
            # the block scores are taken before any candidate mask (this layer makes the mask)
            block_scores = candidate_block_scores(score, reachable.unsqueeze(-1), self.candidate_block_size)
            reach_blocks = -(-reachable // self.candidate_block_size)
            record.candidate_kth_score, record.candidate_next_score = (
                t.cpu() for t in _cut_scores(block_scores, reach_blocks, self.candidate_topk_blocks))
        if mask is not None:
            record.candidate_blocks = mask[..., :: self.candidate_block_size].cpu()
            record.candidates_from = runtime.candidates_from


# ---------------------------------------------------------------------------------- attention
def window_rows(start_pos: int, seqlen: int, window: int, layout: str = "reference",
                device=None) -> torch.Tensor:
    """Which rows of the window KV each query attends to, int64 [s, width] (a decode step's single
    query: [1, width]), -1 = absent. The window KV is the call's own KV on a prefill (row =
    position), the ring on a decode step (row = position % window), and on a call of several
    tokens at a later position the ring as it was before the call followed by the call's own KV
    (row = position % window before start_pos, window + position - start_pos from it on).

    "reference", the released runtime: a prefill has min(seqlen, window) columns, present positions
    oldest first, then -1; a decode step lists all `window` ring slots starting after the newest,
    so while the ring is still filling its empty slots come first, and once full the oldest
    position does. "uniform": `window` columns on both, present positions oldest first, then -1.

    sparse_attn sums a row in column order, 64 columns at a time, so where the two orderings give
    the same query different columns (a prefill row narrower than the window, a decode row with
    empty slots in front) their float32 sums can round differently; "uniform" gives a query the
    same columns either way, so prefill and decode agree bit for bit. A call of several tokens at a
    later position (the reference has none) lists `window` columns, oldest first, in either layout."""
    if layout not in WINDOW_LAYOUTS:
        raise ValueError(f"window_layout must be one of {', '.join(map(repr, WINDOW_LAYOUTS))}, got {layout!r}")
    if layout == "reference" and start_pos > 0 and seqlen == 1:
        slots = (start_pos + 1 + torch.arange(window, device=device)) % window  # ring order from the oldest
        return torch.where(slots <= start_pos, slots, -1).unsqueeze(0)  # a slot past start_pos is unwritten
    positions = torch.arange(start_pos, start_pos + seqlen, device=device)
    width = min(seqlen, window) if layout == "reference" and start_pos == 0 else window
    seen = (positions - window + 1).clamp_min(0).unsqueeze(-1) + torch.arange(width, device=device)  # [s, width]
    if start_pos == 0:
        rows = seen
    elif seqlen == 1:
        rows = seen % window
    else:
        rows = torch.where(seen >= start_pos, window + seen - start_pos, seen % window)
    return torch.where(seen <= positions.unsqueeze(-1), rows, -1)


class Attention(nn.Module):
    """One CSA2 attention layer: low-rank queries, a shared K=V latent, a sliding window ring of
    FP8-QAT KV plus (ratio > 0) the selected compressed positions as FP4 (E4M3 scales over 16),
    one sparse_attn call with a per-head sink, and a grouped low-rank output projection.

    Parameter names and runtime dtypes are the checkpoint's / reference runtime's (wo_a is held in
    BF16 although the checkpoint stores it FP8; ratio > 1 compressor projections in float32).
    `max_batch_size` and `max_seq_len` size the caches and the RoPE table; `numerics` says how the
    index rows are laid out (`window_rows`), whether stale index keys are fixed (`Indexer`) and
    whether the compressor's float32 projections pad their rows (`layers.f32_linear`).
    `cache_format` how the caches hold their values (`QuantizedCache`): "packed" (default, the
    stored formats) or "bf16" (the reference runtime's BF16 buffers); the outputs are the same bit
    for bit.
    """

    def __init__(self, cfg, layer: int, *, numerics: Numerics = Numerics(), max_batch_size: int = 1,
                 max_seq_len: int = 4096, cache_format: str = "packed"):
        super().__init__()
        n_total = cfg.n_layers + (cfg.n_mtp_layers or 0)
        if not 0 <= layer < n_total:
            raise ValueError(f"layer {layer} is outside the config's {n_total} layers")
        self.layer, self.numerics = layer, numerics
        self.dim, self.n_heads, self.head_dim = cfg.dim, cfg.n_heads, cfg.head_dim
        self.rope_head_dim = cfg.rope_head_dim
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window_size = cfg.window_size
        self.index_topk = cfg.index_topk
        self.ratio = cfg.compress_ratios[layer]
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.cache_format = check_cache_format(cache_format)
        self.softmax_scale = self.head_dim ** -0.5
        # MTP layers are never sources; within the backbone the config decides
        self.mode = cfg.layer_mode(layer) if layer < cfg.n_layers else "reuse"
        if self.mode != "reuse" and self.ratio == 0:
            raise ValueError(f"layer {layer} is a {self.mode} layer with compress ratio 0")
        act, lin = activation_dtype(cfg), linear_dtype(cfg)

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dtype=lin)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype=act)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=lin)
        self.wkv = Linear(cfg.dim, self.head_dim, dtype=lin)
        self.kv_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype=act)
        # block-diagonal over groups: group g projects only its own heads, applied by einsum
        self.wo_a = Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, dtype=act)
        self.wo_b = Linear(self.n_groups * self.o_lora_rank, cfg.dim, dtype=lin)

        self.compressor = (Compressor(cfg, layer, max_batch_size, numerics=numerics)
                           if self.mode == "full" else None)
        self.indexer = (Indexer(cfg, layer, max_batch_size, max_seq_len, numerics=numerics, cache_format=cache_format)
                        if self.mode in ("full", "reindex") else None)

        self.window_kv_cache = QuantizedCache(WINDOW_ENCODING, max_batch_size, self.window_size, self.head_dim,
                                              act, cache_format)
        if self.mode == "full":
            self.compress_kv_cache = QuantizedCache(COMPRESSED_ENCODING, max_batch_size, max_seq_len // self.ratio,
                                                    self.head_dim, act, cache_format)
        # layers reading compressed positions rotate at compress_rope_theta with YaRN; pure window
        # layers at rope_theta without
        if self.ratio:
            base, original = cfg.compress_rope_theta, cfg.original_seq_len
        else:
            base, original = cfg.rope_theta, 0
        freqs = precompute_freqs_cis(self.rope_head_dim, max_seq_len, original, base, cfg.rope_factor,
                                     cfg.beta_fast, cfg.beta_slow)
        self.register_buffer("freqs_cis", freqs, persistent=False)

    # ------------------------------------------------------------------ state
    def reset_state(self) -> None:
        """Forget everything a previous forward left behind (window ring, compressor tail,
        compressed KV, index keys)."""
        self.window_kv_cache.reset()
        if self.compressor is not None:
            self.compressor.reset_state()
            self.compress_kv_cache.reset()
        if self.indexer is not None:
            self.indexer.reset_state()

    def capture(self, start: int, end: int) -> dict:
        """Copies of the cache rows a call over positions [start, end) may write (or, with start 0,
        every row a sequence of `end` positions has written): the window ring slots of the last
        `window` of those positions, the compressed-KV and index-key rows of the groups they can
        complete, and the compressor's partial group, as the caches hold them (packed bytes or BF16).
        `restore` writes them back."""
        win = self.window_size
        slots = torch.arange(max(start, end - win), end, device=self.window_kv_cache.values.device) % win
        saved = {"slots": slots, "window": self.window_kv_cache.save(slots)}
        if self.ratio:
            groups = slice(start // self.ratio, end // self.ratio)
            saved["groups"] = groups
            if self.compressor is not None:
                saved["compressed"] = self.compress_kv_cache.save(groups)
                if self.compressor.ratio > 1:
                    saved["kv_state"] = self.compressor.kv_state.clone()
                    saved["score_state"] = self.compressor.score_state.clone()
            if self.indexer is not None and self.indexer.owns_k:
                saved["index_keys"] = self.indexer.k_cache.save(groups)
        return saved

    def truncatable(self, start: int, end: int) -> bool:
        """Whether the last call, over [start, end), can be cut short in place (`truncate`): no
        longer than the window (so its undo record holds every slot it wrote) and, for a pooling
        compressor, with that call's projections still kept."""
        if end - start > self.window_size:
            return False
        if self.compressor is not None and self.compressor.ratio > 1:
            last = self.compressor.last_call
            return last is not None and last[0] == start and last[1].size(1) == end - start
        return True

    def truncate(self, saved: dict, start: int, end: int, keep_end: int) -> None:
        """Cut the last call (over [start, end), `saved` its undo record) back to [start, keep_end):
        the slots and groups of the dropped positions get their earlier contents again, the
        partial group is rebuilt; the rows the call computed for the kept positions stay. The
        same bytes as running [start, keep_end) as its own call wherever a row's arithmetic does
        not depend on how many rows share the call (Numerics.parity())."""
        positions = torch.arange(max(start, end - self.window_size), end, device=saved["slots"].device)
        dropped = positions >= keep_end
        self.window_kv_cache.load(saved["slots"][dropped], tuple(part[:, dropped] for part in saved["window"]))
        if self.ratio:
            first, kept = start // self.ratio, keep_end // self.ratio
            groups, offset = slice(kept, end // self.ratio), kept - first
            if "compressed" in saved:
                self.compress_kv_cache.load(groups, tuple(part[:, offset:] for part in saved["compressed"]))
            if "kv_state" in saved:
                self.compressor.truncate_state(saved["kv_state"], saved["score_state"], start, keep_end)
            if "index_keys" in saved:
                self.indexer.k_cache.load(groups, tuple(part[:, offset:] for part in saved["index_keys"]))

    def restore(self, saved: dict) -> None:
        self.window_kv_cache.load(saved["slots"], saved["window"])
        if "compressed" in saved:
            self.compress_kv_cache.load(saved["groups"], saved["compressed"])
        if "kv_state" in saved:
            self.compressor.kv_state.copy_(saved["kv_state"])
            self.compressor.score_state.copy_(saved["score_state"])
        if "index_keys" in saved:
            self.indexer.k_cache.load(saved["groups"], saved["index_keys"])

    def cache_bytes(self) -> dict[str, int]:
        """Allocated bytes of this layer's caches by part ('window ring data' / 'scales',
        'compressed KV data' / 'scales', 'index key data' / 'scales', 'compressor tails'), zero
        for what the layer does not hold; RoPE tables are not caches."""
        out = dict.fromkeys(CACHE_PARTS, 0)
        caches = [(WINDOW_RING, self.window_kv_cache)]
        if self.compressor is not None:
            caches.append((COMPRESSED_KV, self.compress_kv_cache))
            if self.compressor.ratio > 1:
                out[COMPRESSOR_TAILS] = sum(b.numel() * b.element_size()
                                            for b in (self.compressor.kv_state, self.compressor.score_state))
        if self.indexer is not None and self.indexer.owns_k:
            caches.append(("index key", self.indexer.k_cache))
        for name, cache in caches:
            for part, n in cache.nbytes().items():
                out[f"{name} {part}"] = n
        return out

    def _random_init_(self, gen: torch.Generator) -> None:
        self.attn_sink.copy_(torch.randn(self.n_heads, generator=gen) * 0.5)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, start_pos: int, runtime: AttentionRuntime,
                trace: Optional[Trace] = None) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, dim]: any number of tokens at start_pos (0 starts a sequence; a
        later call continues it: one token is a decode step, several a chunk, causal inside it).
        Reads and writes `runtime`; appends an AttentionRecord to `trace` if given."""
        bsz, seqlen, _ = x.shape
        if start_pos + seqlen > self.max_seq_len or bsz > self.max_batch_size:
            raise ValueError(f"layer {self.layer}: batch {bsz} x positions up to {start_pos + seqlen} exceed the "
                             f"caches ({self.max_batch_size} x {self.max_seq_len}); build with larger limits")
        record = None
        if trace is not None:
            record = AttentionRecord(layer=self.layer, mode=self.mode, compress_ratio=self.ratio,
                                     start_pos=start_pos, seqlen=seqlen)
        rd = self.rope_head_dim
        freqs = self.freqs_cis[start_pos : start_pos + seqlen]

        qr = self.q_norm(self.wq_a(x))  # [b, s, q_lora_rank]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [b, s, heads, head_dim]
        apply_rotary_emb(q[..., -rd:], freqs)

        kv, idxs = self._window(x, freqs, start_pos)  # [b, n_kv, head_dim], [b, s, w]
        if self.ratio:
            cache, selected = self._compressed(x, qr, start_pos, runtime, record, trace)
            compress_kv, rows = self._compressed_rows(cache, bsz, (start_pos + seqlen) // self.ratio, selected)
            # the selections index the compressed rows appended after the window rows
            idxs = torch.cat([idxs, torch.where(rows >= 0, rows + kv.size(1), -1)], dim=-1)
            kv = torch.cat([kv, compress_kv], dim=1)
            if record is not None:
                record.selected = self._pad_topk(selected).cpu()  # one width in every trace
                record.reachable = (torch.arange(start_pos, start_pos + seqlen) + 1) // self.ratio

        o = sparse_attn(q, kv, self.attn_sink, idxs, self.softmax_scale)  # [b, s, heads, head_dim]
        # the values carry their key's rotation; taking the query's off leaves relative position
        apply_rotary_emb(o[..., -rd:], freqs, inverse=True)

        o = o.view(bsz, seqlen, self.n_groups, -1)  # [b, s, groups, heads/groups * head_dim]
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)  # [b, s, groups, o_lora_rank]
        out = self.wo_b(o.flatten(2))
        if record is not None:
            if trace.keep_outputs:
                record.output = out.detach().cpu()
            trace.attention.append(record)
        return out

    def _window(self, x: torch.Tensor, freqs: torch.Tensor, start_pos: int):
        """This layer's window KV (FP8 QAT over 32, RoPE tail included) and, per query, the rows of
        it to attend, [b, s, width] laid out by `window_rows`."""
        bsz, seqlen, _ = x.shape
        win, ring = self.window_size, self.window_kv_cache
        kv = self.kv_norm(self.wkv(x))  # [b, s, head_dim]
        apply_rotary_emb(kv[..., -self.rope_head_dim :], freqs)
        parts, kv = ring.quantize(kv)  # FP8 E4M3, one E8M0 scale per 32
        if start_pos > 0 and seqlen == 1:
            slot = start_pos % win
            ring.write(slice(slot, slot + 1), parts)
            window_kv = ring.read(bsz)
        else:
            # a later chunk reads the earlier positions from the ring as it was: [b, win + s, head_dim]
            window_kv = kv if start_pos == 0 else torch.cat([ring.read(bsz), kv], dim=1)
            # then position p takes slot p % win (the chunk's last `win` positions)
            keep = min(seqlen, win)
            slots = torch.arange(start_pos + seqlen - keep, start_pos + seqlen, device=x.device) % win
            ring.write(slots, tuple(part[:, seqlen - keep :] for part in parts))
        idxs = window_rows(start_pos, seqlen, win, self.numerics.window_layout, x.device)  # [s or 1, width]
        return window_kv, idxs.int().unsqueeze(0).expand(bsz, seqlen, -1)

    @staticmethod
    def _compressed_rows(cache: "QuantizedCache", bsz: int, width: int,
                         selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed rows for sparse_attn, where each selection sits in them: like `selected`).

        BF16 storage hands over every reachable row [b, T, head_dim], indexed by position (the
        reference's kv). Packed storage decodes only the rows some query selected, [b, P, head_dim]
        in ascending position, and renumbers the selections to match: sparse_attn gathers the same
        row contents in the same column order, so its output is the same bit for bit, while a
        decode step decodes and converts index_topk rows instead of the whole context."""
        if not cache.packed:
            return cache.read(bsz, width), selected
        picked = torch.unique(selected[selected >= 0]).long()  # ascending positions
        rows = torch.searchsorted(picked, selected.long().clamp_min(0)).to(selected.dtype)
        return cache.gather(bsz, picked), torch.where(selected >= 0, rows, -1)

    def _compressed(self, x, qr, start_pos, runtime: AttentionRuntime, record, trace):
        """The shared compressed-KV cache and each query's selected compressed positions, -1 where
        unreachable: [b, s, min(index_topk, T)] as the reference has them, or -1 padded to
        [b, s, index_topk] under the uniform layout. Full layers compress and publish first; the
        indexer takes the latent before it is rotated and quantized into the cache."""
        bsz, seqlen, _ = x.shape
        ratio = self.ratio
        width = (start_pos + seqlen) // ratio
        latent = None
        if self.mode == "full":
            latent = self.compressor(x, start_pos)
            runtime.compress_kv, runtime.compress_kv_from = self.compress_kv_cache, self.layer
            if record is not None:
                record.wrote_compressed = latent is not None

        if self.indexer is not None:
            if width == 0:
                selected = torch.full((bsz, seqlen, 0), -1, dtype=torch.long, device=x.device)
                if record is not None:  # nothing reachable yet, so nothing truncated
                    record.kth_score = torch.full((bsz, seqlen), float("nan"))
                    record.next_score = record.kth_score.clone()
            else:
                keep = trace is not None and trace.keep_index_scores
                selected = self.indexer(x, qr, latent, start_pos, self.freqs_cis, runtime, record, keep)
            selected = selected.int()
            if self.numerics.window_layout == "uniform":  # one width for prefill and decode (see window_rows)
                selected = self._pad_topk(selected)
            runtime.topk, runtime.topk_from, runtime.topk_call = selected, self.layer, (start_pos, seqlen)
        else:
            if runtime.topk is None or runtime.topk_call != (start_pos, seqlen) or runtime.topk.size(0) != bsz:
                raise RuntimeError(f"layer {self.layer} reuses an index source's top-k, but none ran for this call; "
                                   f"run the layers in order")
            selected = runtime.topk
        if record is not None:
            record.selected_by = runtime.topk_from

        if latent is not None:
            first = start_pos // ratio
            group_pos = (first + torch.arange(latent.size(1), device=x.device)) * ratio
            # one latent stands for its whole group and is rotated at the group's first token
            apply_rotary_emb(latent[..., -self.rope_head_dim :], self.freqs_cis[group_pos])
            parts, _ = self.compress_kv_cache.quantize(latent)  # FP4, one E4M3 scale per 16
            self.compress_kv_cache.write(slice(first, first + latent.size(1)), parts)
        if runtime.compress_kv is None:
            raise RuntimeError(f"layer {self.layer} reads compressed KV, but no KV source has run")
        return runtime.compress_kv, selected

    def _pad_topk(self, selected: torch.Tensor) -> torch.Tensor:
        return F.pad(selected, (0, self.index_topk - selected.size(-1)), value=-1)


# ---------------------------------------------------------------------------------- cache bytes
CACHE_PARTS = ("window ring data", "window ring scales", "compressed KV data", "compressed KV scales",
               "index key data", "index key scales", COMPRESSOR_TAILS)
_PART_OF = {WINDOW_RING: ("window ring data", "window ring scales"),
            COMPRESSED_KV: ("compressed KV data", "compressed KV scales"),
            INDEX_KEYS: ("index key data", "index key scales"), COMPRESSOR_TAILS: (COMPRESSOR_TAILS,)}
LONG_TERM = (COMPRESSED_KV, INDEX_KEYS)


@dataclass(frozen=True)
class CacheBytes:
    """What the attention caches of a stack of layers allocated, measured from their buffers.

    parts: bytes by part (CACHE_PARTS: data and scales of each cache, the compressor tails) over all
    `max_batch_size` rows; components: the same by cache (window ring, compressed KV, index keys,
    compressor tails). sources: per Full layer (layer, ratio, positions its caches hold: rows x
    ratio = max_seq_len rounded down to whole groups, compressed-KV bytes, index-key bytes).

    The compressed KV and index keys grow with the context (one row per `ratio` positions); the
    window rings and compressor tails are `fixed`. `per_token`: the growing caches' bytes per
    position of one sequence, each source's bytes over max_batch_size x the positions it holds, by
    component and in 'total' (on the released geometry, packed: 890, the model card's number)."""

    cache_format: str
    max_batch_size: int
    max_seq_len: int
    parts: dict
    sources: tuple

    @property
    def components(self) -> dict[str, int]:
        return {c: sum(self.parts[p] for p in parts) for c, parts in _PART_OF.items()}

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def long_term(self) -> int:
        return sum(self.components[c] for c in LONG_TERM)

    @property
    def fixed(self) -> int:
        return self.total - self.long_term

    @property
    def per_token_by_source(self) -> dict[int, float]:
        """{Full layer: (its compressed KV + index keys) bytes per position of one sequence}."""
        return {layer: (kv + keys) / (self.max_batch_size * positions)
                for layer, _, positions, kv, keys in self.sources if positions}

    @property
    def per_token(self) -> dict[str, float]:
        out = {c: sum(s[3 + i] / (self.max_batch_size * s[2]) for s in self.sources if s[2])
               for i, c in enumerate(LONG_TERM)}
        out["total"] = sum(out.values())
        return out

    def summary(self) -> str:
        per = self.per_token
        return (f"attention caches ({self.cache_format}, batch {self.max_batch_size} x {self.max_seq_len} positions): "
                f"{self.total:,} B = {self.long_term:,} B growing ({per[COMPRESSED_KV]:g} B/token compressed KV + "
                f"{per[INDEX_KEYS]:g} B/token index keys = {per['total']:g} B/token) + {self.fixed:,} B fixed "
                f"({self.components[WINDOW_RING]:,} window rings, "
                f"{self.components[COMPRESSOR_TAILS]:,} compressor tails)")


def cache_bytes(layers) -> CacheBytes:
    """`CacheBytes` of the Attention layers `layers` (one stack: same format and sizes)."""
    layers = list(layers)
    if not layers:
        raise ValueError("cache_bytes needs at least one Attention layer")
    first = layers[0]
    parts = dict.fromkeys(CACHE_PARTS, 0)
    sources = []
    for layer in layers:
        mine = layer.cache_bytes()
        for k, v in mine.items():
            parts[k] += v
        if layer.compressor is not None:
            rows = layer.compress_kv_cache.rows
            sources.append((layer.layer, layer.ratio, rows * layer.ratio,
                            sum(mine[p] for p in _PART_OF[COMPRESSED_KV]), sum(mine[p] for p in _PART_OF[INDEX_KEYS])))
    return CacheBytes(cache_format=first.cache_format, max_batch_size=first.max_batch_size,
                      max_seq_len=first.max_seq_len, parts=parts, sources=tuple(sources))


# ---------------------------------------------------------------------------------- stack
class AttentionStack(nn.Module):
    """One Attention per backbone layer and one shared runtime, for tests and notebooks.

    `forward` runs a residual chain (each layer reads the RMS-normalized stream, parameter-free,
    and adds its output back); `forward_each` feeds the same input to every layer and returns each
    layer's output, so a difference in one layer cannot leak into the next. Both advance the
    caches; call `reset_state()` before an unrelated sequence. `numerics` reaches every layer (the
    reference's arithmetic by default), and so does `cache_format` ("packed" by default, or
    "bf16"; `cache_bytes()` measures what it allocates). Built under `torch.device("meta")` a stack
    of any size allocates nothing and still reports its `cache_bytes()`.
    """

    def __init__(self, cfg, *, numerics: Numerics = Numerics(), max_batch_size: int = 1,
                 max_seq_len: int = 4096, seed: Optional[int] = None, cache_format: str = "packed"):
        super().__init__()
        self.cfg, self.numerics = cfg, numerics
        self.cache_format = check_cache_format(cache_format)
        self.runtime = AttentionRuntime()
        self.layers = nn.ModuleList(Attention(cfg, i, numerics=numerics, max_batch_size=max_batch_size,
                                              max_seq_len=max_seq_len, cache_format=cache_format)
                                    for i in range(cfg.n_layers))
        if seed is not None:
            init_random_(self, seed)

    def cache_bytes(self) -> CacheBytes:
        return cache_bytes(self.layers)

    @torch.inference_mode()  # the caches take in-place writes whichever grad mode made them
    def reset_state(self) -> None:
        for layer in self.layers:
            layer.reset_state()
        self.runtime.reset()

    @torch.inference_mode()  # the caches take in-place writes whichever grad mode made them
    def forward(self, x: torch.Tensor, start_pos: int, trace: Optional[Trace] = None) -> torch.Tensor:
        h = x
        for layer in self.layers:
            normed = F.rms_norm(h.float(), (h.size(-1),), eps=self.cfg.norm_eps).to(h.dtype)
            h = h + layer(normed, start_pos, self.runtime, trace)
        return h

    @torch.inference_mode()  # the caches take in-place writes whichever grad mode made them
    def forward_each(self, x: torch.Tensor, start_pos: int, trace: Optional[Trace] = None) -> torch.Tensor:
        """[n_layers, b, s, dim]: every layer's output on the same input x."""
        return torch.stack([layer(x, start_pos, self.runtime, trace) for layer in self.layers])
