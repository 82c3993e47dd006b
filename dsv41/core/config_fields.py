"""The config schema as one table: per field its canonical name, JSON type, place in the nested
config.json, presence in the flat file, value bound and runtime default (`FIELDS`), and what is
derived from it: the alias map between the two layouts and the bounds `Config.value_problems`
checks. `config.Config` and `config.VerifiedConfig` write the fields out, so that an editor finds
them; tests/test_config.py holds their names, types and defaults to this table.

Standard library only: the header audit imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

T, V, Q = "text_config", "vision_config", "quantization_config"


# ---------------------------------------------------------------------- the field table
@dataclass(frozen=True)
class Field:
    """One schema field: its canonical (flat) name, its JSON type, where the nested config.json keeps
    it, whether the flat file has it, the bound `value_problems` holds it to, and the value runtime
    code reads where a file is silent on it (`Config.verified`; None: no default).

    `bound` by kind: an int's (lowest, highest); a list's largest entry; a float's (relation, lowest,
    highest or None), where relation ">" excludes the lowest and ">=" admits it."""

    name: str
    kind: str  # "int" | "float" | "str" | "bool" | "tuple[int, ...]" | "tuple[str, ...]"
    nested: tuple[str, ...]
    bound: Any = None
    flat: bool = True
    default: Any = None

    @property
    def annotation(self) -> str:
        return f"{self.kind} | None"

    @property
    def may_be_absent(self) -> bool:
        """Whether a config the runtime accepts may still lack it (no default, and either only the
        nested file states it or null means something: vision_max_wh_ratio, no limit)."""
        return self.default is None and (not self.flat or self.name in NULLABLE)


# ---------------------------------------------------------------------- value bounds
# verify() rejects values no checkpoint can have before it looks at any relationship, and the
# tensor inventory (so the audit, make-headers and the loader) refuses a config that fails them,
# because every consumer enumerates the config: n_layers = 10**9 makes the inventory list billions
# of tensors, n_mtp_layers = 2**37 a 2**37-entry tuple of DSpark targets, o_groups = 0 a division by
# zero. Each ceiling is the released value times a generous factor (about 16-64x, rounded to a
# power of two; the released value is in the comment), so a successor several times the release's
# size still verifies while nothing absurd does. Sizes start at 1; counts that may be absent start
# at 0. Two joint bounds then cap what the counts multiply into (MAX_INVENTORY_TENSORS,
# MAX_ENGRAM_COLUMNS, below). Layer ids, token ids and ratios are placed by the relationship checks
# of verify(); here they only need to be 64-bit integers.
MAX_LAYERS = 1024  # n_layers 40
# The shortest image span: image start, one cell, its row newline, image end (vision.span_length(1, 1)).
# A vision_max_n_token below it cannot hold any image.
MIN_IMAGE_SPAN = 4
MAX_INT64 = (1 << 63) - 1
# Lists: at most one entry per layer (MAX_LAYERS backbone + 64 MTP), each entry at most its bound.
MAX_LIST_ENTRIES = MAX_LAYERS + 64
MAX_FP8_BLOCK = 1 << 12  # [32, 32]
# Joint bounds. Every consumer enumerates the inventory (the audit spends about 10 us a tensor on
# two slow cores, the loader more), so its size is capped at about 5x the release's 96,085:
# a geometry with twice the layers and twice the experts still fits, and the audit of the largest
# allowed config finishes in seconds. The Engram prime search grows with the square of the hash
# columns (1 s for 384 columns from a 2**30 vocabulary), so those are capped at 8x the release's 48.
MAX_INVENTORY_TENSORS = 500_000
MAX_ENGRAM_COLUMNS = 384

# The table, in the released flat file's key order, then the fields only the nested file states;
# a comment gives the released value a ceiling was scaled from. Floats must be finite, and at least
# (>=) or above (>) their minimum: a RoPE base of 1 makes YaRN divide by log(1) = 0; a YaRN factor
# below 1 would shrink the context it extends, and original_seq_len x rope_factor must stay a
# modest integer. A `default` is what runtime code reads where a file is silent (`Config.verified`).
FIELDS: tuple[Field, ...] = (
    Field("vocab_size", "int", (T, "vocab_size"), (1, 1 << 22)),  # 129,280
    Field("dim", "int", (T, "hidden_size"), (1, 1 << 17)),  # 5,120
    Field("moe_inter_dim", "int", (T, "moe_intermediate_size"), (1, 1 << 17)),  # 2,304
    Field("n_layers", "int", (T, "num_hidden_layers"), (1, MAX_LAYERS)),
    Field("n_mtp_layers", "int", (T, "num_nextn_predict_layers"), (0, 64), default=0),  # 3
    # 5; 0 turns the draft stack off
    Field("dspark_block_size", "int", (T, "dspark_block_size"), (0, 256), default=0),
    Field("dspark_noise_token_id", "int", (T, "dspark_noise_token_id"), (-MAX_INT64, MAX_INT64)),
    Field("dspark_target_layer_ids", "tuple[int, ...]", (T, "dspark_target_layer_ids"), MAX_INT64, default=()),
    Field("dspark_markov_rank", "int", (T, "dspark_markov_rank"), (1, 1 << 14)),  # 256
    # 128; 0 routes the MTP layers like the backbone
    Field("dspark_n_routed_experts", "int", (T, "dspark_n_routed_experts"), (0, 1 << 14)),
    Field("dspark_n_activated_experts", "int", (T, "dspark_num_experts_per_tok"), (0, 1 << 14)),  # 3
    Field("n_heads", "int", (T, "num_attention_heads"), (1, 1 << 12)),  # 64
    Field("n_routed_experts", "int", (T, "n_routed_experts"), (1, 1 << 14)),  # 384
    Field("n_shared_experts", "int", (T, "n_shared_experts"), (0, 64)),  # 1
    Field("n_activated_experts", "int", (T, "num_experts_per_tok"), (1, 1 << 14)),  # 6
    Field("score_func", "str", (T, "scoring_func")),
    Field("route_scale", "float", (T, "routed_scaling_factor"), (">", 0, None)),  # 1.5
    Field("swiglu_limit", "float", (T, "swiglu_limit"), (">=", 0, None), default=0.0),  # 10.0; 0 turns the clamp off
    Field("q_lora_rank", "int", (T, "q_lora_rank"), (1, 1 << 16)),  # 1,280
    Field("head_dim", "int", (T, "head_dim"), (1, 1 << 14)),  # 512
    Field("rope_head_dim", "int", (T, "qk_rope_head_dim"), (1, 1 << 14)),  # 64
    Field("norm_eps", "float", (T, "rms_norm_eps"), (">=", 0, None)),  # 1e-20
    Field("o_groups", "int", (T, "o_groups"), (1, 1 << 12)),  # 8
    Field("o_lora_rank", "int", (T, "o_lora_rank"), (1, 1 << 16)),  # 1,024
    # 128; every layer's KV window cache holds this many positions
    Field("window_size", "int", (T, "sliding_window"), (1, 1 << 13)),
    Field("kv_source_layers", "tuple[int, ...]", (T, "kv_source_layer_ids"), MAX_INT64),
    Field("index_source_layers", "tuple[int, ...]", (T, "index_source_layer_ids"), MAX_INT64),
    Field("original_seq_len", "int", (T, "rope_scaling", "original_max_position_embeddings"), (1, 1 << 22)),  # 65,536
    Field("rope_theta", "float", (T, "rope_theta"), (">", 1, None)),  # 10,000
    Field("rope_factor", "float", (T, "rope_scaling", "factor"), (">=", 1, 1 << 10)),  # 16
    # 32; YaRN divides by these numbers of turns
    Field("beta_fast", "int", (T, "rope_scaling", "beta_fast"), (1, 1 << 10)),
    Field("beta_slow", "int", (T, "rope_scaling", "beta_slow"), (1, 1 << 10)),  # 1
    Field("index_n_heads", "int", (T, "index_n_heads"), (1, 1 << 11)),  # 32
    Field("index_head_dim", "int", (T, "index_head_dim"), (1, 1 << 13)),  # 128
    Field("index_topk", "int", (T, "index_topk"), (1, 1 << 15)),  # 512
    # 20; -1 turns candidate blocks off
    Field("candidate_source_layer", "int", (T, "candidate_source_layer_id"), (-1, MAX_LAYERS - 1), default=-1),
    Field("candidate_topk_blocks", "int", (T, "candidate_topk_blocks"), (0, 1 << 17)),  # 2,048
    Field("candidate_block_size", "int", (T, "candidate_block_size"), (0, 1 << 9)),  # 8
    Field("hc_mult", "int", (T, "hc_mult"), (1, 64)),  # 4
    Field("hc_sinkhorn_iters", "int", (T, "hc_sinkhorn_iters"), (1, 1 << 10)),  # 20
    Field("hc_eps", "float", (T, "hc_eps"), (">=", 0, None)),  # 1e-06
    Field("engram_layer_ids", "tuple[int, ...]", (T, "engram_layer_ids"), MAX_INT64, default=()),
    # 16,000,000; the primes are searched upward from it
    Field("engram_vocab_size", "int", (T, "engram_vocab_size"), (1, 1 << 30)),
    # 384,016,682 rows; a table is rows x engram_head_dim bytes
    Field("engram_num_embeddings", "tuple[int, ...]", (T, "engram_num_embeddings"), 1 << 35),
    Field("engram_max_ngram_size", "int", (T, "engram_max_ngram_size"), (1, 64)),  # 4
    Field("engram_pad_id", "int", (T, "engram_pad_token_id"), (-MAX_INT64, MAX_INT64)),
    Field("engram_compressed_vocab_size", "int", (T, "engram_compressed_vocab_size"), (1, 1 << 22)),  # 99,092
    Field("dtype", "str", (Q, "quant_method")),  # quantization dtype of the dense linears ("fp8" / "bf16")
    Field("expert_dtype", "str", (Q, "expert_dtype")),  # routed experts ("fp4")
    Field("compress_rope_theta", "float", (T, "compress_rope_theta"), (">", 1, None)),  # 160,000
    # 2; positions pooled into one compressed entry
    Field("compress_ratios", "tuple[int, ...]", (T, "compress_ratios"), 1 << 10),
    # 32; 0 is a checkpoint without the vision tower
    Field("vision_n_layers", "int", (V, "num_hidden_layers"), (0, MAX_LAYERS)),
    Field("vision_dim", "int", (V, "hidden_size"), (1, 1 << 16)),  # 1,024
    Field("vision_n_heads", "int", (V, "num_attention_heads"), (1, 1 << 10)),  # 16
    Field("vision_inter_dim", "int", (V, "intermediate_size"), (1, 1 << 17)),  # 2,816
    Field("vision_patch_size", "int", (V, "patch_size"), (1, 1 << 9)),  # 14
    Field("vision_downsample_ratio", "int", (V, "downsample_ratio"), (1, 64)),  # 3
    Field("vision_max_n_token", "int", (V, "max_image_tokens"), (MIN_IMAGE_SPAN, 1 << 16)),  # 1,024
    Field("vision_min_pixels", "int", (V, "min_pixels"), (1, 1 << 24)),  # 295,936
    Field("vision_max_wh_ratio", "float", (V, "max_wh_ratio"), (">", 0, None)),  # null: no limit
    Field("image_token_id", "int", ("image_token_id",), (-MAX_INT64, MAX_INT64)),
    Field("engram_n_heads", "int", (T, "engram_n_heads"), (1, 1 << 10)),  # 8
    Field("engram_head_dim", "int", (T, "engram_head_dim"), (1, 1 << 14)),  # 256
    Field("vision_rope_theta", "float", (V, "rope_theta"), (">", 1, None), default=10000.0),  # 10,000
    # fields only the nested file states; the flat file never had them
    Field("model_type", "str", ("model_type",), flat=False),
    Field("architectures", "tuple[str, ...]", ("architectures",), 0, flat=False),  # strings: only the length applies
    # storage dtype of unquantized tensors ("bfloat16")
    Field("param_dtype", "str", ("dtype",), flat=False, default="bfloat16"),
    Field("bos_token_id", "int", ("bos_token_id",), (-MAX_INT64, MAX_INT64), flat=False),
    Field("eos_token_id", "int", ("eos_token_id",), (-MAX_INT64, MAX_INT64), flat=False),
    Field("pad_token_id", "int", ("pad_token_id",), (-MAX_INT64, MAX_INT64), flat=False),
    Field("hidden_act", "str", (T, "hidden_act"), flat=False),
    Field("max_position_embeddings", "int", (T, "max_position_embeddings"), (1, 1 << 26), flat=False),  # 1,048,576
    Field("num_key_value_heads", "int", (T, "num_key_value_heads"), (1, 1 << 12), flat=False),  # 1
    Field("tie_word_embeddings", "bool", (T, "tie_word_embeddings"), flat=False),
    Field("topk_method", "str", (T, "topk_method"), flat=False),
    Field("norm_topk_prob", "bool", (T, "norm_topk_prob"), flat=False, default=True),
)

FLAT_ALIASES: tuple[tuple[str, tuple[str, ...]], ...] = tuple((f.name, f.nested) for f in FIELDS if f.flat)
NESTED_ONLY: tuple[tuple[str, tuple[str, ...]], ...] = tuple((f.name, f.nested) for f in FIELDS if not f.flat)
VALUE_BOUNDS: dict[str, tuple[int, int]] = {f.name: f.bound for f in FIELDS if f.kind == "int"}
LIST_BOUNDS: dict[str, int] = {f.name: f.bound for f in FIELDS if f.kind.startswith("tuple[")}
FLOAT_LIMITS: dict[str, tuple[str, float, float | None]] = {f.name: f.bound for f in FIELDS if f.kind == "float"}

# Nested keys that carry format facts, not model facts: kept verbatim for the round trip back to
# config.json and checked by verify(), but not fields of the schema.
NESTED_FORMAT_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("transformers_version",): "5.6.0",
    (Q, "activation_scheme"): "dynamic",
    (Q, "weight_block_size"): [32, 32],
    (Q, "scale_fmt"): "ue8m0",
    (T, "model_type"): "deepseek_v41_text",
    (T, "attention_bias"): False,
    (T, "attention_dropout"): 0.0,
    (T, "initializer_range"): 0.02,
    (T, "use_cache"): True,
    (T, "rope_scaling", "rope_type"): "yarn",
    (V, "model_type"): "deepseek_v41_vision",
}

FLAT_KEYS = tuple(name for name, _ in FLAT_ALIASES)
NESTED_ONLY_KEYS = tuple(name for name, _ in NESTED_ONLY)
# vision_max_wh_ratio is legitimately null in the release: "no limit".
NULLABLE = frozenset({"vision_max_wh_ratio"})
