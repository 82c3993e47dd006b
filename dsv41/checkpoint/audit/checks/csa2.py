"""CSA2 (5): the compressor and indexer tensors sit exactly on the layers the config makes
sources, and the Full / Reindex / Reuse partition they imply is the config's."""

from __future__ import annotations

from collections import Counter

from dsv41.checkpoint.audit.evidence import Tally, registry

CHECKS, check = registry("CSA2")


def _exactly_on(what: str, suffix: str, layers):
    def run(ctx):
        t = Tally(ctx.ev)
        t.exactly_on(what, suffix, layers(ctx.cfg), ctx.cfg.n_layers)
        return t, f"on {list(layers(ctx.cfg))}"

    return run


check("csa2.compressor", "attn.compressor.wkv exactly on kv_source_layers")(
    _exactly_on("compressor.wkv", "attn.compressor.wkv.weight", lambda cfg: cfg.kv_source_layers)
)
# the ratio-1 sources keep every position and so have nothing to gate
check("csa2.wgate", "attn.compressor.wgate exactly on the KV sources with ratio > 1")(
    _exactly_on(
        "compressor.wgate",
        "attn.compressor.wgate.weight",
        lambda cfg: [s for s in cfg.kv_source_layers if cfg.compress_ratios[s] > 1],
    )
)
check("csa2.index_keys", "attn.indexer.wk exactly on kv_source_layers")(
    _exactly_on("indexer.wk", "attn.indexer.wk.weight", lambda cfg: cfg.kv_source_layers)
)
check("csa2.index_queries", "attn.indexer.wq_b exactly on index_source_layers")(
    _exactly_on("indexer.wq_b", "attn.indexer.wq_b.weight", lambda cfg: cfg.index_source_layers)
)


@check("csa2.modes", "Full / Reindex / Reuse read from tensor presence partition the backbone as the config says")
def _modes(ctx):
    cfg, t = ctx.cfg, Tally(ctx.ev)
    for layer, mode in enumerate(ctx.ev.presence_modes(cfg.n_layers)):
        if mode is None:
            t.wait(f"layers.{layer}.attn.indexer.wq_b.weight")
        elif mode != cfg.layer_mode(layer):
            t.fail(f"layer {layer} holds a {mode} tensor set but the config makes it {cfg.layer_mode(layer)}")
    counts = Counter(cfg.layer_modes)
    return t, f"Full {counts['full']}, Reindex {counts['reindex']}, Reuse {counts['reuse']}"
