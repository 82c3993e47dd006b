"""Engram (5): where the hashed n-gram tables sit, their rows, dtypes and scale blocks."""

from __future__ import annotations

from dsv41.checkpoint.audit.evidence import Tally, need, registry, verdict
from dsv41.checkpoint.inventory import ENGRAM, ENGRAM_ROW_BLOCK, derived_engram_rows

CHECKS, check = registry("Engram")


def _is_table(name: str) -> bool:
    return ".engram.embed." in name


@check("engram.placement", "the Engram tables sit on exactly engram_layer_ids")
def _placement(ctx):
    t = Tally(ctx.ev)
    t.exactly_on("an Engram table", "engram.embed.weight", ctx.cfg.engram_layer_ids, ctx.cfg.n_layers)
    return t, f"tables on layers {list(ctx.cfg.engram_layer_ids)}"


@check(
    "engram.projections",
    "each Engram layer has its gate and value projections (wkv, q_weight, k_weight) at the config's dtypes and shapes",
)
def _projections(ctx):
    t = Tally(ctx.ev)
    t.match_specs(s for s in ctx.specs if s.category == ENGRAM and not _is_table(s.name))
    return t, f"wkv, q_weight and k_weight on {len(ctx.cfg.engram_layer_ids)} layers"


@check("engram.rows", "the declared table rows equal what the prime bucket layout derives", False)
def _rows(ctx):
    cfg = ctx.cfg
    need(
        cfg, "engram_layer_ids", "engram_num_embeddings", "engram_vocab_size", "engram_max_ngram_size", "engram_n_heads"
    )
    declared, derived = list(cfg.engram_num_embeddings), list(derived_engram_rows(cfg))
    text = f"declared={declared} derived={derived}"
    return verdict([text] if declared != derived else [], text)


@check("engram.dtype", "the tables are F8_E4M3 [rows, engram_head_dim] with F8_E8M0 scales, at the declared rows")
def _dtype(ctx):
    t = Tally(ctx.ev)
    t.match_specs(s for s in ctx.specs if _is_table(s.name))
    return t, "F8_E4M3 tables, F8_E8M0 scales"


@check("engram.row_block", f"the tables use a 1x{ENGRAM_ROW_BLOCK} per-row scale block")
def _row_block(ctx):
    t = Tally(ctx.ev)
    for layer in ctx.cfg.engram_layer_ids:
        w, s = t.entry(f"layers.{layer}.engram.embed.weight"), t.entry(f"layers.{layer}.engram.embed.scale")
        # [rows, head_dim] table, [rows, ceil(head_dim / 32)] scale
        if (
            w
            and s
            and (len(w.shape) != 2 or len(s.shape) != 2 or s.shape != (w.shape[0], -(-w.shape[1] // ENGRAM_ROW_BLOCK)))
        ):
            t.fail(
                f"layer {layer}: scale {list(s.shape)} for table {list(w.shape)} is not a 1x{ENGRAM_ROW_BLOCK} block"
            )
    return t, f"1x{ENGRAM_ROW_BLOCK} on every table"
