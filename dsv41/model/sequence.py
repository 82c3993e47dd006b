"""A model's sequence as state that can be undone: the record each forward keeps of what it
overwrote (`CallRecord`), a copy of the whole sequence (`Snapshot`), and the verbs over them
(`rollback`, `rollback_limit`, `snapshot`, `restore`), free functions that take the model first:
`sequence.rollback(model, 3)`.

A sequence lives in several parts, and each copies and puts back its own state: the attention
layers and their runtime (`attention.state`: the cache rows a call over [start, end) may write,
what the runtime had published), the draft stack's window rings and last main hidden state
(`DraftStack.capture`), the n-gram hasher's look-back (`NgramHasher.state`). This module composes
them with the model's token ids and position; it knows nothing of how any part keeps its rows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .attention import state as attention_state
from .attention.state import StackRows
from .vision import Prompt

if TYPE_CHECKING:  # annotations only
    from .model import Model


# The caches are written in place by calls, resets, rollbacks and restores. Running each of those
# verbs under inference mode lets them take a model and its snapshots made in any grad mode (a
# tensor made under inference mode refuses in-place writes outside it, a normal one takes them
# inside). `Model.__call__` and `Model.reset` run under this too.
any_grad_mode = torch.inference_mode()


@dataclass
class CallRecord:
    """What one forward over positions [start, end) overwrote (its undo record), and the call
    itself: undoing it puts every part back and cuts the ids to `start` (the ids before it are
    still the sequence's own, so none are copied); its `ids` with its `image_mask` or `prompt` run
    the part of it a rollback keeps again."""

    start: int
    end: int
    attention: StackRows
    draft: Optional[object]  # a dspark.DraftRows where a draft stack is attached
    hasher: Optional[tuple]  # NgramHasher.state() before the call
    ids: torch.Tensor  # [b, end - start]
    image_mask: Optional[torch.Tensor] = None
    prompt: Optional[Prompt] = None  # the call's Prompt when it was given one (its images with it)


@dataclass
class Snapshot:
    """A copy of a model's sequence of `position` positions, for `restore`: every cache row it
    wrote, what was published, the look-back, its token ids, and the undo records of its calls
    (so a restored sequence can still roll back). Restores into the model it was taken of only."""

    position: int
    token_ids: torch.Tensor  # [b, position]
    attention: StackRows
    draft: Optional[object]
    hasher: Optional[tuple]
    undo: tuple[CallRecord, ...]
    model_id: int

    def __repr__(self) -> str:
        return f"Snapshot(position={self.position}, batch={self.token_ids.size(0)}, undo_calls={len(self.undo)})"


def _attention_layers(model) -> list:
    return [block.attn for block in model.backbone.layers]


def _capture_parts(model, start: int, end: int) -> tuple:
    """(attention rows, draft rows, hasher state) a call over [start, end) may overwrite."""
    return (
        attention_state.capture(_attention_layers(model), model.runtime, start, end),
        None if model.draft_stack is None else model.draft_stack.capture(start, end),
        None if model.hasher is None else model.hasher.state(),
    )


def _put_back_parts(model, attention: StackRows, draft, hasher) -> None:
    attention_state.restore(_attention_layers(model), model.runtime, attention)
    if model.draft_stack is not None:
        model.draft_stack.restore(draft)
    if model.hasher is not None:
        model.hasher.set_state(hasher)


# ---------------------------------------------------------------------------------- undo records
def record_call(
    model: Model, start: int, ids: torch.Tensor, image_mask=None, prompt: Optional[Prompt] = None
) -> CallRecord:
    """The undo record of a forward of `ids` [b, s] at `start`, taken before it runs."""
    end = start + ids.size(1)
    return CallRecord(start, end, *_capture_parts(model, start, end), ids, image_mask, prompt)


def undo_call(model: Model, record: CallRecord) -> None:
    """The sequence as it was before the call `record` was taken of."""
    _put_back_parts(model, record.attention, record.draft, record.hasher)
    model.token_ids = model.token_ids[:, : record.start]
    model.position = record.start


def rollback_limit(model: Model) -> int:
    """The shortest length `rollback` can return to: the start of the oldest call the model still
    remembers (each call keeps what it overwrote; the last `undo_calls` calls are kept), its
    current length if none."""
    return model.undo_records[0].start if model.undo_records else model.position


@any_grad_mode
def rollback(model: Model, n_positions: int, *, rerun: bool = True) -> bool:
    """Return the sequence to `n_positions` fewer positions, so that continuing from there
    equals never having gone past it, bit for bit: the calls after it are undone (each kept
    what it overwrote) and the part of the first undone call that stays is run again as one
    call, exactly as a sequence that stopped there would have run it. Reaches back as far as
    `rollback_limit`; 0 positions back to 0 is a reset.

    `rerun=False`: when the positions to drop all lie in the last call and it was no longer
    than the window (and held no image), cut that call short in place instead
    (`Attention.truncate`), keeping the rows it computed for the positions that stay: no
    forward, and the same bytes as the re-run under Numerics.parity() (under the reference's
    arithmetic a row can depend on how many rows shared its call). Returns whether a kept
    part ran again."""
    model._refuse_inside_forward("sequence.rollback(model)")
    if not isinstance(n_positions, int) or not 0 <= n_positions <= model.position:
        raise ValueError(f"rollback takes 0 to {model.position} positions, got {n_positions!r}")
    target = model.position - n_positions
    if n_positions == 0:
        return False
    if target == 0:
        model.reset()
        return False
    limit = rollback_limit(model)
    if target < limit:
        raise ValueError(
            f"can roll back to position {limit} at the earliest (the oldest call "
            f"kept; load with a larger undo_calls), not to {target}"
        )
    if not rerun and _truncatable(model, target):
        _truncate(model, model.undo_records[-1], target)
        return False
    last = None
    while model.position > target:
        last = model.undo_records.pop()
        undo_call(model, last)
    if model.position < target:  # the undone call's kept part, as the one call it would have been
        keep = target - last.start
        if last.prompt is not None:  # its images' spans are written again, cut to the kept part
            model(last.prompt[:keep], last.start)
        else:
            mask = None if last.image_mask is None else torch.as_tensor(last.image_mask)[:, :keep]
            model(last.ids[:, :keep], last.start, image_mask=mask)
        return True
    return False


def _truncatable(model, target: int) -> bool:
    """Whether the positions from `target` on all lie in the last call, which held no image and
    which every part can cut short in place."""
    last = model.undo_records[-1] if model.undo_records else None
    if last is None or not last.start < target < model.position or last.prompt is not None:
        return False
    start, end = last.start, model.position
    return attention_state.truncatable(_attention_layers(model), start, end) and (
        model.draft_stack is None or model.draft_stack.truncatable(start, end)
    )


def _truncate(model, record: CallRecord, target: int) -> None:
    """Cut the last call, `record`, back to [record.start, target): every part in place, the
    look-back run again over the kept ids; the record then describes the shorter call."""
    keep = target - record.start
    attention_state.truncate(_attention_layers(model), model.runtime, record.attention, target)
    if model.draft_stack is not None:
        model.draft_stack.truncate(record.draft, target)
    mask = None if record.image_mask is None else torch.as_tensor(record.image_mask, dtype=torch.bool)[:, :keep]
    if model.hasher is not None:
        model.hasher.set_state(record.hasher)
        model.hasher(record.ids[:, :keep], None if mask is None else ~mask)  # the look-back after the kept ids
    record.ids, record.image_mask, record.end = record.ids[:, :keep], mask, target
    model.token_ids = model.token_ids[:, :target]
    model.position = target


# ---------------------------------------------------------------------------------- snapshots
@any_grad_mode
def snapshot(model: Model) -> Snapshot:
    """A copy of the sequence so far (caches, look-back, what was published), for `restore`:
    a later request continues from a shared prefix instead of running it again."""
    model._refuse_inside_forward("sequence.snapshot(model)")
    return Snapshot(
        model.position,
        model.token_ids.clone(),
        *_capture_parts(model, 0, model.position),
        tuple(model.undo_records),
        id(model),
    )


@any_grad_mode
def restore(model: Model, snap: Snapshot) -> None:
    """Continue from a `snapshot` of this model (the sequence as it was then)."""
    model._refuse_inside_forward("sequence.restore(model)")
    if not isinstance(snap, Snapshot):
        raise ValueError(f"restore takes a snapshot from sequence.snapshot(model), got {type(snap).__name__}")
    if snap.model_id != id(model):
        raise ValueError("this snapshot was taken of another model")
    model.reset()
    _put_back_parts(model, snap.attention, snap.draft, snap.hasher)
    model.token_ids = snap.token_ids.clone()
    model.position = snap.position
    model.undo_records = deque(snap.undo, maxlen=model.undo_records.maxlen)
