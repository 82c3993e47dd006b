"""The indexer and the two-level top-k: candidate blocks, then the `index_topk` compressed
positions each query attends to."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...core.config import Config
from ...core.numerics import TIE_BREAKS, Numerics
from ...kernels import fp4_act_quant
from ..hooks import NO_SITES, site
from ..layers import Linear, RMSNorm, activation_dtype, linear_dtype, rotate_tail, straight_through
from .caches import INDEX_FP4_BLOCK, INDEX_KEY_ENCODING, QuantizedCache
from .runtime import AttentionRuntime, HeldRows


def candidate_block_scores(logits: torch.Tensor, compress_lens: torch.Tensor | int, block_size: int) -> torch.Tensor:
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


def select_candidate_blocks(
    logits: torch.Tensor, compress_lens: torch.Tensor | int, topk_blocks: int, block_size: int, tie_break: str = "topk"
) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------- indexer
class Indexer(nn.Module):
    """Scores every reachable compressed position for each query and keeps the `index_topk` best.

    FP4 query heads (E8M0 over 32) against one shared index key per compressed position, rectified
    and mixed over heads by `weights_proj`. A Full layer owns `wk`/`k_norm` and the key cache:
    keys are wk of the compressor's latent before RoPE, then rotated at the group's first position
    and FP4-quantized. The candidate source publishes its block mask; later index sources score
    only inside it. The key cache `k_cache` holds FP4 E2M1 with one E8M0 scale per 32 (packed, the
    default) or the same values in BF16 (`cache_format="bf16"`).

    Its site (`layers.N.attn.indexer`) sees each call's selection with, in the context, the scores
    it was cut from ("score", None on a call that reaches no compressed position yet), "reachable",
    the candidate "mask" it scored inside, whose keys and mask were read and the indexer itself.
    """

    SITES = ("",)
    named_sites = NO_SITES

    def __init__(
        self,
        cfg: Config,
        layer: int,
        max_batch_size: int = 1,
        max_seq_len: int = 4096,
        *,
        numerics: Numerics = Numerics(),
        cache_format: str = "packed",
    ):
        super().__init__()
        self.layer, self.numerics = layer, numerics
        self.ratio = cfg.compress_ratios[layer]
        self.owns_k = layer in cfg.kv_source_layers
        cand = cfg.candidate_source_layer  # -1: none
        self.is_candidate_source = layer == cand
        self.uses_candidates = 0 <= cand < layer
        self.candidate_topk_blocks = cfg.candidate_topk_blocks
        self.candidate_block_size = cfg.candidate_block_size
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_head_dim = cfg.rope_head_dim
        self.index_topk = cfg.index_topk
        self.softmax_scale = self.head_dim**-0.5
        act = activation_dtype(cfg)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=linear_dtype(cfg))
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype=act)
        if self.owns_k:
            self.wk = Linear(cfg.head_dim, self.head_dim, dtype=act)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype=act)
            self.k_cache = QuantizedCache(
                INDEX_KEY_ENCODING, max_batch_size, max_seq_len // self.ratio, self.head_dim, act, cache_format
            )

    def reset_state(self) -> None:
        if self.owns_k:
            self.k_cache.reset()

    def _random_init_(self, gen: torch.Generator) -> None:
        pass

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        latent: Optional[torch.Tensor],
        start_pos: int,
        freqs_cis: torch.Tensor,
        runtime: AttentionRuntime,
    ) -> torch.Tensor:
        """Compressed positions [b, s, min(index_topk, T)] per query, sorted, -1 where unreachable
        (T = (start_pos + s) // ratio). `latent` is this layer's pre-RoPE compressor output.
        Publishes keys and candidate blocks to `runtime` as the layer's role says; the
        arithmetic is `write_keys`, `scores` and `select`."""
        bsz, seqlen, _ = x.shape
        if self.owns_k and not runtime.cache:  # the whole sequence: its keys are published, not cached
            runtime.index_k, runtime.index_k_from = HeldRows(self.index_keys(latent, 0, freqs_cis)), self.layer
        elif self.owns_k:
            if latent is not None:
                self.write_keys(latent, start_pos, freqs_cis)
            # the reference republishes only when a group completed (stale keys otherwise)
            if latent is not None or self.numerics.fix_stale_index_keys:
                runtime.index_k, runtime.index_k_from = self.k_cache, self.layer
        if runtime.index_k is None:
            raise RuntimeError(
                f"layer {self.layer}: no index keys have been published; run the layers in "
                f"order from a prefill at position 0 (and after reset_state)"
            )

        width = (start_pos + seqlen) // self.ratio
        with torch.no_grad():  # a selection has no gradient (the indexer learns from its own loss)
            score, reachable = self.scores(x, qr, runtime.index_k.read(bsz, width), start_pos, freqs_cis)
        lens = reachable.unsqueeze(-1)  # [s, 1]
        if self.is_candidate_source:
            mask = select_candidate_blocks(
                score, lens, self.candidate_topk_blocks, self.candidate_block_size, self.numerics.tie_break
            )
            runtime.candidates, runtime.candidates_from = mask, self.layer
            runtime.candidates_call = (start_pos, seqlen)
        elif self.uses_candidates:
            if (
                runtime.candidates is None
                or runtime.candidates_call != (start_pos, seqlen)
                or runtime.candidates.shape != score.shape
            ):
                raise RuntimeError(
                    f"layer {self.layer}: the candidate source has not run for this call "
                    f"(or compresses at another ratio); run the layers in order"
                )
            mask = runtime.candidates
            score = score.masked_fill(~mask, -torch.inf)
        else:
            mask = None

        selected = self.select(score, lens)
        own = site(self, "")
        if own:
            own.exit(
                selected,
                {
                    "score": score,
                    "reachable": reachable,
                    "mask": mask,
                    "indexer": self,
                    "index_keys_from": runtime.index_k_from,
                    "candidates_from": runtime.candidates_from,
                },
            )
        return selected

    def unreachable(self, bsz: int, seqlen: int, device) -> torch.Tensor:
        """The selection [b, s, 0] of a call none of whose queries reaches a compressed position
        yet: nothing is scored or published."""
        selected = torch.full((bsz, seqlen, 0), -1, dtype=torch.long, device=device)
        own = site(self, "")
        if own:
            own.exit(selected, {"score": None})
        return selected

    def block_scores(self, score: torch.Tensor, reachable: torch.Tensor) -> torch.Tensor:
        """The candidate source's block scores [b, s, n_blocks] of its index scores, before any mask."""
        return candidate_block_scores(score, reachable.unsqueeze(-1), self.candidate_block_size)

    def write_keys(self, latent: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor) -> None:
        """Index keys of the groups this call completed (latent [b, groups, head_dim], pre-RoPE)
        into the key cache: rotated at each group's first position, FP4-quantized."""
        first = start_pos // self.ratio
        k = self.k_norm(self.wk(latent))  # [b, groups, index_head_dim]
        group_pos = (first + torch.arange(k.size(1), device=k.device)) * self.ratio
        k = rotate_tail(k, freqs_cis[group_pos], self.rope_head_dim)
        parts, _ = self.k_cache.quantize(k)  # FP4, one E8M0 scale per 32
        self.k_cache.write(slice(first, first + k.size(1)), parts)

    def index_keys(self, latent: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor) -> torch.Tensor:
        """`write_keys`' keys as values [b, groups, index_head_dim] on the cache's grid, without a
        cache (the whole-sequence path). No gradient: a key reaches the loss only through the
        selection, which has none, and the indexer's own loss reads its keys detached."""
        with torch.no_grad():
            k = self.k_norm(self.wk(latent.detach()))  # [b, groups, index_head_dim]
            group_pos = (start_pos // self.ratio + torch.arange(k.size(1), device=k.device)) * self.ratio
            k = rotate_tail(k, freqs_cis[group_pos], self.rope_head_dim)
            return self.k_cache.encoding.on_grid(k)

    def scores(
        self, x: torch.Tensor, qr: torch.Tensor, index_k: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(index scores [b, s, T] in the activation dtype, -inf where a query cannot reach;
        reachable counts [s]) against keys index_k [b, >= T, index_head_dim]."""
        seqlen = x.size(1)
        end_pos = start_pos + seqlen
        width = end_pos // self.ratio
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [b, s, heads, index_head_dim]
        q = rotate_tail(q, freqs_cis[start_pos:end_pos], self.rope_head_dim)
        if q.requires_grad:  # the indexer's own loss: FP4 queries with a straight-through gradient
            q = straight_through(q, fp4_act_quant(q.detach().clone(), INDEX_FP4_BLOCK, inplace=True))
        else:
            fp4_act_quant(q, INDEX_FP4_BLOCK, inplace=True)

        weights = self.weights_proj(x) * (self.softmax_scale * self.n_heads**-0.5)  # [b, s, heads]
        score = torch.einsum("bshd,btd->bsht", q, index_k[:, :width])
        score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, T], activation dtype

        # a compressed position is reachable once the query has passed its group's last token
        positions = torch.arange(start_pos, end_pos, device=x.device)
        reachable = (positions + 1) // self.ratio  # [s]
        score = score.masked_fill(torch.arange(width, device=x.device) >= reachable.unsqueeze(-1), -torch.inf)
        return score, reachable

    def select(self, score: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return select_positions(score, lens, self.index_topk, self.numerics.tie_break)


def select_positions(score: torch.Tensor, lens: torch.Tensor, index_topk: int, tie_break: str = "topk") -> torch.Tensor:
    """The top `index_topk` positions of score [b, s, T], sorted, -1 past a query's reach (lens
    [s, 1]: reachable counts); `tie_break` as in `top_k`."""
    k_sel = min(index_topk, score.size(-1))
    if tie_break == "topk":
        idx = score.topk(k_sel, dim=-1, sorted=False).indices.sort(dim=-1).values
    else:
        idx = top_k(score, k_sel, tie_break)[1].sort(dim=-1).values
    # A -inf pick at a reachable position is kept, as in the reference: where the candidate
    # pool holds fewer than index_topk positions, the remainder are positions outside it.
    return torch.where(idx < lens, idx, -1)


def attention_target(q: torch.Tensor, compressed: torch.Tensor, ratio: int, start_pos: int = 0) -> torch.Tensor:
    """What a layer's heads attend to among the compressed positions each query reaches, heads
    averaged: the distribution an indexer is distilled towards. q [b, s, heads, head_dim] (the
    rotated queries), compressed [b, T, head_dim] (the compressed KV rows) -> float32 [b, s, T],
    zero where a query reaches nothing."""
    seqlen, width = q.size(1), compressed.size(1)
    reachable = (torch.arange(start_pos, start_pos + seqlen, device=q.device) + 1) // ratio  # [s]
    unreachable = torch.arange(width, device=q.device) >= reachable.unsqueeze(-1)  # [s, T]
    logits = torch.einsum("bshd,btd->bsht", q.float(), compressed.float()) * q.size(-1) ** -0.5
    probs = logits.masked_fill(unreachable.unsqueeze(1), -torch.inf).softmax(dim=-1).nan_to_num(0.0)
    return probs.mean(dim=2)
