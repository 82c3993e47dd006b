"""Vision (2): the vision tower, aligner and image markers are complete and shaped as the config says."""

from __future__ import annotations

from dsv41.checkpoint.audit.evidence import SHOWN, Tally, registry
from dsv41.checkpoint.inventory import is_vision_name

CHECKS, check = registry("Vision")


@check("vision.blocks", "all vision blocks, the patch embedding, the aligner and the image markers are present")
def _blocks(ctx):
    ev, t = ctx.ev, Tally(ctx.ev)
    n = 0
    for spec in ctx.specs:
        if is_vision_name(spec.name):
            n += 1
            t.present(spec.name)
    extra = sorted(name for name in ev.present if is_vision_name(name) and name not in ev.expected)
    for name in extra[:SHOWN]:
        t.fail(f"{name} is not part of a {ctx.cfg.vision_n_layers}-block vision tower")
    return t, f"{ctx.cfg.vision_n_layers} blocks, {n} tensors"


@check("vision.shapes", "the vision encoder and aligner shapes match the config")
def _shapes(ctx):
    t = Tally(ctx.ev)
    n = t.match_specs(s for s in ctx.specs if is_vision_name(s.name))
    return t, f"{n} tensors"
