"""Routed experts computed straight from packed FP4, every selected expert of a layer in one call.

A decode step's expert call, from `moe.RoutedExperts.forward`:

    routed_experts   quantize the tokens to FP8 once, group them by expert, add the experts'
                     outputs into a float32 sum
      _run_experts   every selected expert's gate and up GEMMs as one list, clamped SwiGLU and
                     routing weight, then every down GEMM as one list
        _products    each GEMM of a list, where its weight lives:
          CUDA       triton_experts.fp4_gemm_triton (FP8 weights: the op layer's fp8_gemm)
          CPU        native `gemm_many`, one call for every product of up to 8 tokens (any count
                     with batch_invariant); the rest through `_fused_products`, an expert's gate
                     and up projections (the same tokens) in one call

`routed_experts_reference` is the plain reference with the same contract. `expert_devices` and
`device_for` say where the loader places experts (round-robin over a device list).

Storage: w1 (gate) and w3 (up) are I8 [inter, dim/2], w2 (down) I8 [dim, inter/2]; each byte holds
two E2M1 codes (element 2i in the low nibble), with one E8M0 scale per 32 values along K. The
reference `fp4_gemm` expands a whole matrix to float32 first; the runtime this project replaces
expanded every routed expert to BF16 and spent almost all of a decode step doing so. The fused
path never holds more than a chunk of decoded rows (4 MiB of float32, or 8 MiB of BF16 rows, sized
to still be in cache when the GEMM reads them). `cpu_kernel` picks the CPU kernel: "native"
(native.c, built once per machine with its C compiler), "torch" (plain PyTorch), or "auto", the
default: native where it builds, torch otherwise, saying so once on stderr.

- Native, up to 8 tokens per weight (every expert while decoding): the reference's own
  arithmetic, each 32-value block's partial product scaled by the activation and weight scales
  as `fp4_gemm` / `fp8_gemm` scale it and added in K order; only the order of the 32 additions
  inside a block is the kernel's, the same for any token count, so a token's result does not
  depend on its company. SIMD decode (a pshufb table for E2M1, IEEE halves for E4M3).
- More tokens, on either kernel: scales are split into one power of two per weight row (per
  token for activations) and a relative power of two in [2**-48, 1]. A value times its relative
  scale is exact in float32, and so is the product of two such values, so one float32 dot product
  over all of K (a BLAS GEMM over decoded rows) yields the block-scaled sum; only the order of the
  float32 additions differs from the reference. Rows or tokens whose scales span more than 48
  octaves are computed by the reference itself, a chunk at a time. The native kernel decodes the
  rows in C: to BF16 for torch's BF16 GEMM (float32 accumulation, one rounding) when the result is
  BF16 and the CPU has AMX or AVX-512 BF16 (`native.prefill_path`, read at run time; a value
  times its relative scale has at most 4 significant bits, exact in BF16; the powers of two are
  then applied to the BF16 result in C, exact but for a result below the normal range), to float32
  for the float32 GEMM otherwise; the tokens are decoded once for every weight of the call, whose
  rows share the chunks and GEMMs; the torch kernel, at any token count, decodes a chunk of rows with three integer ops
  on int32 words: each code is moved to the top of the word, shifted back arithmetically and
  masked, which leaves the float32 bit pattern of value * 2**-126 (value * 2**-120 for FP8
  bytes); one multiply applies the relative scales and 2**126 back. The chunk's columns are in a
  permuted order, so that multiply runs along long contiguous rows; the activation is permuted to
  match.

`batch_invariant=True` keeps every token count on one arithmetic, so a token's outputs do not
depend on how many tokens an expert sees in the call (a prefill then matches the same tokens
decoded one at a time): the native kernel's block order at any token count (slower than BLAS
beyond 8 tokens), or the torch kernel one token at a time. It applies to the CPU kernels only.

Every buffer is allocated float32 explicitly, so `torch.set_default_dtype` changes nothing here.
In the torch kernel the value 0.5 (E2M1 code 1) decodes to a float32 subnormal for one multiply;
where the calling thread flushes subnormals (`torch.set_flush_denormal(True)`) the chunk is decoded
through the codec table instead, at a fraction of the speed. The native kernel decodes through
small integers and IEEE halves and does not depend on that setting.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from . import native
from .codecs import fp4_to_float
from .gemm import FP4_WEIGHT_BLOCK, fp4_gemm, fp8_gemm, linear
from .operands import Operands, check_operands
from .quant import act_quant

# Scales within a row (or a token) may span this many octaves and still take the fused path:
# relative scales >= 2**-48 keep every product of two pre-scaled values a normal float32.
_SPAN_OCTAVES = 48
# Upper bound on float32 values in one decoded chunk (4 MiB): large enough that a chunk's handful
# of torch calls cost little next to its work, small enough to stay in the last-level cache.
_CHUNK_VALUES = 1 << 20
# The same bound for the BF16 path (8 MiB of BF16 rows): decoded rows still in cache when torch's
# BF16 GEMM reads them, which measured faster here than decoding whole weights (whose rows go out
# to memory and back) or smaller chunks (whose GEMMs run below their peak).
_BF16_CHUNK_VALUES = 1 << 22
_BLOCK = FP4_WEIGHT_BLOCK  # both formats scale blocks of 32 values along K
CPU_KERNELS = ("auto", "native", "torch")
# The many-token paths that multiply in BF16 (see native.PREFILL_PATHS).
_BF16_PATHS = ("amx", "avx512_bf16")

Expert = Any  # anything with w1, w1_scale, w2, w2_scale, w3, w3_scale attributes (e.g. PackedExpert)
Experts = Union[Mapping[int, Expert], Sequence[Expert]]
DeviceSpec = Union[None, str, torch.device, Sequence[Union[str, torch.device]]]


class PackedExpert(NamedTuple):
    """One expert as the checkpoint stores it. Routed: FP4 weights (I8 / uint8 /
    float4_e2m1fn_x2) [out, in/2] with E8M0 scales [out, in/32]. Shared: FP8 E4M3 [out, in] with
    E8M0 [ceil(out/32), in/32]. w1 gate and w3 up are [inter, dim]; w2 down is [dim, inter]."""

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w3: torch.Tensor
    w3_scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    def to(self, device) -> "PackedExpert":
        return PackedExpert(*(t.to(device) for t in self))


# ---------------------------------------------------------------------- experts
def routed_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: Optional[Experts],
    swiglu_limit: float = 0.0,
    *,
    cpu_kernel: str = "auto",
    batch_invariant: bool = False,
    product: Optional[Callable] = None,
    batches: Optional[Iterable] = None,
) -> torch.Tensor:
    """y = sum_k weights[:, k] * expert_{expert_ids[:, k]}(x), float32 [n, dim] on x's device.

    Call contract (the same for `routed_experts_reference`): x [n, dim] activations (bf16 in the
    model; GEMM outputs are rounded to x.dtype as the reference's linears do); expert_ids [n, k]
    integer ids; weights [n, k] float32 routing weights (already normalized and scaled); experts
    maps each id present in expert_ids to an object with w1, w1_scale, w2, w2_scale, w3, w3_scale
    exactly as stored (`PackedExpert`): a dict {id: expert} from the loader's cache, or a sequence
    indexed by id. Each GEMM runs where its expert's weight lives: Triton on CUDA, the fused CPU
    kernels on the CPU. Tokens are quantized to FP8 once, grouped by expert with one sort, and
    each selected expert runs once on all of its tokens, in ascending id order, added into a
    float32 sum as the reference does. Weights are read packed, never expanded as a whole.
    `batches` instead of `experts`: dicts {id: expert} that together hold every id, as a store
    hands them out while it is still reading the rest (`stores.SlotCache.stream`); each batch is
    computed before the next is asked for, and the sum is added in ascending id order all the
    same, so the result equals one call with every expert at once.
    `cpu_kernel` ("auto", "native" or "torch") and `batch_invariant`: see the module docstring.
    `product(a, a_s, w, s, dtype)`, for tests, replaces every GEMM (one call per product)."""
    _check_routing(x, expert_ids, weights)
    n, k = expert_ids.shape
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [n, dim]
    if n == 0:
        return y
    a, a_s = act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)  # per token, so once for every expert
    flat = expert_ids.reshape(-1)  # [n*k]: pair p is token p // k
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending within one
    ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
    flat_weights = weights.reshape(-1).float()  # [n*k]
    pairs_of = dict(zip(ids.tolist(), torch.split(order, counts.tolist())))  # ascending id
    outs = {}
    for source in [experts] if batches is None else batches:
        wanted = list(pairs_of) if batches is None else sorted(e for e in source if e in pairs_of)
        groups = [
            (a[pairs_of[e] // k], a_s[pairs_of[e] // k], source[e], flat_weights[pairs_of[e]].unsqueeze(1))
            for e in wanted
        ]  # per expert its tokens' rows [c] and routing weights [c, 1]
        outs.update(zip(wanted, _run_experts(groups, x.dtype, swiglu_limit, cpu_kernel, batch_invariant, product)))
    for e, pairs in pairs_of.items():
        y.index_add_(0, pairs // k, outs[e].to(y.device, torch.float32))  # ascending expert id, as the reference adds
    return y


def routed_experts_reference(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: Experts, swiglu_limit: float = 0.0
) -> torch.Tensor:
    """The plain reference for `routed_experts`: per selected expert (ascending id), its tokens
    gathered, quantized to FP8 and multiplied by the op layer's `fp4_gemm`, which expands each
    weight matrix to float32; the expert outputs summed in float32."""
    _check_routing(x, expert_ids, weights)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        rows, slot = torch.where(expert_ids == e)
        out = expert_ffn_reference(x[rows], experts[e], swiglu_limit, weights[rows, slot, None].float())
        y.index_add_(0, rows, out.float())
    return y


def _check_routing(x, expert_ids, weights):
    """The one check of the routing inputs, for `routed_experts` and its reference."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, dim], got shape {tuple(x.shape)}")
    if expert_ids.shape != weights.shape or expert_ids.dim() != 2 or expert_ids.size(0) != x.size(0):
        raise ValueError(
            f"expert_ids and weights must both be [{x.size(0)}, k], got "
            f"{tuple(expert_ids.shape)} and {tuple(weights.shape)}"
        )


def expert_ffn(
    x: torch.Tensor,
    expert: Expert,
    swiglu_limit: float = 0.0,
    weights: Optional[torch.Tensor] = None,
    *,
    cpu_kernel: str = "auto",
    batch_invariant: bool = False,
) -> torch.Tensor:
    """One SwiGLU expert (FP4 routed or FP8 shared weights) on x [n, dim] -> [n, dim] in x's dtype,
    through the same GEMMs as `routed_experts`; `weights` [n, 1] scales the activation before the
    down projection."""
    a, a_s = act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    return _run_experts([(a, a_s, expert, weights)], x.dtype, swiglu_limit, cpu_kernel, batch_invariant)[0]


def expert_ffn_reference(
    x: torch.Tensor, expert: Expert, swiglu_limit: float = 0.0, weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """`expert_ffn` through the op layer's reference `linear` (each weight expanded whole)."""
    h = clamped_swiglu(
        linear(x, _as_fp4(expert.w1), expert.w1_scale, kernel="reference"),
        linear(x, _as_fp4(expert.w3), expert.w3_scale, kernel="reference"),
        swiglu_limit,
    )
    if weights is not None:
        h = weights * h
    return linear(h.to(x.dtype), _as_fp4(expert.w2), expert.w2_scale, kernel="reference")


def _as_fp4(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.float4_e2m1fn_x2) if w.dtype in (torch.int8, torch.uint8) else w


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up in float32; with limit > 0 the up branch is clamped to [-limit, limit] and
    the gate branch from above only, as in training."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def _run_experts(
    groups, dtype, swiglu_limit: float, cpu_kernel: str, batch_invariant: bool, product: Optional[Callable] = None
) -> list:
    """Experts on FP8-quantized tokens: groups [(a, a_s, expert, routing weights [c, 1] or None)]
    -> each expert's output in `dtype`: gate/up -> clamped SwiGLU -> routing weight -> down.
    Every GEMM output is rounded to the activation dtype, as the reference's linears return it.
    All gate and up projections go to `_products` as one list, then all down projections, so the
    native kernel takes each list in one parallel pass (its threads start twice per layer)."""
    ups = _products(
        [
            (a, a_s, w, s)
            for a, a_s, expert, _ in groups
            for w, s in ((expert.w1, expert.w1_scale), (expert.w3, expert.w3_scale))
        ],
        dtype,
        cpu_kernel,
        batch_invariant,
        product,
    )
    downs = []
    for (_a, _a_s, expert, weights), gate, up in zip(groups, ups[0::2], ups[1::2]):
        h = clamped_swiglu(gate, up, swiglu_limit)  # [c, inter] float32
        if weights is not None:
            h = weights.to(h.device) * h  # the routing weight scales the activation before the down projection
        h_q, h_s = act_quant(h.to(dtype), 32, "ue8m0", torch.float8_e8m0fnu)
        downs.append((h_q, h_s, expert.w2, expert.w2_scale))
    return _products(downs, dtype, cpu_kernel, batch_invariant, product)


def _products(jobs, dtype, cpu_kernel: str, batch_invariant: bool, product: Optional[Callable] = None) -> list:
    """Products (a, a_s, w, s) of FP8 tokens [M, K] with E8M0 scales [M, K/32] -> each [M, N] in
    `dtype`, on the device of its weight: the Triton kernel on CUDA; on the CPU (where any other
    device's weights are copied), the native kernel's block-order products in one `gemm_many`
    call, the rest through `_fused_products`, one call per run of jobs on the same tokens.
    `product`, where given, runs each one instead."""
    if product is not None:
        return [product(*job, dtype) for job in jobs]
    outs: list = [None] * len(jobs)
    on_cpu = []
    for i, (a, a_s, w, s) in enumerate(jobs):
        if w.device.type == "cuda" and _triton_experts().available():
            a, a_s = a.to(w.device), a_s.to(w.device)
            # Triton has the FP4 kernel only; the shared expert's FP8 takes the op layer's GEMM there
            gemm = fp8_gemm if w.dtype == torch.float8_e4m3fn else _triton_experts().fp4_gemm_triton
            outs[i] = gemm(a, a_s, w, s, out_dtype=dtype)
            continue
        if w.device.type != "cpu":
            _say_once("product", f"no Triton kernel for {w.device}; expert GEMMs run on the CPU")
            w, s = w.cpu(), s.cpu()
        a, a_s = a.cpu(), a_s.cpu()
        on_cpu.append((i, a, a_s, w, s, check_operands(a, a_s, w, s)))
    if not on_cpu:
        return outs

    kernels = _native_kernels(cpu_kernel)
    block_order = []  # (job index, gemm_many operands)
    shared_tokens = []  # runs of (job index, a, a_s, w, s, op) with the same tokens and format
    for i, a, a_s, w, s, op in on_cpu:
        a_raw, w_raw = _e8m0_bytes(a_s.reshape(op.m, op.k // _BLOCK)), _e8m0_bytes(s)
        if (
            kernels is not None
            and a_raw is not None
            and w_raw is not None
            and (op.m <= native.BLOCK_ORDER_MAX_TOKENS or batch_invariant)
        ):
            block_order.append(
                (
                    i,
                    (
                        op.fp4,
                        a.reshape(op.m, op.k).view(torch.uint8),
                        a_raw,
                        _BLOCK,
                        w.view(torch.uint8),
                        w_raw,
                        op.rows_per_scale,
                    ),
                )
            )
            continue
        # more tokens, or scales the native kernel does not read: an expert's gate and up
        # projections read the same tokens, so they decode them once and share one GEMM
        if shared_tokens and shared_tokens[-1][0][1] is a and _same_format(shared_tokens[-1][0][5], op):
            shared_tokens[-1].append((i, a, a_s, w, s, op))
        else:
            shared_tokens.append([(i, a, a_s, w, s, op)])
    for run in shared_tokens:
        _, a, a_s, *_ = run[0]
        products = _fused_products(
            a, a_s, [(w, s, op) for _, _, _, w, s, op in run], _BLOCK, kernels, batch_invariant, dtype
        )
        for (i, *_), out in zip(run, products):
            outs[i] = out.to(dtype)
    if block_order:
        for (i, _), out in zip(block_order, kernels.gemm_many([operands for _, operands in block_order])):
            outs[i] = out.to(dtype)
    return outs


def _same_format(x: Operands, y: Operands) -> bool:
    """Whether two products' weights can share one `_fused_products` call."""
    return (x.fp4, x.k, x.rows_per_scale) == (y.fp4, y.k, y.rows_per_scale)


# ---------------------------------------------------------------------- the fused GEMMs
def fp4_gemm_fused(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    *,
    act_block_size: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
    cpu_kernel: str = "auto",
    batch_invariant: bool = False,
) -> torch.Tensor:
    """`fp4_gemm` on the CPU without expanding the weight: FP8 [..., K] x packed FP4 [N, K/2] (I8,
    uint8 or float4_e2m1fn_x2) with E8M0 scales [N, K/32] -> [..., N]; equal to `fp4_gemm` up to
    the order of float32 additions."""
    op = check_operands(a, a_s, b, b_s, act_block_size, kind="fp4")
    out = _fused(a, a_s, b, b_s, op, act_block_size, _native_kernels(cpu_kernel), batch_invariant, out_dtype)
    return out.to(out_dtype).reshape(*a.shape[:-1], op.n)


def fp8_gemm_fused(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    *,
    block_size: int = 32,
    out_dtype: torch.dtype = torch.bfloat16,
    cpu_kernel: str = "auto",
    batch_invariant: bool = False,
) -> torch.Tensor:
    """`fp8_gemm` on the CPU without expanding the weight: FP8 [..., K] x FP8 E4M3 [N, K] with
    E8M0 scales per 32x32 block [ceil(N/32), K/32] -> [..., N]; equal to `fp8_gemm` up to float32
    addition order."""
    op = check_operands(a, a_s, b, b_s, block_size, kind="fp8")
    out = _fused(a, a_s, b, b_s, op, block_size, _native_kernels(cpu_kernel), batch_invariant, out_dtype)
    return out.to(out_dtype).reshape(*a.shape[:-1], op.n)


def linear_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
    *,
    cpu_kernel: str = "auto",
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The op layer's `linear` (FP8 activation quantization, then the FP4 or FP8 product, output in
    x's dtype) through the fused GEMMs; other weights are plain F.linear."""
    if weight.dtype in (torch.int8, torch.uint8):
        weight = weight.view(torch.float4_e2m1fn_x2)  # the checkpoint's I8 expert weights
    if weight.dtype not in (torch.float4_e2m1fn_x2, torch.float8_e4m3fn):
        return F.linear(x, weight)
    if scale is None:
        raise ValueError(f"a {weight.dtype} weight needs its block scales")
    a, a_s = act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    gemm = fp4_gemm_fused if weight.dtype == torch.float4_e2m1fn_x2 else fp8_gemm_fused
    return gemm(a, a_s, weight, scale, out_dtype=x.dtype, cpu_kernel=cpu_kernel, batch_invariant=batch_invariant)


def _fused(
    a,
    a_s,
    w,
    s,
    op: Operands,
    act_block: int,
    kernels: Optional["native.NativeKernels"],
    batch_invariant: bool,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One fused CPU GEMM (`_fused_products` of one weight)."""
    return _fused_products(a, a_s, [(w, s, op)], act_block, kernels, batch_invariant, out_dtype)[0]


def _fused_products(
    a,
    a_s,
    weights: list,
    act_block: int,
    kernels: Optional["native.NativeKernels"],
    batch_invariant: bool,
    out_dtype: torch.dtype = torch.float32,
) -> list:
    """The fused CPU GEMMs of one set of tokens with weights [(w, s, op)] of one format and K (the
    operands `check_operands` passed) -> float32 [M, N] each: the native kernel where it is loaded
    and all scales are E8M0 (the weights' rows in one pass), the torch kernel otherwise; rows and
    tokens whose scales span too far for the split scales then come from the reference. For a
    BF16 result on a CPU with AMX or AVX-512 BF16 (`native.prefill_path`), the native kernel's
    many-token path multiplies in BF16 (exact operands, float32 accumulation, one rounding to
    BF16) and returns BF16."""
    op = weights[0][2]
    m, k = op.m, op.k
    if m == 0 or any(w_op.n == 0 for _, _, w_op in weights):
        if len(weights) > 1:  # one at a time, so the empty ones come back empty
            return [
                _fused(a, a_s, w, s, w_op, act_block, kernels, batch_invariant, out_dtype) for w, s, w_op in weights
            ]
        return [torch.zeros(m, op.n, dtype=torch.float32)]
    a_raw = _e8m0_bytes(a_s.reshape(m, -1))  # a_s [M, K/act_block]
    w_raws = [_e8m0_bytes(s) for _, s, _ in weights]
    if kernels is not None and a_raw is not None and all(raw is not None for raw in w_raws):
        bf16 = out_dtype == torch.bfloat16 and native.prefill_path(kernels) in _BF16_PATHS
        results = kernels.gemm(
            op.fp4,
            a.reshape(m, k).view(torch.uint8),
            a_raw,
            act_block,
            [(_words(w).view(torch.uint8), raw) for (w, _, _), raw in zip(weights, w_raws)],
            op.rows_per_scale,
            _SPAN_OCTAVES,
            _BF16_CHUNK_VALUES if bf16 else _CHUNK_VALUES,
            block_order=batch_invariant,
            bf16=bf16,
        )
    else:  # the torch kernel (also for scales that are not E8M0, which the native kernel does not read)
        results = [
            _torch_fused(a, a_s, w, s, w_op, act_block, raw, batch_invariant)
            for (w, s, w_op), raw in zip(weights, w_raws)
        ]
    return [
        _out_of_span(out, a_ok, w_ok, a, a_s, w, s, w_op, act_block)
        for (out, a_ok, w_ok), (w, s, w_op) in zip(results, weights)
    ]


def _torch_fused(a, a_s, w, s, op: Operands, act_block: int, w_raw: Optional[torch.Tensor], batch_invariant: bool):
    """The plain-PyTorch fused GEMM -> (float32 [M, N], token ok [M], row ok [N])."""
    m, n = op.m, op.n
    codec = _FP4 if op.fp4 else _FP8
    words = _words(w)  # [N, K/per_word]
    a_scaled, a_top, a_ok = _activation_operand(a, a_s, act_block)
    if w_raw is not None:
        top_byte = w_raw.amax(dim=1).to(torch.int32)
        w_top, w_ok = native.split_powers(top_byte, w_raw.amin(dim=1).to(torch.int32), _SPAN_OCTAVES)
        w_rel = _relative_e8m0(w_raw, top_byte)
    else:
        w_top, w_rel, w_ok = _split(s.float())
    # one entry per weight row rather than per block of rows: [N], [N], [N, K/32]
    w_top, w_ok, w_rel = (t.repeat_interleave(op.rows_per_scale, dim=0)[:n] for t in (w_top, w_ok, w_rel))
    table = None
    if not _subnormals_kept():
        table = fp4_to_float if op.fp4 else lambda raw: e4m3_to_float(raw.view(torch.float8_e4m3fn))
    a_perm = _permute_columns(a_scaled, codec)
    if batch_invariant:  # one token at a time: the same BLAS call whatever the token count
        inner = torch.cat([_chunked_product(a_perm[i : i + 1], words, w_rel, codec, table) for i in range(m)])
    else:
        inner = _chunked_product(a_perm, words, w_rel, codec, table)
    # the token's power of two first, then the row's: the order the reference applies a_s, w_s
    return inner * a_top.unsqueeze(1) * w_top.unsqueeze(0), a_ok, w_ok


def _out_of_span(out, a_ok, w_ok, a, a_s, w, s, op: Operands, act_block: int) -> torch.Tensor:
    """`out` [M, N] with the rows and tokens whose scales span too much for the pre-scaled
    operands (not ok) recomputed by the reference, a bounded number of rows at a time; None for
    a_ok: the native kernel's block order, nothing to recompute."""
    if a_ok is None:
        return out
    m, n, k = op.m, op.n, op.k
    bad_rows = (~w_ok).nonzero().flatten()
    bad_tokens = (~a_ok).nonzero().flatten()
    if len(bad_rows) or len(bad_tokens):
        a2, s2 = a.reshape(m, k), a_s.reshape(m, -1)
        rows = max(1, _CHUNK_VALUES // k)
        for i in range(0, len(bad_rows), rows):
            idx = bad_rows[i : i + rows]
            out[:, idx] = _reference_rows(a2, s2, w, s, idx, op, act_block).to(out.dtype)
        if len(bad_tokens):
            for r0 in range(0, n, rows):
                idx = torch.arange(r0, min(n, r0 + rows))
                out[bad_tokens.unsqueeze(1), idx.unsqueeze(0)] = _reference_rows(
                    a2[bad_tokens], s2[bad_tokens], w, s, idx, op, act_block
                ).to(out.dtype)
    return out


def _reference_rows(a2, s2, w, s, rows: torch.Tensor, op: Operands, act_block: int) -> torch.Tensor:
    """Weight rows `rows` of the product through the op layer's reference GEMM: float32 [M, len(rows)]."""
    if op.fp4:  # fp4_gemm takes float4 or uint8 bytes, not int8
        return fp4_gemm(a2, s2, w.view(torch.uint8)[rows], s[rows], act_block_size=act_block, out_dtype=torch.float32)
    # fp8_gemm needs whole 32-row scale blocks: take the rows' blocks, then the rows
    blocks = torch.unique(rows // _BLOCK)
    sub = torch.cat([w[i * _BLOCK : (i + 1) * _BLOCK] for i in blocks.tolist()])
    full = fp8_gemm(a2, s2, sub, s[blocks], block_size=_BLOCK, out_dtype=torch.float32)
    starts = torch.cumsum(torch.tensor([0] + [min(_BLOCK, op.n - i * _BLOCK) for i in blocks.tolist()]), 0)
    pos = starts[torch.searchsorted(blocks, rows // _BLOCK)] + rows % _BLOCK
    return full[:, pos]


# ---------------------------------------------------------------------- word codecs
def _i32(bits: int) -> int:
    """A 32-bit pattern as the signed int32 torch's bitwise ops take."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


@dataclass(frozen=True)
class _WordCodec:
    """How the codes packed in one little-endian int32 word become float32 bit patterns."""

    per_word: int  # codes per word; code i sits at bits [i*bits, (i+1)*bits)
    bits: int
    sar: int  # arithmetic right shift from "code at the top of the word" to float32 position
    mask: int  # sign bit plus the code's exponent and mantissa bits, as int32
    exp_offset: int  # the decoded float32 is value * 2**-exp_offset

    @property
    def shifts(self) -> tuple[int, ...]:
        return tuple(32 - self.bits * (i + 1) for i in range(self.per_word))


# E2M1 s|e1 e0|m at bits 28..31, shifted right by 6: exponent bits 23-24, mantissa bit 22.
_FP4 = _WordCodec(per_word=8, bits=4, sar=6, mask=_i32(0x81C00000), exp_offset=126)
# E4M3 s|eeee|mmm at bits 24..31, shifted right by 4: exponent bits 23-26, mantissa bits 20-22.
_FP8 = _WordCodec(per_word=4, bits=8, sar=4, mask=_i32(0x87F00000), exp_offset=120)


def _words(packed: torch.Tensor) -> torch.Tensor:
    """Row-major packed bytes [N, B] -> int32 words [N, B/4] over the same memory (B is a
    multiple of 16: `check_operands` holds K to multiples of 32)."""
    return packed.contiguous().view(torch.uint8).view(torch.int32)


def _subnormals_kept() -> bool:
    # the decode relies on float32 subnormal inputs being read as themselves
    return bool((torch.tensor(2.0**-140, dtype=torch.float32) * 2.0**20) != 0)


def e4m3_to_float(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly, through float16 bit patterns (torch's own conversion is
    a scalar loop on CPU). The NaN code is not preserved: quantizers here never produce it."""
    b = x.contiguous().view(torch.uint8).to(torch.int16)
    # s|eeee|mmm -> float16 s|0eeee|mmm0000000: value * 2**-8, subnormals included
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.view(torch.float16).float() * 256.0


# ---------------------------------------------------------------------- scale splitting
def _split(scales: torch.Tensor):
    """float32 [rows, blocks] -> (row power of two [rows], relative [rows, blocks], fused-ok [rows])."""
    top = scales.amax(dim=1)  # [rows]
    rel = scales / top.unsqueeze(1)
    ok = (rel >= 2.0**-_SPAN_OCTAVES).all(dim=1) & torch.isfinite(top) & (top > 0)
    return top, rel, ok


def _e8m0_bytes(scale: torch.Tensor) -> Optional[torch.Tensor]:
    """E8M0 scales (float8_e8m0fnu or their uint8 bytes) as contiguous uint8; None for float scales."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.contiguous().view(torch.uint8)
    return scale.contiguous() if scale.dtype == torch.uint8 else None


def _relative_e8m0(raw: torch.Tensor, top_byte: torch.Tensor) -> torch.Tensor:
    """2**(byte - row max) float32 [rows, blocks], from its bits without a float division; rows
    outside the span get meaningless bits here and are recomputed by the reference."""
    return ((raw.to(torch.int32) + (127 - top_byte.to(torch.int32)).unsqueeze(1)) << 23).view(torch.float32)


def _activation_operand(a: torch.Tensor, a_s: torch.Tensor, act_block: int):
    """FP8 activations [..., K] + scales -> (values * relative scale [M, K]; token power of two
    [M]; fused-ok [M])."""
    k = a.size(-1)
    m, nb = a.numel() // k, k // _BLOCK
    values = e4m3_to_float(a.reshape(m, k))  # [M, K]
    scales = a_s.reshape(m, k // act_block).float().repeat_interleave(act_block // _BLOCK, dim=1)  # [M, nb]
    top, rel, ok = _split(scales)
    scaled = (values.view(m, nb, _BLOCK) * rel.unsqueeze(-1)).view(m, k)
    return scaled, top, ok


def _permute_columns(x: torch.Tensor, codec: _WordCodec) -> torch.Tensor:
    """[M, K] in natural order -> the chunk's column order (code in word, word in block, block)."""
    m, k = x.shape
    per_block = _BLOCK // codec.per_word
    return x.view(m, k // _BLOCK, per_block, codec.per_word).permute(0, 3, 2, 1).reshape(m, k)


# ---------------------------------------------------------------------- the chunked product
def _chunked_product(
    a_perm: torch.Tensor,
    words: torch.Tensor,
    rel: torch.Tensor,
    codec: _WordCodec,
    table_decode: Optional[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """sum_k a_perm[m, k] * w[n, k] * rel[n, k/32] -> float32 [M, N], a chunk of rows at a time.

    a_perm is already scaled and in the chunk column order; `table_decode` (bytes [rows, B] ->
    float32 values [rows, K]) replaces the bit decode when subnormals are flushed."""
    m, k = a_perm.shape
    n = words.size(0)
    nb = k // _BLOCK
    per_block = _BLOCK // codec.per_word  # words per 32-value block
    rows = max(1, min(n, _CHUNK_VALUES // k))
    word_buf = torch.empty(rows, per_block, nb, dtype=torch.int32)  # [rows, word in block, block]
    value_buf = torch.empty(rows, codec.per_word, per_block, nb, dtype=torch.float32)  # [rows, code, word, block]
    bits_buf = value_buf.view(torch.int32)
    shifts = torch.tensor(codec.shifts, dtype=torch.int32).view(1, -1, 1, 1)
    # relative scales times 2**exp_offset: undoes the decode's offset in the same multiply
    factor = rel * 2.0**codec.exp_offset  # [N, nb]
    out = torch.empty(n, m, dtype=torch.float32)  # [N, M], transposed at the end
    for r0 in range(0, n, rows):
        r = min(rows, n - r0)
        vals = value_buf[:r]
        if table_decode is None:
            wb, bits = word_buf[:r], bits_buf[:r]
            wb.copy_(words[r0 : r0 + r].view(r, nb, per_block).transpose(1, 2))  # [r, word in block, block]
            torch.bitwise_left_shift(wb.unsqueeze(1), shifts, out=bits)  # code i at the word's top
            bits.bitwise_right_shift_(codec.sar).bitwise_and_(codec.mask)
            vals.view(r, _BLOCK, nb).mul_(factor[r0 : r0 + r].unsqueeze(1))
        else:
            natural = table_decode(words[r0 : r0 + r].view(torch.uint8))  # [r, K]
            vals.copy_(natural.view(r, nb, per_block, codec.per_word).permute(0, 3, 2, 1))
            vals.view(r, _BLOCK, nb).mul_(rel[r0 : r0 + r].unsqueeze(1))
        flat = vals.view(r, k)  # [r, K] in the chunk column order
        if m == 1:
            torch.mv(flat, a_perm[0], out=out[r0 : r0 + r, 0])
        else:
            torch.mm(flat, a_perm.t(), out=out[r0 : r0 + r])
    return out.t()


# ---------------------------------------------------------------------- placement
def expert_devices(spec: DeviceSpec = None) -> list[torch.device]:
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
    reason = _triton_experts().unavailable_reason()
    if reason is not None:
        _say_once("devices", f"{reason}; routed experts stay on the CPU (fused packed-FP4 path)")
        return [torch.device("cpu")]
    count = torch.cuda.device_count()
    devices = [torch.device("cuda", d.index if d.index is not None else 0) for d in devices]
    bad = [str(d) for d in devices if d.index >= count]
    if bad:
        raise ValueError(f"no such CUDA device {', '.join(bad)} ({count} present)")
    return devices


def device_for(expert_id: int, devices: Sequence[torch.device]) -> torch.device:
    """The device expert `expert_id` is placed on: round-robin over `devices` (from `expert_devices`)."""
    return devices[expert_id % len(devices)]


# ---------------------------------------------------------------------- kernel choice
_SAID: set = set()  # keys of the one-line stderr notices already printed by this process


def _say_once(key: str, message: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        print(f"dsv41: {message}", file=sys.stderr)


def _triton_experts():
    """The Triton module, imported on first need, so CPU-only runs never import Triton."""
    from . import triton_experts

    return triton_experts


def _native_kernels(cpu_kernel: str) -> Optional["native.NativeKernels"]:
    """The native kernels for "native" (an error where they cannot be built) and "auto" (None,
    with one stderr line, where they cannot); None for "torch"."""
    if cpu_kernel not in CPU_KERNELS:
        raise ValueError(f"cpu_kernel must be one of {', '.join(CPU_KERNELS)}, got {cpu_kernel!r}")
    if cpu_kernel == "torch":
        return None
    kernels = native.load()
    if kernels is None:
        if cpu_kernel == "native":
            raise RuntimeError(f"cpu_kernel='native' is not available: {native.unavailable_reason()}")
        _say_once("native", f"{native.unavailable_reason()}; expert GEMMs use the plain-PyTorch kernel")
    return kernels
