"""What an audit returns, its text form, and the one wording of a wrong value."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace

PASS, FAIL, UNDECIDED = "pass", "fail", "undecided"
GIB = 1 << 30


@dataclass
class CheckResult:
    id: str
    group: str
    title: str
    status: str  # pass | fail | undecided
    detail: str
    waits_on: list[str] = field(default_factory=list)  # shard files an undecided check needs


@dataclass
class ShardFile:
    path: str
    shard: str  # the shard this file was identified as (by name, else by its tensors)
    tensors: int
    bytes: int  # sum of the declared tensor extents


@dataclass
class CategoryRow:
    category: str
    tensors: int
    bytes: int
    expected_tensors: int
    expected_bytes: int


@dataclass
class ValueFinding:
    """A tensor whose payload holds codes that are not finite values (`dsv41 audit --values`)."""

    tensor: str
    shard: str  # the file's name
    dtype: str
    shape: list[int]
    elements: int
    nan: int
    inf: int

    def sentence(self) -> str:
        counts = " and ".join(f"{n:,} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "Inf")) if n)
        return f"{self.tensor} ({self.dtype} {self.shape} in {self.shard}): {counts} of {self.elements:,} values"


@dataclass
class ValueScan:
    """What `--values` read: tensors and bytes read, those with non-finite codes, those it could not read."""

    files: int = 0
    tensors: int = 0  # floating-point tensors read
    bytes: int = 0
    not_float: int = 0  # integer tensors (packed FP4 included): no non-finite codes to look for
    findings: list[ValueFinding] = field(default_factory=list)
    unread: list[tuple[str, str]] = field(default_factory=list)  # (tensor or file, why)

    @property
    def problems(self) -> int:
        return len(self.findings)


@dataclass
class AuditReport:
    # the field order is the order of the --json document's keys
    checkpoint_dir: str
    config_path: str
    config_layout: str | None
    index_path: str | None
    header_prefix: bool
    require_complete: bool
    files: list[ShardFile]
    duplicates: list[tuple[str, str]]  # (skipped file, file with the identical header)
    unreadable: list[tuple[str, str]]  # (file, why)
    missing_shards: list[str]
    checks: list[CheckResult]
    categories: list[CategoryRow]
    layer_modes: dict[
        str, list[int]
    ]  # full / reindex / reuse (and unknown, while shards are missing) from tensor presence
    layer_tensor_counts: list[int | None]  # tensors per backbone layer (None: not known yet)
    tensors: int
    bytes: int
    expected_tensors: int
    expected_bytes: int
    index_tensors: int | None
    config_summary: str = ""
    values: ValueScan | None = None  # the payload scan, with --values only

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.checks)

    @property
    def passed(self) -> int:
        return self.count(PASS)

    @property
    def failed(self) -> int:
        return self.count(FAIL)

    @property
    def undecided(self) -> int:
        return self.count(UNDECIDED)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed or self.unreadable or (self.values is not None and self.values.problems) else 0

    def as_required_complete(self) -> "AuditReport":
        """The same report with every undecided check failed, as --require-complete reports it."""
        checks = [
            CheckResult(
                c.id, c.group, c.title, FAIL, f"undecided, which --require-complete fails: {c.detail}", list(c.waits_on)
            )
            if c.status == UNDECIDED
            else c
            for c in self.checks
        ]
        return replace(self, checks=checks, require_complete=True)

    def check(self, check_id: str) -> CheckResult:
        return next(c for c in self.checks if c.id == check_id)

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["duplicates"] = [{"path": a, "same_header_as": b} for a, b in self.duplicates]
        doc["unreadable"] = [{"path": a, "reason": b} for a, b in self.unreadable]
        doc["totals"] = {
            "tensors": self.tensors,
            "bytes": self.bytes,
            "gib": round(self.bytes / GIB, 2),
            "expected_tensors": self.expected_tensors,
            "expected_bytes": self.expected_bytes,
            "index_tensors": self.index_tensors,
            "shards_on_disk": len(self.files),
            "shards_missing": len(self.missing_shards),
        }
        doc["summary"] = {
            "checks": len(self.checks),
            "passed": self.passed,
            "failed": self.failed,
            "undecided": self.undecided,
            "gib": round(self.bytes / GIB, 2),
            "exit_code": self.exit_code,
        }
        if self.values is None:
            del doc["values"]  # without --values the document is what it always was
        else:
            doc["values"]["unread"] = [{"what": a, "reason": b} for a, b in self.values.unread]
            doc["summary"]["value_problems"] = self.values.problems
        return doc

    def format(self) -> str:
        return "\n".join(_format_report(self))


def wrong(what: str, found, wanted, word: str = "expected") -> str:
    """The one wording of a value that is not what it should be: "WHAT is FOUND, expected WANTED"
    (word "not" where a format allows exactly one value)."""
    return f"{what} is {found}, {word} {wanted}"


def format_ranges(ids) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10": layer and shard numbers in one short string."""
    ids = sorted(int(i) for i in ids)
    parts, start = [], None
    for k, v in enumerate(ids):
        start = v if start is None else start
        if k + 1 == len(ids) or ids[k + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


_SHARD_RE = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


def describe_shards(names: list[str]) -> str:
    """A few shard names in full; many release-named ones as number ranges."""
    if len(names) <= 3:
        return ", ".join(names)
    matches = [_SHARD_RE.match(n) for n in names]
    totals = {m.group(2) for m in matches if m}
    if all(matches) and len(totals) == 1:
        total = totals.pop()
        numbers = sorted(int(m.group(1)) for m in matches)
        return f"{len(names)} shards: {format_ranges(numbers)} of model-NNNNN-of-{total}.safetensors"
    return f"{len(names)} shards: " + ", ".join(names)


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def _size(n: int, total: int) -> str:
    # GiB for a real checkpoint; a tiny one would read 0.00 GiB on every row
    return _gib(n) if total >= GIB else f"{n / (1 << 20):,.2f} MiB"


def _format_report(r: AuditReport) -> list[str]:
    kind = " (header prefixes)" if r.header_prefix else ""
    lines = [
        f"checkpoint  {r.checkpoint_dir}{kind}",
        f"config      {r.config_path} ({r.config_layout}): {r.config_summary}",
    ]
    if r.index_path:
        lines.append(
            f"index       {r.index_path}: "
            + (f"{r.index_tensors:,} tensors" if r.index_tensors is not None else "unreadable")
        )
    n_shards = len(r.files) + len(r.missing_shards)
    lines.append(
        f"shards      {len(r.files)} of {n_shards} on disk"
        + (f"; missing: {describe_shards(r.missing_shards)}" if r.missing_shards else "")
    )
    for path, same in r.duplicates:
        lines.append(f"  skipped {os.path.basename(path)}: its header duplicates {os.path.basename(same)}")
    for _path, why in r.unreadable:
        lines.append(f"  unreadable: {why}")
    lines.append(f"tensors     {r.tensors:,} of {r.expected_tensors:,} readable, {r.bytes:,} bytes ({_gib(r.bytes)})")
    lines.append("")
    lines.append(f"{'category':<30} {'tensors':>9} {'expected':>9} {'bytes':>14} {'share':>6}")
    for row in r.categories:
        share = f"{100 * row.bytes / r.bytes:.1f}%" if r.bytes else "-"
        lines.append(
            f"{row.category:<30} {row.tensors:>9,} {row.expected_tensors:>9,} "
            f"{_size(row.bytes, r.bytes):>14} {share:>6}"
        )
    lines.append(f"{'total':<30} {r.tensors:>9,} {r.expected_tensors:>9,} {_size(r.bytes, r.bytes):>14}")
    lines.append("")
    lines.append("CSA2 layer modes, from tensor presence:")
    for mode, ids in r.layer_modes.items():
        label = "not known" if mode == "unknown" else mode.capitalize()
        lines.append(f"  {label:<9} {len(ids):>3}  [{format_ranges(ids)}]")
    known = [(i, n) for i, n in enumerate(r.layer_tensor_counts) if n is not None]
    if known:
        groups = defaultdict(list)
        for i, n in known:
            groups[n].append(i)
        parts = [
            f"{n:,} x {len(ids)}"
            + (f" (layer{'s' if len(ids) > 1 else ''} {format_ranges(ids)})" if len(ids) <= 4 else "")
            for n, ids in sorted(groups.items())
        ]
        lines.append("  tensors per backbone layer: " + "; ".join(parts))
    lines.append("")
    lines.append("checks:")
    width = max((len(c.id) for c in r.checks), default=0)
    for c in r.checks:
        lines.append(f"  [{c.status.upper():<9}] {c.id:<{width}}  {c.title}")
        lines.append(f"  {'':11} {'':<{width}}  -> {c.detail}")
    values = ""
    if r.values is not None:
        lines += [""] + _format_values(r.values)
        values = f"; values: {r.values.problems} tensor(s) with non-finite codes"
    lines.append("")
    lines.append(
        f"{len(r.checks)} checks: {r.passed} passed, {r.failed} failed, {r.undecided} undecided; "
        f"{r.tensors:,} tensors, {r.bytes:,} bytes ({_gib(r.bytes)}){values}; exit {r.exit_code}"
    )
    return lines


VALUES_SHOWN = 20  # tensors the text report names; --json lists every one


def _format_values(v: ValueScan) -> list[str]:
    lines = [
        f"values (--values): {v.tensors:,} floating-point tensors read ({_size(v.bytes, v.bytes)}) in {v.files} files, "
        f"{v.not_float:,} integer tensors skipped; "
        + (f"{v.problems:,} hold NaN or Inf codes:" if v.problems else "no NaN or Inf codes")
    ]
    for f in v.findings[:VALUES_SHOWN]:
        lines.append(f"  [FAIL     ] {f.sentence()}")
    if v.problems > VALUES_SHOWN:
        lines.append(f"  ... and {v.problems - VALUES_SHOWN:,} more tensors (--json lists every one)")
    for what, why in v.unread[:VALUES_SHOWN]:
        lines.append(f"  [not read ] {what}: {why}")
    if len(v.unread) > VALUES_SHOWN:
        lines.append(f"  ... and {len(v.unread) - VALUES_SHOWN:,} more not read")
    return lines
