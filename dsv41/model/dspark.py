"""The DSpark draft stack: the checkpoint's `mtp.*` stages, which propose a block of tokens from the
target model's own hidden states.

What the target hands over: at each `dspark_target_layer_ids` layer, the layer's input averaged
over its hyper-connection copies (`Block.feeds_draft`), concatenated in layer order — the *main
hidden* of a position. Stage 0 maps it to one `dim` vector (`main_proj`, `main_norm`); from that
every stage writes one window-KV row per committed position with its own `wkv` / `kv_norm`, into a
window ring like a backbone layer's (`feed`, called by `Model` after every forward).

A draft (`DraftStack.draft`) anchored at the last committed position p: the block is the anchor
token (the target's next token, at position p + 1) followed by `dspark_block_size - 1` noise
tokens, embedded with the target's embedding and run through the stages as ordinary blocks (mHC,
MoE with the draft's own experts, no Engram, no VL bias), except that attention reads the window
ring (positions up to p) plus every block position, with no causal mask inside the block. The last
stage's collapse goes through its norm and the target's head; a Markov head adds bigram logits
from the previously chosen token, position by position (greedy), and a confidence head reads
[hidden, Markov embedding] in float32. Block row i's logits propose the token at p + 2 + i.

The row of position p is written again by the draft from a one-row computation, exactly as the
reference's draft call does, so a draft right after a prefill equals the reference's seeding call
followed by its one-row call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..core.config import Config
from ..core.numerics import Numerics
from ..kernels import masked_attention, sparse_attn
from .attention import Attention, LayerRows
from .layers import Linear, RMSNorm, activation_dtype, f32_linear, linear_dtype
from .model import Block, Embedding, Head, identity_pre, runtime_config
from .sampling import gumbel_max, probabilities


@dataclass
class DraftBlock:
    """One draft: `ids` int64 [b, block + 1] (column 0 the anchor, then the proposals), `logits`
    float32 [b, block, vocab] (Markov bias included; row i proposes ids[:, i + 1]) and `confidence`
    float32 [b, block] (the confidence head's raw output; sigmoid gives a probability)."""

    ids: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    probs: Optional[torch.Tensor] = None  # sampled drafts: float32 [b, block, vocab], what row i was drawn from

    @property
    def proposals(self) -> list[int]:
        return self.ids[0, 1:].tolist()


@dataclass
class DraftRows:
    """What a target forward over [start, end) may overwrite in the draft stack: each stage's
    window-ring rows and the main hidden state of the last fed position before it."""

    start: int
    end: int
    rings: list[LayerRows]
    last_main: Optional[torch.Tensor]


class DraftAttention(Attention):
    """A draft stage's attention: a window ring fed with the main hidden state of committed
    positions, and a block that attends to the ring and to all of its own positions."""

    def feed(self, main_x: torch.Tensor, start_pos: int) -> None:
        """Write the window rows of main_x [b, s, dim], positions start_pos.., into their slots
        (FP8 QAT over 32 after RoPE, as a backbone layer's window rows)."""
        freqs = self.freqs_cis[start_pos : start_pos + main_x.size(1)]
        parts, _ = self.window_kv_cache.quantize(self.window_kv(main_x, freqs))
        self.write_window(parts, start_pos)

    def block(self, x: torch.Tensor, start_pos: int, main_x: torch.Tensor) -> torch.Tensor:
        """x [b, block, dim] at positions start_pos + 1.. ; main_x [b, 1, dim] of position start_pos
        (written into its slot first) -> [b, block, dim]."""
        bsz, block, _ = x.shape
        self.feed(main_x, start_pos)
        freqs = self.freqs_cis[start_pos + 1 : start_pos + 1 + block]
        # the ring's written slots (all once the sequence has `window` positions)
        return self.attend_block(x, freqs, self.window_kv_cache.read(bsz), min(self.window_size, start_pos + 1))

    def attend_block(self, x: torch.Tensor, freqs: torch.Tensor, ring: torch.Tensor, written: int) -> torch.Tensor:
        """x [b, block, dim] at the positions freqs [block or b, block, rope/2] rotates to; ring
        [b, window, head_dim] the window rows in slot order, of which the first `written` are read,
        then every block row -> [b, block, dim]."""
        bsz, block, _ = x.shape
        _, q = self.queries(x, freqs)  # [b, block, heads, head_dim]
        kv = self.window_kv_cache.encoding.on_grid(self.window_kv(x, freqs))  # on the ring's grid, not stored
        kv = torch.cat([ring, kv], dim=1)  # [b, window + block, head_dim]
        columns = torch.cat([torch.arange(written), self.window_size + torch.arange(block)]).to(x.device)
        idxs = columns.int().view(1, 1, -1).expand(bsz, block, -1)
        attend = masked_attention if self.numerics.summation == "fast" else sparse_attn
        o = attend(q, kv, self.attn_sink, idxs, self.softmax_scale)
        return self.project_out(o, freqs)


class MarkovHead(nn.Module):
    """Bigram logits from the previous token: a small embedding and a float32 projection."""

    def __init__(self, vocab_size: int, rank: int, *, numerics: Numerics, dtype: torch.dtype):
        super().__init__()
        self.pad_f32_rows = numerics.pad_f32_rows
        self.embed = Embedding(vocab_size, rank, dtype)
        self.head = Head(vocab_size, rank, numerics=numerics)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [b] -> (logits float32 [b, vocab], embedding [b, rank])."""
        embed = self.embed(token_ids)
        return f32_linear(embed, self.head.weight, pad_f32_rows=self.pad_f32_rows), embed


class ConfidenceHead(nn.Module):
    def __init__(self, width: int, *, numerics: Numerics):
        super().__init__()
        self.proj = Linear(width, 1, torch.float32, pad_f32_rows=numerics.pad_f32_rows)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """[b, block, dim] and [b, block, rank] -> float32 [b, block]."""
        return self.proj(torch.cat([hidden, markov_embed], dim=-1).float()).squeeze(-1)


class DraftLayer(Block):
    """One `mtp.N` stage: a block with DraftAttention; stage 0 also holds the main-hidden
    projection, the last stage the norm, the Markov head and the confidence head."""

    attention_type = DraftAttention

    def __init__(
        self, cfg: Config, stage: int, *, numerics: Numerics, max_batch_size: int, max_seq_len: int, cache_format: str
    ):
        # the block reaches `dspark_block_size` positions past the last committed one
        super().__init__(
            cfg,
            cfg.n_layers + stage,
            numerics=numerics,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len + cfg.dspark_block_size + 1,
            cache_format=cache_format,
        )
        act = activation_dtype(cfg)
        self.stage = stage
        if stage == 0:
            self.main_proj = Linear(cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim, linear_dtype(cfg))
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=act)
        if stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=act)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, numerics=numerics, dtype=act)
            self.confidence_head = ConfidenceHead(cfg.dim + cfg.dspark_markov_rank, numerics=numerics)

    def forward(self, x: torch.Tensor, start_pos: int, pre: torch.Tensor, main_x: torch.Tensor):
        # drafts are text: no VL routing bias
        return self.sublayers(x, pre, lambda h: self.attn.block(h, start_pos, main_x), None)


class DraftStack(nn.Module):
    """The `mtp.*` stages (parameter names are the checkpoint's), sharing the target's embedding
    and head. Holds the window rings and the main hidden state of the last fed position."""

    def __init__(
        self,
        cfg: Config,
        embed: Embedding,
        head: Head,
        *,
        numerics: Numerics = Numerics(),
        max_batch_size: int = 1,
        max_seq_len: int = 4096,
        cache_format: str = "packed",
    ):
        super().__init__()
        cfg = runtime_config(cfg)
        if cfg.n_mtp_layers == 0 or cfg.dspark_block_size == 0 or not cfg.dspark_target_layer_ids:
            raise ValueError(
                "this config has no DSpark draft stack (n_mtp_layers, dspark_block_size and "
                "dspark_target_layer_ids must all be set)"
            )
        self.cfg, self.block_size, self.noise_token_id = cfg, cfg.dspark_block_size, cfg.dspark_noise_token_id
        self.numerics = numerics
        self.hc_mult = cfg.hc_mult
        self.mtp = nn.ModuleList(
            DraftLayer(
                cfg,
                stage,
                numerics=numerics,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                cache_format=cache_format,
            )
            for stage in range(cfg.n_mtp_layers)
        )
        self._target = (embed, head)  # the target's own modules: a tuple, so not parameters of this stack
        self.last_main: Optional[torch.Tensor] = None  # [b, 1, dim * n_targets] of the last fed position
        self.last_fed: Optional[tuple] = None  # (start_pos, main_hidden) of the last forward, for `truncate`

    def attach_store(self, store) -> None:
        for layer in self.mtp:
            layer.ffn.attach_store(store)

    def reset_state(self) -> None:
        for layer in self.mtp:
            layer.reset_state()
        self.last_main = self.last_fed = None

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        first = self.mtp[0]
        return first.main_norm(first.main_proj(main_hidden))

    @torch.inference_mode()
    def feed(self, main_hidden: torch.Tensor, start_pos: int) -> None:
        """main_hidden [b, s, dim * n_targets] of positions start_pos.. (one target forward)."""
        main_x = self.main_x(main_hidden)
        for layer in self.mtp:
            layer.attn.feed(main_x, start_pos)
        self.last_main = main_hidden[:, -1:]
        # kept only as long as a call `truncate` can cut (no longer than the window)
        self.last_fed = (start_pos, main_hidden) if main_hidden.size(1) <= self.cfg.window_size else None

    def capture(self, start: int, end: int) -> DraftRows:
        """What a forward over [start, end) may overwrite here: each ring's slots and the last main
        hidden state (`restore` puts them back, `truncate` cuts the last feed short)."""
        return DraftRows(start, end, [layer.attn.capture(start, end) for layer in self.mtp], self.last_main)

    def restore(self, rows: DraftRows) -> None:
        for layer, ring in zip(self.mtp, rows.rings):
            layer.attn.restore(ring)
        self.last_main = rows.last_main

    def truncatable(self, start: int, end: int) -> bool:
        return (
            self.last_fed is not None
            and self.last_fed[0] == start
            and self.last_fed[1].size(1) == end - start
            and all(layer.attn.truncatable(start, end) for layer in self.mtp)
        )

    def truncate(self, rows: DraftRows, keep_end: int) -> None:
        """The last forward's feed cut back to [start, keep_end) (see `Attention.truncate`)."""
        start = rows.start
        for layer, ring in zip(self.mtp, rows.rings):
            layer.attn.truncate(ring, keep_end)
        self.last_main = self.last_fed[1][:, keep_end - start - 1 : keep_end - start]
        self.last_fed = (start, self.last_fed[1][:, : keep_end - start])

    @torch.inference_mode()
    def draft(
        self, token_id, start_pos: int, *, temperature: float = 0.0, generator: Optional[torch.Generator] = None
    ) -> DraftBlock:
        """A draft after the last fed position `start_pos`, starting from `token_id` (the target's
        next token; an int or [b]): greedy at temperature 0, else each proposal drawn from
        softmax(row / temperature) by Gumbel-max with `generator` (the block's `probs`)."""
        if self.last_main is None:
            raise ValueError("the draft stack has not been fed: run the model on a prompt first")
        embed, head = self._target
        anchor = torch.as_tensor(token_id, dtype=torch.long).reshape(-1).to(self.last_main.device)
        bsz, block = anchor.numel(), self.block_size
        if bsz != self.last_main.size(0):
            raise ValueError(f"{bsz} anchor tokens for a sequence batch of {self.last_main.size(0)}")
        main_x = self.main_x(self.last_main)  # [b, 1, dim]
        ids = torch.full((bsz, block), self.noise_token_id, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        x = embed(ids).unsqueeze(2).repeat(1, 1, self.hc_mult, 1)  # [b, block, hc, dim]: equal copies
        pre = identity_pre(bsz, block, self.hc_mult, x.device)
        for layer in self.mtp:
            x, pre = layer(x, start_pos, pre, main_x)
        last = self.mtp[-1]
        hidden = last.collapse(x, pre)  # [b, block, dim]
        logits = head(last.norm(hidden), all_positions=True)  # [b, block, vocab] float32
        out = torch.empty(bsz, block + 1, dtype=torch.long, device=anchor.device)
        out[:, 0] = anchor
        markov_embeds, probs = [], []
        for i in range(block):  # each proposal conditions the next position's bigram bias
            bias, markov_embed = last.markov_head(out[:, i])
            logits[:, i] += bias
            markov_embeds.append(markov_embed)
            if temperature > 0:
                p = probabilities(logits[:, i], temperature)
                out[:, i + 1] = gumbel_max(p, generator)
                probs.append(p)
            else:
                out[:, i + 1] = logits[:, i].argmax(dim=-1)
        confidence = last.confidence_head(hidden, torch.stack(markov_embeds, dim=1))
        return DraftBlock(out, logits, confidence, torch.stack(probs, dim=1) if probs else None)

    def anchored(
        self, main_hidden: torch.Tensor, anchors: torch.Tensor, block_tokens: torch.Tensor, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafts of a batch of anchors over a whole sequence, without rings (training's path: the
        proposals are the teacher's, not chosen). main_hidden [b, s, dim * n_targets] (positions
        0..s-1); anchors int64 [b, A] (committed positions p >= window - 1, so each ring is full);
        block_tokens [b, A, block] (the anchor token then noise); previous [b, A, block] (the token
        before each row, the Markov head's input). -> (logits float32 [b * A, block, vocab] with
        the Markov bias, confidence [b * A, block] from detached inputs (the confidence head learns
        on its own), hidden [b * A, block, dim]). Row for row what `draft` computes after a prefill
        of s positions (under the reference summation, bit for bit)."""
        embed, head = self._target
        bsz, n_anchor = anchors.shape
        block, win, n = self.block_size, self.cfg.window_size, anchors.numel()
        p = anchors.reshape(n, 1)
        ring_pos = p - (p - torch.arange(win, device=p.device)) % win  # [n, win]: the position in each slot
        batch_row = torch.arange(bsz, device=p.device).repeat_interleave(n_anchor).unsqueeze(-1)  # [n, 1]
        block_pos = p + 1 + torch.arange(block, device=p.device)  # [n, block]
        main_x = self.main_x(main_hidden)  # [b, s, dim]
        x = embed(block_tokens.reshape(n, block)).unsqueeze(2).repeat(1, 1, self.hc_mult, 1)  # [n, block, hc, dim]
        pre = identity_pre(n, block, self.hc_mult, x.device)
        for layer in self.mtp:
            attn = layer.attn
            rows = attn.window_kv_cache.encoding.on_grid(attn.window_kv(main_x, attn.freqs_cis[: main_x.size(1)]))
            ring = rows[batch_row, ring_pos]  # [n, win, head_dim]
            freqs = attn.freqs_cis[block_pos]  # [n, block, rope / 2]
            x, pre = layer.sublayers(x, pre, lambda h, a=attn, r=ring, f=freqs: a.attend_block(h, f, r, win), None)
        last = self.mtp[-1]
        hidden = last.collapse(x, pre)  # [n, block, dim]
        logits = head(last.norm(hidden), all_positions=True)  # [n, block, vocab] float32
        previous = previous.reshape(n, block)
        if self.numerics.summation == "fast":
            bias, markov = last.markov_head(previous)
        else:  # a row at a time, as `draft` adds each position's bias (float32 GEMMs round by row count)
            rows = [last.markov_head(previous[:, i]) for i in range(block)]
            bias, markov = torch.stack([r[0] for r in rows], dim=1), torch.stack([r[1] for r in rows], dim=1)
        confidence = last.confidence_head(hidden.detach(), markov.detach())
        return logits + bias, confidence, hidden

    def describe(self) -> dict:
        cfg = self.cfg
        n_experts, topk = cfg.moe_shape(cfg.n_layers)
        return {
            "stages": cfg.n_mtp_layers,
            "target_layers": list(cfg.dspark_target_layer_ids),
            "block_size": self.block_size,
            "noise_token_id": self.noise_token_id,
            "window": cfg.window_size,
            "routed_experts": n_experts,
            "activated_experts": topk,
            "markov_rank": cfg.dspark_markov_rank,
            "parameters": sum(p.numel() for p in self.parameters()),
        }
