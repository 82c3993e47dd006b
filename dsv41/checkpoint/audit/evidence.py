"""What the headers and the index say about each tensor, and how a check turns that into a verdict."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

from dsv41.checkpoint.audit.report import FAIL, PASS, UNDECIDED, ShardFile, describe_shards, wrong
from dsv41.checkpoint.headers import HeaderEntry
from dsv41.checkpoint.inventory import TensorSpec, layer_of
from dsv41.core.config import Config

SHOWN = 4  # problems quoted per check before "... and N more"

_EXPERT_RE = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.")


class Evidence:
    """What is known about each tensor name: its header entry if a local shard has it, whether it
    is present at all (the index decides presence when there is one), and which shard to wait on."""

    def __init__(
        self,
        expected: dict[str, TensorSpec],
        headers: dict[str, tuple[HeaderEntry, str, str]],
        index_map: dict[str, str] | None,
        on_disk: set[str],
        layer_shards: dict[tuple[str, int], str],
        unreadable: set[str],
    ):
        self.expected = expected
        self.headers = headers  # name -> (entry, shard, path)
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
        """True or False when known, None while the shard that would decide it is not on disk."""
        if name in self.headers:
            return True
        if self.index_map is not None:
            return name in self.index_map
        where = self.location(name)
        return None if where is not None and where not in self.on_disk else False

    def presence_modes(self, n_layers: int) -> list[str | None]:
        """Each backbone layer's CSA2 mode as its tensors show it: Full owns indexer.wk, Reindex
        owns indexer.wq_b only, Reuse neither; None while unknown."""
        modes = []
        for layer in range(n_layers):
            wk, wq = (self.presence(f"layers.{layer}.attn.indexer.{n}.weight") for n in ("wk", "wq_b"))
            if wk:
                modes.append("full")
            elif wk is None or wq is None:
                modes.append(None)
            else:
                modes.append("reindex" if wq else "reuse")
        return modes


def spec_mismatch(spec: TensorSpec, e: HeaderEntry, name_what_differs: bool = False) -> str | None:
    """None when the header entry has the spec's dtype and shape. Otherwise a sentence quoting
    both (name_what_differs: only the one that differs). The dtype matters as much as the shape:
    an I8 tensor where the config puts an F8_E4M3 one has the same shape and byte size, and the
    loader rejects it."""
    dtype_ok, shape_ok = e.dtype == spec.dtype, tuple(e.shape) == tuple(spec.shape)
    if dtype_ok and shape_ok:
        return None
    if name_what_differs and dtype_ok:
        return wrong(spec.name, list(e.shape), list(spec.shape))
    if name_what_differs and shape_ok:
        return wrong(spec.name, e.dtype, spec.dtype)
    return wrong(spec.name, f"{e.dtype} {list(e.shape)}", f"{spec.dtype} {list(spec.shape)}")


def verdict(problems: list[str], passed: str) -> tuple[str, str]:
    if problems:
        return FAIL, "; ".join(problems[:SHOWN]) + (
            f"; ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        )
    return PASS, passed


class Tally:
    """Collects one check's evidence: failures win, then waits, else a pass."""

    def __init__(self, ev: Evidence):
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

    def match_specs(self, specs: Iterable[TensorSpec], name_what_differs: bool = False) -> int:
        """Compares each spec's header entry with it; returns how many specs there were."""
        n = 0
        for spec in specs:
            n += 1
            e = self.entry(spec.name)
            problem = e and spec_mismatch(spec, e, name_what_differs)
            if problem:
                self.fail(problem)
        return n

    def exactly_on(self, what: str, suffix: str, expected_layers, n_layers: int) -> None:
        """layers.N.SUFFIX is present on the expected layers and on no other."""
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
            status, detail = verdict(self.problems, passed)
            return status, detail, []
        if self.waits:
            waits = sorted(self.waits)
            return UNDECIDED, f"waits on {describe_shards(waits)}", waits
        return PASS, passed, []


@dataclass
class Context:
    """Everything a check may read."""

    cfg: Config
    ev: Evidence
    specs: list[TensorSpec]  # the config's inventory, in inventory order
    block: tuple[int, int]  # the FP8 block the packing checks expect
    files: list[ShardFile]
    layout: dict[str, list[str]]  # path -> how its extents fail to tile it
    index_problem: str | None  # why the index cannot be used, when it cannot
    index_total: int | None  # the index's metadata.total_size
    duplicated_names: dict[str, list[str]]  # tensor name -> every file defining it, when more than one
    inventory_error: str | None  # why the inventory cannot be derived from this config
    value_problems: list[str] = field(default_factory=list)  # Config.value_problems(): nothing else runs


class Missing(Exception):
    """The config does not state a field the check needs."""


def need(cfg: Config, *names: str) -> None:
    absent = [n for n in names if getattr(cfg, n) is None]
    if absent:
        raise Missing(f"cannot be evaluated: the config does not state {', '.join(absent)}")


class Check(NamedTuple):
    id: str
    group: str
    title: str | Callable[[Context], str]  # a callable words the title from the context
    run: Callable  # ctx -> (Tally, detail if it passes) or (status, detail)
    needs_inventory: bool  # fails "not evaluated" when the inventory cannot be derived
    needs_index: bool  # left out of the report when there is no index


def registry(group: str) -> tuple[list[Check], Callable]:
    """A group's checks, in report order, and the decorator that registers one."""
    checks: list[Check] = []

    def check(cid: str, title, needs_inventory: bool = True, needs_index: bool = False):
        def register(fn):
            checks.append(Check(cid, group, title, fn, needs_inventory, needs_index))
            return fn

        return register

    return checks, check
