"""Block-scaled GEMMs over FP8 activations and FP8 / packed-FP4 weights.

Both compute C[M, N] = A[M, K] @ B[N, K]^T the way a tiled kernel does: one float32 partial
product per K block, multiplied by that block's scales and added into a float32 accumulator in
K order. On real hardware the products inside a block are summed by the tensor core in its own
order; only that inner order can differ here, by a few float32 ulps.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from .codecs import fp4_to_float
from .quant import act_quant

# One FP4 weight scale per 32 elements along K; fixed by the checkpoint format.
FP4_WEIGHT_BLOCK = 32
# Upper bound on the elements of one batch of per-block partial products held at once.
_PARTIALS_BUDGET = 1 << 24


def _block_partials(a_values: torch.Tensor, w_values: torch.Tensor, block: int):
    """Yield (first block index, A_blk @ W_blk^T as float32 [blocks, M, N]) batches in K order."""
    m, k = a_values.shape
    n = w_values.size(0)
    n_blocks = k // block
    a_blocks = a_values.view(m, n_blocks, block).transpose(0, 1)  # [n_blocks, M, block]
    w_blocks = w_values.view(n, n_blocks, block).permute(1, 2, 0)  # [n_blocks, block, N]
    # batch the block products, but bound how many [M, N] partials exist at a time
    step = max(1, _PARTIALS_BUDGET // max(1, m * n))
    for start in range(0, n_blocks, step):
        yield start, torch.bmm(a_blocks[start : start + step], w_blocks[start : start + step])


def _flatten_activations(a: torch.Tensor, a_s: torch.Tensor, act_block: int):
    if a.dtype != torch.float8_e4m3fn:
        raise TypeError(f"activations must be float8_e4m3fn (quantize with act_quant), got {a.dtype}")
    k = a.size(-1)
    if k % act_block:
        raise ValueError(f"K={k} is not a multiple of the activation block {act_block}")
    m = a.numel() // k
    a_values = a.reshape(m, k).float()  # [M, K]
    a_scales = a_s.reshape(m, k // act_block).float()  # [M, K/act_block]
    return a_values, a_scales


def fp8_gemm(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    *,
    block_size: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """FP8 [..., K] x FP8 weight [N, K] with block_size x block_size weight scales -> [..., N]."""
    if b.dtype != torch.float8_e4m3fn:
        raise TypeError(f"weight must be float8_e4m3fn, got {b.dtype}")
    a_values, a_scales = _flatten_activations(a, a_s, block_size)
    n, k = b.shape
    if k != a.size(-1):
        raise ValueError(f"weight has K={k}, activations {a.size(-1)}")
    n_blocks = -(-n // block_size)
    if tuple(b_s.shape) != (n_blocks, k // block_size):
        raise ValueError(f"weight scales must be [{n_blocks}, {k // block_size}], got {list(b_s.shape)}")
    # one scale per output row rather than per 32-row block, to index it like the activations
    w_scales = b_s.float().repeat_interleave(block_size, dim=0)[:n]  # [N, K/block]
    w_values = b.float()

    a_scales = a_scales.T.unsqueeze(-1)  # [K/block, M, 1]
    w_scales = w_scales.T.unsqueeze(1)  # [K/block, 1, N]
    acc = a_values.new_zeros(a_values.size(0), n)  # [M, N]
    for start, partials in _block_partials(a_values, w_values, block_size):
        blocks = slice(start, start + partials.size(0))
        # the two scales are combined first, then applied to each block's partial product
        partials *= a_scales[blocks] * w_scales[blocks]
        for partial in partials:  # added one block at a time, in K order
            acc += partial
    return acc.to(out_dtype).reshape(*a.shape[:-1], n)


def fp4_gemm(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    *,
    act_block_size: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """FP8 [..., K] x packed FP4 weight [N, K/2] with one scale per 32 along K -> [..., N]."""
    if b.dtype not in (torch.float4_e2m1fn_x2, torch.uint8):
        raise TypeError(f"weight must be float4_e2m1fn_x2 (or its uint8 bytes), got {b.dtype}")
    if act_block_size % FP4_WEIGHT_BLOCK:
        raise ValueError(f"act_block_size must be a multiple of {FP4_WEIGHT_BLOCK}, got {act_block_size}")
    a_values, a_scales = _flatten_activations(a, a_s, act_block_size)
    n, k = b.size(0), a.size(-1)
    if b.size(1) * 2 != k:
        raise ValueError(f"packed weight [{n}, {b.size(1)}] does not hold K={k} values per row")
    if tuple(b_s.shape) != (n, k // FP4_WEIGHT_BLOCK):
        raise ValueError(f"weight scales must be [{n}, {k // FP4_WEIGHT_BLOCK}], got {list(b_s.shape)}")
    # the K loop runs at the weight's granularity; each activation scale covers several steps
    a_scales = a_scales.repeat_interleave(act_block_size // FP4_WEIGHT_BLOCK, dim=1)  # [M, K/32]
    w_values = fp4_to_float(b)  # [N, K]
    w_scales = b_s.float()  # [N, K/32]

    a_scales = a_scales.T.unsqueeze(-1)  # [K/32, M, 1]
    w_scales = w_scales.T.unsqueeze(1)  # [K/32, 1, N]
    acc = a_values.new_zeros(a_values.size(0), n)  # [M, N]
    for start, partials in _block_partials(a_values, w_values, FP4_WEIGHT_BLOCK):
        blocks = slice(start, start + partials.size(0))
        # here the scales are applied one after the other: activation, then weight
        partials *= a_scales[blocks]
        partials *= w_scales[blocks]
        for partial in partials:  # added one block at a time, in K order
            acc += partial
    return acc.to(out_dtype).reshape(*a.shape[:-1], n)


# Kernels `linear` takes a quantized product on: "auto" (the native block-order kernel where it
# builds and the operands are CPU tensors with E8M0 scales, the reference otherwise), "native"
# (that kernel or an error) and "reference" (fp4_gemm / fp8_gemm above).
LINEAR_KERNELS = ("auto", "native", "reference")


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None, *, kernel: str = "auto"
) -> torch.Tensor:
    """y = x @ weight^T, choosing the FP4, FP8 or plain path from weight.dtype.

    Quantized weights: the activation is quantized to FP8 over blocks of 32, then multiplied by
    the weight as stored. The native kernel reads the FP8 / FP4 bytes directly (no float32 copy of
    the weight) and keeps the block order above: one float32 partial per 32-wide K block, scaled
    as fp4_gemm / fp8_gemm scale it, added in K order. Only the order of the 32 additions inside a
    block is its own (native.c), the same for any token count, so a token's result does not
    depend on how many tokens share the call; against the reference's BLAS block sums that moves
    a block partial by a float32 ulp now and then (README: what the dense linears change)."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    quantized = weight.dtype in (torch.float4_e2m1fn_x2, torch.float8_e4m3fn)
    if not quantized:
        return F.linear(x, weight)
    if scale is None:
        raise ValueError(f"a {weight.dtype} weight needs its block scales")
    # both quantized paths take FP8 activations with power-of-two scales over blocks of 32
    a, a_s = act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    if kernel != "reference":
        out = _native_linear(a, a_s, weight, scale, x.dtype, required=kernel == "native")
        if out is not None:
            return out
    if weight.dtype == torch.float4_e2m1fn_x2:
        return fp4_gemm(a, a_s, weight, scale, act_block_size=32, out_dtype=x.dtype)
    return fp8_gemm(a, a_s, weight, scale, block_size=32, out_dtype=x.dtype)


def _native_linear(a, a_s, weight, scale, out_dtype, *, required: bool) -> Optional[torch.Tensor]:
    """The quantized product on the native kernel -> [..., N] in out_dtype; None where it does
    not apply (no native build, another device, scales that are not E8M0, K off the block grid)
    and `required` is False."""
    from . import native

    fp4 = weight.dtype == torch.float4_e2m1fn_x2
    k = a.size(-1)
    n = weight.size(0)
    why = None
    if weight.device.type != "cpu" or a.device.type != "cpu":
        why = f"its operands are on {weight.device}, not the CPU"
    elif scale.dtype != torch.float8_e8m0fnu:
        why = f"its weight scales are {scale.dtype}, not float8_e8m0fnu"
    elif k % FP4_WEIGHT_BLOCK or weight.size(1) * (2 if fp4 else 1) != k:
        why = f"the weight {list(weight.shape)} does not hold K={k} on blocks of {FP4_WEIGHT_BLOCK}"
    elif native.load() is None:
        why = native.unavailable_reason()
    if why is not None:
        if required:
            raise RuntimeError(f"kernel='native' cannot take this product: {why}")
        return None
    m = a.numel() // k
    rows_per_scale = 1 if fp4 else FP4_WEIGHT_BLOCK  # FP8 scales cover 32 x 32 blocks
    a_bytes = a.reshape(m, k).view(torch.uint8)  # [M, K] E4M3 codes
    a_scale = a_s.reshape(m, k // FP4_WEIGHT_BLOCK).view(torch.uint8)  # [M, K/32] E8M0 bytes
    out = native.load().gemm_many(
        [(fp4, a_bytes, a_scale, FP4_WEIGHT_BLOCK, weight.view(torch.uint8), scale.view(torch.uint8), rows_per_scale)]
    )[0]  # float32 [M, N]
    # the kernel writes [N, M]; the callers (RoPE, views) want the reference's row-major [M, N]
    return out.to(out_dtype, memory_format=torch.contiguous_format).reshape(*a.shape[:-1], n)
