"""Inventory (4): every tensor the config implies is present at its dtype and shape, and nothing else is."""

from __future__ import annotations

import os
from collections import defaultdict

from dsv41.checkpoint.audit.evidence import SHOWN, Tally, registry, verdict
from dsv41.checkpoint.audit.report import wrong
from dsv41.checkpoint.inventory import ENGRAM, layer_of

CHECKS, check = registry("Inventory")


@check(
    "inventory.layer_sets",
    "every backbone layer has its full tensor set, and nothing lies outside the config's inventory",
)
def _layer_sets(ctx):
    ev, t = ctx.ev, Tally(ctx.ev)
    missing = defaultdict(list)  # "layers.5" (or the name itself outside a layer) -> missing names
    for spec in ctx.specs:
        if spec.name not in ev.present:
            if ev.presence(spec.name) is None:
                t.wait(spec.name)
            else:
                layer = layer_of(spec.name)
                missing[f"{layer[0]}.{layer[1]}" if layer else spec.name].append(spec.name)
    for where, names in missing.items():
        t.fail(
            f"{where}: {len(names)} tensor(s) missing, e.g. {names[0]}" if names[0] != where else f"{where} is missing"
        )
    extra = sorted(ev.present - set(ev.expected))
    for name in extra[:SHOWN]:
        t.fail(f"{name} is not in the config's inventory")
    if len(extra) > SHOWN:
        t.fail(f"{len(extra) - SHOWN} more tensors outside the inventory")
    for name, paths in sorted(ctx.duplicated_names.items())[:SHOWN]:
        t.fail(f"{name} is defined in {len(paths)} files: {', '.join(os.path.basename(p) for p in paths)}")
    return t, f"{len(ctx.specs):,} tensors, every layer complete"


@check("inventory.shapes", "tensor dtypes and shapes match the config (the Engram checks own the Engram tensors)")
def _shapes(ctx):
    t = Tally(ctx.ev)
    t.match_specs((s for s in ctx.specs if s.category != ENGRAM), name_what_differs=True)
    return t, "every dtype and shape as the config implies"


@check("inventory.unquantized", "the F32/BF16 tensors are stored unquantized, in their dtype")
def _unquantized(ctx):
    ev, t = ctx.ev, Tally(ctx.ev)
    n = 0
    for spec in ctx.specs:
        if spec.dtype in ("F32", "BF16", "F16") and spec.category != ENGRAM:
            n += 1
            e = t.entry(spec.name)
            if e and e.dtype != spec.dtype:
                t.fail(wrong(spec.name, e.dtype, spec.dtype))
            if spec.name.endswith(".weight") and ev.presence(spec.name[: -len("weight")] + "scale"):
                t.fail(f"{spec.name} has a scale beside it")
    return t, f"{n:,} unquantized tensors in their dtype"


@check("inventory.nonempty", "the tensor count and byte total on disk are non-zero")
def _nonempty(ctx):
    n = sum(f.tensors for f in ctx.files)
    size = sum(f.bytes for f in ctx.files)
    return verdict([] if n and size else [f"{n} tensors, {size} bytes"], f"{n:,} tensors, {size:,} bytes")
