"""Triton kernels for the packed-FP4 expert GEMMs, and `fp4_gemm_triton`, the product that
`experts.routed_experts` runs for weights on CUDA.

Two kernels read the checkpoint's bytes directly (two E2M1 codes per byte, an E8M0 byte per 32
values along K) and follow the reference `fp4_gemm` step for step: per 32-value block one float32
partial product, multiplied by the activation scale and then the weight scale, added into a
float32 accumulator. E2M1 and E4M3 values are exact in float16, so the prefill kernel's
`tl.dot` on fp16 operands forms the same products; only the order of float32 additions differs.
(fp16 rather than bf16: Triton's CPU interpreter, which the tests run, mis-multiplies bf16 dots.)

- `_fp4_gemv_kernel`: a few tokens (decode); one program per (row tile, token), several K blocks
  per step, no tensor cores.
- `_fp4_gemm_kernel`: many tokens (prefill); (token tile, row tile) programs, `tl.dot` per block.

`TRITON_INTERPRET=1` (set before this module is imported) runs both on CPU tensors, which is how
the tests check them without a GPU. Placement (which experts go to which GPU) is
`experts.expert_devices` / `experts.device_for`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .operands import check_operands

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs none of this
    triton = None

# Token counts up to this use the GEMV kernel (each program streams its rows once per token).
GEMV_MAX_TOKENS = 4


def unavailable_reason() -> Optional[str]:
    """Why the Triton kernels cannot run on a GPU here, in a few words; None when they can."""
    if triton is None:
        return "Triton is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def available() -> bool:
    """True when the Triton kernels can run on a GPU here: Triton imports and CUDA is present."""
    return unavailable_reason() is None


if triton is not None:

    @triton.jit
    def _e2m1(code):
        """4-bit E2M1 codes (any int type, low nibble) -> float32 values."""
        c = code.to(tl.int32) & 15
        e = (c >> 1) & 3
        m = c & 1
        # 4 * |value|: m * 2 when e == 0, (2 + m) * 2**e otherwise
        four = tl.where(e == 0, 2 * m, (2 + m) << e)
        v = four.to(tl.float32) * 0.25
        return tl.where((c & 8) != 0, -v, v)

    @triton.jit
    def _e8m0(byte):
        """E8M0 bytes -> float32 2**(byte - 127); byte 0 is the subnormal 2**-127, 255 is NaN."""
        b = byte.to(tl.int32)
        bits = tl.where(b == 0, 0x00400000, b << 23)
        bits = tl.where(b == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_gemv_kernel(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        N,
        NB,
        stride_am,
        stride_asm,
        stride_wn,
        stride_wsn,
        stride_cm,
        BLOCK_N: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        m = tl.program_id(1)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_b = tl.arange(0, BLOCKS)
        offs_h = tl.arange(0, 16)  # byte within a block: values 2h (low nibble) and 2h + 1
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for kb0 in range(0, NB, BLOCKS):
            kb = kb0 + offs_b  # [BLOCKS]
            mask_b = kb < NB
            w_mask = mask_n[:, None, None] & mask_b[None, :, None]
            wb = tl.load(
                w_ptr + offs_n[:, None, None] * stride_wn + kb[None, :, None] * 16 + offs_h[None, None, :],
                mask=w_mask,
                other=0,
            )  # [BLOCK_N, BLOCKS, 16] bytes
            a_base = a_ptr + m * stride_am + kb[:, None] * 32 + 2 * offs_h[None, :]
            a_even = tl.load(a_base, mask=mask_b[:, None], other=0.0)  # [BLOCKS, 16]
            a_odd = tl.load(a_base + 1, mask=mask_b[:, None], other=0.0)
            part = tl.sum(_e2m1(wb) * a_even[None, :, :], axis=2) + tl.sum(_e2m1(wb >> 4) * a_odd[None, :, :], axis=2)
            a_sc = tl.load(as_ptr + m * stride_asm + kb, mask=mask_b, other=0.0)  # [BLOCKS]
            w_sc = _e8m0(
                tl.load(
                    ws_ptr + offs_n[:, None] * stride_wsn + kb[None, :],
                    mask=mask_n[:, None] & mask_b[None, :],
                    other=127,
                )
            )  # [BLOCK_N, BLOCKS]
            part = part * a_sc[None, :]  # activation scale first, then the weight's, as the reference
            part = part * w_sc
            acc += tl.sum(part, axis=1)
        tl.store(c_ptr + m * stride_cm + offs_n, acc, mask=mask_n)

    @triton.jit
    def _fp4_gemm_kernel(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        M,
        N,
        NB,
        stride_am,
        stride_asm,
        stride_wn,
        stride_wsn,
        stride_cm,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        offs_h = tl.arange(0, 16)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, NB):
            wb = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + kb * 16 + offs_h[None, :], mask=mask_n[:, None], other=0
            )  # [BLOCK_N, 16]
            a_base = a_ptr + offs_m[:, None] * stride_am + kb * 32 + 2 * offs_h[None, :]
            a_even = tl.load(a_base, mask=mask_m[:, None], other=0.0).to(tl.float16)  # exact: E4M3 values
            a_odd = tl.load(a_base + 1, mask=mask_m[:, None], other=0.0).to(tl.float16)
            lo = tl.trans(_e2m1(wb).to(tl.float16))  # [16, BLOCK_N], exact: E2M1 values
            hi = tl.trans(_e2m1(wb >> 4).to(tl.float16))
            part = tl.dot(a_even, lo) + tl.dot(a_odd, hi)  # float32 [BLOCK_M, BLOCK_N]
            a_sc = tl.load(as_ptr + offs_m * stride_asm + kb, mask=mask_m, other=0.0)
            w_sc = _e8m0(tl.load(ws_ptr + offs_n * stride_wsn + kb, mask=mask_n, other=127))
            part = part * a_sc[:, None]
            part = part * w_sc[None, :]
            acc += part
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


def fp4_gemm_triton(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    *,
    act_block_size: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`fp4_gemm` as Triton kernels, on the device holding the tensors (CUDA, or CPU tensors under
    TRITON_INTERPRET=1): FP8 [..., K] x packed FP4 [N, K/2] with E8M0 [N, K/32] -> [..., N]."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use fp4_gemm_fused or routed_experts (CPU kernels)")
    op = check_operands(a, a_s, b, b_s, act_block_size, kind="fp4")
    m, n, k = op.m, op.n, op.k
    values = a.reshape(m, k).float().contiguous()  # [M, K] E4M3 values, exact in float32
    # [M, K/act_block] -> [M, K/32]: the kernels step through K at the weight's granularity
    scales = a_s.reshape(m, -1).float().repeat_interleave(act_block_size // 32, dim=1).contiguous()
    w = b.contiguous().view(torch.uint8)  # [N, K/2]
    ws = b_s.contiguous().view(torch.uint8)  # [N, K/32]
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    if m and n:
        nb = k // 32
        if m <= GEMV_MAX_TOKENS:
            block_n, blocks = 16, 8
            grid = (triton.cdiv(n, block_n), m)
            _fp4_gemv_kernel[grid](
                values,
                scales,
                w,
                ws,
                out,
                n,
                nb,
                values.stride(0),
                scales.stride(0),
                w.stride(0),
                ws.stride(0),
                out.stride(0),
                BLOCK_N=block_n,
                BLOCKS=blocks,
            )
        else:
            block_m, block_n = (16 if m <= 16 else 64), 64
            grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
            _fp4_gemm_kernel[grid](
                values,
                scales,
                w,
                ws,
                out,
                m,
                n,
                nb,
                values.stride(0),
                scales.stride(0),
                w.stride(0),
                ws.stride(0),
                out.stride(0),
                BLOCK_M=block_m,
                BLOCK_N=block_n,
            )
    return out.to(out_dtype).reshape(*a.shape[:-1], n)
