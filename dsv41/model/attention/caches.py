"""The attention caches: their encodings, `QuantizedCache`, and the one byte model.

Each cache's quantization is a `CacheEncoding`; how a row of it is held in memory under a
`cache_format` is its `RowLayout`, from which both `QuantizedCache` sizes its buffers and
`kv_cache_bytes` predicts a config's bytes. `cache_bytes` measures what a stack of layers
allocated (`CacheBytes`); the prediction and the measurement agree byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from ...core.config import Config
from ...kernels import act_quant, e8m0_decode, fp4_act_quant, fp4_to_float
from ..layers import straight_through

# Index-key and indexer-query FP4 blocks (E8M0 scales), compressed-KV FP4 blocks (E4M3 scales),
# and the sliding window's FP8 blocks: fixed by the trained model's fake quantization.
INDEX_FP4_BLOCK = 32
KV_FP4_BLOCK = 16
WINDOW_FP8_BLOCK = 32

# How the caches are held: "packed" (the stored formats, decoded when read) or "bf16" (the same
# values in the activation dtype, the reference runtime's buffers)
CACHE_FORMATS = ("packed", "bf16")
# The cache components, as `cache_bytes` and `csa2_stats` name them
WINDOW_RING, COMPRESSED_KV, INDEX_KEYS, COMPRESSOR_TAILS = (
    "window ring",
    "compressed KV",
    "index keys",
    "compressor tails",
)


def check_cache_format(cache_format: str) -> str:
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"cache_format must be one of {', '.join(map(repr, CACHE_FORMATS))}, got {cache_format!r}")
    return cache_format


# ---------------------------------------------------------------------------------- encodings
@dataclass(frozen=True)
class RowLayout:
    """How one cached row is held in memory: `bits` per channel plus one `scale_bytes` scale per
    `scale_block` channels (scale_block 0: no scales)."""

    name: str
    bits: int
    scale_block: int = 0
    scale_bytes: int = 0

    def data_bytes(self, dim: int) -> int:
        return dim * self.bits // 8

    def scale_bytes_for(self, dim: int) -> int:
        return dim // self.scale_block * self.scale_bytes if self.scale_block else 0


@dataclass(frozen=True)
class CacheEncoding:
    """One cache's quantization: E4M3 (`value_bits` 8) or E2M1 (4) values, one `scale_dtype` scale
    per `block` channels (E8M0: a power of two; E4M3: amax / 6 rounded to E4M3)."""

    name: str
    value_bits: int
    block: int
    scale_dtype: torch.dtype

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> (values [..., dim * value_bits / 8], scales [..., dim / block]), both as
        raw uint8 bytes: the quantizers' own (codes, scales) output."""
        if self.value_bits == 8:
            codes, scales = act_quant(x, self.block, "ue8m0", self.scale_dtype)
        else:
            codes, scales = fp4_act_quant(x, self.block, scale_dtype=self.scale_dtype)
        return codes.view(torch.uint8), scales.view(torch.uint8)

    def fake_quantize_(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to the grid in place (the reference's quantization-aware form)."""
        if self.value_bits == 8:
            return act_quant(x, self.block, "ue8m0", self.scale_dtype, inplace=True)
        return fp4_act_quant(x, self.block, inplace=True, scale_dtype=self.scale_dtype)

    def on_grid(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to the grid as a new tensor, gradient straight through (the whole-sequence
        path, which keeps no cache: `AttentionRuntime(cache=False)`)."""
        return straight_through(x, self.fake_quantize_(x.detach().clone()))

    def decode(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The bytes `quantize` returned -> [..., dim] in `dtype`: the same float32 products the
        in-place form computes (code value x scale), rounded to `dtype` the same way, so equal to
        `fake_quantize_` bit for bit."""
        if self.value_bits == 8:
            grid = values.view(torch.float8_e4m3fn).float()
        else:
            grid = fp4_to_float(values)
        if self.scale_dtype == torch.float8_e8m0fnu:
            scale = e8m0_decode(scales)
        else:
            scale = scales.view(self.scale_dtype).float()
        return (grid.unflatten(-1, (-1, self.block)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)

    def layout(self, cache_format: str) -> "RowLayout":
        """How a row is held under `cache_format`: the stored values and scales ("packed") or the
        rounded values in BF16, the activation dtype ("bf16")."""
        if check_cache_format(cache_format) == "packed":
            return RowLayout(self.name, self.value_bits, self.block, self.scale_dtype.itemsize)
        return RowLayout("BF16", 16)


WINDOW_ENCODING = CacheEncoding("FP8 E4M3 + E8M0 per 32", 8, WINDOW_FP8_BLOCK, torch.float8_e8m0fnu)
COMPRESSED_ENCODING = CacheEncoding("FP4 E2M1 + E4M3 per 16", 4, KV_FP4_BLOCK, torch.float8_e4m3fn)
INDEX_KEY_ENCODING = CacheEncoding("FP4 E2M1 + E8M0 per 32", 4, INDEX_FP4_BLOCK, torch.float8_e8m0fnu)

ENCODINGS = {WINDOW_RING: WINDOW_ENCODING, COMPRESSED_KV: COMPRESSED_ENCODING, INDEX_KEYS: INDEX_KEY_ENCODING}
# the compressor's partial group (kv_state, score_state) is pooled in float32
TAIL_DTYPE = torch.float32

Rows = Union[slice, torch.Tensor]


# ---------------------------------------------------------------------------------- caches
class QuantizedCache(nn.Module):
    """A cache of `rows` rows of `dim` channels per batch row, holding values on an encoding's grid.

    cache_format "packed": buffers `values` (E4M3 bytes, or two E2M1 codes a byte, low nibble
    first) and `scales`, both raw uint8 (torch cannot index-assign float8_e8m0fnu or
    float4_e2m1fn_x2 tensors; `stored()` views them in their own dtypes); a read decodes.
    "bf16": one buffer `values` in `dtype` (the activation dtype) of the already-rounded values.
    Either way `quantize` rounds new rows onto the grid and gives back what a read of them
    returns; `write` stores them; `read`, `save`, `load` and `reset` act on rows.
    """

    def __init__(
        self, encoding: CacheEncoding, batch: int, rows: int, dim: int, dtype: torch.dtype, cache_format: str = "packed"
    ):
        super().__init__()
        self.encoding, self.dim, self.dtype = encoding, dim, dtype
        self.cache_format = check_cache_format(cache_format)
        if cache_format == "packed":
            layout = encoding.layout(cache_format)
            self.register_buffer(
                "values", torch.zeros(batch, rows, layout.data_bytes(dim), dtype=torch.uint8), persistent=False
            )
            self.register_buffer(
                "scales", torch.zeros(batch, rows, layout.scale_bytes_for(dim), dtype=torch.uint8), persistent=False
            )
        else:
            self.register_buffer("values", torch.zeros(batch, rows, dim, dtype=dtype), persistent=False)

    @property
    def packed(self) -> bool:
        return self.cache_format == "packed"

    @property
    def rows(self) -> int:
        return self.values.size(1)

    def _buffers_(self) -> tuple[torch.Tensor, ...]:
        return (self.values, self.scales) if self.packed else (self.values,)

    def quantize(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """x [b, n, dim] -> (what `write` stores, x on the grid in `dtype`). The packed bytes
        decode to exactly the in-place quantizer's values; "bf16" rounds x in place (returned)."""
        if not self.packed:
            self.encoding.fake_quantize_(x)
            return (x,), x
        parts = self.encoding.quantize(x)
        return parts, self.encoding.decode(*parts, x.dtype)

    def write(self, rows: Rows, parts: tuple[torch.Tensor, ...]) -> None:
        """Store `quantize`'s parts [b, n, ...] at `rows` (a slice or positions) of batch rows :b."""
        for buf, part in zip(self._buffers_(), parts):
            buf[: part.size(0), rows] = part

    def read(self, bsz: int, n: Optional[int] = None) -> torch.Tensor:
        """Rows :n (all by default) of batch rows :bsz, [bsz, n, dim] in `dtype`."""
        if not self.packed:
            return self.values[:bsz, :n]
        return self.encoding.decode(self.values[:bsz, :n], self.scales[:bsz, :n], self.dtype)

    def gather(self, bsz: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (positions, any order) of batch rows :bsz, [bsz, len(rows), dim] in `dtype`."""
        rows = rows.long()
        if not self.packed:
            return self.values[:bsz, rows]
        return self.encoding.decode(self.values[:bsz, rows], self.scales[:bsz, rows], self.dtype)

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The buffers in their own dtypes: (E4M3 or float4_e2m1fn_x2 values, E8M0 or E4M3 scales)
        packed; (values,) in `dtype` for "bf16"."""
        if not self.packed:
            return (self.values,)
        value_dtype = torch.float8_e4m3fn if self.encoding.value_bits == 8 else torch.float4_e2m1fn_x2
        return self.values.view(value_dtype), self.scales.view(self.encoding.scale_dtype)

    def save(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        """Copies of `rows` of every batch row, for `load`."""
        return tuple(buf[:, rows].clone() for buf in self._buffers_())

    def load(self, rows: Rows, saved: tuple[torch.Tensor, ...]) -> None:
        for buf, part in zip(self._buffers_(), saved):
            buf[:, rows] = part

    def reset(self) -> None:
        """Every row back to zeros (a packed zero row decodes to +0.0, as a BF16 one holds)."""
        for buf in self._buffers_():
            buf.zero_()

    def nbytes(self) -> dict[str, int]:
        """Allocated bytes: {'data': values, 'scales': scales (0 for "bf16")}."""
        return {
            "data": self.values.numel() * self.values.element_size(),
            "scales": self.scales.numel() * self.scales.element_size() if self.packed else 0,
        }

    def extra_repr(self) -> str:
        held = self.encoding.name if self.packed else f"{self.dtype} values on the {self.encoding.name} grid"
        return f"{self.rows} rows x {self.dim}, {held}"


# ---------------------------------------------------------------------------------- cache bytes
CACHE_PARTS = (
    "window ring data",
    "window ring scales",
    "compressed KV data",
    "compressed KV scales",
    "index key data",
    "index key scales",
    COMPRESSOR_TAILS,
)
_PART_OF = {
    WINDOW_RING: ("window ring data", "window ring scales"),
    COMPRESSED_KV: ("compressed KV data", "compressed KV scales"),
    INDEX_KEYS: ("index key data", "index key scales"),
    COMPRESSOR_TAILS: (COMPRESSOR_TAILS,),
}
LONG_TERM = (COMPRESSED_KV, INDEX_KEYS)


@dataclass(frozen=True)
class CacheBytes:
    """What the attention caches of a stack of layers allocated, measured from their buffers.

    parts: bytes by part (CACHE_PARTS: data and scales of each cache, the compressor tails) over all
    `max_batch_size` rows; components: the same by cache (window ring, compressed KV, index keys,
    compressor tails). sources: per Full layer (layer, ratio, positions its caches hold: rows x
    ratio = max_seq_len rounded down to whole groups, compressed-KV bytes, index-key bytes).

    The compressed KV and index keys grow with the context (one row per `ratio` positions); the
    window rings and compressor tails are `fixed`. `per_token`: the growing caches' bytes per
    position of one sequence, each source's bytes over max_batch_size x the positions it holds, by
    component and in 'total' (on the released geometry, packed: 890, the model card's number)."""

    cache_format: str
    max_batch_size: int
    max_seq_len: int
    parts: dict
    sources: tuple

    @property
    def components(self) -> dict[str, int]:
        return {c: sum(self.parts[p] for p in parts) for c, parts in _PART_OF.items()}

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def long_term(self) -> int:
        return sum(self.components[c] for c in LONG_TERM)

    @property
    def fixed(self) -> int:
        return self.total - self.long_term

    @property
    def per_token_by_source(self) -> dict[int, float]:
        """{Full layer: (its compressed KV + index keys) bytes per position of one sequence}."""
        return {
            layer: (kv + keys) / (self.max_batch_size * positions)
            for layer, _, positions, kv, keys in self.sources
            if positions
        }

    @property
    def per_token(self) -> dict[str, float]:
        out = {
            c: sum(s[3 + i] / (self.max_batch_size * s[2]) for s in self.sources if s[2])
            for i, c in enumerate(LONG_TERM)
        }
        out["total"] = sum(out.values())
        return out

    def summary(self) -> str:
        per = self.per_token
        return (
            f"attention caches ({self.cache_format}, batch {self.max_batch_size} x {self.max_seq_len} positions): "
            f"{self.total:,} B = {self.long_term:,} B growing ({per[COMPRESSED_KV]:g} B/token compressed KV + "
            f"{per[INDEX_KEYS]:g} B/token index keys = {per['total']:g} B/token) + {self.fixed:,} B fixed "
            f"({self.components[WINDOW_RING]:,} window rings, "
            f"{self.components[COMPRESSOR_TAILS]:,} compressor tails)"
        )


def cache_bytes(layers) -> CacheBytes:
    """`CacheBytes` of the Attention layers `layers` (one stack: same format and sizes)."""
    layers = list(layers)
    if not layers:
        raise ValueError("cache_bytes needs at least one Attention layer")
    first = layers[0]
    parts = dict.fromkeys(CACHE_PARTS, 0)
    sources = []
    for layer in layers:
        mine = layer.cache_bytes()
        for k, v in mine.items():
            parts[k] += v
        if layer.compressor is not None:
            rows = layer.compress_kv_cache.rows
            sources.append(
                (
                    layer.layer,
                    layer.ratio,
                    rows * layer.ratio,
                    sum(mine[p] for p in _PART_OF[COMPRESSED_KV]),
                    sum(mine[p] for p in _PART_OF[INDEX_KEYS]),
                )
            )
    return CacheBytes(
        cache_format=first.cache_format,
        max_batch_size=first.max_batch_size,
        max_seq_len=first.max_seq_len,
        parts=parts,
        sources=tuple(sources),
    )


# ---------------------------------------------------------------------------------- predicted bytes
# which holding of the prediction describes the buffers of each cache_format: the trained model's
# stored formats, or the reference runtime's BF16 buffers of the already-rounded values
HOLDING = {"packed": "stored", "bf16": "runtime"}
STORED = {name: enc.layout("packed") for name, enc in ENCODINGS.items()}
RUNTIME = {name: enc.layout("bf16") for name, enc in ENCODINGS.items()}
TAIL_BYTES = TAIL_DTYPE.itemsize


@dataclass(frozen=True)
class SourceBytes:
    """One KV source layer (a Full layer): bytes of one compressed entry (a latent and its index
    key) and, divided by the ratio, per token of context."""

    layer: int
    ratio: int
    kv_data: int
    kv_scales: int
    key_data: int
    key_scales: int

    @property
    def per_entry(self) -> int:
        return self.kv_data + self.kv_scales + self.key_data + self.key_scales

    @property
    def per_token(self) -> float:
        return self.per_entry / self.ratio

    def per_token_by_component(self) -> dict[str, float]:
        return {
            "compressed KV data": self.kv_data / self.ratio,
            "compressed KV scales": self.kv_scales / self.ratio,
            "index key data": self.key_data / self.ratio,
            "index key scales": self.key_scales / self.ratio,
        }

    def entries(self, context: int) -> int:
        return context // self.ratio


@dataclass(frozen=True)
class KVCacheBytes:
    """KV-cache bytes of a config, by component. Per token: the compressed KV and index keys of
    each KV source (one entry per `ratio` tokens). Fixed, whatever the context: one window ring of
    `window_size` entries per backbone layer and the float32 partial-group tail of each ratio > 1
    compressor. `total(context)` counts whole groups only, as the caches do."""

    holding: str  # 'stored' | 'runtime'
    encodings: dict
    sources: tuple[SourceBytes, ...]
    window_entry: int  # bytes of one window entry
    window_size: int
    n_window_rings: int
    tail_bytes: dict  # {source layer: bytes}, ratio > 1 only

    @property
    def per_token(self) -> float:
        return sum(s.per_token for s in self.sources)

    @property
    def window_ring_bytes(self) -> int:
        return self.window_entry * self.window_size * self.n_window_rings

    @property
    def fixed(self) -> int:
        return self.window_ring_bytes + sum(self.tail_bytes.values())

    def total(self, context: int) -> int:
        return self.fixed + sum(s.entries(context) * s.per_entry for s in self.sources)

    def components(self, context: int) -> dict[str, int]:
        """Bytes at `context` tokens: window rings, compressor tails, and per source its KV and keys."""
        out = {WINDOW_RING: self.window_ring_bytes, COMPRESSOR_TAILS: sum(self.tail_bytes.values())}
        for s in self.sources:
            n = s.entries(context)
            out[f"layer {s.layer} {COMPRESSED_KV}"] = n * (s.kv_data + s.kv_scales)
            out[f"layer {s.layer} {INDEX_KEYS}"] = n * (s.key_data + s.key_scales)
        return out

    def formula(self, cfg: Config) -> list[str]:
        """The arithmetic, one line per term, with this config's numbers in it."""
        e = self.encodings
        lines = []
        for name, dim in ((COMPRESSED_KV, cfg.head_dim), (INDEX_KEYS, cfg.index_head_dim), (WINDOW_RING, cfg.head_dim)):
            enc = e[name]
            scale = f" + {dim}/{enc.scale_block} x {enc.scale_bytes} B scales" if enc.scale_block else ""
            lines.append(
                f"{name} entry ({enc.name}): {dim} x {enc.bits}/8 B{scale} = "
                f"{enc.data_bytes(dim) + enc.scale_bytes_for(dim)} B"
            )
        for s in self.sources:
            lines.append(
                f"layer {s.layer} (ratio {s.ratio}): ({s.kv_data + s.kv_scales} + {s.key_data + s.key_scales}) "
                f"/ {s.ratio} = {s.per_token:g} B per token"
            )
        lines.append(f"per token: {' + '.join(f'{s.per_token:g}' for s in self.sources)} = {self.per_token:g} B")
        lines.append(
            f"window rings (fixed): {self.n_window_rings} layers x {self.window_size} x {self.window_entry} B "
            f"= {self.window_ring_bytes:,} B"
        )
        if self.tail_bytes:
            lines.append(
                f"compressor tails (fixed, float32 kv_state + score_state): "
                f"{' + '.join(f'{b:,}' for b in self.tail_bytes.values())} = {sum(self.tail_bytes.values()):,} B"
            )
        return lines


def kv_cache_bytes(cfg: Config, holding: str = "stored") -> KVCacheBytes:
    """KV-cache bytes of `cfg` (backbone layers, batch 1). holding='stored': the trained model's
    formats (window FP8 + E8M0 per 32, compressed KV FP4 + E4M3 per 16, index keys FP4 + E8M0 per
    32), which is what cache_format="packed" (the default) allocates; 'runtime': BF16 everywhere,
    what cache_format="bf16" (the reference runtime's buffers) allocates."""
    if holding not in ("stored", "runtime"):
        raise ValueError(f"holding must be 'stored' or 'runtime', got {holding!r}")
    enc = STORED if holding == "stored" else RUNTIME
    sources = []
    tails = {}
    for layer in cfg.kv_source_layers:
        ratio = cfg.compress_ratios[layer]
        kv, key = enc[COMPRESSED_KV], enc[INDEX_KEYS]
        sources.append(
            SourceBytes(
                layer,
                ratio,
                kv.data_bytes(cfg.head_dim),
                kv.scale_bytes_for(cfg.head_dim),
                key.data_bytes(cfg.index_head_dim),
                key.scale_bytes_for(cfg.index_head_dim),
            )
        )
        if ratio > 1:
            tails[layer] = 2 * ratio * cfg.head_dim * TAIL_BYTES
    win = enc[WINDOW_RING]
    return KVCacheBytes(
        holding=holding,
        encodings=dict(enc),
        sources=tuple(sources),
        window_entry=win.data_bytes(cfg.head_dim) + win.scale_bytes_for(cfg.head_dim),
        window_size=cfg.window_size,
        n_window_rings=cfg.n_layers,
        tail_bytes=tails,
    )
