"""The DSpark draft stack trained on the frozen target: the twin of `dspark.DraftStack.draft` on a
batch of anchors, and the trainer's draft phase.

A draft anchored at committed position p reads each stage's window ring (the main hidden state of
positions p - window + 1 .. p, in ring-slot order, as `DraftAttention.block` reads it) and its own
block: the anchor token (position p + 1) then noise tokens. Row i proposes the token at p + 2 + i.
Training forces the teacher's tokens: the anchor and the Markov head's previous token are the
text's, and row i learns the target's own next-token distribution at position p + 1 + i (so the
draft learns what the target will accept, not the text). The confidence head learns, from detached
inputs, whether the row's greedy proposal is the target's greedy token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.caches import WINDOW_ENCODING
from .schedule import lr_at
from .state import restore_moments
from .twin import TwinOutput, bf16, on_grid, rms_norm, rotate


def draft_forward(
    twin,
    W,
    main_hidden: torch.Tensor,
    anchors: torch.Tensor,
    block_tokens: torch.Tensor,
    previous: torch.Tensor,
    *,
    qat: bool,
    out: TwinOutput | None = None,
):
    """Drafts of a batch of anchors.

    main_hidden [b, s, dim * n_targets] (the target's, positions 0..s-1); anchors int64 [b, A]
    (committed positions p, each >= window - 1); block_tokens int64 [b, A, block] (the anchor token
    then noise); previous int64 [b, A, block] (the token before each row: the Markov head's input).
    -> (logits float32 [b * A, block, vocab] with the Markov bias, confidence [b * A, block],
    hidden [b * A, block, dim], markov embeddings [b * A, block, rank])."""
    c = twin.cfg
    bsz, n_anchor = anchors.shape
    block, win, rope = c.dspark_block_size, c.window_size, c.rope_head_dim
    n = bsz * n_anchor
    freqs_table = twin.window_freqs  # draft stages compress nothing: window-layer rotation
    main_x = rms_norm(
        twin.linear(W, "mtp.0.main_proj.weight", main_hidden, qat), W["mtp.0.main_norm.weight"], c.norm_eps
    )
    p = anchors.reshape(n)  # [n]
    slots = torch.arange(win)
    ring_pos = p.unsqueeze(-1) - (p.unsqueeze(-1) - slots) % win  # [n, win]: the position in each slot
    batch_row = torch.arange(bsz).repeat_interleave(n_anchor).unsqueeze(-1)  # [n, 1]
    block_pos = p.unsqueeze(-1) + 1 + torch.arange(block)  # [n, block]
    block_freqs = freqs_table[block_pos]  # [n, block, rope / 2]

    x = bf16(W["embed.weight"][block_tokens.reshape(n, block)])  # [n, block, dim]
    x = x.unsqueeze(2).expand(n, block, c.hc_mult, c.dim)
    pre = torch.zeros(n, block, c.hc_mult)
    pre[..., 0] = 1.0
    scratch = out or TwinOutput(logits=None)
    for stage in range(c.n_mtp_layers):
        sp = f"mtp.{stage}."
        layer = c.n_layers + stage
        ring_all = rms_norm(
            twin.linear(W, sp + "attn.wkv.weight", main_x, qat), W[sp + "attn.kv_norm.weight"], c.norm_eps
        )
        ring_all = on_grid(rotate(ring_all, freqs_table[: main_x.size(1)], rope), WINDOW_ENCODING)  # [b, s, head_dim]
        ring = ring_all[batch_row, ring_pos]  # [n, win, head_dim]

        def attend(h, sp=sp, ring=ring):
            qr = rms_norm(twin.linear(W, sp + "attn.wq_a.weight", h, qat), W[sp + "attn.q_norm.weight"], c.norm_eps)
            q = rotate(
                twin.linear(W, sp + "attn.wq_b.weight", qr, qat).unflatten(-1, (c.n_heads, c.head_dim)),
                block_freqs,
                rope,
            )
            kv = rms_norm(twin.linear(W, sp + "attn.wkv.weight", h, qat), W[sp + "attn.kv_norm.weight"], c.norm_eps)
            kv = torch.cat(
                [ring, on_grid(rotate(kv, block_freqs, rope), WINDOW_ENCODING)], dim=1
            )  # [n, win + block, d]
            idxs = torch.arange(win + block, dtype=torch.int32).view(1, 1, -1).expand(n, block, -1)
            o = bf16(twin.attend(q, kv, W[sp + "attn.attn_sink"], idxs, c.head_dim**-0.5))
            o = rotate(o, block_freqs, rope, inverse=True).view(n, block, c.o_groups, -1)
            wo_a = W[sp + "attn.wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
            o = twin.bf16_product(torch.einsum, o, wo_a, "bsgd,grd->bsgr")
            return twin.linear(W, sp + "attn.wo_b.weight", o.flatten(2), qat)

        x, pre = twin.block_sites(
            W, sp, x, pre, qat, attend, lambda f, sp=sp, layer=layer: twin.moe(W, sp + "ffn.", f, qat, scratch, layer)
        )
    last = f"mtp.{c.n_mtp_layers - 1}."
    hidden = bf16(twin.hc_pre(x, pre))  # [n, block, dim]
    logits = F.linear(rms_norm(hidden, W[last + "norm.weight"], c.norm_eps), W["head.weight"])
    markov = bf16(W[last + "markov_head.embed.weight"][previous.reshape(n, block)])  # [n, block, rank]
    markov_w = W[last + "markov_head.head.weight"]
    if twin.exact:  # a row at a time, as the draft loop adds each position's bias (float32 GEMMs round by row count)
        logits = logits + torch.stack([F.linear(markov[:, i], markov_w) for i in range(block)], dim=1)
    else:
        logits = logits + F.linear(markov, markov_w)
    confidence = F.linear(torch.cat([hidden, markov], dim=-1), W[last + "confidence_head.proj.weight"]).squeeze(-1)
    return logits, confidence, hidden, markov


class DraftTrainer:
    """The draft phase of a `loop.Trainer`: the target frozen on its release rounding."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.twin = trainer.twin
        self.names = self.twin.trainable(prefix="mtp.")
        with torch.no_grad():
            self.target_weights = {
                k: v.detach() for k, v in self.twin.weights(qat=True).items() if not k.startswith("mtp.")
            }

    def optimizer(self, saved=None):
        opt = self.trainer.optimizer_for(self.names, self.trainer.settings.draft_lr)
        if saved is not None:
            restore_moments(opt, self.trainer.names_of, saved["moments"])
        return opt

    def anchors(self, step: int, seq_len: int, batch: int) -> torch.Tensor:
        c = self.twin.cfg
        gen = torch.Generator().manual_seed(self.trainer.settings.seed * 7_000_003 + step)
        low, high = c.window_size - 1, seq_len - c.dspark_block_size - 1  # ring full, every row labelled
        return torch.stack(
            [
                torch.randperm(high - low, generator=gen)[: self.trainer.settings.draft_anchors] + low
                for _ in range(batch)
            ]
        )  # [b, A]

    def batch(self, inputs: torch.Tensor, anchors: torch.Tensor):
        """(block tokens, previous tokens) [b, A, block] for anchors [b, A] of inputs [b, s]."""
        c = self.twin.cfg
        block = c.dspark_block_size
        offsets = anchors.unsqueeze(-1) + 1 + torch.arange(block)  # positions p + 1 + i
        previous = torch.gather(inputs.unsqueeze(1).expand(-1, anchors.size(1), -1), 2, offsets)
        tokens = torch.full_like(previous, int(c.dspark_noise_token_id))
        tokens[..., 0] = previous[..., 0]
        return tokens, previous, offsets

    def step(self, step: int, opt) -> dict:
        t, s = self.trainer, self.trainer.settings
        c = self.twin.cfg
        inputs, _ = t.batch(step)
        with torch.no_grad():
            target = self.twin.forward(
                inputs,
                t.hash_ids(inputs),
                qat=True,
                index_loss=False,
                want_main_hidden=True,
                weights=self._target_view(),
            )
        anchors = self.anchors(step, inputs.size(1), inputs.size(0))
        tokens, previous, offsets = self.batch(inputs, anchors)
        lr = lr_at(step - s.backbone_steps, s.draft_steps, s.draft_lr, s.warmup, s.min_lr_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        W = self.twin.weights(qat=True)
        out = TwinOutput(logits=None)
        logits, confidence, hidden, markov = draft_forward(
            self.twin, W, target.main_hidden, anchors, tokens, previous, qat=True, out=out
        )
        # row i learns the target's distribution at position p + 1 + i
        rows = torch.arange(inputs.size(0)).view(-1, 1, 1)
        teacher = target.logits[rows, offsets].reshape(-1, c.dspark_block_size, c.vocab_size)
        kl = F.kl_div(logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean")
        kl = kl / c.dspark_block_size
        accepted = (logits.argmax(-1) == teacher.argmax(-1)).float()  # [n, block]
        conf_w = W[f"mtp.{c.n_mtp_layers - 1}.confidence_head.proj.weight"]
        conf = F.linear(torch.cat([hidden, markov], dim=-1).detach(), conf_w).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(conf, accepted)
        loss = kl + bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        t.balance({k: v for k, v in out.expert_load.items()})
        by_row = accepted.mean(0).tolist()
        return {
            "step": step,
            "phase": "draft",
            "loss": kl.item(),
            "confidence_bce": bce.item(),
            "lr": lr,
            "agreement_by_row": by_row,
        }

    def _target_view(self):
        return {**self.twin.params, **self.target_weights}
