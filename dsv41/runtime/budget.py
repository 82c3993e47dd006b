"""A memory budget, spent: what `load(memory=...)` holds in RAM and how many routed experts fit
beside it.

`plan_budget(cfg, memory, ...)` takes the bytes the load report predicts for the dense part
(`report.predict_retained_bytes`, the vision tower included), the attention caches for the
positions asked (`attention.kv_cache_bytes`), the DSpark draft stack's dense part
(`report.predict_draft_bytes`) and a fixed allowance for the process itself (`BASELINE_BYTES`),
and gives the rest to the expert cache as whole slots of one packed expert's stored size
(`stores.SlotCache`), never more slots than the checkpoint has routed experts (a small model under
a large budget holds them all and leaves the rest unspent). A budget that cannot hold all that
plus one token's experts (top-k of the widest layer) is a `BudgetError` naming the minimum,
rounded up so that the size it names is enough; `check_machine` refuses a budget above the memory
this machine has, before anything is allocated for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..checkpoint.checkpoint import LoadError
from ..checkpoint.inventory import expected_tensors
from ..core.argtypes import byte_size
from ..core.config import Config
from ..model.attention import kv_cache_bytes
from .report import predict_draft_bytes, predict_retained_bytes

GIB = 1 << 30
# The process beside its weights: the interpreter, torch and its libraries, the tokenizer, and the
# scratch of a forward at the released width (activations, the FP32 logits of a prefill's last
# rows, the transient copies while the dense part is filled). Measured: 0.29 GiB resident after
# a tiny model's load and generation; the released geometry's scratch makes up the rest.
BASELINE_BYTES = int(1.5 * GIB)


class BudgetError(LoadError):
    """A memory budget too small for the dense part plus one token's routed experts, or larger
    than the memory this machine has."""


def gib_text(nbytes: int, *, up: bool) -> str:
    """`nbytes` in GiB with two decimals, rounded up (a minimum: the size named is enough) or down
    (a maximum: the size named fits)."""
    hundredths = -(-nbytes * 100 // GIB) if up else nbytes * 100 // GIB
    return f"{hundredths // 100:,}.{hundredths % 100:02d}"


def budget_bytes(memory) -> int:
    """A budget (bytes, or a size such as "16GiB") as bytes; LoadError naming the accepted forms."""
    try:
        return byte_size(memory)
    except ValueError as exc:
        raise LoadError(f"memory: {exc}") from None


# Where a container's memory limit is written (cgroup v2, then v1); "max" or a huge number: none.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory() -> Optional[tuple[int, str]]:
    """(bytes, what they are) of the memory this process can have: the machine's physical memory,
    or its container's limit when that is lower; None where the system does not say."""
    try:
        have = (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of physical memory this machine has")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name here
        return None
    if have[0] <= 0:
        return None
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < have[0]:
            return int(text), f"this process's container may use ({path})"
    return have


def check_machine(memory: int) -> None:
    """BudgetError when `memory` bytes are more than `machine_memory()`: the pool would be refused
    by the allocator, or the system would swap or kill the process once the slots fill."""
    have = machine_memory()
    if have is None or memory <= have[0]:
        return
    limit, what = have
    raise BudgetError(
        f"a memory budget of {gib_text(memory, up=True)} GiB is more than the "
        f"{gib_text(limit, up=False)} GiB ({limit:,} bytes) {what}; give at most "
        f"{gib_text(limit, up=False)} GiB"
    )


@dataclass(frozen=True)
class BudgetPlan:
    """How `memory` bytes are spent: dense, kv, draft, baseline, and `slots` experts of
    `slot_bytes` each (the rest of the budget, rounded down to whole slots, at most `n_experts`:
    every routed expert the loaded layers have)."""

    memory: int
    dense: int
    kv: int
    draft: int
    baseline: int
    slot_bytes: int
    slots: int
    minimum: int
    n_experts: int

    @property
    def holds_every_expert(self) -> bool:
        return self.slots == self.n_experts

    @property
    def fixed(self) -> int:
        """The bytes spent before any slot: dense, attention caches, draft stack, process."""
        return self.dense + self.kv + self.draft + self.baseline

    def budget_for(self, slots: int) -> int:
        """The budget that leaves exactly `slots` expert slots (`slots` at most `n_experts`: a plan
        never holds more)."""
        return self.fixed + slots * self.slot_bytes

    @property
    def expert_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def line(self) -> str:
        g = GIB
        held, of_all = "every expert fits:", ""
        if not self.holds_every_expert:
            held, of_all = "the rest holds", f" of the {self.n_experts:,} routed experts"
        return (
            f"memory budget {self.memory / g:.2f} GiB: dense {self.dense / g:.2f} + attention caches "
            f"{self.kv / g:.2f} + draft stack {self.draft / g:.2f} + process allowance {self.baseline / g:.2f} "
            f"GiB; {held} {self.slots} expert slots x {self.slot_bytes / 2**20:.2f} MiB = "
            f"{self.expert_bytes / g:.2f} GiB{of_all} (the minimum for this checkpoint is "
            f"{gib_text(self.minimum, up=True)} GiB)"
        )

    def as_dict(self) -> dict:
        return {
            "memory": self.memory,
            "dense": self.dense,
            "kv": self.kv,
            "draft": self.draft,
            "baseline": self.baseline,
            "slot_bytes": self.slot_bytes,
            "slots": self.slots,
            "expert_bytes": self.expert_bytes,
            "minimum": self.minimum,
            "n_experts": self.n_experts,
        }


def routed_expert_bytes(cfg: Config) -> int:
    """The stored bytes of one routed expert (three packed FP4 matrices and their E8M0 scales),
    from the inventory: 18,800,640 (17.93 MiB) at the released geometry."""
    prefix = "layers.0.ffn.experts.0."
    return sum(s.nbytes for s in expected_tensors(cfg) if s.name.startswith(prefix))


def plan_budget(
    cfg: Config,
    memory,
    *,
    max_seq_len: int,
    max_batch_size: int = 1,
    dspark: bool = True,
    cache_format: str = "packed",
    baseline: int = BASELINE_BYTES,
) -> BudgetPlan:
    """How `memory` (bytes, or a size such as "16GiB") is spent on `cfg` with caches for
    `max_seq_len` positions of `max_batch_size` rows; `dspark`: the draft stack is built.
    BudgetError when it cannot hold the dense part and one token's experts."""
    memory = budget_bytes(memory)
    dense = predict_retained_bytes(cfg)["bytes"]
    kv = kv_cache_bytes(cfg, "stored" if cache_format == "packed" else "runtime").total(max_seq_len) * max_batch_size
    draft = predict_draft_bytes(cfg) if dspark and cfg.n_mtp_layers and cfg.dspark_block_size else 0
    slot = routed_expert_bytes(cfg)
    layers = range(cfg.n_layers + (cfg.n_mtp_layers if draft else 0))
    topk = max(cfg.moe_shape(layer)[1] for layer in layers)
    n_experts = sum(cfg.moe_shape(layer)[0] for layer in layers)
    fixed = dense + kv + draft + baseline
    minimum = fixed + topk * slot
    if memory < minimum:
        raise BudgetError(
            f"a memory budget of {gib_text(memory, up=False)} GiB cannot hold the dense part "
            f"({dense / GIB:.2f} GiB), the attention caches, the draft stack and the process "
            f"({(kv + draft + baseline) / GIB:.2f} GiB) plus one token's {topk} routed experts "
            f"({topk * slot / GIB:.2f} GiB); give at least {gib_text(minimum, up=True)} GiB (or fewer "
            f"positions with max_seq_len)"
        )
    return BudgetPlan(
        memory=memory,
        dense=dense,
        kv=kv,
        draft=draft,
        baseline=baseline,
        slot_bytes=slot,
        slots=min((memory - fixed) // slot, n_experts),
        minimum=minimum,
        n_experts=n_experts,
    )
