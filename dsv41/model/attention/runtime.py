"""What the attention layers of one stack hand down within a call, and which layer published it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Published:
    """What a runtime carries from call to call: the caches the last Full layer and the last
    index-key owner published, and who they were (the stale-key rule makes that part of the
    sequence's state)."""

    compress_kv: Optional[object] = None  # a QuantizedCache
    compress_kv_from: Optional[int] = None
    index_k: Optional[object] = None
    index_k_from: Optional[int] = None


class HeldRows:
    """Rows a layer publishes on the whole-sequence path (`AttentionRuntime(cache=False)`): a tensor
    [b, n, dim] read the way a `QuantizedCache` is, so the layers after it read either alike."""

    packed = False  # the rows as they are: nothing to decode (see `Attention._compressed_rows`)

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def read(self, bsz: int, n: Optional[int] = None) -> torch.Tensor:
        return self.rows[:bsz, :n]


class AttentionRuntime:
    """What the layers of one stack hand down instead of recomputing, plus who wrote it: per-call
    state only (how it is computed is each layer's `Numerics`).

    compress_kv / index_k: the caches (`QuantizedCache`, read through `read`) of the last Full
    layer that published them (they persist across calls, as caches do); topk: the last index
    source's selection for the current call, as compressed positions [b, s, index_topk] padded with
    -1; candidates: the candidate source's position mask [b, s, T] for the current call.

    `cache=False`: the whole-sequence path (training's forward, one call from position 0): no layer
    writes or reads a cache; the compressed KV and index keys are published as `HeldRows`, on the
    grids the caches would hold them on, with straight-through gradients.
    """

    def __init__(self, *, cache: bool = True):
        self.cache = cache
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

    def published(self) -> Published:
        """What persists from call to call; `republish` puts it back."""
        return Published(self.compress_kv, self.compress_kv_from, self.index_k, self.index_k_from)

    def republish(self, published: Published) -> None:
        self.reset()
        self.compress_kv, self.compress_kv_from = published.compress_kv, published.compress_kv_from
        self.index_k, self.index_k_from = published.index_k, published.index_k_from

    def __repr__(self) -> str:
        return (
            f"AttentionRuntime(compress_kv_from={self.compress_kv_from}, "
            f"index_k_from={self.index_k_from}, topk_from={self.topk_from}, "
            f"candidates_from={self.candidates_from})"
        )
