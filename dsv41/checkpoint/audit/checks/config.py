"""Config (13): relationships between config fields, before any tensor is looked at. Where
Config.verify() has the same rule, both use one Config helper; the wording here is the audit's."""

from __future__ import annotations

from dsv41.checkpoint.audit.evidence import need, registry, verdict
from dsv41.checkpoint.audit.report import PASS, wrong
from dsv41.checkpoint.inventory import REQUIRED_KEYS
from dsv41.core.config import distinct_ascending, inside

CHECKS, check = registry("Config")


def _required_title(ctx) -> str:
    title = f"the {len(REQUIRED_KEYS)} keys the tensor inventory is derived from are present"
    # values no checkpoint can have fail here too, and stop every other check (Config.value_problems)
    return title + ", with values a checkpoint can have" if ctx.value_problems else title


@check("config.required_keys", _required_title, False)
def _required(ctx):
    missing = [k for k in REQUIRED_KEYS if getattr(ctx.cfg, k) is None]
    problems = ([f"missing: {', '.join(missing)}"] if missing else []) + list(ctx.value_problems)
    return verdict(problems, f"all {len(REQUIRED_KEYS)} present")


@check("config.compress_ratios_length", "len(compress_ratios) == n_layers + n_mtp_layers", False)
def _ratio_len(ctx):
    cfg = ctx.cfg
    need(cfg, "compress_ratios", "n_layers", "n_mtp_layers")
    n = cfg.n_total_layers
    return verdict(
        [f"{len(cfg.compress_ratios)} entries for {n} layers"] if len(cfg.compress_ratios) != n else [], f"{n} entries"
    )


@check("config.mtp_uncompressed", "MTP layers read no compressed positions (compress_ratios[n_layers:] == 0)", False)
def _mtp(ctx):
    cfg = ctx.cfg
    need(cfg, "compress_ratios", "n_layers")
    tail = list(cfg.compress_ratios[cfg.n_layers :])
    return verdict(
        [f"compress_ratios[{cfg.n_layers}:] = {tail}"] if any(tail) else [],
        f"compress_ratios[{cfg.n_layers}:] = {tail}",
    )


@check("config.kv_within_index", "kv_source_layers is a subset of index_source_layers", False)
def _kv_index(ctx):
    cfg = ctx.cfg
    need(cfg, "kv_source_layers", "index_source_layers")
    extra = cfg.kv_sources_outside_index()
    return verdict(
        [f"KV sources {extra} are not index sources"] if extra else [],
        f"KV {list(cfg.kv_source_layers)} within index {list(cfg.index_source_layers)}",
    )


@check("config.sources_compress", "every source layer is a backbone layer that reads compressed positions", False)
def _sources(ctx):
    cfg = ctx.cfg
    need(cfg, "kv_source_layers", "index_source_layers", "compress_ratios", "n_layers")
    problems = []
    for layer in sorted(set(cfg.kv_source_layers) | set(cfg.index_source_layers)):
        if not 0 <= layer < cfg.n_layers:
            problems.append(f"source layer {layer} is outside the backbone")
        elif layer >= len(cfg.compress_ratios) or cfg.compress_ratios[layer] <= 0:
            problems.append(f"source layer {layer} has compress ratio 0")
    return verdict(problems, "every source has a ratio > 0")


@check("config.index_has_kv", "every index source has a KV source at or below it, at its ratio", False)
def _index_kv(ctx):
    cfg = ctx.cfg
    need(cfg, "kv_source_layers", "index_source_layers", "compress_ratios")
    ratios, problems = cfg.compress_ratios, []
    for layer, _, src in cfg.source_breaks(cfg.index_source_layers, kinds=("KV",)):
        if src is None:
            problems.append(f"index source {layer} has no KV source at or below it")
        else:
            problems.append(f"index source {layer} (ratio {ratios[layer]}) reads KV source {src} (ratio {ratios[src]})")
    return verdict(problems, "every index source reads a KV source of its ratio")


@check(
    "config.readers_have_sources",
    "every layer reading compressed positions has a KV and an index source at or before it, at its ratio",
    False,
)
def _readers(ctx):
    cfg = ctx.cfg
    need(cfg, "kv_source_layers", "index_source_layers", "compress_ratios", "n_layers")
    ratios, problems = cfg.compress_ratios, []
    readers = cfg.compressed_readers()
    for layer, kind, src in cfg.source_breaks(readers):
        if src is None:
            problems.append(f"layer {layer} has no {kind} source at or before it")
        else:
            problems.append(f"layer {layer} (ratio {ratios[layer]}) reads {kind} source {src} (ratio {ratios[src]})")
    return verdict(problems, f"{len(readers)} reading layers, each behind sources of its ratio")


@check("config.candidate_source", "candidate_source_layer is an index source with no KV source after it", False)
def _candidate(ctx):
    cfg = ctx.cfg
    need(cfg, "candidate_source_layer", "kv_source_layers", "index_source_layers")
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
    return verdict(problems, f"layer {c}, the last KV source")


@check("config.dspark_targets", "dspark_target_layer_ids are the last n_mtp_layers backbone layers", False)
def _dspark(ctx):
    cfg = ctx.cfg
    need(cfg, "dspark_target_layer_ids", "n_layers", "n_mtp_layers")
    want, got = list(cfg.expected_dspark_targets), list(cfg.dspark_target_layer_ids)
    return verdict([f"{got}, expected {want}"] if got != want else [], f"{got}")


@check("config.engram_sizes", "one Engram table size per Engram layer", False)
def _engram_sizes(ctx):
    cfg = ctx.cfg
    need(cfg, "engram_layer_ids", "engram_num_embeddings")
    a, b = len(cfg.engram_num_embeddings), len(cfg.engram_layer_ids)
    return verdict([f"{a} sizes for {b} layers"] if a != b else [], f"{a} sizes for {b} layers")


@check("config.engram_layers", "engram_layer_ids are distinct, ascending and inside the backbone", False)
def _engram_layers(ctx):
    cfg = ctx.cfg
    need(cfg, "engram_layer_ids", "n_layers")
    ids = list(cfg.engram_layer_ids)
    problems = []
    if not distinct_ascending(ids):
        problems.append(f"{ids} are not distinct and ascending")
    if not inside(ids, cfg.n_layers):
        problems.append(f"{ids} reach outside [0, {cfg.n_layers})")
    return verdict(problems, f"{ids}")


@check("config.engram_vocab", "engram_compressed_vocab_size is set (every hash multiplier derives from it)", False)
def _engram_vocab(ctx):
    v = ctx.cfg.engram_compressed_vocab_size
    ok = isinstance(v, int) and v > 0
    return verdict([] if ok else [f"engram_compressed_vocab_size is {v!r}"], f"{v}")


@check(
    "config.quantization", "dense linears are fp8 and routed experts fp4, the formats the packing checks read", False
)
def _quantization(ctx):
    cfg = ctx.cfg
    problems = []
    if cfg.dtype != "fp8":
        problems.append(wrong("dtype (quantization)", repr(cfg.dtype), repr("fp8"), "not"))
    if cfg.expert_dtype != "fp4":
        problems.append(wrong("expert_dtype", repr(cfg.expert_dtype), repr("fp4"), "not"))
    return verdict(problems, f"fp8 with {ctx.block[0]}x{ctx.block[1]} blocks, experts fp4")
