"""The compressor: `ratio` consecutive tokens pooled into one compressed KV latent."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...core.config import Config
from ...core.numerics import Numerics
from ..hooks import NO_SITES, site
from ..layers import Linear, RMSNorm, activation_dtype
from .caches import TAIL_DTYPE
from .state import CompressorTail


class Compressor(nn.Module):
    """Pools `ratio` consecutive tokens into one KV latent [head_dim] with a learned softmax gate.

    Returns the normalized latents of the groups completed by this call, before RoPE (the
    indexer needs them unrotated), or None when no group completes. The trailing partial group
    waits in kv_state / score_state for the next call; a call of several tokens at a later
    position completes it first, so any split of a sequence into calls pools the same groups.
    Ratio 1 has no group to pool: no gate, a plain BF16 projection. Above ratio 1 the projections
    and pooling run in float32 (the weights are held in float32, as the reference runtime promotes
    them). Its site (`layers.N.attn.compressor`) sees what each call returns: the latents, or None.
    """

    SITES = ("",)
    named_sites = NO_SITES

    def __init__(self, cfg: Config, layer: int, max_batch_size: int = 1, *, numerics: Numerics = Numerics()):
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
            self.register_buffer("kv_state", torch.zeros(state, dtype=TAIL_DTYPE), persistent=False)
            self.register_buffer("score_state", torch.full(state, -torch.inf, dtype=TAIL_DTYPE), persistent=False)
        self.window = cfg.window_size
        # (start_pos, kv, score) of the last call of several rows, at most a window long: what
        # `truncate` rebuilds the partial group from when that call is cut short
        self.last_call: Optional[tuple] = None

    def reset_state(self) -> None:
        if self.ratio > 1:
            self.kv_state.zero_()
            self.score_state.fill_(-torch.inf)
        self.last_call = None

    def capture(self) -> CompressorTail:
        """A copy of the partial group, for `restore` or `truncate`."""
        return CompressorTail(self.kv_state.clone(), self.score_state.clone())

    def restore(self, tail: CompressorTail) -> None:
        self.kv_state.copy_(tail.kv_state)
        self.score_state.copy_(tail.score_state)

    def truncatable(self, start: int, end: int) -> bool:
        """Whether the last call was over [start, end) with its projections kept (`truncate`)."""
        return self.last_call is not None and self.last_call[0] == start and self.last_call[1].size(1) == end - start

    def truncate(self, tail: CompressorTail, start: int, keep_end: int) -> None:
        """The partial group as a call over [start, keep_end) would have left it, from the tail
        before the last call and that call's own projections."""
        call_start, kv, score = self.last_call
        assert call_start == start, "truncate cuts the last call only"
        kv_state, score_state = tail.kv_state, tail.score_state
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

    def forward(self, x: torch.Tensor, start_pos: int, *, keep_tail: bool = True) -> Optional[torch.Tensor]:
        """x [b, s, dim] -> latents [b, n_completed, head_dim] in x.dtype, or None. keep_tail=False
        (the whole-sequence path, from position 0): the trailing partial group is not kept."""
        latent = self._pool(x, start_pos, keep_tail)
        own = site(self, "")
        if own:
            own.exit(latent)
        return latent

    def _pool(self, x: torch.Tensor, start_pos: int, keep_tail: bool) -> Optional[torch.Tensor]:
        bsz, seqlen, _ = x.shape
        ratio = self.ratio
        if ratio == 1:
            return self.norm(self.wkv(x))

        x32 = x.float()
        kv, score = self.wkv(x32), self.wgate(x32)  # [b, s, head_dim] float32 each
        if keep_tail:
            self.last_call = (start_pos, kv, score) if 1 < seqlen <= self.window else None
        if start_pos == 0 or seqlen > 1:
            held = start_pos % ratio  # the partial group's earlier tokens, waiting in the state
            if held:  # [b, held + s, head_dim]: the group's held rows first, then this call's
                kv = torch.cat([self.kv_state[:bsz, :held], kv], dim=1)
                score = torch.cat([self.score_state[:bsz, :held], score], dim=1)
            rows = held + seqlen
            n_groups = rows // ratio
            cut = n_groups * ratio
            if rows > cut and keep_tail:  # the partial trailing group waits for the next call (slot = position % ratio)
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
