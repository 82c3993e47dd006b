"""Speculative decoding with the DSpark draft stack: draft a block, verify it in one target forward,
keep the longest prefix the target agrees with, roll the rest back.

One step, with the sequence holding positions ..p and `anchor` the target's next token (chosen,
not yet fed):
1. draft: `model.draft(anchor)` proposes up to `draft_tokens` tokens for positions p + 2.. with a
   confidence each; the proposals after the first whose sigmoid(confidence) is below
   `min_confidence` are dropped together with it (0 keeps all), and none past the token budget.
2. verify: one forward of [anchor, kept proposals] at p + 1 with every position's logits.
3. accept: proposal i is accepted while it equals the target's greedy choice after the tokens
   before it; the target's own choice after the last accepted one comes free (the next anchor).
   A stop token among them ends the run there.
4. roll back: the positions after the last accepted token are undone (`sequence.rollback` with
   rerun=False: target caches and the draft rings): the verify call is cut short in place,
   keeping the rows it computed for the accepted positions, so a rejection costs no forward. (A
   call it cannot cut — longer than the window — has its kept part run again as one call; that
   re-run counts as a second target forward.)

Greedy (temperature 0): each token is the target's argmax whatever the draft proposed, so under
`Numerics.parity()` (a multi-token forward and one-token steps are the same arithmetic, and the
cut-short call leaves the same bytes as a re-run) the output equals plain greedy decoding token for
token. Sampling (temperature > 0): the draft samples its proposals, and each is judged by the
standard rejection rule (`judge`): accepted with probability min(1, p(x) / q(x)), p the target's
and q the draft's distribution at that position; on rejection the token is drawn from max(p - q, 0)
normalized, and after a fully accepted block a bonus token from the target. Every token is then
distributed as plain sampling's (not the same draws: equal in distribution, not token for token).

A trace of a speculative run records every verify forward as it ran, the rejected positions
included (a later step's forward covers those positions again), so its routing counts what the
experts really computed, not only what was kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from ..model import sequence
from ..model.sampling import gumbel_max, probabilities

if TYPE_CHECKING:  # annotations only
    from ..model.model import Model

# draft_source(model, anchor, n) -> (proposals, confidences) or (proposals, confidences, probs): what
# the tests and the best-case benchmark put in place of the draft stack; `probs` [n, vocab] are the
# distributions sampled proposals were drawn from (without them a proposal counts as certain)
DraftSource = Callable[[object, int, int], tuple]


@dataclass
class SpeculationStep:
    """One draft-verify step: `position` where the anchor went; `drafted` proposals made, `kept`
    after the confidence cut and the budget, `accepted` of them; `confidences` the raw confidence
    of every proposal made; `target_forwards` 1, or 2 when the rollback had to re-run the kept part;
    `committed` the tokens the step added (accepted proposals and the target's next token)."""

    position: int
    drafted: int
    kept: int
    accepted: int
    confidences: list[float]
    target_forwards: int
    committed: list[int] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Speculation:
    """A speculative run summed up: per draft position how often a kept proposal there was
    accepted, the mean accepted length per step, and tokens per target forward."""

    steps: list[SpeculationStep]

    @property
    def tokens(self) -> int:
        return sum(len(s.committed) for s in self.steps)

    @property
    def target_forwards(self) -> int:
        return sum(s.target_forwards for s in self.steps)

    @property
    def tokens_per_forward(self) -> Optional[float]:
        return self.tokens / self.target_forwards if self.target_forwards else None

    @property
    def mean_accepted(self) -> Optional[float]:
        return sum(s.accepted for s in self.steps) / len(self.steps) if self.steps else None

    def judged_by_position(self) -> tuple[list[int], list[int]]:
        """(judged, accepted) counts per draft position: a proposal is judged when every one before
        it was accepted (those after the first rejection never are)."""
        width = max((s.drafted for s in self.steps), default=0)
        judged, taken = [0] * width, [0] * width
        for s in self.steps:
            for i in range(min(s.kept, s.accepted + 1)):
                judged[i] += 1
                taken[i] += i < s.accepted
        return judged, taken

    def acceptance_by_position(self) -> list[Optional[float]]:
        """Entry i: accepted / judged proposals at draft position i (the conditional rate), None
        where none was judged."""
        judged, taken = self.judged_by_position()
        return [t / n if n else None for t, n in zip(taken, judged)]

    def calibration(self, bins: int = 5) -> list[dict]:
        """Binned sigmoid(confidence) of the judged proposals against the fraction accepted:
        per bin its range, count, mean predicted probability and accepted fraction."""
        pairs = []
        for s in self.steps:
            for i in range(min(s.kept, s.accepted + 1)):  # judged: up to and including the first rejection
                pairs.append((1 / (1 + math.exp(-s.confidences[i])), i < s.accepted))
        out = []
        for b in range(bins):
            lo, hi = b / bins, (b + 1) / bins
            inside = [(p, a) for p, a in pairs if lo <= p < hi or (b == bins - 1 and p == 1.0)]
            out.append(
                {
                    "low": lo,
                    "high": hi,
                    "count": len(inside),
                    "mean_probability": sum(p for p, _ in inside) / len(inside) if inside else None,
                    "accepted_fraction": sum(a for _, a in inside) / len(inside) if inside else None,
                }
            )
        return out

    def as_dict(self) -> dict:
        return {
            "steps": len(self.steps),
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "tokens_per_forward": self.tokens_per_forward,
            "mean_accepted": self.mean_accepted,
            "acceptance_by_position": self.acceptance_by_position(),
            "per_step": [
                {
                    "position": s.position,
                    "drafted": s.drafted,
                    "kept": s.kept,
                    "accepted": s.accepted,
                    "confidences": s.confidences,
                    "target_forwards": s.target_forwards,
                    "committed": s.committed,
                }
                for s in self.steps
            ],
        }


def check_speculation(model: Model, temperature: float, draft_tokens, min_confidence, draft_source) -> int:
    """The draft length a speculative run will use, after checking the request (one sentence each)."""
    block = model.cfg.verified().dspark_block_size
    if draft_source is None and getattr(model, "draft_stack", None) is None:
        raise ValueError(
            "speculative decoding needs the DSpark draft stack, and this model has none (no "
            "mtp.* stages, dspark_block_size 0, or loaded with dspark=False)"
        )
    limit = block if draft_source is None else max(block, 1 << 16)
    n = block if draft_tokens is None else draft_tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
        raise ValueError(f"draft_tokens must be a whole number in [1, {limit}] (the draft block), got {draft_tokens!r}")
    if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) or not 0 <= min_confidence <= 1:
        raise ValueError(f"min_confidence must be a probability in [0, 1], got {min_confidence!r}")
    return n


def judge(
    p: torch.Tensor, q: Optional[torch.Tensor], proposal: int, generator: Optional[torch.Generator] = None
) -> tuple[bool, Optional[int]]:
    """The rejection rule for one proposal drawn from q (float32 [vocab]; None: a certain proposal,
    q one-hot) against the target's p: (True, None) with probability min(1, p[x] / q[x]), else
    (False, a token drawn from max(p - q, 0) normalized)."""
    if q is None:
        q = torch.zeros_like(p)
        q[proposal] = 1.0
    u = float(torch.rand((), generator=generator))
    if u * float(q[proposal]) < float(p[proposal]):
        return True, None
    residual = (p - q).clamp_min(0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def stack_drafts(model: Model, anchor: int, n: int, temperature: float = 0.0, generator=None) -> tuple:
    block = model.draft(anchor, temperature=temperature, generator=generator)
    probs = None if block.probs is None else block.probs[0, :n]
    return block.proposals[:n], block.confidence[0, :n].tolist(), probs


def decode_speculative(
    model: Model,
    anchor: int,
    n: int,
    *,
    draft_tokens: int,
    min_confidence: float = 0.5,
    draft_source: Optional[DraftSource] = None,
    stop_ids: Sequence[int] = (),
    trace=None,
    callback=None,
    check_finite=None,
    step_record=None,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], list[SpeculationStep]]:
    """Up to `n` tokens after `anchor` (chosen, not yet fed), `draft_tokens` proposals per step ->
    (the ids, one SpeculationStep per draft-verify step). `step_record(position, token, logits,
    seconds)` sees every token with the logits row [1, vocab] it was chosen from, as plain decoding
    records them; `callback(step, token, logits)` returning False stops after that token."""

    def source(m, anchor_id, k):
        if draft_source is not None:
            drafted = tuple(draft_source(m, anchor_id, k))
            return drafted if len(drafted) == 3 else (*drafted, None)
        return stack_drafts(m, anchor_id, k, temperature, generator)

    out: list[int] = []
    spec: list[SpeculationStep] = []
    while len(out) < n:
        began = time.perf_counter()
        start = model.position  # the anchor's position
        proposals, confidences, draft_probs = source(model, anchor, draft_tokens)
        proposals = [int(t) for t in proposals][:draft_tokens]
        confidences = [float(c) for c in confidences][: len(proposals)]
        kept = 0
        for c in confidences:
            if 1 / (1 + math.exp(-c)) < min_confidence:
                break
            kept += 1
        kept = min(kept, len(proposals), n - len(out) - 1)  # the target's own next token always comes too
        fed = [anchor] + proposals[:kept]
        logits = model(torch.tensor([fed]), start, trace=trace, all_positions=True)[0]  # [1 + kept, vocab]
        if check_finite is not None:
            check_finite(model, logits)
        if temperature > 0:
            accepted, following = 0, None
            for i in range(kept):
                p = probabilities(logits[i], temperature)
                ok, following = judge(
                    p, None if draft_probs is None else draft_probs[i].float(), proposals[i], generator
                )
                if not ok:
                    break
                accepted += 1
            if accepted == kept:  # every kept proposal accepted: the bonus token from the target
                following = int(gumbel_max(probabilities(logits[kept], temperature), generator))
        else:
            choice = logits.argmax(dim=-1).tolist()  # the target's greedy token after each fed prefix
            accepted = 0
            while accepted < kept and proposals[accepted] == choice[accepted]:
                accepted += 1
            following = choice[accepted]
        committed, stop = [], False
        for i, token in enumerate(proposals[:accepted] + [following]):
            committed.append(token)
            stop = token in stop_ids or (
                callback is not None and callback(len(out) + i, token, logits[i : i + 1]) is False
            )
            if stop:
                break
        undo = len(fed) - len(committed)  # positions fed after the last token that stays
        reran = bool(undo) and sequence.rollback(model, undo, rerun=False)  # the verify cut short in place
        seconds = time.perf_counter() - began
        if step_record is not None:
            for i, token in enumerate(committed):
                step_record(start + i, token, logits[i : i + 1], seconds / len(committed))
        out += committed
        spec.append(
            SpeculationStep(start, len(proposals), kept, accepted, confidences, 2 if reran else 1, committed, seconds)
        )
        if stop:
            break
        anchor = committed[-1]
    return out, spec


# ---------------------------------------------------------------------- known acceptance, and the reference
def scripted_source(continuation: Sequence[int], right: int, vocab_size: int, confidence: float = 8.0) -> DraftSource:
    """A draft source that knows the answer, for speculation at a known acceptance: at the anchor's
    position p it proposes `continuation[p + 1:]` for `right` tokens, then a wrong one (the next
    right token + 1, mod `vocab_size`), each with `confidence`. `continuation`: the ids of a plain
    greedy run from position 0, its prompt included."""

    def source(model, anchor: int, n: int) -> tuple[list[int], list[float]]:
        start = model.position
        proposals = list(continuation[start + 1 : start + 1 + min(right, n)])
        if len(proposals) < n and start + 1 + len(proposals) < len(continuation):
            proposals.append((continuation[start + 1 + len(proposals)] + 1) % vocab_size)
        return proposals, [confidence] * len(proposals)

    return source
