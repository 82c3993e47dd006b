"""Bit-level codecs for the three narrow formats the checkpoint and the ops use.

FP8 E4M3 (values, and the compressed-KV scales), FP4 E2M1 (values, two per byte) and
E8M0 (power-of-two scales). Everything here is elementwise and exact: a value that is
representable in the target format survives a round trip bit for bit.
"""

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0

# Magnitudes of the eight E2M1 codes 0..7; bit 3 of a code is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Value of each of the 16 codes, negative half included (code 8 is -0.0).
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)
# Halfway points between consecutive magnitudes: the rounding boundaries.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn, nearest-even, saturating at ±448 instead of overflowing."""
    # the hardware conversion the ops model saturates; clamping first makes that explicit
    # rather than relying on what a given torch build does with out-of-range values
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(x)) for positive float32 x, read off the IEEE-754 bits."""
    # exponent field plus one when any mantissa bit is set; an exact power of two keeps its
    # exponent. Subnormal inputs land on 2**-126, which the amax floors never go below.
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    biased = biased + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (biased << 23).view(torch.float32)


def e8m0_encode(pow2: torch.Tensor) -> torch.Tensor:
    """float32 powers of two -> float8_e8m0fnu, by taking the exponent field as the byte."""
    bits = pow2.to(torch.float32).contiguous().view(torch.int32)
    # 2**-127 is an fp32 subnormal whose exponent field is 0, which is also its E8M0 byte
    return ((bits >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its raw uint8 bytes) -> float32 2**(byte - 127); byte 255 is NaN."""
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.uint8)
    biased = raw.to(torch.int32)
    value = torch.where(biased == 0, 0x00400000, biased << 23).view(torch.float32)
    return torch.where(biased == 255, torch.nan, value)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float values already within ±6 -> 4-bit E2M1 codes (uint8), round-to-nearest-even."""
    magnitude = x.float().abs()
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    # number of boundaries strictly below the magnitude = the code when rounding ties down
    code = torch.bucketize(magnitude, midpoints, right=False)
    # an exact tie sits on boundary `code`, between codes `code` and `code + 1`: nearest-even
    # takes the one whose mantissa bit (bit 0) is clear, so move up when `code` is odd
    on_boundary = magnitude == midpoints[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (on_boundary & (code % 2 == 1)).to(code.dtype)
    # the sign survives rounding to zero, as it does in the hardware conversion
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, low nibble) -> float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes & 0x0F).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> float4_e2m1fn_x2 [..., K/2], element 2i in the low nibble."""
    if codes.size(-1) % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {codes.size(-1)}")
    codes = codes.to(torch.uint8)
    packed = (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 (or uint8) [..., K/2] -> uint8 codes [..., K], low nibble first."""
    raw = packed.contiguous().view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1)  # [..., K/2, 2]
    return codes.flatten(-2)


def fp4_to_float(packed: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [..., K/2] -> float32 [..., K] (unscaled E2M1 values)."""
    raw = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=raw.device)
    # one lookup per byte instead of per nibble: row b of `pairs` is (low nibble, high nibble)
    pairs = torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=-1)  # [256, 2]
    values = pairs.index_select(0, raw.flatten().int())  # [bytes, 2]
    return values.view(*raw.shape[:-1], raw.size(-1) * 2)
