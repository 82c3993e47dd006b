"""DSpark (3): the MTP draft stages carry what the config gives each of them."""

from __future__ import annotations

from dsv41.checkpoint.audit.evidence import SHOWN, Tally, registry
from dsv41.checkpoint.inventory import ROUTED

CHECKS, check = registry("DSpark")


@check("dspark.heads", "the Markov and confidence heads match the config")
def _heads(ctx):
    cfg, t = ctx.cfg, Tally(ctx.ev)
    last = f"mtp.{cfg.n_mtp_layers - 1}."
    heads = (f"{last}markov_head.", f"{last}confidence_head.", f"{last}norm.")
    n = t.match_specs(s for s in ctx.specs if s.name.startswith(heads))
    return t, f"{n} head tensors, Markov rank {cfg.dspark_markov_rank}"


@check("dspark.main_proj", "main_proj takes len(dspark_target_layer_ids) x dim = n_mtp_layers x dim inputs")
def _main_proj(ctx):
    cfg, t = ctx.cfg, Tally(ctx.ev)
    if len(cfg.dspark_target_layer_ids) != cfg.n_mtp_layers:
        t.fail(f"{len(cfg.dspark_target_layer_ids)} target layers for {cfg.n_mtp_layers} MTP layers")
    t.match_specs(s for s in ctx.specs if s.name.startswith("mtp.0.main_proj."))
    return t, f"[{cfg.dim}, {len(cfg.dspark_target_layer_ids) * cfg.dim}]"


@check(
    "dspark.stages",
    "every MTP layer carries attention and FFN; only the first has main_proj/main_norm, only the last the heads",
)
def _stages(ctx):
    ev, t = ctx.ev, Tally(ctx.ev)
    for spec in ctx.specs:
        if spec.name.startswith("mtp.") and spec.category != ROUTED:
            t.present(spec.name)
    extra = sorted(n for n in ev.present if n.startswith("mtp.") and n not in ev.expected)
    for name in extra[:SHOWN]:
        t.fail(f"{name} is on a stage the config does not give it")
    return t, f"{ctx.cfg.n_mtp_layers} stages"
