"""Storage encodings of the release: how a float weight becomes the bytes a shard holds, and back.

Three layouts, all with power-of-two E8M0 scales (byte b means 2**(b - 127)):

- FP8 block: F8_E4M3 weight [R, C] with one scale per 32x32 block, F8_E8M0 [ceil(R/32), ceil(C/32)].
  Dense linears of attention, shared experts, MTP projections, Engram `wkv`.
- Engram rows: the same FP8 encoding with a 1x32 block, so a gathered row dequantizes alone:
  F8_E4M3 [rows, D] with F8_E8M0 [rows, D/32].
- FP4 experts: routed experts as I8 [N, K/2], each byte two E2M1 values (element 2i in the low
  nibble, as torch.float4_e2m1fn_x2 lays them out), with F8_E8M0 [N, K/32], one scale per 32
  along K.

A scale is the smallest power of two that brings its block's amax inside the format's range (448
for E4M3, 6 for E2M1), so quantizing never clips. Dequantizing is `values.float() * scale` per
block, which is how the reference runtime reads these tensors; the loader calls `dequantize`.
Everything here is exact arithmetic on fixed inputs, so the bytes are the same on every machine.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from dsv41.core.cachedir import current_umask

# the bit-level codecs are the op layer's: one E2M1 rounding rule for weights and activations
from dsv41.kernels.codecs import E2M1_MAX, E4M3_MAX, e2m1_encode, e8m0_decode, fp4_to_float, pack_fp4

FP8_BLOCK = (32, 32)
ENGRAM_BLOCK = (1, 32)
FP4_BLOCK = 32
# E8M0 spans 2**-127 .. 2**127; byte 255 is NaN and never written.
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127

# safetensors dtype names of the release <-> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name ("F8_E4M3" -> torch.float8_e4m3fn)."""
    try:
        return SAFETENSORS_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {name!r}; known: {', '.join(SAFETENSORS_DTYPES)}") from None


# ---------------------------------------------------------------------- scales
def pow2_exponent(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """int32 e = ceil(log2(amax / max_value)), clamped to E8M0's range; an all-zero block gets the
    smallest scale (any scale reproduces zeros)."""
    ratio = amax.to(torch.float64) / max_value  # float64: exact for every float32 amax
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    # an exact power of two (mantissa 0.5) needs no rounding up
    e = exponent - (mantissa == 0.5).to(exponent.dtype)
    e = torch.where(ratio > 0, e, torch.full_like(e, E8M0_MIN_EXP))
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu holding 2**e (biased byte e + 127)."""
    return (e.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _exp2(e: torch.Tensor) -> torch.Tensor:
    # 2**e in float64 is exact across the whole E8M0 range
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), e.to(torch.float64))


# ---------------------------------------------------------------------- FP8 blocks
def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = x.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = x.abs()
    return padded.view(nr, br, nc, bc).amax(dim=(1, 3))  # [nr, nc]


def _expand(blocks: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    br, bc = block
    return blocks.repeat_interleave(br, dim=0)[: shape[0]].repeat_interleave(bc, dim=1)[:, : shape[1]]


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] -> (float8_e4m3fn [R, C], float8_e8m0fnu [ceil(R/br), ceil(C/bc)])."""
    if weight.ndim != 2:
        raise ValueError(f"FP8 block quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    x = weight.detach().to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize a weight holding NaN or inf")
    e = pow2_exponent(_block_amax(x, block), E4M3_MAX)
    scaled = x.to(torch.float64) / _expand(_exp2(e), block, tuple(x.shape))  # exact: power-of-two divisor
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float32).to(torch.float8_e4m3fn)
    return q, e8m0_from_exponent(e)


def infer_fp8_block(weight_shape, scale_shape) -> tuple[int, int]:
    """The block a FP8 weight was quantized with, from the two shapes: 32x32 or a 1x32 row block."""
    rows, cols = weight_shape
    srows, scols = scale_shape
    if -(-cols // 32) != scols:
        raise ValueError(
            f"scale {list(scale_shape)} does not fit weight {list(weight_shape)} with 32 columns per block"
        )
    if srows == rows:
        return ENGRAM_BLOCK
    if srows == -(-rows // 32):
        return FP8_BLOCK
    raise ValueError(f"scale {list(scale_shape)} does not fit weight {list(weight_shape)} with a 1x32 or 32x32 block")


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float8_e4m3fn [R, C] with E8M0 block scales -> `dtype` [R, C] (block inferred when None)."""
    block = block or infer_fp8_block(tuple(weight.shape), tuple(scale.shape))
    values = weight.float() * _expand(e8m0_decode(scale), block, tuple(weight.shape))
    return values.to(dtype)


def quantize_engram_table(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, D] -> (float8_e4m3fn [rows, D], float8_e8m0fnu [rows, D/32]): per-row 1x32 blocks."""
    return quantize_fp8_blocks(table, ENGRAM_BLOCK)


def dequantize_engram_rows(
    rows: torch.Tensor, scales: Optional[torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Gathered Engram rows [..., D] with their scales [..., D/32] -> `dtype` [..., D]; scales None:
    the rows are values already (a table of float32 master weights, training's)."""
    if scales is None:
        return rows.to(dtype)
    values = rows.float().unflatten(-1, (-1, ENGRAM_BLOCK[1])) * e8m0_decode(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


# ---------------------------------------------------------------------- FP4 experts
def quantize_fp4(weight: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K/2] holding two E2M1 values per byte, float8_e8m0fnu [N, K/block])."""
    if weight.ndim != 2 or weight.shape[1] % block:
        raise ValueError(f"FP4 quantization takes [N, K] with K a multiple of {block}, got {tuple(weight.shape)}")
    x = weight.detach().to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize a weight holding NaN or inf")
    groups = x.unflatten(-1, (-1, block))  # [N, K/block, block]
    e = pow2_exponent(groups.abs().amax(dim=-1), E2M1_MAX)  # [N, K/block]
    scaled = (groups.to(torch.float64) / _exp2(e).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = e2m1_encode(scaled.to(torch.float32).flatten(-2))  # [N, K] uint8
    packed = pack_fp4(codes).view(torch.int8)  # [N, K/2], as the release stores it
    return packed, e8m0_from_exponent(e)


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """int8 / uint8 / float4_e2m1fn_x2 [..., K/2] -> unscaled float32 E2M1 values [..., K]."""
    return fp4_to_float(packed.contiguous().view(torch.uint8))


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed FP4 [N, K/2] with E8M0 [N, K/block] -> `dtype` [N, K]."""
    values = fp4_values(packed)
    if values.shape[-1] != scale.shape[-1] * block:
        raise ValueError(
            f"FP4 weight {list(packed.shape)} (K = {values.shape[-1]}) does not match "
            f"scale {list(scale.shape)} with {block} values per scale"
        )
    out = values.unflatten(-1, (-1, block)) * e8m0_decode(scale).unsqueeze(-1)
    return out.flatten(-2).to(dtype)


# ---------------------------------------------------------------------- dispatch
def dequantize(
    weight: torch.Tensor, scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Any stored weight -> `dtype`: FP4 (I8 / float4 x2) and FP8 (E4M3) use their scale; plain
    floats are only cast."""
    if weight.dtype in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        if scale is None:
            raise ValueError("a packed FP4 weight needs its scale")
        return dequantize_fp4(weight, scale, dtype=dtype)
    if weight.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("an FP8 weight needs its scale")
        return dequantize_fp8_blocks(weight, scale, dtype=dtype)
    return weight.to(dtype)


# ---------------------------------------------------------------------- files
def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write one shard with the `safetensors` library (which handles F8_E4M3 and F8_E8M0); the
    bytes depend only on the tensors and the metadata."""
    from safetensors.torch import save_file

    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} is not one the release stores")
    save_file(
        {name: t.contiguous() for name, t in tensors.items()},
        path,
        metadata={"format": "pt"} if metadata is None else metadata,
    )
    # the library creates the file owner-only; give it the mode any other file written here gets
    os.chmod(path, 0o666 & ~current_umask())
