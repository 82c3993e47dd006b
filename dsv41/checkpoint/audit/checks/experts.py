"""Experts (3): the routed experts are FP4-packed, and each layer has as many as the config says."""

from __future__ import annotations

from dsv41.checkpoint.audit.evidence import SHOWN, Tally, registry
from dsv41.checkpoint.inventory import FP4_BLOCK, ROUTED

CHECKS, check = registry("Experts")


@check("experts.fp4", f"routed w1/w2/w3 are FP4 packed in I8 with an F8_E8M0 scale per {FP4_BLOCK} along K")
def _fp4(ctx):
    t = Tally(ctx.ev)
    n = t.match_specs(s for s in ctx.specs if s.category == ROUTED)
    return t, f"{n:,} routed-expert tensors"


def _count_experts(ctx, namespace: str, layers, n_expected: int) -> Tally:
    t = Tally(ctx.ev)
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


@check("experts.backbone_count", "every backbone layer has n_routed_experts routed experts")
def _backbone(ctx):
    n = ctx.cfg.n_routed_experts
    return _count_experts(ctx, "layers", range(ctx.cfg.n_layers), n), f"{n} on each of {ctx.cfg.n_layers} layers"


@check("experts.mtp_count", "every MTP layer has dspark_n_routed_experts routed experts")
def _mtp(ctx):
    cfg = ctx.cfg
    n = cfg.moe_shape(cfg.n_layers)[0]
    return _count_experts(ctx, "mtp", range(cfg.n_mtp_layers), n), f"{n} on each of {cfg.n_mtp_layers} MTP layers"
