"""The trainer's draft phase: the DSpark draft stack trained on the frozen target, through the
stack's own forward over a batch of anchors (`dspark.DraftStack.anchored`).

A draft anchored at committed position p reads each stage's window ring (the main hidden state of
positions p - window + 1 .. p, in ring-slot order, as `DraftAttention.block` reads it) and its own
block: the anchor token (position p + 1) then noise tokens. Row i proposes the token at p + 2 + i.
Training forces the teacher's tokens: the anchor and the Markov head's previous token are the
text's, and row i learns the target's own next-token distribution at position p + 1 + i (so the
draft learns what the target will accept, not the text). The confidence head learns, from detached
inputs, whether the row's greedy proposal is the target's greedy token, on the rows whose context
is one inference gives a row it judges: there a row is judged only after the anchor and every
proposal before it were the target's own greedy tokens, so only rows where the text agrees with the
target's greedy choice at the anchor and at each earlier row count (`greedy_context`). Trained on
every row, the shipped miniature's head expected less than inference accepted (proposals it gave
0.54 were accepted 0.67 of the time), so the confidence cut dropped proposals that would have been
accepted; this rule alone did not move the measured tokens per forward, the greedy pool below did.

Every other draft step reads the target's own greedy continuations instead of the text
(`greedy_pool`, made once at the start of the phase from the released rounding of the target, as
`dsv41.load` runs it): what speculative greedy decoding verifies is such a continuation, more
regular than the text (it repeats itself), and a draft and confidence head trained on text alone
expected less of it than it gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import train_batch
from .masters import forward as run_forward
from .masters import holding, set_qat, trainable_names, weights
from .schedule import lr_at
from .state import restore_moments

# The greedy pool: `settings.pool_sequences` sequences of the run's length, each a prompt from the
# train stream then the target's greedy continuation, made in batches of POOL_BATCH (1,024 sequences
# of 256 tokens took 9.9 minutes here, so the default 256 take about 2.5).
POOL_PROMPT = 64
POOL_BATCH = 32


def pool_shape(settings) -> tuple[int, int]:
    """(sequences, prompt tokens) of a run's greedy pool: no more sequences than the phase's pool
    steps read, and a prompt of at most a quarter of the sequence."""
    return min(settings.pool_sequences, settings.batch * (settings.draft_steps // 2 + 1)), min(
        POOL_PROMPT, settings.seq_len // 4
    )


def greedy_pool(trainer, target_weights: dict) -> torch.Tensor:
    """[sequences, seq_len] int64 (`pool_shape`): BOS and the prompt's other tokens from the train
    stream at seeded offsets, then the target's greedy tokens, decoded by the release checkpoint of
    `target_weights` loaded as `dsv41.load` loads it (so the pool is what inference would generate)."""
    import sys
    import tempfile

    from tqdm import tqdm

    from ..generation.generate import decode_one, prefill
    from ..runtime.loader import load
    from .release import write_miniature

    s = trainer.settings
    n, prompt = pool_shape(s)
    gen = torch.Generator().manual_seed(s.seed * 9_000_011)
    prompts, _ = train_batch(trainer.streams.train, n, prompt, int(trainer.cfg.bos_token_id), gen)
    params = {**trainer.params, **target_weights}
    with tempfile.TemporaryDirectory(prefix="dsv41-draft-pool-") as folder:
        write_miniature(folder + "/checkpoint", trainer.cfg, trainer.tokenizer, params, {"steps": s.backbone_steps})
        model = load(
            folder + "/checkpoint",
            quiet=True,
            max_batch_size=POOL_BATCH,
            max_seq_len=s.seq_len,
            dspark=False,
            expert_cache=trainer.cfg.n_routed_experts,
        )
        rows = []
        bar = tqdm(total=n, desc="greedy pool", unit="seq", leave=False, file=sys.stderr, disable=not trainer.progress)
        with torch.no_grad(), bar:
            for first in range(0, n, POOL_BATCH):
                ids = prompts[first : first + POOL_BATCH]  # [rows, prompt]
                logits = prefill(model, ids)  # [rows, vocab]: the prompt's last position
                out = [ids]
                for position in range(prompt, s.seq_len):
                    chosen = logits.argmax(-1, keepdim=True)  # [rows, 1]
                    out.append(chosen)
                    if position + 1 < s.seq_len:
                        logits = decode_one(model, chosen)
                rows.append(torch.cat(out, dim=1))
                bar.update(ids.size(0))
    return torch.cat(rows)  # [sequences, seq_len]


def greedy_context(inputs: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[b, A, block] bool: row i of the draft at each anchor p sees what inference would give it,
    i.e. the tokens at p + 1 .. p + 1 + i are the target's greedy choices from the positions before
    them. `inputs` [b, s] the text, `greedy` [b, s] the target's argmax at each position (the
    token it predicts next), `anchors` [b, A]."""
    agrees = inputs[:, 1:] == greedy[:, :-1]  # [b, s - 1]: the token at q + 1 is the greedy choice at q
    at = anchors.unsqueeze(-1) + torch.arange(block)  # [b, A, block]: q = p + i
    rows = torch.arange(inputs.size(0)).view(-1, 1, 1)
    return agrees[rows, at].int().cumprod(-1).bool()


class DraftTrainer:
    """The draft phase of a `loop.Trainer`: the target frozen on its release rounding."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.model = trainer.model
        self.names = trainable_names(trainer.params, prefix="mtp.")
        with torch.no_grad():  # the target as released: on its storage grid, frozen
            self.target_weights = {
                k: v.detach()
                for k, v in weights(trainer.params, trainer.specs, qat=True).items()
                if not k.startswith("mtp.")
            }
        self.pool = greedy_pool(trainer, self.target_weights)

    def optimizer(self, saved=None):
        opt = self.trainer.optimizer_for(self.names, self.trainer.settings.draft_lr)
        if saved is not None:
            restore_moments(opt, self.trainer.names_of, saved["moments"])
        return opt

    def from_pool(self, step: int) -> bool:
        return step % 2 == 1

    def inputs(self, step: int) -> torch.Tensor:
        """[b, s]: the text's batch of this step, or (every other step) rows of the greedy pool."""
        if not self.from_pool(step):
            return self.trainer.batch(step)[0]
        gen = torch.Generator().manual_seed(self.trainer.settings.seed * 5_000_011 + step)
        return self.pool[torch.randint(0, self.pool.size(0), (self.trainer.settings.batch,), generator=gen)]

    def anchors(self, step: int, seq_len: int, batch: int) -> torch.Tensor:
        c = self.trainer.cfg
        gen = torch.Generator().manual_seed(self.trainer.settings.seed * 7_000_003 + step)
        low, high = c.window_size - 1, seq_len - c.dspark_block_size - 1  # ring full, every row labelled
        if self.from_pool(step):
            low = max(low, pool_shape(self.trainer.settings)[1] - 1)  # the anchor and what follows it: greedy tokens
        return torch.stack(
            [
                torch.randperm(high - low, generator=gen)[: self.trainer.settings.draft_anchors] + low
                for _ in range(batch)
            ]
        )  # [b, A]

    def batch(self, inputs: torch.Tensor, anchors: torch.Tensor):
        """(block tokens, previous tokens) [b, A, block] for anchors [b, A] of inputs [b, s]."""
        c = self.trainer.cfg
        block = c.dspark_block_size
        offsets = anchors.unsqueeze(-1) + 1 + torch.arange(block)  # positions p + 1 + i
        previous = torch.gather(inputs.unsqueeze(1).expand(-1, anchors.size(1), -1), 2, offsets)
        tokens = torch.full_like(previous, int(c.dspark_noise_token_id))
        tokens[..., 0] = previous[..., 0]
        return tokens, previous, offsets

    def step(self, step: int, opt) -> dict:
        t, s = self.trainer, self.trainer.settings
        c = t.cfg
        inputs = self.inputs(step)
        set_qat(self.model, True)
        draft_weights = {k: v for k, v in weights(t.params, t.specs, qat=True).items() if k.startswith("mtp.")}
        with torch.no_grad(), holding(self.model, self.target_weights):
            target = run_forward(self.model, inputs, t.hash_ids(inputs), index_loss=False)
        anchors = self.anchors(step, inputs.size(1), inputs.size(0))
        tokens, previous, offsets = self.batch(inputs, anchors)
        lr = lr_at(step - s.backbone_steps, s.draft_steps, s.draft_lr, s.warmup, s.min_lr_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        stack = self.model.draft_stack
        with holding(self.model, {**self.target_weights, **draft_weights}):
            logits, confidence, _ = stack.anchored(target.main_hidden, anchors, tokens, previous)
        # row i learns the target's distribution at position p + 1 + i
        rows = torch.arange(inputs.size(0)).view(-1, 1, 1)
        teacher = target.logits[rows, offsets].reshape(-1, c.dspark_block_size, c.vocab_size)
        kl = F.kl_div(logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean")
        kl = kl / c.dspark_block_size
        accepted = (logits.argmax(-1) == teacher.argmax(-1)).float()  # [n, block]
        judged = greedy_context(inputs, target.logits.argmax(-1), anchors, c.dspark_block_size)
        judged = judged.reshape(-1, c.dspark_block_size).float()  # [n, block], rows as the logits'
        bce_rows = F.binary_cross_entropy_with_logits(confidence, accepted, reduction="none")
        bce = (bce_rows * judged).sum() / judged.sum().clamp(min=1.0)
        loss = kl + bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        t.balance({layer.layer: layer.ffn.experts.load for layer in stack.mtp})
        by_row = accepted.mean(0).tolist()
        in_context = ((accepted * judged).sum(0) / judged.sum(0).clamp(min=1.0)).tolist()
        return {
            "step": step,
            "phase": "draft",
            "loss": kl.item(),
            "confidence_bce": bce.item(),
            "lr": lr,
            "agreement_by_row": by_row,
            "agreement_in_greedy_context_by_row": in_context,
            "greedy_context_by_row": judged.mean(0).tolist(),
            "greedy_pool": int(self.from_pool(step)),
        }
