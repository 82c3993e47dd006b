"""One frozen schema over both released config layouts.

The checkpoint describes itself twice: `config.json` (nested: text_config, vision_config,
quantization_config; Transformers names) and `inference/config.json` (one flat level, the reference
runtime's names). Canonical field names here are the flat ones. Each file is silent on something the
other states; a field a file does not state is None, never a guessed default.

The dtype trap: the nested top-level `dtype` is the *storage* dtype of unquantized tensors
(`bfloat16`, canonical name `param_dtype`), while the flat `dtype` is the *quantization* dtype of the
dense linears (`fp8`), which the nested file states as `quantization_config.quant_method`.

Standard library only: the header audit imports this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dsv41.core.config_fields import (
    FIELDS,
    FLAT_ALIASES,
    FLAT_KEYS,
    FLOAT_LIMITS,
    LIST_BOUNDS,
    MAX_ENGRAM_COLUMNS,
    MAX_FP8_BLOCK,
    MAX_INT64,
    MAX_INVENTORY_TENSORS,
    MAX_LIST_ENTRIES,
    NESTED_FORMAT_DEFAULTS,
    NESTED_ONLY,
    NESTED_ONLY_KEYS,
    NULLABLE,
    VALUE_BOUNDS,
    Q,
    T,
    V,
)
from dsv41.core.config_json import (
    MAX_CONFIG_INT_DIGITS,
    assign,
    freeze,
    is_finite,
    leaf_paths,
    lookup,
    parse_int,
    shape_problem,
    shown,
    thaw,
)
from dsv41.core.errors import Dsv41Error
from dsv41.core.text import LongInteger, brief, is_whole, number_text


class ConfigError(Dsv41Error, ValueError):
    """A config file that cannot be read as either released layout."""


@dataclass(frozen=True, kw_only=True)
class VerifiedConfig:
    """A config as runtime code reads it (`Config.verified`): the same field names in the same
    order, each runtime default applied where the file was silent, values inside their bounds, and
    None only where a field may be absent (`Field.may_be_absent`: the nested-only fields of a flat
    file, `vision_max_wh_ratio`). The types and defaults are FIELDS' (tests/test_config.py holds
    them to it); what each field means is on `Config`."""

    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_mtp_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: str
    route_scale: float
    swiglu_limit: float = 0.0
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    norm_eps: float
    o_groups: int
    o_lora_rank: int
    window_size: int
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    original_seq_len: int
    rope_theta: float
    rope_factor: float
    beta_fast: int
    beta_slow: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer: int = -1
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    dtype: str
    expert_dtype: str
    compress_rope_theta: float
    compress_ratios: tuple[int, ...]
    vision_n_layers: int
    vision_dim: int
    vision_n_heads: int
    vision_inter_dim: int
    vision_patch_size: int
    vision_downsample_ratio: int
    vision_max_n_token: int
    vision_min_pixels: int
    vision_max_wh_ratio: float | None = None
    image_token_id: int
    engram_n_heads: int
    engram_head_dim: int
    vision_rope_theta: float = 10000.0
    model_type: str | None = None
    architectures: tuple[str, ...] | None = None
    param_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    hidden_act: str | None = None
    max_position_embeddings: int | None = None
    num_key_value_heads: int | None = None
    tie_word_embeddings: bool | None = None
    topk_method: str | None = None
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class Config:
    """A config as a file states it: one field per row of `config_fields.FIELDS` (in the table's
    order; canonical names the flat file's; None where the file is silent, never a guessed
    default), then where the config came from. The table keeps each field's nested name, bound and
    runtime default; tests/test_config.py holds these fields to it."""

    # --- the text model (flat-file fields, in the released flat file's key order)
    vocab_size: int | None = None
    dim: int | None = None  # width of the residual stream
    moe_inter_dim: int | None = None  # hidden width of one expert
    n_layers: int | None = None  # backbone layers
    n_mtp_layers: int | None = None  # DSpark draft layers after the backbone (nested: num_nextn_predict_layers)
    dspark_block_size: int | None = None  # tokens a draft block spans; 0 turns the draft stack off
    dspark_noise_token_id: int | None = None  # fills the draft block after its first token
    dspark_target_layer_ids: tuple[int, ...] | None = None  # backbone layers whose hidden states feed the drafts
    dspark_markov_rank: int | None = None  # width of the draft's Markov head
    dspark_n_routed_experts: int | None = None  # the MTP layers' experts; 0: as many as the backbone's
    dspark_n_activated_experts: int | None = None
    n_heads: int | None = None
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    n_activated_experts: int | None = None  # routed experts per token
    score_func: str | None = None  # router scores: "sqrtsoftplus", "sigmoid" or "softmax"
    route_scale: float | None = None  # multiplies the routing weights
    swiglu_limit: float | None = None  # clamp of the expert activations; 0 turns it off
    q_lora_rank: int | None = None
    head_dim: int | None = None
    rope_head_dim: int | None = None  # the rotary part of each head
    norm_eps: float | None = None
    o_groups: int | None = None  # groups of heads, each projected to o_lora_rank before the output
    o_lora_rank: int | None = None
    window_size: int | None = None  # positions every layer's KV window cache holds
    kv_source_layers: tuple[int, ...] | None = None  # layers that own a compressor and publish its cache
    index_source_layers: tuple[int, ...] | None = None  # layers that rank compressed positions with their own queries
    original_seq_len: int | None = None  # the context YaRN extends
    rope_theta: float | None = None
    rope_factor: float | None = None  # YaRN's extension factor
    beta_fast: int | None = None  # YaRN's ramp, in rotations
    beta_slow: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None  # compressed positions a query reads
    candidate_source_layer: int | None = None  # the layer that pre-filters blocks for the rest; -1 turns it off
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    hc_mult: int | None = None  # parallel copies of the residual stream (hyper-connections)
    hc_sinkhorn_iters: int | None = None
    hc_eps: float | None = None
    engram_layer_ids: tuple[int, ...] | None = None
    engram_vocab_size: int | None = None  # the Engram primes are searched upward from it
    engram_num_embeddings: tuple[int, ...] | None = None  # rows of each Engram layer's table
    engram_max_ngram_size: int | None = None
    engram_pad_id: int | None = None
    engram_compressed_vocab_size: int | None = None  # the tokenizer folded for hashing; the multipliers derive from it
    dtype: str | None = None  # quantization dtype of the dense linears ("fp8"), not the storage dtype
    expert_dtype: str | None = None  # quantization dtype of the routed experts ("fp4")
    compress_rope_theta: float | None = None
    compress_ratios: tuple[int, ...] | None = None  # per layer, positions pooled into one compressed entry; 0: none
    vision_n_layers: int | None = None  # 0 is a checkpoint without the vision tower
    vision_dim: int | None = None
    vision_n_heads: int | None = None
    vision_inter_dim: int | None = None
    vision_patch_size: int | None = None
    vision_downsample_ratio: int | None = None
    vision_max_n_token: int | None = None  # the longest image span in tokens
    vision_min_pixels: int | None = None
    vision_max_wh_ratio: float | None = None  # null in the release: no limit
    image_token_id: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    vision_rope_theta: float | None = None
    # --- stated only by the nested config.json
    model_type: str | None = None
    architectures: tuple[str, ...] | None = None
    param_dtype: str | None = None  # storage dtype of unquantized tensors ("bfloat16"; nested: dtype)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    hidden_act: str | None = None
    max_position_embeddings: int | None = None
    num_key_value_heads: int | None = None
    tie_word_embeddings: bool | None = None
    topk_method: str | None = None
    norm_topk_prob: bool | None = None

    # --- provenance, not model facts
    layout: str | None = dataclasses.field(default=None, compare=False)  # "nested" | "flat" | None
    source: str | None = dataclasses.field(default=None, compare=False)
    nested_format: tuple[tuple[tuple[str, ...], Any], ...] = dataclasses.field(default=(), compare=False)
    unknown_keys: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, data: dict, source: str | None = None) -> "Config":
        """Read either layout; the nested one is recognised by its `text_config`."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source or 'config'}: expected a JSON object, got {type(data).__name__}")
        problem = shape_problem(data)
        if problem:
            raise ConfigError(f"{source or 'config'}: {problem}")
        if "text_config" in data:
            return cls._from_nested(data, source)
        return cls._from_flat(data, source)

    @classmethod
    def _from_flat(cls, data: dict, source: str | None) -> "Config":
        values = {key: freeze(data[key]) for key in FLAT_KEYS if key in data}
        _check_types(values, source)
        unknown = tuple(sorted(set(data) - set(FLAT_KEYS)))
        return cls(**values, layout="flat", source=source, unknown_keys=unknown)

    @classmethod
    def _from_nested(cls, data: dict, source: str | None) -> "Config":
        values, seen = {}, set()
        for name, path in FLAT_ALIASES + NESTED_ONLY:
            found, value = lookup(data, path)
            if found:
                values[name] = freeze(value)
                seen.add(path)
        fmt = []
        for path in NESTED_FORMAT_DEFAULTS:
            found, value = lookup(data, path)
            if found:
                fmt.append((path, value))
                seen.add(path)
        _check_types(values, source)
        block = dict(fmt).get((Q, "weight_block_size"), [32, 32])
        if not (isinstance(block, list) and len(block) == 2 and all(is_whole(b) for b in block)):
            raise ConfigError(
                f"{source or 'config'}: field {Q}.weight_block_size is {brief(block, as_json=True)}, "
                "expected a list of two integers"
            )
        unknown = tuple(sorted(".".join(map(str, p)) for p in leaf_paths(data) if p not in seen))
        return cls(**values, layout="nested", source=source, nested_format=tuple(fmt), unknown_keys=unknown)

    # ------------------------------------------------------------------ writing
    def as_reference_dict(self) -> dict:
        """The flat `inference/config.json` this config corresponds to (64 keys, release order)."""
        return {key: thaw(getattr(self, key)) for key in FLAT_KEYS}

    def as_nested_dict(self) -> dict:
        """The nested `config.json` (Transformers layout), in the release's key arrangement."""
        missing = [k for k in FLAT_KEYS + NESTED_ONLY_KEYS if getattr(self, k) is None and k not in NULLABLE]
        if missing:
            raise ConfigError(f"cannot write the nested layout: fields not set: {', '.join(missing)}")
        fmt = dict(NESTED_FORMAT_DEFAULTS)
        fmt.update(dict(self.nested_format))
        out: dict = {}
        top_order = (
            "architectures",
            "model_type",
            "dtype",
            "transformers_version",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "image_token_id",
        )
        pairs = {path: thaw(getattr(self, name)) for name, path in FLAT_ALIASES + NESTED_ONLY}
        pairs.update(fmt)
        for key in top_order:
            assign(out, (key,), pairs.pop((key,)))
        for section in (Q, T, V):
            out[section] = {}
        # model_type first inside each section, as the release writes it
        for path in sorted(pairs, key=lambda p: (p[0], p[-1] != "model_type")):
            assign(out, path, pairs[path])
        return out

    # ------------------------------------------------------------------ comparing
    def differs_from(self, other: "Config") -> list[str]:
        """Every field the two configs disagree on or one of them is silent on, one line each."""
        lines = []
        for field in FLAT_KEYS + NESTED_ONLY_KEYS:
            a, b = getattr(self, field), getattr(other, field)
            if a != b:
                lines.append(f"{field}: {shown(a)} vs {shown(b)}")
        return lines

    # ------------------------------------------------------------------ derived facts
    @property
    def n_total_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    @property
    def max_seq_len(self) -> int:
        """Longest context: max_position_embeddings where stated, else the YaRN-extended length."""
        if self.max_position_embeddings is not None:
            return self.max_position_embeddings
        return int(self.original_seq_len * self.rope_factor)

    @property
    def n_hash_cols(self) -> int:
        """Engram hash ids per position and layer: one per (n-gram size >= 2, head)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def fp8_block(self) -> tuple[int, int]:
        fmt = dict(NESTED_FORMAT_DEFAULTS)
        fmt.update(dict(self.nested_format))
        rows, cols = fmt[(Q, "weight_block_size")]
        return int(rows), int(cols)

    def layer_mode(self, layer: int) -> str:
        """CSA2 mode: 'full' owns compressor and indexer keys, 'reindex' re-ranks with its own
        queries, 'reuse' reads what the last source published (pure window layers included)."""
        if layer in self.kv_source_layers:
            return "full"
        if layer in self.index_source_layers:
            return "reindex"
        return "reuse"

    @property
    def layer_modes(self) -> tuple[str, ...]:
        return tuple(self.layer_mode(i) for i in range(self.n_layers))

    def source_at_or_before(self, layer: int, sources: tuple[int, ...]) -> int | None:
        """The latest of `sources` at or before `layer` (the one whose published state it reads)."""
        candidates = [s for s in sources if s <= layer]
        return max(candidates) if candidates else None

    def compressed_readers(self) -> list[int]:
        """The backbone layers that read compressed positions (compress ratio above 0)."""
        ratios = self.compress_ratios
        return [layer for layer in range(min(self.n_layers, len(ratios))) if ratios[layer] > 0]

    def source_breaks(
        self, layers: Iterable[int] | None = None, kinds: tuple[str, ...] = ("KV", "index")
    ) -> list[tuple[int, str, int | None]]:
        """The ratio-source rule, as (layer, kind, source) for each break: a layer reads the cache
        of the latest KV source and the selection of the latest index source at or before it, and
        compresses at that source's ratio (the source writes at its own ratio; a reader at another
        would index it at the wrong granularity). `source` is None where no `kind` source is at or
        before the layer, else the source whose ratio differs; a layer past compress_ratios is not
        compared. `layers`: the compressed readers unless given. verify() and the audit word them."""
        sources = {"KV": self.kv_source_layers, "index": self.index_source_layers}
        ratios = self.compress_ratios
        breaks: list[tuple[int, str, int | None]] = []
        for layer in self.compressed_readers() if layers is None else layers:
            for kind in kinds:
                src = self.source_at_or_before(layer, sources[kind])
                if src is None or (layer < len(ratios) and ratios[src] != ratios[layer]):
                    breaks.append((layer, kind, src))
        return breaks

    def kv_sources_outside_index(self) -> list[int]:
        """The KV sources that are not also index sources (there should be none)."""
        return sorted(set(self.kv_source_layers) - set(self.index_source_layers))

    @property
    def expected_dspark_targets(self) -> tuple[int, ...]:
        """The layers DSpark should read: the last n_mtp_layers backbone layers."""
        return tuple(range(self.n_layers - self.n_mtp_layers, self.n_layers))

    def moe_shape(self, layer: int) -> tuple[int, int]:
        """(routed experts, activated experts) for a backbone or MTP layer."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def summary(self) -> str:
        s = (
            f"{self.n_layers} layers + {self.n_mtp_layers} draft, dim {self.dim}, {self.n_heads} heads of "
            f"{self.head_dim}, {self.n_routed_experts} experts ({self.n_activated_experts} active)"
        )
        s += f"; Engram on layers {list(self.engram_layer_ids or ())}"
        s += f", vision {self.vision_n_layers} layers" if self.vision_n_layers else ", no vision"
        s += f", DSpark block {self.dspark_block_size} over layers {list(self.dspark_target_layer_ids or ())}"
        return s

    def verified(self) -> VerifiedConfig:
        """This config for runtime code, without the None a defending `or 0` would need: every
        default of FIELDS applied where the file is silent. ConfigError when a field a model needs
        is unset or a value is outside its bounds (`value_problems`); the relationships between
        fields are verify()'s."""
        values = {f.name: f.default if getattr(self, f.name) is None else getattr(self, f.name) for f in FIELDS}
        missing = [f.name for f in FIELDS if values[f.name] is None and not f.may_be_absent]
        if missing:
            raise ConfigError(f"{self.source or 'config'}: fields a model needs are not set: {', '.join(missing)}")
        problems = self.value_problems()
        if problems:
            raise ConfigError(f"{self.source or 'config'}: {problems[0]}")
        return VerifiedConfig(**values)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ checking
    def value_problems(self) -> list[str]:
        """Values no checkpoint can have, one sentence each: a non-finite or out-of-sign float, a
        size below its minimum, a count above the ceiling in VALUE_BOUNDS, a list longer than the
        layers it can describe, or counts that together imply more tensors than an inventory may
        hold (MAX_INVENTORY_TENSORS) or more Engram hash columns than MAX_ENGRAM_COLUMNS. Fields
        the config does not state are skipped (verify() reports them as missing). Cheap: it never
        enumerates anything, which is why the tensor inventory, the audit and the loader call it
        before they do."""
        problems: list[str] = []
        for name, (low, high) in VALUE_BOUNDS.items():
            value = getattr(self, name)
            if is_whole(value) and not low <= value <= high:
                problems.append(f"{self._label(name)} is {number_text(value)}, outside [{low:,}, {high:,}]")
        for name, high in LIST_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, tuple):
                continue
            if len(value) > MAX_LIST_ENTRIES:
                problems.append(
                    f"{self._label(name)} has {len(value):,} entries; no list in a config describes "
                    f"more than {MAX_LIST_ENTRIES:,} layers"
                )
            elif (bad := next((v for v in value if is_whole(v) and not -MAX_INT64 <= v <= high), None)) is not None:
                limit = f"above {high:,}" if bad > 0 and high < MAX_INT64 else "beyond a 64-bit integer"
                problems.append(f"{self._label(name)} holds {number_text(bad)}, {limit}")
        for name, (relation, low, high) in FLOAT_LIMITS.items():
            value = getattr(self, name)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not is_finite(value):
                problems.append(f"{self._label(name)} is {number_text(value)}, not a finite number")
            elif value < low or (relation == ">" and value == low):
                word = "above" if relation == ">" else "at least"
                problems.append(f"{self._label(name)} is {number_text(value)}, it must be {word} {low}")
            elif high is not None and value > high:
                problems.append(f"{self._label(name)} is {number_text(value)}, above {high:,}")
        fmt = dict(self.nested_format)
        block = fmt.get((Q, "weight_block_size"), [32, 32])
        if not _block_ok(block):
            problems.append(
                f"quantization_config.weight_block_size {brief(block, as_json=True)} is not two integers in "
                f"[1, {MAX_FP8_BLOCK:,}]"
            )
        if problems:
            return problems  # the joint bounds below multiply these
        tensors = self.inventory_tensor_bound()
        if tensors is not None and tensors > MAX_INVENTORY_TENSORS:
            problems.append(
                f"these counts imply up to {tensors:,} tensors (n_layers {self.n_layers:,} + n_mtp_layers "
                f"{self.n_mtp_layers:,} layers of {self.n_routed_experts:,} routed experts); an inventory "
                f"holds at most {MAX_INVENTORY_TENSORS:,}"
            )
        columns = self.engram_column_count()
        if columns is not None and columns > MAX_ENGRAM_COLUMNS:
            problems.append(
                f"{len(self.engram_layer_ids)} Engram layers x (engram_max_ngram_size - 1) x "
                f"engram_n_heads = {columns:,} hash columns, above the {MAX_ENGRAM_COLUMNS:,} "
                "whose primes can be derived promptly"
            )
        return problems

    def inventory_tensor_bound(self) -> int | None:
        """An upper bound on the tensors the release-layout inventory lists for this config (None
        while a count it needs is unstated): 6 per routed expert (w1/w2/w3, each weight + scale),
        at most 48 others per backbone or MTP layer, 8 per vision block, 6 per Engram table and a
        few global ones. The released geometry: 96,812 against its 96,085."""
        counts = (self.n_layers, self.n_mtp_layers, self.n_routed_experts, self.vision_n_layers)
        if not all(is_whole(c) for c in counts):
            return None
        n, mtp, experts, vision = counts
        mtp_experts = self.dspark_n_routed_experts if is_whole(self.dspark_n_routed_experts) else 0
        engram = len(self.engram_layer_ids) if isinstance(self.engram_layer_ids, tuple) else 0
        return 6 * (n * experts + mtp * (mtp_experts or experts)) + 48 * (n + mtp) + 8 * vision + 6 * engram + 16

    def engram_column_count(self) -> int | None:
        """Hash columns over all Engram layers, each of which owns one prime: the prime search that
        lays the tables out grows with the square of this."""
        if not (
            isinstance(self.engram_layer_ids, tuple)
            and is_whole(self.engram_max_ngram_size)
            and is_whole(self.engram_n_heads)
        ):
            return None
        return len(self.engram_layer_ids) * max(self.engram_max_ngram_size - 1, 0) * self.engram_n_heads

    def _label(self, name: str) -> str:
        """The canonical field name, with the nested file's own name beside it when it differs."""
        if self.layout == "nested":
            path = _NESTED_PATHS.get(name)
            if path and path[-1] != name:
                return f"{name} ({'.'.join(path)})"
        return name

    def _layer_problems(self) -> list[str]:
        """verify()'s checks of the per-layer lists: compress ratios, the layer-id lists, and which
        source each compressing layer reads."""
        problems: list[str] = []
        n, n_all = self.n_layers, self.n_total_layers
        ratios = self.compress_ratios
        if len(ratios) != n_all:
            problems.append(f"compress_ratios has {len(ratios)} entries, expected n_layers + n_mtp_layers = {n_all}")
        if any(r < 0 for r in ratios) or not any(ratios):
            problems.append("compress_ratios must be non-negative and not all zero")
        if any(ratios[n:]):
            problems.append(
                f"MTP layers must not read compressed positions: compress_ratios[{n}:] = {list(ratios[n:])}"
            )

        for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            if not distinct_ascending(ids):
                problems.append(f"{name} must be distinct and ascending: {list(ids)}")
            if not inside(ids, n):
                problems.append(f"{name} must lie inside the backbone [0, {n}): {list(ids)}")
        if self.kv_sources_outside_index():
            problems.append("every KV source must also be an index source")
        for layer in range(min(n, len(ratios))):
            if layer in self.index_source_layers and ratios[layer] == 0:
                problems.append(f"source layer {layer} has compress ratio 0: it has nothing to compress or index")
        for layer, kind, src in self.source_breaks():
            r = ratios[layer]
            if src is None:
                problems.append(
                    f"layer {layer} reads compressed positions (ratio {r}) but no {kind} source is at or before it"
                )
            else:
                problems.append(
                    f"layer {layer} (ratio {r}) reads the {kind} source {src}, which compresses at ratio {ratios[src]}"
                )
        return problems

    def verify(self) -> list[str]:
        """Relationships between fields that a consumer would otherwise hold in its head.
        Returns one sentence per problem; empty means self-consistent."""
        problems: list[str] = []
        required = [k for k in FLAT_KEYS if k not in NULLABLE]
        if self.layout == "nested":
            required += list(NESTED_ONLY_KEYS)
        missing = [k for k in required if getattr(self, k) is None]
        if missing:
            problems.append(f"required fields missing: {', '.join(missing)}")
            return problems  # the relationships below need them
        problems += self.value_problems()
        if problems:
            return problems  # the relationships below would divide by, loop over or allocate these values

        problems += self._layer_problems()
        if self.candidate_source_layer >= 0:
            if self.candidate_source_layer not in self.index_source_layers:
                problems.append(f"candidate_source_layer {self.candidate_source_layer} is not an index source")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                problems.append(
                    "candidate_topk_blocks and candidate_block_size must be positive when a candidate source is set"
                )
        if self.index_topk <= 0 or self.window_size <= 0:
            problems.append("index_topk and window_size must be positive")

        expected_targets = self.expected_dspark_targets
        if self.n_mtp_layers and self.dspark_target_layer_ids != expected_targets:
            problems.append(
                f"dspark_target_layer_ids {list(self.dspark_target_layer_ids)} are not the last "
                f"{self.n_mtp_layers} backbone layers {list(expected_targets)}"
            )

        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            problems.append(
                f"{len(self.engram_num_embeddings)} Engram row counts for {len(self.engram_layer_ids)} Engram layers"
            )
        if self.engram_layer_ids and (
            self.engram_compressed_vocab_size <= 0 or self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0
        ):
            problems.append(
                "Engram layers need a positive compressed vocabulary, n_heads and an n-gram size of at least 2"
            )

        token_ids = {
            "image_token_id": self.image_token_id,
            "dspark_noise_token_id": self.dspark_noise_token_id,
            "engram_pad_id": self.engram_pad_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        for name, value in token_ids.items():
            if value is not None and not 0 <= value < self.vocab_size:
                problems.append(f"{name} {value} is outside the vocabulary [0, {self.vocab_size})")
        if self.pad_token_id is not None and self.engram_pad_id != self.pad_token_id:
            problems.append(
                f"engram_pad_id {self.engram_pad_id} differs from the tokenizer's pad_token_id {self.pad_token_id}"
            )

        if self.rope_head_dim > self.head_dim or self.rope_head_dim % 2:
            problems.append(f"rope_head_dim {self.rope_head_dim} must be even and at most head_dim {self.head_dim}")
        if (self.n_heads * self.head_dim) % self.o_groups:
            problems.append(
                f"n_heads * head_dim = {self.n_heads * self.head_dim} is not divisible by o_groups {self.o_groups}"
            )
        if self.n_activated_experts > self.n_routed_experts:
            problems.append("n_activated_experts exceeds n_routed_experts")
        if self.vision_n_layers:
            if self.vision_dim % self.vision_n_heads:
                problems.append(
                    f"vision_dim {self.vision_dim} is not divisible by vision_n_heads {self.vision_n_heads}"
                )
            elif (self.vision_dim // self.vision_n_heads) % 4:
                problems.append("the vision head dim must divide by 4 for its 2D rotary embedding")
        if self.dtype not in ("fp8", "bf16"):
            problems.append(f"dtype (quantization dtype) {self.dtype!r} is not 'fp8' or 'bf16'")
        if self.expert_dtype not in ("fp4", "fp8", None):
            problems.append(f"expert_dtype {self.expert_dtype!r} is not 'fp4' or 'fp8'")
        if self.layout == "nested" and self.param_dtype not in ("bfloat16", "float32", "float16"):
            problems.append(f"nested dtype (the storage dtype) {self.param_dtype!r} is not a torch float dtype")
        block = self.fp8_block
        if block != (32, 32):
            problems.append(f"weight_block_size {list(block)} is not the [32, 32] the release uses")
        return problems


# ---------------------------------------------------------------------- presets
RELEASED = Config(
    vocab_size=129280,
    dim=5120,
    moe_inter_dim=2304,
    n_layers=40,
    n_mtp_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=(37, 38, 39),
    dspark_markov_rank=256,
    dspark_n_routed_experts=128,
    dspark_n_activated_experts=3,
    n_heads=64,
    n_routed_experts=384,
    n_shared_experts=1,
    n_activated_experts=6,
    score_func="sqrtsoftplus",
    route_scale=1.5,
    swiglu_limit=10.0,
    q_lora_rank=1280,
    head_dim=512,
    rope_head_dim=64,
    norm_eps=1e-20,
    o_groups=8,
    o_lora_rank=1024,
    window_size=128,
    kv_source_layers=(2, 8, 14, 20),
    index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    original_seq_len=65536,
    rope_theta=10000,
    rope_factor=16,
    beta_fast=32,
    beta_slow=1,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    candidate_source_layer=20,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-06,
    engram_layer_ids=(1, 14),
    engram_vocab_size=16000000,
    engram_num_embeddings=(384006168, 384016682),
    engram_max_ngram_size=4,
    engram_pad_id=2,
    engram_compressed_vocab_size=99092,
    dtype="fp8",
    expert_dtype="fp4",
    compress_rope_theta=160000,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
    vision_n_layers=32,
    vision_dim=1024,
    vision_n_heads=16,
    vision_inter_dim=2816,
    vision_patch_size=14,
    vision_downsample_ratio=3,
    vision_max_n_token=1024,
    vision_min_pixels=295936,
    vision_max_wh_ratio=None,
    image_token_id=129264,
    engram_n_heads=8,
    engram_head_dim=256,
    vision_rope_theta=10000,
    model_type="deepseek_v41",
    architectures=("DeepseekV41ForCausalLM",),
    param_dtype="bfloat16",
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    hidden_act="silu",
    max_position_embeddings=1048576,
    num_key_value_heads=1,
    tie_word_embeddings=False,
    topk_method="noaux_tc",
    norm_topk_prob=True,
    layout="nested",
)

# The embedded default's geometry: tiny, every dim a multiple of 32 so every quantization applies,
# and every branch present: pure window layers (0, 1, 7), a ratio-2 KV source (2) with a Reuse
# reader (3), a ratio-1 KV source that is also the candidate source (4), a Reuse layer (5), a
# Reindex layer (6), Engram on a plain layer (1) and on a Full layer (2), three MTP layers, vision.
# engram_num_embeddings and engram_compressed_vocab_size are derived when the checkpoint is
# written (from the prime layout and the tokenizer), so the preset leaves them unset.
TINY = Config(
    vocab_size=1024,
    dim=128,
    moe_inter_dim=64,
    n_layers=8,
    n_mtp_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=1000,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=32,
    dspark_n_routed_experts=8,
    dspark_n_activated_experts=2,
    n_heads=4,
    n_routed_experts=16,
    n_shared_experts=1,
    n_activated_experts=4,
    score_func="sqrtsoftplus",
    route_scale=1.5,
    swiglu_limit=10.0,
    q_lora_rank=64,
    head_dim=64,
    rope_head_dim=32,
    norm_eps=1e-20,
    o_groups=2,
    o_lora_rank=32,
    window_size=8,
    kv_source_layers=(2, 4),
    index_source_layers=(2, 4, 6),
    original_seq_len=256,
    rope_theta=10000,
    rope_factor=16,
    beta_fast=32,
    beta_slow=1,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=8,
    candidate_source_layer=4,
    candidate_topk_blocks=4,
    candidate_block_size=2,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-06,
    engram_layer_ids=(1, 2),
    engram_vocab_size=1000,
    engram_num_embeddings=None,
    engram_max_ngram_size=4,
    engram_pad_id=2,
    engram_compressed_vocab_size=None,
    dtype="fp8",
    expert_dtype="fp4",
    compress_rope_theta=160000,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 0, 0, 0, 0),
    vision_n_layers=2,
    vision_dim=64,
    vision_n_heads=2,
    vision_inter_dim=96,
    vision_patch_size=14,
    vision_downsample_ratio=3,
    vision_max_n_token=64,
    vision_min_pixels=3136,
    vision_max_wh_ratio=None,
    image_token_id=1001,
    engram_n_heads=2,
    engram_head_dim=32,
    vision_rope_theta=10000,
    model_type="deepseek_v41",
    architectures=("DeepseekV41ForCausalLM",),
    param_dtype="bfloat16",
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    hidden_act="silu",
    max_position_embeddings=4096,
    num_key_value_heads=1,
    tie_word_embeddings=False,
    topk_method="noaux_tc",
    norm_topk_prob=True,
    layout="nested",
)


# ---------------------------------------------------------------------- files
def resolve_config_path(path: str) -> str:
    """A directory resolves to its config.json, falling back to inference/config.json."""
    if os.path.isdir(path):
        for candidate in ("config.json", os.path.join("inference", "config.json")):
            full = os.path.join(path, candidate)
            if os.path.isfile(full):
                return full
        raise ConfigError(f"{path}: no config.json or inference/config.json in this directory")
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file or directory")
    return path


def load_config(path: str) -> Config:
    """Read a config file (either layout) or a checkpoint directory. Every file that cannot be read
    as a config raises ConfigError, one sentence naming it."""
    path = resolve_config_path(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read(), parse_int=parse_int)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except LongInteger as exc:
        raise ConfigError(
            f"{path}: holds an integer of {exc.digits:,} digits; no config value needs more "
            f"than {MAX_CONFIG_INT_DIGITS}, so the file is damaged"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{path}: nests too deep to read (a config nests three levels), so the file is damaged"
        ) from None
    except MemoryError:
        raise ConfigError(f"{path}: too large to read as a config") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return Config.from_dict(data, source=path)


def write_config_pair(config: Config, directory: str) -> tuple[str, str]:
    """Write config.json (nested) and inference/config.json (flat) as the release lays them out."""
    os.makedirs(os.path.join(directory, "inference"), exist_ok=True)
    nested = os.path.join(directory, "config.json")
    flat = os.path.join(directory, "inference", "config.json")
    with open(nested, "w", encoding="utf-8") as f:
        json.dump(config.as_nested_dict(), f, indent=2)
        f.write("\n")
    with open(flat, "w", encoding="utf-8") as f:
        json.dump(config.as_reference_dict(), f, indent=4)
        f.write("\n")
    return nested, flat


def compare_layouts(directory: str) -> dict:
    """Read a checkpoint folder's two config files and say how they relate, as plain data: which
    layout each is, the two dtypes, whether each reproduces the flat file exactly, whether the
    nested one round-trips, verify()'s problems and the fields only one of them states."""
    nested = load_config(os.path.join(directory, "config.json"))
    flat_path = os.path.join(directory, "inference", "config.json")
    flat = load_config(flat_path)
    with open(flat_path, encoding="utf-8") as f:
        flat_file = json.load(f)
    return {
        "nested": nested.layout,
        "flat": flat.layout,
        "dtype (quantization)": nested.dtype,
        "param_dtype (storage)": nested.param_dtype,
        "flat file from nested": nested.as_reference_dict() == flat_file,
        "flat file from flat": flat.as_reference_dict() == flat_file,
        "nested round trip": Config.from_dict(nested.as_nested_dict()) == nested,
        "verify problems": nested.verify() + flat.verify(),
        "differs": nested.differs_from(flat),
    }


# ---------------------------------------------------------------------- helpers
_NESTED_PATHS = {f.name: f.nested for f in FIELDS}


def _block_ok(block) -> bool:
    return (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(is_whole(b) and 1 <= b <= MAX_FP8_BLOCK for b in block)
    )


def distinct_ascending(ids) -> bool:
    return list(ids) == sorted(set(ids))


def inside(ids, n: int) -> bool:
    """Whether every layer id lies in [0, n)."""
    return all(0 <= i < n for i in ids)


def _type_ok(value, annotation: str) -> bool:
    """Whether a JSON value fits a field annotation such as 'int | None' or 'tuple[int, ...] | None'."""
    if value is None:
        return True

    def scalar(v, kind: str) -> bool:
        if kind == "int":
            return is_whole(v)
        if kind == "float":
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        return isinstance(v, {"str": str, "bool": bool}[kind])

    kind = annotation.split(" | ")[0]
    if kind.startswith("tuple["):
        inner = kind[len("tuple[") :].split(",")[0]
        return isinstance(value, tuple) and all(scalar(v, inner) for v in value)
    return scalar(value, kind)


_ANNOTATIONS = {f.name: f.annotation for f in FIELDS}


def _check_types(values: dict, source: str | None) -> None:
    for name, value in values.items():
        if not _type_ok(value, _ANNOTATIONS[name]):
            expected = _ANNOTATIONS[name].replace(" | None", "").replace("tuple[", "list of ").replace(", ...]", "")
            raise ConfigError(
                f"{source or 'config'}: field {name} is {brief(value, as_json=True)}, expected {expected}"
            )


# ---------------------------------------------------------------------- CLI
def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 config",
        description=(
            "Read a config in either released layout (a directory resolves to config.json, then "
            "inference/config.json), print its shape and check its internal relationships."
        ),
    )
    parser.add_argument("path", help="config file or checkpoint directory")
    parser.add_argument(
        "--json", metavar="OUT", help="write the flat form, the nested-only fields and the problems here"
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.path)
    except ConfigError as exc:
        print(f"dsv41 config: {exc}", file=sys.stderr)
        return 1
    problems = cfg.verify()
    print(f"{cfg.source} ({cfg.layout})")
    if not any(p.startswith("required fields missing") for p in problems):
        print(f"  {cfg.summary()}")
    if cfg.unknown_keys:
        print(f"  note: keys this schema does not model, ignored: {', '.join(cfg.unknown_keys)}")
    for p in problems:
        print(f"  [problem] {p}")
    print("  [ok] the config is self-consistent" if not problems else f"  [fail] {len(problems)} problem(s)")
    if args.json:
        report = {
            "source": cfg.source,
            "layout": cfg.layout,
            "flat": cfg.as_reference_dict(),
            "nested_only": {k: thaw(getattr(cfg, k)) for k in NESTED_ONLY_KEYS},
            "unknown_keys": list(cfg.unknown_keys),
            "problems": problems,
        }
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
        except OSError as exc:
            print(
                f"dsv41 config: cannot write {args.json} ({exc.strerror or exc}); pass --json a path in an "
                "existing, writable folder",
                file=sys.stderr,
            )
            return 1
    return 1 if problems else 0
