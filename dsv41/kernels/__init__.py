"""The op layer: reference arithmetic for the model's quantizers, GEMMs, attention and mHC split.

Plain PyTorch, any device torch supports for these dtypes; written for fidelity to the released
kernels' quantization points and reduction orders, not for speed.
"""

from .attention import SCORE_FLOOR, SPARSE_ATTN_CHUNK, masked_attention, sparse_attn
from .codecs import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    fp4_to_float,
    pack_fp4,
    pow2_ceil,
    to_e4m3,
    unpack_fp4,
)
from .gemm import FP4_WEIGHT_BLOCK, LINEAR_KERNELS, fp4_gemm, fp8_gemm, linear
from .hyper import hc_split_sinkhorn
from .quant import act_quant, fp4_act_quant

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP4_WEIGHT_BLOCK",
    "LINEAR_KERNELS",
    "SCORE_FLOOR",
    "SPARSE_ATTN_CHUNK",
    "act_quant",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_decode",
    "e8m0_encode",
    "fp4_act_quant",
    "fp4_gemm",
    "fp4_to_float",
    "fp8_gemm",
    "hc_split_sinkhorn",
    "linear",
    "masked_attention",
    "pack_fp4",
    "pow2_ceil",
    "sparse_attn",
    "to_e4m3",
    "unpack_fp4",
]
