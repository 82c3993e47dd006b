"""Reading a checkpoint directory into evidence, running the checks over it, and the CLI."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter, defaultdict

from dsv41.checkpoint.audit.checks import CHECKS
from dsv41.checkpoint.audit.evidence import Context, Evidence, Missing, Tally
from dsv41.checkpoint.audit.report import FAIL, AuditReport, CategoryRow, CheckResult, ShardFile
from dsv41.checkpoint.headers import (
    INDEX_NAME,
    HeaderError,
    ShardHeader,
    layout_problems,
    plausible_header_length,
    read_header,
)
from dsv41.checkpoint.inventory import TensorSpec, category_of, category_totals, expected_tensors, layer_of, shard_names
from dsv41.core.config import Config, ConfigError, load_config, resolve_config_path
from dsv41.core.errors import Dsv41Error

VALUE_BOUNDS_CHECK = "config.required_keys"  # the check that reports the config's impossible values


class AuditError(Dsv41Error):
    """Input the audit cannot start on: `problem` names the file, `fix` (when there is one) says
    which of `dsv41 audit`'s options mends it; the message is both, one sentence. Other commands
    that run the audit say `problem` with their own options' fix."""

    def __init__(self, problem: str, fix: str | None = None):
        super().__init__(problem if fix is None else f"{problem}; {fix}")
        self.problem = problem


def find_shard_files(checkpoint_dir: str) -> list[str]:
    """Files that are shards: a .safetensors suffix, or a plausible header length at the start."""
    found = []
    for name in sorted(os.listdir(checkpoint_dir)):
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path) or name == INDEX_NAME:
            continue
        if name.endswith(".safetensors") or plausible_header_length(path):
            found.append(path)
    return found


def run_audit(
    checkpoint_dir: str,
    config: str | None = None,
    index: str | None = None,
    header_prefix: bool = False,
    require_complete: bool = False,
    expect_fp8_block: tuple[int, int] | None = None,
    values: bool = False,
    progress: bool = False,
) -> AuditReport:
    """Audit a checkpoint directory (or a directory of header prefixes, with header_prefix=True).
    config and index default to the directory's own files. values=True also reads every tensor's
    payload and counts its NaN and Inf codes (report.values; any found makes the exit code 1),
    with a progress bar on stderr when progress=True. Raises AuditError on input it cannot start
    on (missing directory, no shards, no config)."""
    paths, config_path, cfg, index_path = _inputs(checkpoint_dir, config, index)
    block = tuple(expect_fp8_block) if expect_fp8_block else cfg.fp8_block
    # values no checkpoint can have (n_layers = 10**9, a NaN eps) stop the audit before anything
    # enumerates the config: config.required_keys fails naming them and every other check is not evaluated
    value_problems = cfg.value_problems()
    if value_problems:
        specs, inventory_error = [], f"the config has values no checkpoint can have ({value_problems[0]})"
    else:
        try:
            specs = expected_tensors(cfg)
            inventory_error = None
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, ArithmeticError) as exc:
            specs, inventory_error = [], str(exc)
    expected = {s.name: s for s in specs}

    index_map = index_total = index_problem = None
    if index_path is not None:
        index_map, index_total, index_problem = _read_index(index_path)

    headers_read, duplicates, unreadable = _read_headers(paths)
    layout_shards = sorted(set(index_map.values())) if index_map else (shard_names(cfg) if specs else [])
    known = set(layout_shards) | {s.shard for s in specs}

    def identify(path: str, names) -> str:
        base = os.path.basename(path)
        if base in known:
            return base
        sample = list(names)[:64]  # a shard's tensors all point the same way; a sample decides
        votes = Counter((index_map or {}).get(n) or (expected[n].shard if n in expected else None) for n in sample)
        votes.pop(None, None)
        return votes.most_common(1)[0][0] if votes else base

    files, headers, layout, owners = _collect(headers_read, identify, header_prefix)
    broken = {identify(p, ()) for p, _ in unreadable}
    on_disk = {f.shard for f in files} | broken
    missing_shards = [s for s in layout_shards if s not in on_disk]
    # where an unexpected per-layer name would be: its layer's shard
    layer_shards = {layer_of(s.name): s.shard for s in specs if s.name.endswith(".attn_norm.weight")}

    ev = Evidence(expected, headers, index_map, on_disk, layer_shards, broken)
    ctx = Context(
        cfg, ev, specs, block, files, layout, index_problem, index_total, dict(owners), inventory_error, value_problems
    )
    checks = _run_checks(ctx, with_index=index_path is not None)

    n_layers = cfg.n_layers if isinstance(cfg.n_layers, int) and not value_problems else 0
    modes = ev.presence_modes(n_layers) if specs else []
    counts = _layer_tensor_counts(ev, n_layers, complete=index_map is not None or not missing_shards)
    report = AuditReport(
        checkpoint_dir=checkpoint_dir,
        config_path=config_path,
        config_layout=cfg.layout,
        index_path=index_path,
        header_prefix=header_prefix,
        require_complete=False,
        files=files,
        duplicates=duplicates,
        unreadable=unreadable,
        missing_shards=missing_shards,
        checks=checks,
        categories=_categories(specs, expected, headers),
        layer_modes=_mode_map(modes),
        layer_tensor_counts=counts,
        tensors=len(headers),
        bytes=sum(f.bytes for f in files) - _duplicated_bytes(headers, owners),
        expected_tensors=len(specs),
        expected_bytes=sum(s.nbytes for s in specs),
        index_tensors=len(index_map) if index_map is not None else None,
        config_summary=_summary(cfg),
    )
    if values:
        from dsv41.checkpoint.audit.values import scan_values

        report.values = scan_values([f.path for f in files], progress=progress)
    return report.as_required_complete() if require_complete else report


def _inputs(checkpoint_dir: str, config: str | None, index: str | None) -> tuple[list[str], str, Config, str | None]:
    """(shard files, config path, config, index path), or AuditError naming what is missing."""
    if not os.path.isdir(checkpoint_dir):
        raise AuditError(f"{checkpoint_dir}: no such directory; pass the folder holding the shards")
    paths = find_shard_files(checkpoint_dir)
    if not paths:
        raise AuditError(
            f"{checkpoint_dir}: no safetensors shards here (no *.safetensors file and no file that "
            "starts with a safetensors header)",
            "point --checkpoint-dir at the downloaded shards",
        )
    try:
        config_path = resolve_config_path(config or checkpoint_dir)
        cfg = load_config(config_path)
    except ConfigError as exc:
        raise AuditError(str(exc), "pass --config PATH to a config.json or inference/config.json") from None
    index_path = index
    if index_path is None and os.path.isfile(os.path.join(checkpoint_dir, INDEX_NAME)):
        index_path = os.path.join(checkpoint_dir, INDEX_NAME)
    if index_path is not None and not os.path.isfile(index_path):
        raise AuditError(f"{index_path}: no such index file; pass --index PATH or leave it out")
    return paths, config_path, cfg, index_path


def _read_index(path: str) -> tuple[dict[str, str] | None, int | None, str | None]:
    """(weight_map, total_size, problem): a broken index fails the index check, and the other
    checks then run as if there were none."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        return None, None, f"{path}: cannot be read ({exc})"
    except json.JSONDecodeError as exc:
        return None, None, f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})"
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return None, None, f"{path}: has no weight_map of tensor name -> shard file"
    total = doc.get("metadata", {}).get("total_size") if isinstance(doc.get("metadata"), dict) else None
    return weight_map, total if isinstance(total, int) else None, None


def _read_headers(paths: list[str]) -> tuple[list[ShardHeader], list[tuple[str, str]], list[tuple[str, str]]]:
    """(readable headers, (duplicate, original) pairs, (unreadable path, why) pairs): identical
    headers under two names are one shard, counted once."""
    headers, duplicates, unreadable, seen = [], [], [], {}
    for path in paths:
        try:
            h = read_header(path)
        except HeaderError as exc:
            unreadable.append((path, str(exc)))
            continue
        if h.raw in seen:
            duplicates.append((path, seen[h.raw]))
            continue
        seen[h.raw] = path
        headers.append(h)
    return headers, duplicates, unreadable


def _collect(headers_read: list[ShardHeader], identify, header_prefix: bool):
    """(files, name -> (entry, shard, path), path -> layout problems, name -> every file defining
    it where more than one does); a name's first file wins."""
    files, headers, layout, owners = [], {}, {}, defaultdict(list)
    for h in headers_read:
        shard = identify(h.path, h.entries)
        files.append(ShardFile(h.path, shard, len(h.entries), sum(e.end - e.begin for e in h.entries.values())))
        layout[h.path] = layout_problems(h, header_prefix)
        for name, entry in h.entries.items():
            if name in headers:  # defined by an earlier file too: the inventory check reports it
                owners[name] = owners[name] or [headers[name][2]]
                owners[name].append(h.path)
            else:
                headers[name] = (entry, shard, h.path)
    return files, headers, layout, owners


def _run_checks(ctx: Context, with_index: bool) -> list[CheckResult]:
    results = []
    for c in CHECKS:
        if c.needs_index and not with_index:
            continue
        title = c.title(ctx) if callable(c.title) else c.title
        if ctx.value_problems and c.id != VALUE_BOUNDS_CHECK:
            results.append(CheckResult(c.id, c.group, title, FAIL, f"not evaluated: {ctx.inventory_error}"))
            continue
        if c.needs_inventory and ctx.inventory_error:
            results.append(CheckResult(c.id, c.group, title, FAIL, f"not evaluated: {ctx.inventory_error}"))
            continue
        try:
            first, second = c.run(ctx)
        except Missing as exc:
            first, second = FAIL, str(exc)
        except (TypeError, ValueError, IndexError, KeyError, AttributeError, ArithmeticError) as exc:
            # a config value of the wrong kind: a failed check, not a traceback
            first, second = FAIL, f"cannot be evaluated on this config ({type(exc).__name__}: {exc})"
        if isinstance(first, Tally):
            status, detail, waits = first.outcome(second)
        else:
            status, detail, waits = first, second, []
        results.append(CheckResult(c.id, c.group, title, status, detail, waits))
    return results


def _categories(specs: list[TensorSpec], expected: dict[str, TensorSpec], headers) -> list[CategoryRow]:
    """The category table: the inventory's categories in its order, then any others found on disk."""
    totals = category_totals(specs)
    local = defaultdict(lambda: [0, 0])  # category -> [tensors, bytes] on disk
    for name, (entry, _, _) in headers.items():
        spec = expected.get(name)
        row = local[spec.category if spec else category_of(name)]
        row[0] += 1
        row[1] += entry.end - entry.begin
    return [
        CategoryRow(c, local[c][0], local[c][1], *totals.get(c, (0, 0)))
        for c in list(totals) + sorted(set(local) - set(totals))
    ]


def _mode_map(modes: list[str | None]) -> dict[str, list[int]]:
    layer_modes = {m: [i for i, got in enumerate(modes) if got == m] for m in ("full", "reindex", "reuse")}
    if None in modes:
        layer_modes["unknown"] = [i for i, got in enumerate(modes) if got is None]
    return layer_modes


def _layer_tensor_counts(ev: Evidence, n_layers: int, complete: bool) -> list[int | None]:
    """Tensors per backbone layer; None each until every shard (or the index) says what is there."""
    per_layer = Counter(n.split(".", 2)[1] for n in ev.present if n.startswith("layers."))
    return [per_layer[str(i)] if complete else None for i in range(n_layers)]


def _duplicated_bytes(headers, owners) -> int:
    # a name defined by two files is counted once in the totals, like the tensor count
    return sum((len(paths) - 1) * (headers[n][0].end - headers[n][0].begin) for n, paths in owners.items())


def _summary(cfg: Config) -> str:
    try:
        return cfg.summary()
    except (TypeError, AttributeError, ValueError):
        return "(the config is incomplete)"


def list_tensors(report: AuditReport, pattern) -> list[tuple[str, str, str, int, str]]:
    """(name, dtype, shape, bytes, file) of every readable tensor whose name matches `pattern`."""
    if isinstance(pattern, str):
        pattern = re.compile(pattern)
    rows = []
    for f in report.files:
        h = read_header(f.path)
        for e in h.entries.values():
            if pattern.search(e.name):
                rows.append((e.name, e.dtype, json.dumps(list(e.shape)), e.nbytes, os.path.basename(f.path)))
    return sorted(rows)


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 audit",
        description=(
            "Header-only audit of a checkpoint directory against its config: never reads a payload. "
            "Each check passes, fails, or is undecided while its evidence is in a shard not on disk."
        ),
    )
    parser.add_argument(
        "--checkpoint-dir", required=True, metavar="DIR", help="folder holding the shards (or header prefixes)"
    )
    parser.add_argument(
        "--config", metavar="P", help="config file or folder (default: DIR/config.json, then DIR/inference/config.json)"
    )
    parser.add_argument("--index", metavar="P", help=f"index file (default: DIR/{INDEX_NAME} when present)")
    parser.add_argument(
        "--header-prefix",
        action="store_true",
        help="the files hold only the start of each shard: skip the end-of-file test",
    )
    parser.add_argument("--require-complete", action="store_true", help="an undecided check counts as a failure")
    parser.add_argument("--json", metavar="OUT", help="write every check, the totals and the category table here")
    parser.add_argument(
        "--list-tensors",
        metavar="PATTERN",
        help="print name, dtype, shape, bytes, shard (tab-separated) of the "
        "tensors on disk whose name matches this regular expression, instead of the report",
    )
    parser.add_argument(
        "--expect-fp8-block",
        nargs=2,
        type=int,
        metavar=("R", "C"),
        help="FP8 block the scale check expects (default: the config's)",
    )
    parser.add_argument(
        "--values",
        action="store_true",
        help="also read every tensor's payload (the whole checkpoint) and "
        "report, per tensor, its NaN and Inf codes (FP8 E4M3 0x7F/0xFF, E8M0 0xFF, BF16/F16/F32 "
        "NaN and Inf); exit 1 when any is found",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.expect_fp8_block and min(args.expect_fp8_block) <= 0:
        print("dsv41 audit: --expect-fp8-block takes two positive integers", file=sys.stderr)
        return 2
    pattern = None
    if args.list_tensors is not None:
        try:
            pattern = re.compile(args.list_tensors)
        except re.error as exc:
            print(
                f"dsv41 audit: --list-tensors {args.list_tensors!r} is not a regular expression ({exc})",
                file=sys.stderr,
            )
            return 2
    try:
        report = run_audit(
            args.checkpoint_dir,
            args.config,
            args.index,
            args.header_prefix,
            args.require_complete,
            tuple(args.expect_fp8_block) if args.expect_fp8_block else None,
            values=args.values,
            progress=args.values,
        )
    except AuditError as exc:
        print(f"dsv41 audit: {exc}", file=sys.stderr)
        return 1
    for _, why in report.unreadable:
        print(f"dsv41 audit: {why}", file=sys.stderr)
    if pattern is not None:
        rows = list_tensors(report, pattern)
        for row in rows:
            print("\t".join(str(x) for x in row))
        print(
            f"{len(rows)} tensor(s) match; audit: {report.passed} passed, {report.failed} failed, "
            f"{report.undecided} undecided",
            file=sys.stderr,
        )
    else:
        print(report.format())
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report.to_dict(), f, indent=2)
                f.write("\n")
        except OSError as exc:
            print(f"dsv41 audit: cannot write {args.json}: {exc.strerror}", file=sys.stderr)
            return 1
    return report.exit_code
