"""The complete tensor list a checkpoint in the release layout holds for a config.

Names, safetensors dtypes, shapes, byte sizes, report categories and shard files, derived from the
config alone. For the released geometry this is 96,085 tensors and 510,286,023,000 bytes in 48
shards; the header audit compares what is on disk against it, and the header synthesizer and the
tiny-checkpoint writer lay their files out from it.

Standard library plus dsv41.core.config only: the audit imports this and must run without torch.

Storage rules (what the release keeps on disk, which is not always what the runtime computes in):
- Linear layers of the dense tree: F8_E4M3 [out, in] plus an F8_E8M0 scale per weight block
  (32 x 32 in the release) -> scale [ceil(out/32), ceil(in/32)].
- Routed experts: FP4 E2M1, two values per byte, stored as I8 [out, in/2] with one F8_E8M0 scale
  per 32 values along the input dim -> scale [out, in/32].
- Engram tables: F8_E4M3 [rows, head_dim] with one F8_E8M0 scale per row and 32 columns.
- Everything unquantized is stored in the storage dtype (BF16), except the tensors the runtime
  declares FP32 and the release keeps FP32: attn_sink, the hyper-connection tensors and the router
  biases. A few tensors the runtime promotes to FP32 (ratio-2 compressor.wkv/wgate, head.weight,
  confidence_head.proj, the vision RMSNorm weights) are BF16 on disk.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import NamedTuple

from dsv41.core.config import Config, ConfigError

# Bytes per element of each safetensors dtype name. I8 holds two packed FP4 values; its element
# count is the stored (packed) shape, so no special case is needed here.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FP8, SCALE, PACKED_FP4, F32 = "F8_E4M3", "F8_E8M0", "I8", "F32"
FP4_BLOCK = 32  # one E8M0 scale per 32 FP4 values along the input dim
ENGRAM_ROW_BLOCK = 32  # one E8M0 scale per 32 columns of an Engram table row

# Report categories, in the order the release's inventory table lists them (largest first).
ROUTED, ENGRAM, ATTENTION, EMBED_HEAD, SHARED, VISION, MTP, NORMS_HC = (
    "routed experts",
    "Engram",
    "attention",
    "embedding and head",
    "shared experts",
    "vision and aligner",
    "MTP / DSpark",
    "norms and hyper-connections",
)
CATEGORIES = (ROUTED, ENGRAM, ATTENTION, EMBED_HEAD, SHARED, VISION, MTP, NORMS_HC)
OTHER = "other"

# The config fields the inventory (and so the audit) is derived from.
REQUIRED_KEYS = (
    "vocab_size",
    "dim",
    "moe_inter_dim",
    "n_layers",
    "n_mtp_layers",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "n_heads",
    "n_routed_experts",
    "n_shared_experts",
    "q_lora_rank",
    "head_dim",
    "o_groups",
    "o_lora_rank",
    "kv_source_layers",
    "index_source_layers",
    "index_n_heads",
    "index_head_dim",
    "candidate_source_layer",
    "hc_mult",
    "engram_layer_ids",
    "engram_vocab_size",
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_compressed_vocab_size",
    "dtype",
    "expert_dtype",
    "compress_ratios",
    "vision_n_layers",
    "vision_dim",
    "vision_inter_dim",
    "vision_patch_size",
    "vision_downsample_ratio",
)

IMAGE_MARKERS = ("image_start", "image_newline", "image_end")  # is_vision_name knows them by "image_"


class TensorSpec(NamedTuple):
    # a NamedTuple, not a dataclass: the released inventory builds 96,085 of these per call
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    category: str
    shard: str  # file name inside the checkpoint directory

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def shard_file_name(number: int, total: int) -> str:
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def _refuse_absurd(cfg: Config) -> None:
    """ConfigError (a ValueError) naming the first value verify() rejects as impossible, before
    anything enumerates the config: n_layers = 10**9 would otherwise build billions of specs. The
    relationships verify() also checks do not stop an inventory (the audit compares a config that
    breaks them with the tensors on disk)."""
    problems = cfg.value_problems()
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"{cfg.source or 'the config'}: {problems[0]}{more}; no tensor inventory is derived "
            "from it until it is fixed"
        )


def shard_contents(cfg: Config) -> list[tuple[str, str]]:
    """(shard file name, what it holds), in file order: vision and aligner; embedding and image
    markers; one per backbone layer; head and final norm; one per MTP layer; one per Engram table."""
    _refuse_absurd(cfg)
    parts = []
    if cfg.vision_n_layers:
        parts.append("vision and aligner")
    parts.append("embedding" + (" and image markers" if cfg.vision_n_layers else ""))
    parts += [f"layer {i}" for i in range(cfg.n_layers)]
    parts.append("head and norm")
    parts += [f"mtp {m}" for m in range(cfg.n_mtp_layers)]
    parts += [f"Engram table of layer {i}" for i in cfg.engram_layer_ids or ()]
    return [(shard_file_name(k, len(parts)), what) for k, what in enumerate(parts, start=1)]


def shard_names(cfg: Config) -> list[str]:
    return [name for name, _ in shard_contents(cfg)]


def is_vision_name(name: str) -> bool:
    """Whether a tensor belongs to the vision tower: the encoder, the aligner or an image marker."""
    return name.startswith(("vision.", "aligner.", "image_"))


def category_of(name: str) -> str:
    """The report category of a tensor name. The release's table puts attn_norm with attention
    and the router (ffn.gate.*) with norms and hyper-connections: that is the only split of the
    per-layer small tensors that reproduces its counts and bytes (603 / 4.80 GiB attention,
    400 / 0.29 GiB norms and hyper-connections; the BF16 router weight is most of the latter)."""
    if is_vision_name(name):
        return VISION  # the release's 266: 259 vision + 4 aligner + the 3 image markers
    if name in ("embed.weight", "head.weight", "norm.weight"):
        return EMBED_HEAD
    match = _LAYER_RE.match(name)
    if not match:
        return OTHER
    namespace, rest = match.group(1), match.group(3)
    if rest.startswith("ffn.experts."):
        return ROUTED  # MTP layers' routed experts included: the release counts them here
    if namespace == "mtp":
        return MTP
    if rest.startswith("engram."):
        return ENGRAM
    if rest.startswith("ffn.shared_experts."):
        return SHARED
    if rest.startswith(("attn.", "attn_norm.")):
        return ATTENTION
    return NORMS_HC


_LAYER_RE = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")


def layer_of(name: str) -> tuple[str, int] | None:
    """('layers', i) or ('mtp', m) for a per-layer tensor name, else None."""
    match = _LAYER_RE.match(name)
    return (match.group(1), int(match.group(2))) if match else None


# ---------------------------------------------------------------------- Engram rows
def derived_engram_rows(cfg: Config) -> tuple[int, ...]:
    """Rows each Engram table needs, from the one prime layout (dsv41.checkpoint.engram, standard library)."""
    from dsv41.checkpoint.engram import EngramLayout

    return EngramLayout.from_config(cfg).derived_num_embeddings


# ---------------------------------------------------------------------- the inventory
def expected_tensors(cfg: Config) -> list[TensorSpec]:
    """Every tensor of a checkpoint in the release layout, in shard order.

    The config must state every field in REQUIRED_KEYS; engram_num_embeddings in particular must be
    filled (the tiny preset leaves it to the writer: derived_engram_rows gives it)."""
    missing = [k for k in REQUIRED_KEYS if getattr(cfg, k) is None]
    if missing:
        raise ValueError(f"the config does not state {', '.join(missing)}, which the tensor inventory needs")
    _refuse_absurd(cfg)
    if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
        raise ValueError(
            f"{len(cfg.engram_num_embeddings)} Engram row counts for {len(cfg.engram_layer_ids)} Engram layers"
        )
    try:
        # fp8_block is read from a field that takes no part in Config equality, so it joins the key
        key = (cfg, cfg.fp8_block)
        hash(key)
    except TypeError:  # a config holding an unhashable value: build without the cache
        return _Builder(cfg).build()
    if key not in _CACHE:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = tuple(_Builder(cfg).build())
    return list(_CACHE[key])


_CACHE: dict = {}  # a few recent configs: notebooks and the audit ask for the same inventory often


def expected_by_name(cfg: Config) -> dict[str, TensorSpec]:
    return {spec.name: spec for spec in expected_tensors(cfg)}


def category_totals(specs) -> dict[str, tuple[int, int]]:
    """category -> (tensors, bytes), in CATEGORIES order (plus 'other' if anything is uncategorized)."""
    counts, sizes = Counter(), Counter()
    for spec in specs:
        counts[spec.category] += 1
        sizes[spec.category] += spec.nbytes
    order = list(CATEGORIES) + sorted(set(counts) - set(CATEGORIES))
    return {c: (counts[c], sizes[c]) for c in order if c in counts or c in CATEGORIES}


def _storage_dtype(cfg: Config) -> str:
    return {"float32": "F32", "float16": "F16"}.get(cfg.param_dtype or "bfloat16", "BF16")


class _Builder:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dense = _storage_dtype(cfg)
        self.block_rows, self.block_cols = cfg.fp8_block
        self.shards = shard_names(cfg)
        self.out: list[TensorSpec] = []
        self.shard = ""

    def add(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.out.append(TensorSpec(name, dtype, tuple(map(int, shape)), category_of(name), self.shard))

    def linear(self, name: str, in_features: int, out_features: int, kind: str = "default") -> None:
        """kind: 'default' follows cfg.dtype (FP8 or the storage dtype), 'fp4' follows
        cfg.expert_dtype, 'dense' is always the storage dtype."""
        if kind == "fp4" and self.cfg.expert_dtype == "fp4":
            self.add(f"{name}.weight", PACKED_FP4, (out_features, in_features // 2))
            self.add(f"{name}.scale", SCALE, (out_features, in_features // FP4_BLOCK))
        elif kind != "dense" and (self.cfg.dtype == "fp8" or (kind == "fp4" and self.cfg.expert_dtype == "fp8")):
            self.add(f"{name}.weight", FP8, (out_features, in_features))
            self.add(f"{name}.scale", SCALE, (-(-out_features // self.block_rows), -(-in_features // self.block_cols)))
        else:
            self.add(f"{name}.weight", self.dense, (out_features, in_features))

    def build(self) -> list[TensorSpec]:
        cfg, shards = self.cfg, iter(self.shards)
        if cfg.vision_n_layers:
            self.shard = next(shards)
            self.vision()
        self.shard = next(shards)
        self.add("embed.weight", self.dense, (cfg.vocab_size, cfg.dim))
        if cfg.vision_n_layers:
            for name in IMAGE_MARKERS:
                self.add(name, self.dense, (cfg.dim,))
        for layer in range(cfg.n_layers):
            self.shard = next(shards)
            self.block(f"layers.{layer}.", layer)
        self.shard = next(shards)
        self.add("head.weight", self.dense, (cfg.vocab_size, cfg.dim))
        self.add("norm.weight", self.dense, (cfg.dim,))
        for stage in range(cfg.n_mtp_layers):
            self.shard = next(shards)
            self.mtp(stage)
        # Engram tables ship in their own shards but keep their layer's names
        for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
            self.shard = next(shards)
            self.engram(layer, rows)
        return self.out

    def block(self, p: str, layer: int) -> None:
        cfg, dense = self.cfg, self.dense
        mix_hc, hc_dim = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        for sub in ("attn", "ffn"):
            self.add(f"{p}hc_{sub}_fn", F32, (mix_hc, hc_dim))
            self.add(f"{p}hc_{sub}_base", F32, (mix_hc,))
            self.add(f"{p}hc_{sub}_scale", F32, (3,))  # pre, post, comb
        self.add(f"{p}attn_norm.weight", dense, (cfg.dim,))
        self.add(f"{p}ffn_norm.weight", dense, (cfg.dim,))

        a = f"{p}attn."
        self.add(f"{a}attn_sink", F32, (cfg.n_heads,))
        self.linear(f"{a}wq_a", cfg.dim, cfg.q_lora_rank)
        self.add(f"{a}q_norm.weight", dense, (cfg.q_lora_rank,))
        self.linear(f"{a}wq_b", cfg.q_lora_rank, cfg.n_heads * cfg.head_dim)
        self.linear(f"{a}wkv", cfg.dim, cfg.head_dim)
        self.add(f"{a}kv_norm.weight", dense, (cfg.head_dim,))
        # wo_a is block-diagonal over o_groups: each group maps its heads to o_lora_rank
        self.linear(f"{a}wo_a", cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.linear(f"{a}wo_b", cfg.o_groups * cfg.o_lora_rank, cfg.dim)
        # compressor and indexer exist only on backbone sources; MTP layers never have them
        if layer < cfg.n_layers and layer in cfg.kv_source_layers:
            ratio = cfg.compress_ratios[layer] if layer < len(cfg.compress_ratios) else 0
            self.linear(f"{a}compressor.wkv", cfg.dim, cfg.head_dim, "dense")
            self.add(f"{a}compressor.norm.weight", dense, (cfg.head_dim,))
            if ratio > 1:  # ratio 1 has no group to pool, so no gate
                self.linear(f"{a}compressor.wgate", cfg.dim, cfg.head_dim, "dense")
        if layer < cfg.n_layers and layer in cfg.index_source_layers:
            self.linear(f"{a}indexer.wq_b", cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
            self.linear(f"{a}indexer.weights_proj", cfg.dim, cfg.index_n_heads, "dense")
            if layer in cfg.kv_source_layers:  # index keys come from this layer's own latent
                self.linear(f"{a}indexer.wk", cfg.head_dim, cfg.index_head_dim, "dense")
                self.add(f"{a}indexer.k_norm.weight", dense, (cfg.index_head_dim,))

        # MTP layers route over dspark_n_routed_experts, router included: [128, ...] tensors there
        # are what makes the released byte total close
        n_experts, _ = cfg.moe_shape(layer)
        self.add(f"{p}ffn.gate.weight", dense, (n_experts, cfg.dim))
        self.add(f"{p}ffn.gate.bias", F32, (n_experts,))
        if cfg.vision_n_layers:  # the image-span routing bias exists only with a vision tower
            self.add(f"{p}ffn.gate.bias_vl", F32, (n_experts,))
        for e in range(n_experts):
            self.expert(f"{p}ffn.experts.{e}", "fp4")
        if cfg.n_shared_experts:
            self.expert(f"{p}ffn.shared_experts", "default")

    def expert(self, p: str, kind: str) -> None:
        cfg = self.cfg
        self.linear(f"{p}.w1", cfg.dim, cfg.moe_inter_dim, kind)  # gate branch
        self.linear(f"{p}.w2", cfg.moe_inter_dim, cfg.dim, kind)  # down
        self.linear(f"{p}.w3", cfg.dim, cfg.moe_inter_dim, kind)  # up

    def mtp(self, stage: int) -> None:
        cfg = self.cfg
        p = f"mtp.{stage}."
        self.block(p, cfg.n_layers + stage)
        if stage == 0:  # the first stage projects the concatenated target-layer hiddens
            self.linear(f"{p}main_proj", cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim)
            self.add(f"{p}main_norm.weight", self.dense, (cfg.dim,))
        if stage == cfg.n_mtp_layers - 1:  # only the last stage carries the draft heads
            self.add(f"{p}markov_head.embed.weight", self.dense, (cfg.vocab_size, cfg.dspark_markov_rank))
            self.add(f"{p}markov_head.head.weight", self.dense, (cfg.vocab_size, cfg.dspark_markov_rank))
            self.linear(f"{p}confidence_head.proj", cfg.dim + cfg.dspark_markov_rank, 1, "dense")
            self.add(f"{p}norm.weight", self.dense, (cfg.dim,))

    def engram(self, layer: int, rows: int) -> None:
        cfg = self.cfg
        p = f"layers.{layer}.engram."
        self.add(f"{p}embed.weight", FP8, (rows, cfg.engram_head_dim))
        self.add(f"{p}embed.scale", SCALE, (rows, cfg.engram_head_dim // ENGRAM_ROW_BLOCK))
        n_hash_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        # one key per hyper-connection copy plus one shared value
        self.linear(f"{p}wkv", n_hash_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1))
        self.add(f"{p}q_weight", self.dense, (cfg.hc_mult, cfg.dim))
        self.add(f"{p}k_weight", self.dense, (cfg.hc_mult, cfg.dim))

    def vision(self) -> None:
        cfg, dense = self.cfg, self.dense
        v = cfg.vision_dim
        # The vision RMSNorm weights are BF16 on disk although the module declares FP32: with FP32
        # the released total comes out 133,120 bytes over 510,286,023,000, exactly their
        # 65 x 1024 x 2 extra bytes, and nothing else in the tree accounts for that difference.
        self.add("vision.patch_embed.proj.weight", dense, (v, 3 * cfg.vision_patch_size**2))
        self.add("vision.patch_embed.proj.bias", dense, (v,))
        for b in range(cfg.vision_n_layers):
            p = f"vision.blocks.{b}."
            self.add(f"{p}norm1.weight", dense, (v,))
            self.add(f"{p}attn.wqkv.weight", dense, (3 * v, v))
            self.add(f"{p}attn.wqkv.bias", dense, (3 * v,))
            self.add(f"{p}attn.wo.weight", dense, (v, v))
            self.add(f"{p}attn.wo.bias", dense, (v,))
            self.add(f"{p}norm2.weight", dense, (v,))
            self.add(f"{p}mlp.w1.weight", dense, (2 * cfg.vision_inter_dim, v))  # gate and up, fused
            self.add(f"{p}mlp.w2.weight", dense, (v, cfg.vision_inter_dim))
        self.add("vision.norm.weight", dense, (v,))
        unshuffled = v * cfg.vision_downsample_ratio**2
        self.add("aligner.w1.weight", dense, (cfg.dim, unshuffled))
        self.add("aligner.w1.bias", dense, (cfg.dim,))
        self.add("aligner.w2.weight", dense, (cfg.dim, cfg.dim))
        self.add("aligner.w2.bias", dense, (cfg.dim,))
