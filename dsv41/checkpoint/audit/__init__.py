"""Header-only checkpoint audit: does what is on disk agree with what the config describes?

Reads the config (either layout), the index if there is one, and the safetensors header of every
shard file, never a payload, and runs 38 checks (39 with an index). Each check passes, fails, or
is undecided: its evidence sits in a shard that is not on disk yet. Presence questions are
answered by the index when there is one (the release ships it, so they are decidable before any
payload arrives); shapes, dtypes and byte extents only by the headers of the shards on disk. A
failure is never deferred: wrong evidence on disk fails even while other shards are missing.

It checks metadata consistency, not numerics: a value that is wrong the same way in the config
and in the shapes passes.

Standard library plus the package's config, inventory and header modules: no torch.
"""

from dsv41.checkpoint.audit.checks import CHECKS
from dsv41.checkpoint.audit.evidence import SHOWN
from dsv41.checkpoint.audit.report import (
    FAIL,
    GIB,
    PASS,
    UNDECIDED,
    AuditReport,
    CategoryRow,
    CheckResult,
    ShardFile,
    describe_shards,
    format_ranges,
)
from dsv41.checkpoint.audit.runner import AuditError, cli_main, find_shard_files, list_tensors, run_audit

__all__ = [
    "AuditError",
    "AuditReport",
    "CHECKS",
    "CategoryRow",
    "CheckResult",
    "FAIL",
    "GIB",
    "PASS",
    "SHOWN",
    "ShardFile",
    "UNDECIDED",
    "cli_main",
    "describe_shards",
    "find_shard_files",
    "format_ranges",
    "list_tensors",
    "run_audit",
]
