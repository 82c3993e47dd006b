"""Block-wise activation quantization to FP8 E4M3 and FP4 E2M1.

Both quantizers group the last dimension into fixed blocks, take one scale per block from the
block's absolute maximum, and either return (codes, scales) or, with ``inplace=True``, write the
quantize-dequantize result back into the input. The in-place form is how the model applies
quantization-aware noise to tensors it keeps in bf16 (the sliding-window KV, the indexer's
queries and keys, the compressed KV).
"""

from typing import Optional, Tuple, Union

import torch

from .codecs import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, e8m0_encode, pack_fp4, pow2_ceil, to_e4m3

# Floors on a block's amax. FP8: keeps an all-zero block's scale finite.
_FP8_AMAX_FLOOR = 1e-4
# FP4 with E8M0 scales: the smallest amax whose scale is still a normal float32.
_FP4_E8M0_AMAX_FLOOR = 6 * 2.0**-126
# FP4 with E4M3 scales: amax/6 then equals 2**-9, the smallest E4M3 subnormal, so even an
# all-zero block stores a nonzero scale that can be divided out again.
_FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9

Quantized = Tuple[torch.Tensor, torch.Tensor]


def _f32(value: float, device: torch.device) -> torch.Tensor:
    """A float32 scalar tensor, so reciprocals are rounded to float32 exactly once."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    if x.size(-1) % block_size:
        raise ValueError(f"last dimension {x.size(-1)} is not a multiple of block_size {block_size}")
    return x.float().contiguous().unflatten(-1, (-1, block_size))  # [..., n_blocks, block_size]


def act_quant(
    x: torch.Tensor,
    block_size: int = 32,
    scale_fmt: Optional[str] = "ue8m0",
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
    inplace: bool = False,
) -> Union[Quantized, torch.Tensor]:
    """FP8 E4M3 quantization per block of the last dim; returns (fp8 [..., N], scales [..., N/block])."""
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    power_of_two = scale_fmt is not None
    if scale_dtype == torch.float8_e8m0fnu and not power_of_two:
        raise ValueError("E8M0 scales need scale_fmt='ue8m0': an arbitrary float32 scale does not fit")

    if (
        not inplace
        and power_of_two
        and scale_dtype == torch.float8_e8m0fnu
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and block_size % 32 == 0
        and x.size(-1) % block_size == 0
        and x.numel() > 0
    ):
        from . import native

        kernels = native.load()
        if kernels is not None:  # the same bytes as below, several times faster
            return kernels.act_quant(x, block_size)
    return _act_quant_torch(x, block_size, power_of_two, scale_dtype, inplace)


def _act_quant_torch(
    x: torch.Tensor, block_size: int, power_of_two: bool, scale_dtype: torch.dtype, inplace: bool
) -> Union[Quantized, torch.Tensor]:
    """act_quant in tensor operations: the definition the native kernel follows byte for byte."""
    blocks = _blocks(x, block_size)
    amax = blocks.abs().amax(dim=-1).clamp_min(_FP8_AMAX_FLOOR)  # [..., n_blocks]
    # multiply by the float32 reciprocal of 448, then (ue8m0) round the scale up to a power of two
    scale = amax * _f32(1.0 / E4M3_MAX, amax.device)
    if power_of_two:
        scale = pow2_ceil(scale)
    codes = to_e4m3(blocks / scale.unsqueeze(-1))

    if inplace:
        x.copy_((codes.float() * scale.unsqueeze(-1)).flatten(-2))
        return x
    stored = e8m0_encode(scale) if scale_dtype == torch.float8_e8m0fnu else scale.to(scale_dtype)
    return codes.flatten(-2), stored


def fp4_act_quant(
    x: torch.Tensor,
    block_size: int = 32,
    inplace: bool = False,
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
) -> Union[Quantized, torch.Tensor]:
    """FP4 E2M1 quantization per block; returns (float4_e2m1fn_x2 [..., N/2], scales [..., N/block])."""
    blocks = _blocks(x, block_size)
    amax = blocks.abs().amax(dim=-1)  # [..., n_blocks]
    if scale_dtype == torch.float8_e8m0fnu:
        scale = pow2_ceil(amax.clamp_min(_FP4_E8M0_AMAX_FLOOR) * _f32(1.0 / E2M1_MAX, amax.device))
    elif scale_dtype == torch.float8_e4m3fn:
        # the ratio amax/6 itself rounded to E4M3 (not a power of two, and not amax itself)
        scale = to_e4m3(amax.clamp_min(_FP4_E4M3_AMAX_FLOOR) / E2M1_MAX).float()
    else:
        raise ValueError(f"scale_dtype must be float8_e8m0fnu or float8_e4m3fn, got {scale_dtype}")
    # an E4M3 scale can round below amax/6, so the ratio can exceed 6 and must saturate
    codes = e2m1_encode((blocks / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))

    if inplace:
        x.copy_((e2m1_decode(codes) * scale.unsqueeze(-1)).flatten(-2))
        return x
    stored = e8m0_encode(scale) if scale_dtype == torch.float8_e8m0fnu else scale.to(torch.float8_e4m3fn)
    return pack_fp4(codes.flatten(-2)), stored
