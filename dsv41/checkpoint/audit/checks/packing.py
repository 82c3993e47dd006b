"""Packing (3): byte extents tile each file, every quantized weight has a scale that blocks it
evenly, and the FP8 weights use the expected block."""

from __future__ import annotations

import os

from dsv41.checkpoint.audit.evidence import Tally, registry, verdict
from dsv41.checkpoint.audit.report import wrong
from dsv41.checkpoint.inventory import FP8, PACKED_FP4, SCALE

CHECKS, check = registry("Packing")


@check("packing.extents", "every tensor's byte extent matches its shape and dtype, and the extents tile each file")
def _extents(ctx):
    problems = [f"{os.path.basename(path)}: {p}" for path, ps in ctx.layout.items() for p in ps]
    return verdict(problems, f"{len(ctx.files)} file(s) tiled exactly")


@check("packing.scale_pairs", "every quantized weight has an F8_E8M0 scale, and each weight/scale pair blocks evenly")
def _scale_pairs(ctx):
    ev, t = ctx.ev, Tally(ctx.ev)
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
            t.fail(wrong(name, entry.dtype, SCALE, "not"))
        if w.dtype not in (FP8, PACKED_FP4):
            t.fail(f"{w.name} is {w.dtype} but has a scale")
            continue
        # packed FP4 holds two values a byte: [out, in/2] stores an [out, in] weight
        logical = (w.shape[0], w.shape[1] * 2) if w.dtype == PACKED_FP4 and len(w.shape) == 2 else w.shape
        if len(logical) != len(entry.shape) or not all(_blocks_evenly(a, b) for a, b in zip(logical, entry.shape)):
            t.fail(f"{name} {list(entry.shape)} does not tile {w.name} {list(logical)} with one block size")
    return t, f"{pairs:,} weight/scale pairs"


def _blocks_evenly(size: int, blocks: int) -> bool:
    """Whether one block size cuts `size` into exactly `blocks` blocks (the last may be short)."""
    if blocks <= 0:
        return size == 0
    step = -(-size // blocks)
    return step > 0 and -(-size // step) == blocks


def _fp8_title(ctx) -> str:
    return f"every FP8 weight outside the Engram tables uses a {ctx.block[0]}x{ctx.block[1]} block"


@check("packing.fp8_block", _fp8_title)
def _fp8_block(ctx):
    ev, t = ctx.ev, Tally(ctx.ev)
    rows, cols = ctx.block
    fp8_specs = {s.name for s in ctx.specs if s.dtype == FP8}
    names = set(fp8_specs)
    names.update(n for n, (e, _, _) in ev.headers.items() if e.dtype == FP8 and n.endswith(".weight"))
    names = sorted(n for n in names if ".engram.embed." not in n)
    for name in names:
        w = t.entry(name)
        s = t.entry(name[: -len("weight")] + "scale")
        if w and name in fp8_specs and w.dtype != FP8:
            # a block over a weight that is not FP8 means nothing (an I8 one would read as packed FP4)
            t.fail(wrong(name, w.dtype, FP8))
        elif w and s and (len(w.shape) != 2 or s.shape != (-(-w.shape[0] // rows), -(-w.shape[1] // cols))):
            t.fail(f"{s.name} {list(s.shape)} is not a {rows}x{cols} block over {list(w.shape)}")
    return t, f"{len(names):,} FP8 weights, {rows}x{cols} blocks"
