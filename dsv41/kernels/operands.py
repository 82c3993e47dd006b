"""The one shape and dtype check of a packed-weight product, shared by every expert kernel (the
fused CPU path in experts.py and the Triton kernels in triton_experts.py)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .gemm import FP4_WEIGHT_BLOCK

_BLOCK = FP4_WEIGHT_BLOCK  # both formats scale blocks of 32 values along K
_FP4_DTYPES = (torch.float4_e2m1fn_x2, torch.uint8, torch.int8)  # packed FP4 as stored or viewed


class Operands(NamedTuple):
    """What `check_operands` found in one product's operands."""

    fp4: bool  # packed FP4 weight; False: FP8 E4M3
    m: int  # tokens (the activation's leading dims flattened)
    n: int  # weight rows
    k: int

    @property
    def rows_per_scale(self) -> int:
        """Weight rows sharing one row of block scales: FP8 scales 32x32 blocks."""
        return 1 if self.fp4 else _BLOCK


_FP4_NAME = "packed FP4 (float4_e2m1fn_x2, uint8 or int8)"


def check_operands(
    a: torch.Tensor,
    a_s: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    act_block: int = 32,
    kind: Optional[str] = None,
) -> Operands:
    """The one shape and dtype check of a packed-weight product, for every kernel here and in
    triton_experts: FP8 E4M3 activations a [..., K] with scales a_s [..., K/act_block] against a
    packed FP4 weight [N, K/2] with scales [N, K/32] or an FP8 E4M3 weight [N, K] with scales
    [ceil(N/32), K/32]. `kind` "fp4" or "fp8" admits that weight format only."""
    if w.dtype in _FP4_DTYPES and kind != "fp8":
        fp4 = True
    elif w.dtype == torch.float8_e4m3fn and kind != "fp4":
        fp4 = False
    else:
        wanted = {"fp4": _FP4_NAME, "fp8": "float8_e4m3fn"}.get(kind, f"{_FP4_NAME} or float8_e4m3fn")
        raise TypeError(f"weight must be {wanted}, got {w.dtype}")
    if a.dtype != torch.float8_e4m3fn:
        raise TypeError(f"activations must be float8_e4m3fn (quantize with act_quant), got {a.dtype}")
    k = a.size(-1)
    if k % act_block or act_block % _BLOCK:
        raise ValueError(f"K={k} and act_block_size={act_block} must be multiples of {_BLOCK}")
    if not fp4 and act_block != _BLOCK:
        raise ValueError(f"the fused FP8 path takes 32x32 weight blocks, got {act_block}")
    m, n = a.numel() // k, w.size(0)
    if w.dim() != 2 or w.size(1) * (2 if fp4 else 1) != k:
        raise ValueError(f"packed weight {list(w.shape)} does not hold K={k} values per row")
    scale_rows = n if fp4 else -(-n // _BLOCK)
    if tuple(s.shape) != (scale_rows, k // _BLOCK):
        raise ValueError(f"weight scales must be [{scale_rows}, {k // _BLOCK}], got {list(s.shape)}")
    if a_s.numel() != m * (k // act_block):
        raise ValueError(f"activation scales {list(a_s.shape)} are not one per {act_block} values of {list(a.shape)}")
    return Operands(fp4, m, n, k)
