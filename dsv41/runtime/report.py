"""What a load did and what it should do: the `LoadReport`, and the byte predictions made from the
inventory alone.

Every checkpoint tensor lands in one bucket: LOADED (copied into a parameter), one of the ON_DISK
reasons (routed experts and Engram tables, read on demand; `mtp.*` stages not built with
`load(dspark=False)`), or UNEXPECTED (a name the inventory does not list, or a tensor it lists as
dense that no parameter reads). `disposition` says which bucket a tensor belongs to in a complete
model and `runtime_dtype` which dtype a loaded one is held in; `predict_retained_bytes` and
`predict_draft_bytes` add them up without building anything, and the report sets them beside the
bytes measured on the built model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..checkpoint.formats import DTYPE_NAMES
from ..checkpoint.inventory import DTYPE_SIZES, expected_tensors
from ..core.config import Config
from ..model.layers import activation_dtype

LOADED, ROUTED, ENGRAM, MTP, UNEXPECTED = (
    "loaded",
    "routed experts (read on demand)",
    "Engram tables (rows gathered on demand)",
    "MTP / DSpark (not run)",
    "unexpected",
)
ON_DISK = (ROUTED, ENGRAM, MTP)


# ---------------------------------------------------------------------- what stays where
def disposition(name: str) -> str:
    """Which report bucket a checkpoint tensor belongs to when the model is complete: LOADED or one
    of the on-disk reasons. (Whether it was actually read is checked separately.) The vision tower
    is loaded like the rest of the dense tree (`LoadReport.vision_bytes_retained` says its share)."""
    if name.startswith("mtp."):
        return MTP
    if ".ffn.experts." in name:
        return ROUTED
    if ".engram.embed." in name:
        return ENGRAM
    return LOADED


def runtime_dtype(name: str, stored: str, cfg: Config) -> Optional[str]:
    """The dtype (safetensors name) a loaded tensor is held in at runtime, or None when it is a
    scale consumed by dequantizing its weight. The released runtime dequantizes `attn.wo_a` to the
    activation dtype (it is applied by a grouped einsum, not a quantized GEMM), promotes the
    ratio > 1 compressor projections to float32 (the pooling runs in float32) and holds the head in
    float32 (so the logits come out float32). Everything else is held as stored."""
    act = DTYPE_NAMES[activation_dtype(cfg)]
    if name.endswith("attn.wo_a.scale"):
        return None
    if name.endswith("attn.wo_a.weight"):
        return act
    if ".attn.compressor.w" in name and name.endswith(".weight"):
        layer = int(name.split(".")[1])
        return "F32" if cfg.compress_ratios[layer] > 1 else stored
    if name == "head.weight" or name.endswith(("markov_head.head.weight", "confidence_head.proj.weight")):
        return "F32"  # logits and the draft's confidence come out in float32
    if name.startswith("vision.") and name.rsplit(".", 2)[-2].startswith("norm"):
        return "F32"  # the vision tower's RMSNorm weights: stored BF16, held float32 as the reference does
    return stored


def predict_retained_bytes(cfg: Config) -> dict:
    """What loading retains, from the inventory and `runtime_dtype` alone (no model is built):
    {'bytes', 'tensors' (parameters), 'by_category' {category: bytes}, 'on_disk_bytes'}."""
    total, count, by_category, on_disk = 0, 0, {}, 0
    for spec in expected_tensors(cfg):
        if disposition(spec.name) != LOADED:
            on_disk += spec.nbytes
            continue
        rt = runtime_dtype(spec.name, spec.dtype, cfg)
        if rt is None:
            continue
        nbytes = math.prod(spec.shape) * DTYPE_SIZES[rt]
        total += nbytes
        count += 1
        by_category[spec.category] = by_category.get(spec.category, 0) + nbytes
    return {
        "bytes": total,
        "tensors": count,
        "by_category": by_category,
        "on_disk_bytes": on_disk,
        "draft_bytes": predict_draft_bytes(cfg),
    }


def predict_draft_bytes(cfg: Config) -> int:
    """The DSpark draft stack's dense parameters as held (its experts are read on demand), from the
    inventory and `runtime_dtype`: what `LoadReport.draft_bytes_retained` measures."""
    total = 0
    for spec in expected_tensors(cfg):
        if spec.name.startswith("mtp.") and ".ffn.experts." not in spec.name:
            rt = runtime_dtype(spec.name, spec.dtype, cfg)
            total += 0 if rt is None else math.prod(spec.shape) * DTYPE_SIZES[rt]
    return total


@dataclass
class LoadReport:
    """What a load did. `tensors` maps every checkpoint tensor to LOADED, an ON_DISK reason, or
    UNEXPECTED; `dequantized` lists (name, stored dtype, runtime dtype) for every conversion."""

    checkpoint: str
    parameters_filled: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    bytes_retained: int = 0  # dense parameters as held (measured on the built model)
    predicted_bytes_retained: int = 0  # from the inventory and runtime_dtype alone
    state_bytes: int = 0  # attention caches and RoPE tables (sized by max_seq_len; not weights)
    resident_engram_bytes: int = 0
    draft_bytes_retained: int = 0  # the DSpark draft stack's dense parameters (not in bytes_retained)
    predicted_draft_bytes: int = 0  # the same from the inventory alone (`predict_draft_bytes`)
    vision_bytes_retained: int = 0  # the vision tower, aligner and span delimiters (part of bytes_retained)
    dequantized: list[tuple[str, str, str]] = field(default_factory=list)
    tensors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    threads: Optional[int] = None  # torch's intra-op threads after the load
    threads_choice: str = ""  # why: "auto: ...", "threads=N" or "left alone (threads=None)"
    embedded: str = ""  # which embedded checkpoint this is (`miniature.describe`), "" for any other
    # expert_parallel=True: this rank of world_size, and the routed experts it holds (e % world_size
    # == rank; tensors and their bytes on disk, read on demand) out of all of them
    rank: Optional[int] = None
    world_size: int = 1
    routed_tensors_held: int = 0
    routed_tensors_total: int = 0
    routed_bytes_held: int = 0
    routed_bytes_total: int = 0
    budget: str = ""  # load(memory=...): how the budget was spent (`budget.BudgetPlan.line`)
    budget_plan: Optional[dict] = None

    def count_routed_share(self, ranks, buckets: dict[str, str], nbytes) -> None:
        """Under expert parallelism: this rank and the backbone's routed expert tensors it holds
        (`ranks.owns(e)`) out of all of them, with their bytes on disk (`nbytes(name)`). The draft
        stack's experts are read on every rank and not counted."""
        self.rank, self.world_size = ranks.rank, ranks.world_size
        for name in (n for n, b in buckets.items() if b == ROUTED and n.startswith("layers.")):
            expert = int(name.split(".ffn.experts.")[1].split(".")[0])  # layers.L.ffn.experts.E.w1.weight
            self.routed_tensors_total += 1
            self.routed_bytes_total += nbytes(name)
            if ranks.owns(expert):
                self.routed_tensors_held += 1
                self.routed_bytes_held += nbytes(name)

    def names(self, bucket: str) -> list[str]:
        return [n for n, b in self.tensors.items() if b == bucket]

    def counts(self) -> dict[str, int]:
        out = {}
        for bucket in self.tensors.values():
            out[bucket] = out.get(bucket, 0) + 1
        return out

    @property
    def unexpected(self) -> list[str]:
        return self.names(UNEXPECTED)

    def summary(self) -> str:
        gib = 2**30
        lines = [
            f"{self.checkpoint}: {self.parameters_filled} parameters filled from {self.tensors_read} "
            f"tensors ({self.bytes_read / gib:.3f} GiB read) in {self.seconds:.1f} s",
            f"  retained {self.bytes_retained:,} bytes ({self.bytes_retained / gib:.3f} GiB); "
            f"predicted {self.predicted_bytes_retained:,}; caches {self.state_bytes:,} bytes",
            f"  {len(self.dequantized)} conversions at load: " + _conversion_summary(self.dequantized),
        ]
        if self.embedded:
            lines.insert(1, f"  {self.embedded}")
        if self.threads is not None:
            lines.append(f"  torch threads: {self.threads} ({self.threads_choice})")
        for bucket, n in self.counts().items():
            lines.append(f"  {bucket}: {n} tensors")
        if self.resident_engram_bytes:
            lines.append(f"  resident Engram tables: {self.resident_engram_bytes:,} bytes")
        if self.vision_bytes_retained:
            lines.append(
                f"  vision tower: {self.vision_bytes_retained:,} of the retained bytes (ViT, aligner, span delimiters)"
            )
        if self.draft_bytes_retained:
            lines.append(
                f"  DSpark draft stack: {self.draft_bytes_retained:,} bytes of dense parameters "
                f"(predicted {self.predicted_draft_bytes:,}; its routed experts read on demand like the "
                f"backbone's)"
            )
        if self.budget:
            lines.append(f"  {self.budget}")
        if self.rank is not None:
            lines.append(
                f"  expert parallel: rank {self.rank} of {self.world_size} holds the routed experts e % "
                f"{self.world_size} == {self.rank}: {self.routed_tensors_held} of "
                f"{self.routed_tensors_total} tensors, {self.routed_bytes_held:,} of "
                f"{self.routed_bytes_total:,} bytes; everything else (the dense part, router, shared "
                f"experts, Engram tables, the draft stack and its experts) is replicated on every rank"
            )
        return "\n".join(lines)


def _conversion_summary(items) -> str:
    kinds = {}
    for _, src, dst in items:
        kinds[(src, dst)] = kinds.get((src, dst), 0) + 1
    return ", ".join(f"{n} x {src} -> {dst}" for (src, dst), n in sorted(kinds.items())) or "none"


def settle_buckets(buckets: dict[str, str], read: set[str]) -> dict[str, str]:
    """`buckets` (from the inventory) corrected by what the fill actually read: a tensor read is
    LOADED (UNEXPECTED when the checkpoint's name list did not hold it), and one the inventory
    calls dense but no parameter read is UNEXPECTED."""
    for name in read:
        if buckets.get(name) != LOADED:
            buckets[name] = LOADED if name in buckets else UNEXPECTED
    for name, bucket in buckets.items():
        if bucket == LOADED and name not in read:
            buckets[name] = UNEXPECTED  # the inventory lists it as dense, yet the model has no use for it
    return buckets


def unique_bytes(tensors) -> int:
    """The bytes behind `tensors`, each storage counted once (tied weights share one)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
