"""What an attention call over positions [start, end) may overwrite, and putting it back.

Each stateful part answers for itself: a compressor copies its partial group (`CompressorTail`),
a layer the rows of its caches the call can reach (`LayerRows`: window ring slots, compressed-KV
and index-key rows, the tail), a stack those and what its runtime had published (`StackRows`).
The functions here act on a stack, a list of `Attention` layers and their `AttentionRuntime`: put
the rows back (`restore`), or cut the last call short in place (`truncate`) where every layer
can (`truncatable`). `dsv41.model.sequence` builds undo records and snapshots from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .runtime import Published


@dataclass
class CompressorTail:
    """A pooling compressor's partial group as it was: kv_state, score_state [batch, ratio, head_dim]."""

    kv_state: torch.Tensor
    score_state: torch.Tensor


@dataclass
class LayerRows:
    """Copies of one layer's cache rows a call over [start, end) may write (with start 0, every
    row a sequence of `end` positions has written), as the caches hold them (packed bytes or
    BF16): the window ring `slots` of the last `window` of those positions, and where the layer
    compresses, the `groups` they can complete in its compressed KV and index keys and the
    compressor's partial group. None where the layer holds no such cache."""

    start: int
    end: int
    slots: torch.Tensor
    window: tuple[torch.Tensor, ...]
    groups: Optional[slice] = None
    compressed: Optional[tuple[torch.Tensor, ...]] = None
    tail: Optional[CompressorTail] = None
    index_keys: Optional[tuple[torch.Tensor, ...]] = None


@dataclass
class StackRows:
    """One stack's `LayerRows` (one per layer, in order) and what its runtime had published."""

    layers: list[LayerRows]
    published: Published


def capture(layers, runtime, start: int, end: int) -> StackRows:
    return StackRows([layer.capture(start, end) for layer in layers], runtime.published())


def restore(layers, runtime, rows: StackRows) -> None:
    for layer, saved in zip(layers, rows.layers):
        layer.restore(saved)
    runtime.republish(rows.published)


def truncatable(layers, start: int, end: int) -> bool:
    return all(layer.truncatable(start, end) for layer in layers)


def truncate(layers, runtime, rows: StackRows, keep_end: int) -> None:
    """Cut the last call, `rows` its undo record, back to [start, keep_end) in every layer, and
    publish what a call over [start, keep_end) would have left published."""
    published = rows.published
    for layer, saved in zip(layers, rows.layers):
        layer.truncate(saved, keep_end)
        published = layer.publishes(published, saved.start, keep_end)
    runtime.republish(published)
