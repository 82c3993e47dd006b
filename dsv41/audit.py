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

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace

from dsv41.config import Config, ConfigError, load_config, resolve_config_path
from dsv41.headers import INDEX_NAME, HeaderEntry, HeaderError, layout_problems, plausible_header_length, read_header
from dsv41.inventory import (
    ENGRAM, ENGRAM_ROW_BLOCK, FP4_BLOCK, FP8, PACKED_FP4, REQUIRED_KEYS, ROUTED, SCALE, TensorSpec,
    category_of, category_totals, derived_engram_rows, expected_tensors, layer_of, shard_names,
)

PASS, FAIL, UNDECIDED = "pass", "fail", "undecided"
GIB = 1 << 30
SHOWN = 4  # problems quoted per check before "... and N more"


class AuditError(Exception):
    """Input the audit cannot start on; the message is one sentence naming the file and the fix."""


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
class AuditReport:
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
    layer_modes: dict[str, list[int]]  # full / reindex / reuse (and unknown, while shards are missing) from tensor presence
    layer_tensor_counts: list[int | None]  # tensors per backbone layer (None: not known yet)
    tensors: int
    bytes: int
    expected_tensors: int
    expected_bytes: int
    index_tensors: int | None
    config_summary: str = ""

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
        return 1 if self.failed or self.unreadable else 0

    def as_required_complete(self) -> "AuditReport":
        """The same report with every undecided check failed, as --require-complete reports it."""
        checks = [CheckResult(c.id, c.group, c.title, FAIL, f"undecided, which --require-complete fails: {c.detail}",
                              list(c.waits_on)) if c.status == UNDECIDED else c for c in self.checks]
        return replace(self, checks=checks, require_complete=True)

    def check(self, check_id: str) -> CheckResult:
        return next(c for c in self.checks if c.id == check_id)

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["duplicates"] = [{"path": a, "same_header_as": b} for a, b in self.duplicates]
        doc["unreadable"] = [{"path": a, "reason": b} for a, b in self.unreadable]
        doc["totals"] = {"tensors": self.tensors, "bytes": self.bytes, "gib": round(self.bytes / GIB, 2),
                         "expected_tensors": self.expected_tensors, "expected_bytes": self.expected_bytes,
                         "index_tensors": self.index_tensors, "shards_on_disk": len(self.files),
                         "shards_missing": len(self.missing_shards)}
        doc["summary"] = {"checks": len(self.checks), "passed": self.passed, "failed": self.failed,
                          "undecided": self.undecided, "gib": round(self.bytes / GIB, 2),
                          "exit_code": self.exit_code}
        return doc

    def format(self) -> str:
        return "\n".join(_format_report(self))


# ---------------------------------------------------------------------- evidence
_EXPERT_RE = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.")


class _Evidence:
    """What is known about each tensor name: its header entry if a local shard has it, whether it
    is present at all (the index decides presence when there is one), and which shard to wait on."""

    def __init__(self, expected: dict[str, TensorSpec], headers: dict[str, tuple[HeaderEntry, str, str]],
                 index_map: dict[str, str] | None, on_disk: set[str], layer_shards: dict[tuple[str, int], str],
                 unreadable: set[str]):
        self.expected = expected
        self.headers = headers
        self.index_map = index_map
        self.on_disk = on_disk  # shards with a local file, readable or not
        self.unreadable = unreadable  # shards whose local file has no readable header
        self.layer_shards = layer_shards
        self.present = set(headers) | set(index_map or ())
        # (namespace, layer) -> routed expert ids present there, for the expert-count checks
        self.expert_ids: dict[tuple[str, int], set[int]] = defaultdict(set)
        for name in self.present:
            match = _EXPERT_RE.match(name) if ".experts." in name else None
            if match:
                self.expert_ids[(match.group(1), int(match.group(2)))].add(int(match.group(3)))

    def entry(self, name: str) -> HeaderEntry | None:
        hit = self.headers.get(name)
        return hit[0] if hit else None

    def location(self, name: str) -> str | None:
        if self.index_map is not None and name in self.index_map:
            return self.index_map[name]
        if name in self.expected:
            return self.expected[name].shard
        layer = layer_of(name)  # an unexpected per-layer name would sit in its layer's shard
        return self.layer_shards.get(layer) if layer else None

    def presence(self, name: str) -> bool | None:
        if name in self.headers:
            return True
        if self.index_map is not None:
            return name in self.index_map
        where = self.location(name)
        return None if where is not None and where not in self.on_disk else False

    def present_names(self) -> set[str]:
        return self.present


class _Tally:
    """Collects one check's evidence: failures win, then waits, else a pass."""

    def __init__(self, ev: _Evidence):
        self.ev = ev
        self.problems: list[str] = []
        self.seen: set[str] = set()  # a broken shard would otherwise repeat one sentence per tensor
        self.waits: set[str] = set()

    def fail(self, message: str) -> None:
        if message not in self.seen:
            self.seen.add(message)
            self.problems.append(message)

    def wait(self, name: str) -> None:
        self.waits.add(self.ev.location(name) or "an unidentified shard")

    def present(self, name: str) -> bool:
        """True when present; records a failure or a wait otherwise."""
        p = self.ev.presence(name)
        if p is None:
            self.wait(name)
        elif not p:
            self.fail(f"{name} is missing")
        return bool(p)

    def entry(self, name: str) -> HeaderEntry | None:
        """The header entry, or None after recording why there is none."""
        e = self.ev.entry(name)
        if e is not None:
            return e
        p = self.ev.presence(name)
        where = self.ev.location(name)
        if where in self.ev.unreadable:
            self.fail(f"{where} is unreadable, so its tensors cannot be checked")
        elif p is False:
            self.fail(f"{name} is missing")
        elif p and where in self.ev.on_disk:
            self.fail(f"{name} is assigned to {where} but its header does not have it")
        else:
            self.wait(name)
        return None

    def exactly_on(self, what: str, suffix: str, expected_layers, n_layers: int) -> None:
        expected_layers = set(expected_layers)
        for layer in range(n_layers):
            name = f"layers.{layer}.{suffix}"
            p = self.ev.presence(name)
            if layer in expected_layers:
                if p is False:
                    self.fail(f"{what} missing on layer {layer}")
                elif p is None:
                    self.wait(name)
            elif p:
                self.fail(f"{what} on layer {layer}, which the config does not list")
            elif p is None:
                self.wait(name)

    def outcome(self, passed: str) -> tuple[str, str, list[str]]:
        if self.problems:
            status, detail = _verdict(self.problems, passed)
            return status, detail, []
        if self.waits:
            waits = sorted(self.waits)
            return UNDECIDED, f"waits on {describe_shards(waits)}", waits
        return PASS, passed, []


# ---------------------------------------------------------------------- the checks
class _Context:
    def __init__(self, cfg: Config, ev: _Evidence | None, specs: list[TensorSpec], block: tuple[int, int],
                 files: list[ShardFile], layout: dict[str, list[str]], index_problem: str | None,
                 index_total: int | None, index_shards: set[str], duplicated_names: dict[str, list[str]],
                 inventory_error: str | None):
        self.cfg, self.ev, self.specs, self.block = cfg, ev, specs, block
        self.files, self.layout = files, layout
        self.index_problem, self.index_total, self.index_shards = index_problem, index_total, index_shards
        self.duplicated_names = duplicated_names
        self.inventory_error = inventory_error


class _Missing(Exception):
    pass


def _need(cfg: Config, *names: str) -> None:
    absent = [n for n in names if getattr(cfg, n) is None]
    if absent:
        raise _Missing(f"cannot be evaluated: the config does not state {', '.join(absent)}")


CHECKS: list = []  # (id, group, title, (function, needs the inventory)), in report order


def _check(cid: str, group: str, title: str, needs_inventory: bool = True):
    def register(fn):
        CHECKS.append((cid, group, title, (fn, needs_inventory)))
        return fn
    return register


def _verdict(problems: list[str], passed: str) -> tuple[str, str]:
    if problems:
        return FAIL, "; ".join(problems[:SHOWN]) + (f"; ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    return PASS, passed


# --- Config (12)
@_check("config.required_keys", "Config", f"the {len(REQUIRED_KEYS)} keys the tensor inventory is derived from are present", False)
def _c_required(ctx):
    missing = [k for k in REQUIRED_KEYS if getattr(ctx.cfg, k) is None]
    return _verdict([f"missing: {', '.join(missing)}"] if missing else [], f"all {len(REQUIRED_KEYS)} present")


@_check("config.compress_ratios_length", "Config", "len(compress_ratios) == n_layers + n_mtp_layers", False)
def _c_ratio_len(ctx):
    cfg = ctx.cfg
    _need(cfg, "compress_ratios", "n_layers", "n_mtp_layers")
    n = cfg.n_layers + cfg.n_mtp_layers
    return _verdict([f"{len(cfg.compress_ratios)} entries for {n} layers"] if len(cfg.compress_ratios) != n else [],
                    f"{n} entries")


@_check("config.mtp_uncompressed", "Config", "MTP layers read no compressed positions (compress_ratios[n_layers:] == 0)", False)
def _c_mtp(ctx):
    cfg = ctx.cfg
    _need(cfg, "compress_ratios", "n_layers")
    tail = list(cfg.compress_ratios[cfg.n_layers:])
    return _verdict([f"compress_ratios[{cfg.n_layers}:] = {tail}"] if any(tail) else [], f"compress_ratios[{cfg.n_layers}:] = {tail}")


@_check("config.kv_within_index", "Config", "kv_source_layers is a subset of index_source_layers", False)
def _c_kv_index(ctx):
    cfg = ctx.cfg
    _need(cfg, "kv_source_layers", "index_source_layers")
    extra = sorted(set(cfg.kv_source_layers) - set(cfg.index_source_layers))
    return _verdict([f"KV sources {extra} are not index sources"] if extra else [],
                    f"KV {list(cfg.kv_source_layers)} within index {list(cfg.index_source_layers)}")


@_check("config.sources_compress", "Config", "every source layer is a backbone layer that reads compressed positions", False)
def _c_sources(ctx):
    cfg = ctx.cfg
    _need(cfg, "kv_source_layers", "index_source_layers", "compress_ratios", "n_layers")
    problems = []
    for layer in sorted(set(cfg.kv_source_layers) | set(cfg.index_source_layers)):
        if not 0 <= layer < cfg.n_layers:
            problems.append(f"source layer {layer} is outside the backbone")
        elif layer >= len(cfg.compress_ratios) or cfg.compress_ratios[layer] <= 0:
            problems.append(f"source layer {layer} has compress ratio 0")
    return _verdict(problems, "every source has a ratio > 0")


@_check("config.index_has_kv", "Config", "every index source has a KV source at or below it, at its ratio", False)
def _c_index_kv(ctx):
    cfg = ctx.cfg
    _need(cfg, "kv_source_layers", "index_source_layers", "compress_ratios")
    problems = []
    for layer in cfg.index_source_layers:
        src = cfg.source_at_or_before(layer, cfg.kv_source_layers)
        ratios = cfg.compress_ratios
        if src is None:
            problems.append(f"index source {layer} has no KV source at or below it")
        elif max(src, layer) < len(ratios) and ratios[src] != ratios[layer]:
            problems.append(f"index source {layer} (ratio {ratios[layer]}) reads KV source {src} (ratio {ratios[src]})")
    return _verdict(problems, "every index source reads a KV source of its ratio")


@_check("config.readers_have_sources", "Config", "every layer reading compressed positions has a KV and an index source at or before it, at its ratio", False)
def _c_readers(ctx):
    cfg = ctx.cfg
    _need(cfg, "kv_source_layers", "index_source_layers", "compress_ratios", "n_layers")
    ratios, problems = cfg.compress_ratios, []
    readers = [layer for layer in range(min(cfg.n_layers, len(ratios))) if ratios[layer] > 0]
    for layer in readers:
        for kind, sources in (("KV", cfg.kv_source_layers), ("index", cfg.index_source_layers)):
            src = cfg.source_at_or_before(layer, sources)
            # the source writes the shared cache at its own ratio; a reader at another ratio would
            # index it at the wrong granularity
            if src is None:
                problems.append(f"layer {layer} has no {kind} source at or before it")
            elif src < len(ratios) and ratios[src] != ratios[layer]:
                problems.append(f"layer {layer} (ratio {ratios[layer]}) reads {kind} source {src} (ratio {ratios[src]})")
    return _verdict(problems, f"{len(readers)} reading layers, each behind sources of its ratio")


@_check("config.candidate_source", "Config", "candidate_source_layer is an index source with no KV source after it", False)
def _c_candidate(ctx):
    cfg = ctx.cfg
    _need(cfg, "candidate_source_layer", "kv_source_layers", "index_source_layers")
    c = cfg.candidate_source_layer
    if c < 0:
        return PASS, "candidate pre-filtering is off (-1)"
    problems = []
    if c not in cfg.index_source_layers:
        problems.append(f"candidate_source_layer {c} is not an index source")
    # a later KV source would publish a compressed cache the candidate mask was not built over
    later = [s for s in cfg.kv_source_layers if s > c]
    if later:
        problems.append(f"KV sources {later} come after candidate_source_layer {c}")
    return _verdict(problems, f"layer {c}, the last KV source")


@_check("config.dspark_targets", "Config", "dspark_target_layer_ids are the last n_mtp_layers backbone layers", False)
def _c_dspark(ctx):
    cfg = ctx.cfg
    _need(cfg, "dspark_target_layer_ids", "n_layers", "n_mtp_layers")
    want = list(range(cfg.n_layers - cfg.n_mtp_layers, cfg.n_layers))
    got = list(cfg.dspark_target_layer_ids)
    return _verdict([f"{got}, expected {want}"] if got != want else [], f"{got}")


@_check("config.engram_sizes", "Config", "one Engram table size per Engram layer", False)
def _c_engram_sizes(ctx):
    cfg = ctx.cfg
    _need(cfg, "engram_layer_ids", "engram_num_embeddings")
    a, b = len(cfg.engram_num_embeddings), len(cfg.engram_layer_ids)
    return _verdict([f"{a} sizes for {b} layers"] if a != b else [], f"{a} sizes for {b} layers")


@_check("config.engram_layers", "Config", "engram_layer_ids are distinct, ascending and inside the backbone", False)
def _c_engram_layers(ctx):
    cfg = ctx.cfg
    _need(cfg, "engram_layer_ids", "n_layers")
    ids = list(cfg.engram_layer_ids)
    problems = []
    if ids != sorted(set(ids)):
        problems.append(f"{ids} are not distinct and ascending")
    if any(not 0 <= i < cfg.n_layers for i in ids):
        problems.append(f"{ids} reach outside [0, {cfg.n_layers})")
    return _verdict(problems, f"{ids}")


@_check("config.engram_vocab", "Config", "engram_compressed_vocab_size is set (every hash multiplier derives from it)", False)
def _c_engram_vocab(ctx):
    v = ctx.cfg.engram_compressed_vocab_size
    ok = isinstance(v, int) and v > 0
    return _verdict([] if ok else [f"engram_compressed_vocab_size is {v!r}"], f"{v}")


@_check("config.quantization", "Config", "dense linears are fp8 and routed experts fp4, the formats the packing checks read", False)
def _c_quant(ctx):
    cfg = ctx.cfg
    problems = []
    if cfg.dtype != "fp8":
        problems.append(f"dtype (quantization) is {cfg.dtype!r}, not 'fp8'")
    if cfg.expert_dtype != "fp4":
        problems.append(f"expert_dtype is {cfg.expert_dtype!r}, not 'fp4'")
    return _verdict(problems, f"fp8 with {ctx.block[0]}x{ctx.block[1]} blocks, experts fp4")


# --- Engram (5)
@_check("engram.placement", "Engram", "the Engram tables sit on exactly engram_layer_ids")
def _e_placement(ctx):
    t = _Tally(ctx.ev)
    t.exactly_on("an Engram table", "engram.embed.weight", ctx.cfg.engram_layer_ids, ctx.cfg.n_layers)
    return t, f"tables on layers {list(ctx.cfg.engram_layer_ids)}"


@_check("engram.projections", "Engram", "each Engram layer has its gate and value projections (wkv, q_weight, k_weight) at the config's dtypes and shapes")
def _e_projections(ctx):
    t = _Tally(ctx.ev)
    for spec in ctx.specs:
        if spec.category == "Engram" and ".engram.embed." not in spec.name:
            e = t.entry(spec.name)
            if e and (e.dtype, e.shape) != (spec.dtype, spec.shape):
                t.fail(f"{spec.name} is {e.dtype} {list(e.shape)}, expected {spec.dtype} {list(spec.shape)}")
    return t, f"wkv, q_weight and k_weight on {len(ctx.cfg.engram_layer_ids)} layers"


@_check("engram.rows", "Engram", "the declared table rows equal what the prime bucket layout derives", False)
def _e_rows(ctx):
    cfg = ctx.cfg
    _need(cfg, "engram_layer_ids", "engram_num_embeddings", "engram_vocab_size", "engram_max_ngram_size", "engram_n_heads")
    declared, derived = list(cfg.engram_num_embeddings), list(derived_engram_rows(cfg))
    text = f"declared={declared} derived={derived}"
    return _verdict([text] if declared != derived else [], text)


@_check("engram.dtype", "Engram", "the tables are F8_E4M3 [rows, engram_head_dim] with F8_E8M0 scales, at the declared rows")
def _e_dtype(ctx):
    t = _Tally(ctx.ev)
    for spec in ctx.specs:
        if ".engram.embed." in spec.name:
            e = t.entry(spec.name)
            if e and (e.dtype, e.shape) != (spec.dtype, spec.shape):
                t.fail(f"{spec.name} is {e.dtype} {list(e.shape)}, expected {spec.dtype} {list(spec.shape)}")
    return t, "F8_E4M3 tables, F8_E8M0 scales"


@_check("engram.row_block", "Engram", f"the tables use a 1x{ENGRAM_ROW_BLOCK} per-row scale block")
def _e_block(ctx):
    t = _Tally(ctx.ev)
    for layer in ctx.cfg.engram_layer_ids:
        w, s = t.entry(f"layers.{layer}.engram.embed.weight"), t.entry(f"layers.{layer}.engram.embed.scale")
        if w and s and (len(w.shape) != 2 or len(s.shape) != 2
                        or s.shape != (w.shape[0], -(-w.shape[1] // ENGRAM_ROW_BLOCK))):
            t.fail(f"layer {layer}: scale {list(s.shape)} for table {list(w.shape)} is not a 1x{ENGRAM_ROW_BLOCK} block")
    return t, f"1x{ENGRAM_ROW_BLOCK} on every table"


# --- CSA2 (5)
@_check("csa2.compressor", "CSA2", "attn.compressor.wkv exactly on kv_source_layers")
def _s_compressor(ctx):
    t = _Tally(ctx.ev)
    t.exactly_on("compressor.wkv", "attn.compressor.wkv.weight", ctx.cfg.kv_source_layers, ctx.cfg.n_layers)
    return t, f"on {list(ctx.cfg.kv_source_layers)}"


@_check("csa2.wgate", "CSA2", "attn.compressor.wgate exactly on the KV sources with ratio > 1")
def _s_wgate(ctx):
    cfg = ctx.cfg
    gated = [s for s in cfg.kv_source_layers if cfg.compress_ratios[s] > 1]
    t = _Tally(ctx.ev)
    t.exactly_on("compressor.wgate", "attn.compressor.wgate.weight", gated, cfg.n_layers)
    return t, f"on {gated}"


@_check("csa2.index_keys", "CSA2", "attn.indexer.wk exactly on kv_source_layers")
def _s_wk(ctx):
    t = _Tally(ctx.ev)
    t.exactly_on("indexer.wk", "attn.indexer.wk.weight", ctx.cfg.kv_source_layers, ctx.cfg.n_layers)
    return t, f"on {list(ctx.cfg.kv_source_layers)}"


@_check("csa2.index_queries", "CSA2", "attn.indexer.wq_b exactly on index_source_layers")
def _s_wq(ctx):
    t = _Tally(ctx.ev)
    t.exactly_on("indexer.wq_b", "attn.indexer.wq_b.weight", ctx.cfg.index_source_layers, ctx.cfg.n_layers)
    return t, f"on {list(ctx.cfg.index_source_layers)}"


@_check("csa2.modes", "CSA2", "Full / Reindex / Reuse read from tensor presence partition the backbone as the config says")
def _s_modes(ctx):
    cfg, t = ctx.cfg, _Tally(ctx.ev)
    modes = _presence_modes(ctx.ev, cfg.n_layers)
    for layer, mode in enumerate(modes):
        if mode is None:
            t.wait(f"layers.{layer}.attn.indexer.wq_b.weight")
        elif mode != cfg.layer_mode(layer):
            t.fail(f"layer {layer} holds a {mode} tensor set but the config makes it {cfg.layer_mode(layer)}")
    counts = Counter(cfg.layer_modes)
    return t, f"Full {counts['full']}, Reindex {counts['reindex']}, Reuse {counts['reuse']}"


def _presence_modes(ev: _Evidence, n_layers: int) -> list[str | None]:
    """Full owns indexer.wk, Reindex owns indexer.wq_b only, Reuse neither; None while unknown."""
    modes = []
    for layer in range(n_layers):
        wk, wq = (ev.presence(f"layers.{layer}.attn.indexer.{n}.weight") for n in ("wk", "wq_b"))
        if wk:
            modes.append("full")
        elif wk is None or wq is None:
            modes.append(None)
        else:
            modes.append("reindex" if wq else "reuse")
    return modes


# --- Inventory (4)
@_check("inventory.layer_sets", "Inventory", "every backbone layer has its full tensor set, and nothing lies outside the config's inventory")
def _i_sets(ctx):
    ev, t = ctx.ev, _Tally(ctx.ev)
    present = ev.present_names()
    missing = defaultdict(list)  # "layers.5" (or the name itself outside a layer) -> missing names
    for spec in ctx.specs:
        if spec.name not in present:
            if ev.presence(spec.name) is None:
                t.wait(spec.name)
            else:
                layer = layer_of(spec.name)
                missing[f"{layer[0]}.{layer[1]}" if layer else spec.name].append(spec.name)
    for where, names in missing.items():
        t.fail(f"{where}: {len(names)} tensor(s) missing, e.g. {names[0]}" if names[0] != where else f"{where} is missing")
    extra = sorted(present - set(ev.expected))
    for name in extra[:SHOWN]:
        t.fail(f"{name} is not in the config's inventory")
    if len(extra) > SHOWN:
        t.fail(f"{len(extra) - SHOWN} more tensors outside the inventory")
    for name, paths in sorted(ctx.duplicated_names.items())[:SHOWN]:
        t.fail(f"{name} is defined in {len(paths)} files: {', '.join(os.path.basename(p) for p in paths)}")
    return t, f"{len(ctx.specs):,} tensors, every layer complete"


def _mismatch(spec: TensorSpec, e: HeaderEntry) -> str | None:
    """'NAME is FOUND, expected WANTED' naming only what differs (dtype, shape or both), else None.
    The dtype matters as much as the shape: an I8 tensor where the config puts an F8_E4M3 one has
    the same shape and byte size, and the loader rejects it."""
    dtype_ok, shape_ok = e.dtype == spec.dtype, tuple(e.shape) == tuple(spec.shape)
    if dtype_ok and shape_ok:
        return None
    if dtype_ok:
        return f"{spec.name} is {list(e.shape)}, expected {list(spec.shape)}"
    if shape_ok:
        return f"{spec.name} is {e.dtype}, expected {spec.dtype}"
    return f"{spec.name} is {e.dtype} {list(e.shape)}, expected {spec.dtype} {list(spec.shape)}"


@_check("inventory.shapes", "Inventory", "tensor dtypes and shapes match the config (the Engram checks own the Engram tensors)")
def _i_shapes(ctx):
    t = _Tally(ctx.ev)
    for spec in ctx.specs:
        if spec.category != ENGRAM:
            e = t.entry(spec.name)
            problem = e and _mismatch(spec, e)
            if problem:
                t.fail(problem)
    return t, "every dtype and shape as the config implies"


@_check("inventory.unquantized", "Inventory", "the F32/BF16 tensors are stored unquantized, in their dtype")
def _i_unquantized(ctx):
    t, ev = _Tally(ctx.ev), ctx.ev
    n = 0
    for spec in ctx.specs:
        if spec.dtype in ("F32", "BF16", "F16") and spec.category != "Engram":
            n += 1
            e = t.entry(spec.name)
            if e and e.dtype != spec.dtype:
                t.fail(f"{spec.name} is {e.dtype}, expected {spec.dtype}")
            if spec.name.endswith(".weight") and ev.presence(spec.name[:-len("weight")] + "scale"):
                t.fail(f"{spec.name} has a scale beside it")
    return t, f"{n:,} unquantized tensors in their dtype"


@_check("inventory.nonempty", "Inventory", "the tensor count and byte total on disk are non-zero")
def _i_nonempty(ctx):
    n = sum(f.tensors for f in ctx.files)
    size = sum(f.bytes for f in ctx.files)
    return _verdict([] if n and size else [f"{n} tensors, {size} bytes"], f"{n:,} tensors, {size:,} bytes")


# --- Packing (3)
@_check("packing.extents", "Packing", "every tensor's byte extent matches its shape and dtype, and the extents tile each file")
def _p_extents(ctx):
    problems = [f"{os.path.basename(path)}: {p}" for path, ps in ctx.layout.items() for p in ps]
    return _verdict(problems, f"{len(ctx.files)} file(s) tiled exactly")


@_check("packing.scale_pairs", "Packing", "every quantized weight has an F8_E8M0 scale, and each weight/scale pair blocks evenly")
def _p_pairs(ctx):
    ev, t = ctx.ev, _Tally(ctx.ev)
    pairs = 0
    headers = ev.headers
    for name, (entry, _, _) in headers.items():
        if entry.dtype in (FP8, PACKED_FP4) and name.endswith(".weight"):
            scale = name[:-6] + "scale"
            if scale not in headers:
                t.present(scale)
        if not name.endswith(".scale"):
            continue
        hit = headers.get(name[:-5] + "weight")
        w = hit[0] if hit else t.entry(name[:-5] + "weight")
        if w is None:
            continue
        pairs += 1
        if entry.dtype != SCALE:
            t.fail(f"{name} is {entry.dtype}, not {SCALE}")
        if w.dtype not in (FP8, PACKED_FP4):
            t.fail(f"{w.name} is {w.dtype} but has a scale")
            continue
        logical = (w.shape[0], w.shape[1] * 2) if w.dtype == PACKED_FP4 and len(w.shape) == 2 else w.shape
        if len(logical) != len(entry.shape) or not all(_blocks_evenly(a, b) for a, b in zip(logical, entry.shape)):
            t.fail(f"{name} {list(entry.shape)} does not tile {w.name} {list(logical)} with one block size")
    return t, f"{pairs:,} weight/scale pairs"


def _blocks_evenly(size: int, blocks: int) -> bool:
    if blocks <= 0:
        return size == 0
    step = -(-size // blocks)
    return step > 0 and -(-size // step) == blocks


@_check("packing.fp8_block", "Packing", "every FP8 weight outside the Engram tables uses the expected block")
def _p_fp8(ctx):
    ev, t = ctx.ev, _Tally(ctx.ev)
    rows, cols = ctx.block
    fp8_specs = {s.name for s in ctx.specs if s.dtype == FP8}
    names = set(fp8_specs)
    names.update(n for n, (e, _, _) in ev.headers.items() if e.dtype == FP8 and n.endswith(".weight"))
    names = sorted(n for n in names if ".engram.embed." not in n)
    for name in names:
        w = t.entry(name)
        s = t.entry(name[:-len("weight")] + "scale")
        if w and name in fp8_specs and w.dtype != FP8:
            # a block over a weight that is not FP8 means nothing (an I8 one would read as packed FP4)
            t.fail(f"{name} is {w.dtype}, expected {FP8}")
        elif w and s and (len(w.shape) != 2 or s.shape != (-(-w.shape[0] // rows), -(-w.shape[1] // cols))):
            t.fail(f"{s.name} {list(s.shape)} is not a {rows}x{cols} block over {list(w.shape)}")
    return t, f"{len(names):,} FP8 weights, {rows}x{cols} blocks"


# --- Experts (3)
@_check("experts.fp4", "Experts", f"routed w1/w2/w3 are FP4 packed in I8 with an F8_E8M0 scale per {FP4_BLOCK} along K")
def _x_fp4(ctx):
    t = _Tally(ctx.ev)
    n = 0
    for spec in ctx.specs:
        if spec.category == ROUTED:
            n += 1
            e = t.entry(spec.name)
            if e and (e.dtype, e.shape) != (spec.dtype, spec.shape):
                t.fail(f"{spec.name} is {e.dtype} {list(e.shape)}, expected {spec.dtype} {list(spec.shape)}")
    return t, f"{n:,} routed-expert tensors"


def _count_experts(ctx, namespace: str, layers, n_expected: int) -> _Tally:
    t = _Tally(ctx.ev)
    for layer in layers:
        prefix = f"{namespace}.{layer}."
        extra = sorted(i for i in ctx.ev.expert_ids[(namespace, layer)] if i >= n_expected)
        if extra:
            t.fail(f"{prefix[:-1]} has experts beyond {n_expected - 1}: {extra[:SHOWN]}")
        for e in range(n_expected):
            for w in ("w1", "w2", "w3"):
                for part in ("weight", "scale"):
                    name = f"{prefix}ffn.experts.{e}.{w}.{part}"
                    if name in ctx.ev.expected:
                        t.present(name)
    return t


@_check("experts.backbone_count", "Experts", "every backbone layer has n_routed_experts routed experts")
def _x_backbone(ctx):
    n = ctx.cfg.n_routed_experts
    return _count_experts(ctx, "layers", range(ctx.cfg.n_layers), n), f"{n} on each of {ctx.cfg.n_layers} layers"


@_check("experts.mtp_count", "Experts", "every MTP layer has dspark_n_routed_experts routed experts")
def _x_mtp(ctx):
    cfg = ctx.cfg
    n = cfg.moe_shape(cfg.n_layers)[0]
    return _count_experts(ctx, "mtp", range(cfg.n_mtp_layers), n), f"{n} on each of {cfg.n_mtp_layers} MTP layers"


# --- DSpark (3)
def _shapes_of(ctx, t: _Tally, predicate) -> int:
    n = 0
    for spec in ctx.specs:
        if predicate(spec.name):
            n += 1
            e = t.entry(spec.name)
            if e and (e.dtype, e.shape) != (spec.dtype, spec.shape):
                t.fail(f"{spec.name} is {e.dtype} {list(e.shape)}, expected {spec.dtype} {list(spec.shape)}")
    return n


@_check("dspark.heads", "DSpark", "the Markov and confidence heads match the config")
def _d_heads(ctx):
    cfg, t = ctx.cfg, _Tally(ctx.ev)
    last = f"mtp.{cfg.n_mtp_layers - 1}."
    heads = (f"{last}markov_head.", f"{last}confidence_head.", f"{last}norm.")
    n = _shapes_of(ctx, t, lambda name: name.startswith(heads))
    return t, f"{n} head tensors, Markov rank {cfg.dspark_markov_rank}"


@_check("dspark.main_proj", "DSpark", "main_proj takes len(dspark_target_layer_ids) x dim = n_mtp_layers x dim inputs")
def _d_main_proj(ctx):
    cfg, t = ctx.cfg, _Tally(ctx.ev)
    if len(cfg.dspark_target_layer_ids) != cfg.n_mtp_layers:
        t.fail(f"{len(cfg.dspark_target_layer_ids)} target layers for {cfg.n_mtp_layers} MTP layers")
    _shapes_of(ctx, t, lambda name: name.startswith("mtp.0.main_proj."))
    return t, f"[{cfg.dim}, {len(cfg.dspark_target_layer_ids) * cfg.dim}]"


@_check("dspark.stages", "DSpark", "every MTP layer carries attention and FFN; only the first has main_proj/main_norm, only the last the heads")
def _d_stages(ctx):
    ev, t = ctx.ev, _Tally(ctx.ev)
    for spec in ctx.specs:
        if spec.name.startswith("mtp.") and spec.category != ROUTED:
            t.present(spec.name)
    extra = sorted(n for n in ev.present_names() if n.startswith("mtp.") and n not in ev.expected)
    for name in extra[:SHOWN]:
        t.fail(f"{name} is on a stage the config does not give it")
    return t, f"{ctx.cfg.n_mtp_layers} stages"


# --- Vision (2)
def _is_vision(name: str) -> bool:
    return name.startswith(("vision.", "aligner.", "image_"))


@_check("vision.blocks", "Vision", "all vision blocks, the patch embedding, the aligner and the image markers are present")
def _v_blocks(ctx):
    ev, t = ctx.ev, _Tally(ctx.ev)
    n = 0
    for spec in ctx.specs:
        if _is_vision(spec.name):
            n += 1
            t.present(spec.name)
    extra = sorted(name for name in ev.present_names() if _is_vision(name) and name not in ev.expected)
    for name in extra[:SHOWN]:
        t.fail(f"{name} is not part of a {ctx.cfg.vision_n_layers}-block vision tower")
    return t, f"{ctx.cfg.vision_n_layers} blocks, {n} tensors"


@_check("vision.shapes", "Vision", "the vision encoder and aligner shapes match the config")
def _v_shapes(ctx):
    t = _Tally(ctx.ev)
    n = _shapes_of(ctx, t, _is_vision)
    return t, f"{n} tensors"


# --- Index (1, only with an index)
@_check("index.shards", "Index", "every local shard holds exactly the tensors the index assigns it")
def _x_index(ctx):
    if ctx.index_problem:
        return FAIL, ctx.index_problem
    ev = ctx.ev
    assigned: dict[str, set[str]] = defaultdict(set)
    for name, shard in ev.index_map.items():
        assigned[shard].add(name)
    held: dict[str, set[str]] = defaultdict(set)
    for name, (_, shard, _) in ev.headers.items():
        held[shard].add(name)
    problems = []
    for shard in sorted(held):
        if shard not in assigned:
            problems.append(f"{shard} is not named in the index but holds {len(held[shard])} tensors")
            continue
        missing, extra = assigned[shard] - held[shard], held[shard] - assigned[shard]
        if missing:
            problems.append(f"{shard} lacks {len(missing)} tensor(s) the index assigns it, e.g. {min(missing)}")
        if extra:
            problems.append(f"{shard} holds {len(extra)} tensor(s) the index puts elsewhere or nowhere, e.g. {min(extra)}")
    complete = set(assigned) <= set(held)
    total = sum(f.bytes for f in ctx.files)
    if complete and ctx.index_total is not None and ctx.index_total != total:
        problems.append(f"metadata.total_size is {ctx.index_total:,} but the shards hold {total:,} bytes")
    return _verdict(problems, f"{len(held)} of {len(assigned)} indexed shards on disk, each as indexed")


def _run_checks(ctx: _Context, with_index: bool) -> list[CheckResult]:
    results = []
    for cid, group, title, (fn, needs_inventory) in CHECKS:
        if group == "Index" and not with_index:
            continue
        if cid == "packing.fp8_block":
            title = f"every FP8 weight outside the Engram tables uses a {ctx.block[0]}x{ctx.block[1]} block"
        if needs_inventory and ctx.inventory_error:
            results.append(CheckResult(cid, group, title, FAIL, f"not evaluated: {ctx.inventory_error}"))
            continue
        try:
            first, second = fn(ctx)
        except _Missing as exc:
            first, second = FAIL, str(exc)
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
            # a config value of the wrong kind: a failed check, not a traceback
            first, second = FAIL, f"cannot be evaluated on this config ({type(exc).__name__}: {exc})"
        if isinstance(first, _Tally):
            status, detail, waits = first.outcome(second)
        else:
            status, detail, waits = first, second, []
        results.append(CheckResult(cid, group, title, status, detail, waits))
    return results


# ---------------------------------------------------------------------- running
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


def run_audit(checkpoint_dir: str, config: str | None = None, index: str | None = None,
              header_prefix: bool = False, require_complete: bool = False,
              expect_fp8_block: tuple[int, int] | None = None) -> AuditReport:
    """Audit a checkpoint directory (or a directory of header prefixes, with header_prefix=True).
    config and index default to the directory's own files. Raises AuditError on input it cannot
    start on (missing directory, no shards, no config)."""
    if not os.path.isdir(checkpoint_dir):
        raise AuditError(f"{checkpoint_dir}: no such directory; pass the folder holding the shards")
    paths = find_shard_files(checkpoint_dir)
    if not paths:
        raise AuditError(f"{checkpoint_dir}: no safetensors shards here (no *.safetensors file and no file that "
                         "starts with a safetensors header); point --checkpoint-dir at the downloaded shards")
    try:
        config_path = resolve_config_path(config or checkpoint_dir)
        cfg = load_config(config_path)
    except ConfigError as exc:
        raise AuditError(f"{exc}; pass --config PATH to a config.json or inference/config.json") from None
    index_path = index
    if index_path is None and os.path.isfile(os.path.join(checkpoint_dir, INDEX_NAME)):
        index_path = os.path.join(checkpoint_dir, INDEX_NAME)
    if index_path is not None and not os.path.isfile(index_path):
        raise AuditError(f"{index_path}: no such index file; pass --index PATH or leave it out")

    block = tuple(expect_fp8_block) if expect_fp8_block else cfg.fp8_block
    try:
        specs = expected_tensors(cfg)
        inventory_error = None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        specs, inventory_error = [], str(exc)
    expected = {s.name: s for s in specs}

    index_map = index_total = index_problem = None
    if index_path is not None:
        index_map, index_total, index_problem = _read_index(index_path)

    # read headers; identical headers under two names are one shard counted once
    headers_read, duplicates, unreadable, seen = [], [], [], {}
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
        headers_read.append(h)

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
    broken = {identify(p, ()) for p, _ in unreadable}
    on_disk = {f.shard for f in files} | broken
    missing_shards = [s for s in layout_shards if s not in on_disk]
    # where an unexpected per-layer name would be: its layer's shard
    layer_shards = {layer_of(s.name): s.shard for s in specs if s.name.endswith(".attn_norm.weight")}

    ev = _Evidence(expected, headers, index_map, on_disk, layer_shards, broken)
    ctx = _Context(cfg, ev, specs, block, files, layout, index_problem, index_total,
                   set(layout_shards), dict(owners), inventory_error)
    checks = _run_checks(ctx, with_index=index_path is not None)

    totals = category_totals(specs)
    local = defaultdict(lambda: [0, 0])
    for name, (entry, _, _) in headers.items():
        spec = expected.get(name)
        row = local[spec.category if spec else category_of(name)]
        row[0] += 1
        row[1] += entry.end - entry.begin
    categories = [CategoryRow(c, local[c][0], local[c][1], *totals.get(c, (0, 0)))
                  for c in list(totals) + sorted(set(local) - set(totals))]

    n_layers = cfg.n_layers or 0
    modes = _presence_modes(ev, n_layers) if specs else []
    layer_modes = {m: [i for i, got in enumerate(modes) if got == m] for m in ("full", "reindex", "reuse")}
    if None in modes:
        layer_modes["unknown"] = [i for i, got in enumerate(modes) if got is None]
    present = ev.present_names()
    per_layer = Counter(n.split(".", 2)[1] for n in present if n.startswith("layers."))
    complete_layers = index_map is not None or not missing_shards
    counts = [per_layer[str(i)] if complete_layers else None for i in range(n_layers)]

    report = AuditReport(
        checkpoint_dir=checkpoint_dir, config_path=config_path, config_layout=cfg.layout, index_path=index_path,
        header_prefix=header_prefix, require_complete=False, files=files, duplicates=duplicates,
        unreadable=unreadable, missing_shards=missing_shards, checks=checks, categories=categories,
        layer_modes=layer_modes, layer_tensor_counts=counts,
        tensors=len(headers), bytes=sum(f.bytes for f in files) - _duplicated_bytes(headers, owners),
        expected_tensors=len(specs), expected_bytes=sum(s.nbytes for s in specs),
        index_tensors=len(index_map) if index_map is not None else None,
        config_summary=_summary(cfg))
    return report.as_required_complete() if require_complete else report


def _duplicated_bytes(headers, owners) -> int:
    # a name defined by two files is counted once in the totals, like the tensor count
    return sum((len(paths) - 1) * (headers[n][0].end - headers[n][0].begin) for n, paths in owners.items())


def _summary(cfg: Config) -> str:
    try:
        return cfg.summary()
    except (TypeError, AttributeError):
        return "(the config is incomplete)"


# ---------------------------------------------------------------------- report
def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def _size(n: int, total: int) -> str:
    # GiB for a real checkpoint; a tiny one would read 0.00 GiB on every row
    return _gib(n) if total >= GIB else f"{n / (1 << 20):,.2f} MiB"


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


def _format_report(r: AuditReport) -> list[str]:
    kind = " (header prefixes)" if r.header_prefix else ""
    lines = [f"checkpoint  {r.checkpoint_dir}{kind}",
             f"config      {r.config_path} ({r.config_layout}): {r.config_summary}"]
    if r.index_path:
        lines.append(f"index       {r.index_path}: " + (f"{r.index_tensors:,} tensors" if r.index_tensors is not None else "unreadable"))
    n_shards = len(r.files) + len(r.missing_shards)
    lines.append(f"shards      {len(r.files)} of {n_shards} on disk" + (f"; missing: {describe_shards(r.missing_shards)}" if r.missing_shards else ""))
    for path, same in r.duplicates:
        lines.append(f"  skipped {os.path.basename(path)}: its header duplicates {os.path.basename(same)}")
    for path, why in r.unreadable:
        lines.append(f"  unreadable: {why}")
    lines.append(f"tensors     {r.tensors:,} of {r.expected_tensors:,} readable, {r.bytes:,} bytes ({_gib(r.bytes)})")
    lines.append("")
    lines.append(f"{'category':<30} {'tensors':>9} {'expected':>9} {'bytes':>14} {'share':>6}")
    for row in r.categories:
        share = f"{100 * row.bytes / r.bytes:.1f}%" if r.bytes else "-"
        lines.append(f"{row.category:<30} {row.tensors:>9,} {row.expected_tensors:>9,} {_size(row.bytes, r.bytes):>14} {share:>6}")
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
        parts = [f"{n:,} x {len(ids)}" + (f" (layer{'s' if len(ids) > 1 else ''} {format_ranges(ids)})" if len(ids) <= 4 else "")
                 for n, ids in sorted(groups.items())]
        lines.append("  tensors per backbone layer: " + "; ".join(parts))
    lines.append("")
    lines.append("checks:")
    width = max((len(c.id) for c in r.checks), default=0)
    for c in r.checks:
        lines.append(f"  [{c.status.upper():<9}] {c.id:<{width}}  {c.title}")
        lines.append(f"  {'':11} {'':<{width}}  -> {c.detail}")
    lines.append("")
    lines.append(f"{len(r.checks)} checks: {r.passed} passed, {r.failed} failed, {r.undecided} undecided; "
                 f"{r.tensors:,} tensors, {r.bytes:,} bytes ({_gib(r.bytes)}); exit {r.exit_code}")
    return lines


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


# ---------------------------------------------------------------------- CLI
def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 audit", description=(
        "Header-only audit of a checkpoint directory against its config: never reads a payload. "
        "Each check passes, fails, or is undecided while its evidence is in a shard not on disk."))
    parser.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="folder holding the shards (or header prefixes)")
    parser.add_argument("--config", metavar="P", help="config file or folder (default: DIR/config.json, then DIR/inference/config.json)")
    parser.add_argument("--index", metavar="P", help=f"index file (default: DIR/{INDEX_NAME} when present)")
    parser.add_argument("--header-prefix", action="store_true", help="the files hold only the start of each shard: skip the end-of-file test")
    parser.add_argument("--require-complete", action="store_true", help="an undecided check counts as a failure")
    parser.add_argument("--json", metavar="OUT", help="write every check, the totals and the category table here")
    parser.add_argument("--list-tensors", metavar="PATTERN", help="print name, dtype, shape, bytes, shard (tab-separated) of the "
                        "tensors on disk whose name matches this regular expression, instead of the report")
    parser.add_argument("--expect-fp8-block", nargs=2, type=int, metavar=("R", "C"), help="FP8 block the scale check expects (default: the config's)")
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
            print(f"dsv41 audit: --list-tensors {args.list_tensors!r} is not a regular expression ({exc})", file=sys.stderr)
            return 2
    try:
        report = run_audit(args.checkpoint_dir, args.config, args.index, args.header_prefix, args.require_complete,
                           tuple(args.expect_fp8_block) if args.expect_fp8_block else None)
    except AuditError as exc:
        print(f"dsv41 audit: {exc}", file=sys.stderr)
        return 1
    for _, why in report.unreadable:
        print(f"dsv41 audit: {why}", file=sys.stderr)
    if pattern is not None:
        rows = list_tensors(report, pattern)
        for row in rows:
            print("\t".join(str(x) for x in row))
        print(f"{len(rows)} tensor(s) match; audit: {report.passed} passed, {report.failed} failed, "
              f"{report.undecided} undecided", file=sys.stderr)
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
