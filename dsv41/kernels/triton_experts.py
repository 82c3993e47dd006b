"""Triton kernels for the packed-FP4 expert GEMMs, and the dispatcher that places experts.

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
the tests check them without a GPU. Placement: `expert_devices("cuda")` (or "cuda:1", or a list)
resolves where the expert cache lives; without CUDA it prints one line to stderr and returns the
CPU, and `routed_experts_device` then runs the CPU fused path.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence, Union

import torch

from .experts import Experts, fp4_gemm_fused, fp8_gemm_fused, routed_experts
from .gemm import fp8_gemm

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs none of this
    triton = None

# Token counts up to this use the GEMV kernel (each program streams its rows once per token).
GEMV_MAX_TOKENS = 4
_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        print(f"dsv41: {message}", file=sys.stderr)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """True when the Triton kernels can run on a GPU here: Triton imports and CUDA is present."""
    return triton is not None and torch.cuda.is_available()


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
    def _fp4_gemv_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, N, NB,
                         stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
                         BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
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
            wb = tl.load(w_ptr + offs_n[:, None, None] * stride_wn + kb[None, :, None] * 16 + offs_h[None, None, :],
                         mask=w_mask, other=0)  # [BLOCK_N, BLOCKS, 16] bytes
            a_base = a_ptr + m * stride_am + kb[:, None] * 32 + 2 * offs_h[None, :]
            a_even = tl.load(a_base, mask=mask_b[:, None], other=0.0)  # [BLOCKS, 16]
            a_odd = tl.load(a_base + 1, mask=mask_b[:, None], other=0.0)
            part = tl.sum(_e2m1(wb) * a_even[None, :, :], axis=2) + tl.sum(_e2m1(wb >> 4) * a_odd[None, :, :], axis=2)
            a_sc = tl.load(as_ptr + m * stride_asm + kb, mask=mask_b, other=0.0)  # [BLOCKS]
            w_sc = _e8m0(tl.load(ws_ptr + offs_n[:, None] * stride_wsn + kb[None, :],
                                 mask=mask_n[:, None] & mask_b[None, :], other=127))  # [BLOCK_N, BLOCKS]
            part = part * a_sc[None, :]  # activation scale first, then the weight's, as the reference
            part = part * w_sc
            acc += tl.sum(part, axis=1)
        tl.store(c_ptr + m * stride_cm + offs_n, acc, mask=mask_n)

    @triton.jit
    def _fp4_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, NB,
                         stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        offs_h = tl.arange(0, 16)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, NB):
            wb = tl.load(w_ptr + offs_n[:, None] * stride_wn + kb * 16 + offs_h[None, :],
                         mask=mask_n[:, None], other=0)  # [BLOCK_N, 16]
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
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc,
                 mask=mask_m[:, None] & mask_n[None, :])


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
        raise RuntimeError("Triton is not installed; use fp4_gemm_fused (CPU) or routed_experts_device")
    if b.dtype not in (torch.float4_e2m1fn_x2, torch.uint8, torch.int8):
        raise TypeError(f"weight must be packed FP4 (float4_e2m1fn_x2, uint8 or int8), got {b.dtype}")
    if a.dtype != torch.float8_e4m3fn:
        raise TypeError(f"activations must be float8_e4m3fn (quantize with act_quant), got {a.dtype}")
    k = a.size(-1)
    n = b.size(0)
    if k % act_block_size or act_block_size % 32 or b.size(1) * 2 != k:
        raise ValueError(f"K={k}, act_block_size={act_block_size} and weight {list(b.shape)} do not fit")
    if tuple(b_s.shape) != (n, k // 32):
        raise ValueError(f"weight scales must be [{n}, {k // 32}], got {list(b_s.shape)}")
    m = a.numel() // k
    values = a.reshape(m, k).float().contiguous()  # E4M3 values, exact in float32
    scales = a_s.reshape(m, -1).float().repeat_interleave(act_block_size // 32, dim=1).contiguous()  # [M, K/32]
    w = b.contiguous().view(torch.uint8)
    ws = b_s.contiguous().view(torch.uint8)
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    if m and n:
        nb = k // 32
        if m <= GEMV_MAX_TOKENS:
            block_n, blocks = 16, 8
            grid = (triton.cdiv(n, block_n), m)
            _fp4_gemv_kernel[grid](values, scales, w, ws, out, n, nb, values.stride(0), scales.stride(0),
                                   w.stride(0), ws.stride(0), out.stride(0), BLOCK_N=block_n, BLOCKS=blocks)
        else:
            block_m, block_n = (16 if m <= 16 else 64), 64
            grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
            _fp4_gemm_kernel[grid](values, scales, w, ws, out, m, n, nb, values.stride(0), scales.stride(0),
                                   w.stride(0), ws.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    return out.to(out_dtype).reshape(*a.shape[:-1], n)


# ---------------------------------------------------------------------- placement and dispatch
def expert_devices(spec: Union[None, str, torch.device, Sequence[Union[str, torch.device]]] = None) -> list[torch.device]:
    """Where the expert cache lives: None or "cpu" -> [cpu]; "cuda", "cuda:1" or a list of them ->
    those devices. Without a usable GPU (no CUDA, or no Triton) this prints one line to stderr and
    returns [cpu], so a notebook asking for the GPU still runs."""
    specs = [spec] if spec is None or isinstance(spec, (str, torch.device)) else list(spec)
    devices = [torch.device(s if s is not None else "cpu") for s in specs]
    if not devices:
        raise ValueError("expert_devices needs at least one device")
    if all(d.type == "cpu" for d in devices):
        return [torch.device("cpu")]
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"expert devices must all be cpu or all be cuda, got {[str(d) for d in devices]}")
    if not available():
        reason = "CUDA is not available" if triton is not None else "Triton is not installed"
        _warn_once("devices", f"{reason}; routed experts stay on the CPU (fused packed-FP4 path)")
        return [torch.device("cpu")]
    count = torch.cuda.device_count()
    devices = [torch.device("cuda", d.index if d.index is not None else 0) for d in devices]
    bad = [str(d) for d in devices if d.index >= count]
    if bad:
        raise ValueError(f"no such CUDA device {', '.join(bad)} ({count} present)")
    return devices


def device_for(expert_id: int, devices: Sequence[torch.device]) -> torch.device:
    """The device expert `expert_id` is placed on: round-robin over `devices`."""
    return devices[expert_id % len(devices)]


def _device_product(a, a_s, w, s, dtype, cpu_kernel="auto", batch_invariant=False):
    """One expert GEMM where its weight lives: Triton on CUDA, the fused CPU path otherwise."""
    if w.device.type == "cuda" and available():
        a, a_s = a.to(w.device), a_s.to(w.device)
        if w.dtype == torch.float8_e4m3fn:  # the shared expert's FP8: the op layer's torch path
            return fp8_gemm(a, a_s, w, s, block_size=32, out_dtype=dtype)
        return fp4_gemm_triton(a, a_s, w, s, act_block_size=32, out_dtype=dtype)
    if w.device.type != "cpu":
        _warn_once("product", f"no Triton kernel for {w.device}; expert GEMMs run on the CPU")
        w, s = w.cpu(), s.cpu()
    a, a_s = a.cpu(), a_s.cpu()
    if w.dtype == torch.float8_e4m3fn:
        return fp8_gemm_fused(a, a_s, w, s, block_size=32, out_dtype=dtype, cpu_kernel=cpu_kernel,
                              batch_invariant=batch_invariant)
    return fp4_gemm_fused(a, a_s, w, s, act_block_size=32, out_dtype=dtype, cpu_kernel=cpu_kernel,
                          batch_invariant=batch_invariant)


def routed_experts_device(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
                          swiglu_limit: float = 0.0, *, cpu_kernel: str = "auto",
                          batch_invariant: bool = False) -> torch.Tensor:
    """`routed_experts` with each expert's GEMMs on the device its packed weights live on (Triton
    on CUDA, the fused CPU path on the CPU, `cpu_kernel` and `batch_invariant` (CPU only) as in
    `routed_experts`); float32 [n, dim] on x's device. Same call contract. With x and every
    selected expert on the CPU it is `routed_experts` itself, whose native kernel takes a layer's
    projections a list at a time."""
    selected = torch.unique(expert_ids).tolist()
    on_cpu = (getattr(experts[e], name).device.type == "cpu" for e in selected
              for name in ("w1", "w1_scale", "w2", "w2_scale", "w3", "w3_scale"))
    if x.device.type == "cpu" and all(on_cpu):
        return routed_experts(x, expert_ids, weights, experts, swiglu_limit, cpu_kernel=cpu_kernel,
                              batch_invariant=batch_invariant)

    def product(a, a_s, w, s, dtype):
        return _device_product(a, a_s, w, s, dtype, cpu_kernel, batch_invariant)

    return routed_experts(x, expert_ids, weights, experts, swiglu_limit, product=product)
