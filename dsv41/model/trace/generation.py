"""`GenerationTrace`: what a traced `generate` run returns, as plain data, and its file.

It holds the backbone's `ForwardTrace`, a `StepRecord` per produced token and the expert-cache
accounting. `save(path)` / `GenerationTrace.load(path)` keep one in a file without pickle
(`file.py`: an NPZ archive of plain arrays and a JSON manifest), so a trace recorded on the real
checkpoint can be replayed (`dsv41.observe.cache_policy`) anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from .file import read_trace_file, write_trace_file
from .records import ForwardTrace, StepRecord


@dataclass
class GenerationTrace:
    """Everything a traced run recorded, as plain data.

    forward: the backbone's ForwardTrace (attention records: indexer selections and candidate blocks;
    routing records: expert ids and weights per layer and token; Engram gate values); steps: per
    produced token its logit margin; cache: per forward call the expert-cache hits and misses by layer;
    meta: plain facts about the run a reader of a saved trace needs (`n_routed_experts`,
    `expert_cache`, the checkpoint, the prompt...), JSON values only, kept by `save` / `load`."""

    forward: ForwardTrace
    steps: list[StepRecord] = field(default_factory=list)
    cache: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def margins(self) -> list[float]:
        return [s.margin for s in self.steps]

    def routing(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.forward.routing_by_layer()

    def engram_gates(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.forward.engram_by_layer()

    def attention(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.forward.attention_by_layer()

    def to_dict(self) -> dict:
        """Nested lists and numbers only (JSON-ready)."""

        def plain(groups):
            return {str(layer): {k: v.tolist() for k, v in fields.items()} for layer, fields in groups.items()}

        return {
            "steps": [vars(s) for s in self.steps],
            "cache": self.cache,
            "routing": plain(self.routing()),
            "engram": plain(self.engram_gates()),
            "attention": plain(self.attention()),
        }

    # ------------------------------------------------------------------ files (no pickle)
    def save(self, path: str | os.PathLike, meta: Optional[dict] = None) -> str:
        """Write the whole trace to `path` (an NPZ archive, whatever the name): every record of the
        ForwardTrace with its options, the steps, the per-call cache counts and `meta` (updated with
        `meta` if given). Tensors are stored as plain arrays with their torch dtype named (bf16 and
        FP8 as same-width integers), everything else in a JSON manifest; `load` reads it back with
        `allow_pickle=False`. Returns the path."""
        return write_trace_file(path, self.forward, self.steps, self.cache, {**self.meta, **(meta or {})})

    @classmethod
    def load(cls, path: str | os.PathLike, max_bytes: Optional[int] = None) -> GenerationTrace:
        """A trace written by `save`. TraceFileError (a ValueError), one sentence, when the file is
        not one, is damaged, or its arrays would take more than `max_bytes` uncompressed (default
        MAX_TRACE_BYTES, 4 GiB); FileNotFoundError when it does not exist. Sizes are checked before
        anything is read, and only the members the manifest names are read."""
        return cls(*read_trace_file(path, max_bytes))
