"""Small building blocks shared by the attention layers and the backbone.

RMSNorm, a weight-holding `Linear` over the op layer's `linear`, YaRN rotary frequencies and the
interleaved-pair rotation, weight quantizers for random initialisation, and `init_random_`, which
fills every parameter of a module tree from one seed. Parameters are created with
requires_grad=False: inference holds the stored formats. Training runs the same modules over float32
master weights put in place of the stored ones for a call (`torch.func.functional_call`, see
`dsv41.train.masters`): a `Linear` whose weight is such a master rounds where the stored one would
(`Linear.master_forward`), and every quantization on the way passes its gradient straight through
(`straight_through`).
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.formats import FP8_BLOCK, dequantize_fp8_blocks, infer_fp8_block, quantize_fp4, quantize_fp8_blocks
from ..core.config import Config
from ..kernels import act_quant, linear

# One FP8 weight scale per 32 x 32 block, one FP4 weight scale per 32 elements along K.
WEIGHT_BLOCK = 32


def param(t: torch.Tensor) -> nn.Parameter:
    """An inference-only parameter (no gradient)."""
    return nn.Parameter(t, requires_grad=False)


@contextmanager
def parameters_on_meta():
    """Modules built inside hold their parameters on the meta device (no memory), their buffers as
    usual: for a module that then takes another's parameters with `load_state_dict(..., assign=True)`,
    sharing them, where a copy would double the memory (the released attention weights are 6.5 GB).
    Each parameter exists in memory only while its constructor makes it. Through torch's own
    parameter-registration hook, removed when the block ends, not a patch of `nn.Module`."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def on_meta(module: nn.Module, name: str, value):
        return None if value is None else nn.Parameter(value.to("meta"), requires_grad=value.requires_grad)

    handle = register_module_parameter_registration_hook(on_meta)
    try:
        yield
    finally:
        handle.remove()


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded`'s values (exactly: x - x is zero) with x's gradient, where x needs one; else `rounded`."""
    if not x.requires_grad:
        return rounded
    return rounded.detach() + (x - x.detach())


def linear_dtype(cfg: Config) -> torch.dtype:
    """Storage dtype of the dense linears the config quantizes (`cfg.dtype`: 'fp8' or 'bf16')."""
    return torch.float8_e4m3fn if cfg.dtype == "fp8" else torch.bfloat16


def activation_dtype(cfg: Config) -> torch.dtype:
    """Dtype of activations, norms and caches: the checkpoint's storage dtype, bf16 by default."""
    return getattr(torch, cfg.param_dtype) if cfg.param_dtype else torch.bfloat16


# ---------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and returned in the input's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = param(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        # the (bf16) weight multiplies the float32 value; one rounding at the end
        return (self.weight * x32).to(x.dtype)

    def _random_init_(self, gen: torch.Generator) -> None:
        noise = torch.randn(self.dim, generator=gen) * 0.1
        self.weight.copy_((1.0 + noise).to(self.weight.dtype))


class Linear(nn.Module):
    """y = x @ W^T with W stored as FP8 (+ 32x32 E8M0 scales), packed FP4 (+ 1x32 E8M0 scales),
    BF16 or FP32. Quantized weights go through the op layer's `linear`, which quantizes the
    activation to FP8 over blocks of 32 first, as the reference runtime does; FP32 weights go
    through `f32_linear`, padding their rows when `pad_f32_rows` is set."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        pad_f32_rows: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.pad_f32_rows = pad_f32_rows  # read only when the weight is float32 (see f32_linear)
        self.stored_dtype = dtype  # what a float32 master weight stands for (`master_forward`)
        # set by the trainer (`train.masters.set_phase`): a master's input quantized to FP8 as the
        # stored weight's is (the quantization-aware phase), its products in training's order
        self.qat, self.fast = False, False
        self._stored_master: tuple = (None, None, None)  # (master, weight, scale): see master_forward
        if dtype == torch.float4_e2m1fn_x2:
            # logically [out, in]; two values per byte
            self.weight = param(torch.zeros(out_features, in_features // 2, dtype=dtype))
            self.scale = param(torch.zeros(out_features, in_features // WEIGHT_BLOCK, dtype=torch.float8_e8m0fnu))
        elif dtype == torch.float8_e4m3fn:
            self.weight = param(torch.zeros(out_features, in_features, dtype=dtype))
            blocks = (-(-out_features // WEIGHT_BLOCK), -(-in_features // WEIGHT_BLOCK))
            self.scale = param(torch.zeros(blocks, dtype=torch.float8_e8m0fnu))
        else:
            self.weight = param(torch.zeros(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32 and self.stored_dtype != torch.float32:
            return self.master_forward(x)
        if self.weight.dtype == torch.float32:
            return f32_linear(x, self.weight, pad_f32_rows=self.pad_f32_rows)
        # FP8 / FP4 weights are read as stored by the op layer's native kernel (the reference's
        # block order: one float32 partial per 32-wide K block, added in K order), the plain
        # reference GEMM where that kernel is not built
        return linear(x, self.weight, self.scale)

    def master_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x through a float32 master weight [out, in] standing for the stored one -> bf16.

        Quantized storage: under qat with the reference summation the op layer's own product on the
        master's stored bytes (the loaded checkpoint's arithmetic, bit for bit: for evaluation);
        otherwise a float32 product of the master (the trainer rounds it to its grid under qat)
        with the input, FP8-quantized under qat, gradient straight through. BF16 storage: the bf16
        product (reference) or a float32 one rounded to bf16 (fast)."""
        w = self.weight
        if self.stored_dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
            if self.qat and not self.fast:
                return linear(x.to(torch.bfloat16), *self._stored_bytes(w))
            if self.qat:
                x = straight_through(
                    x, act_quant(x.detach().float().clone(), 32, "ue8m0", torch.float8_e8m0fnu, inplace=True)
                )
            return F.linear(x.float(), w).to(torch.bfloat16)
        return master_product(F.linear, x, w, fast=self.fast)

    def _stored_bytes(self, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scale) of `master` as the checkpoint stores it, kept while `master` is the same tensor."""
        held, weight, scale = self._stored_master
        if held is not master:
            with torch.no_grad():
                if self.stored_dtype == torch.float4_e2m1fn_x2:
                    weight, scale = quantize_weight_fp4(master.detach().float())
                else:
                    blocks = (-(-self.out_features // WEIGHT_BLOCK), -(-self.in_features // WEIGHT_BLOCK))
                    weight, scale = quantize_fp8_blocks(master.detach().float(), infer_fp8_block(master.shape, blocks))
            self._stored_master = (master, weight, scale)
        return weight, scale

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}"

    def _random_init_(self, gen: torch.Generator) -> None:
        w = torch.randn(self.out_features, self.in_features, generator=gen) / math.sqrt(self.in_features)
        if self.weight.dtype == torch.float8_e4m3fn:
            values, scale = quantize_weight_fp8(w)
            self.weight.copy_(values)
            self.scale.copy_(scale)
        elif self.weight.dtype == torch.float4_e2m1fn_x2:
            values, scale = quantize_weight_fp4(w)
            self.weight.copy_(values)
            self.scale.copy_(scale)
        else:
            self.weight.copy_(w.to(self.weight.dtype))


def master_product(product, x: torch.Tensor, w: torch.Tensor, *args, fast: bool) -> torch.Tensor:
    """A product inference runs in bf16 (bf16 linears, the grouped output projection) over a float32
    master w: through the same bf16 kernel (whose float32 accumulation order depends on the row
    count), or under training's fast summation in float32, rounded to bf16 after."""
    if fast:
        return product(*args, x.float(), w).to(torch.bfloat16)
    return product(*args, x.to(torch.bfloat16), w.to(torch.bfloat16))


# CPU BLAS picks its float32 GEMM kernel by row count (this torch build's MKL: a call of fewer than
# 4 rows, as a decode step's one, rounds differently from a call of more), so a token's output can
# depend on how many tokens were projected with it, and a prefill differs from the same tokens
# decoded one at a time by float32 rounding (~1e-7 relative); on AVX-512 Xeons a call of 16 rows
# or more also rounds differently from one of 8 (K >= 256). The released runtime does not pad.
# pad_f32_rows=True runs every call as GEMMs of exactly 8 rows, so every row takes the same kernel: an
# opt-in for bit parity between prefill and decode, not the reference's arithmetic. The float32
# paths need it (the compressor's pooling projections, the router, the hyper-connection mixes,
# the head), and so does the one bf16 GEMM, the grouped output projection: its one-row call rounds
# differently from a many-row one (measured on an AVX-512 Xeon without BF16: at K 256-4,096 on two
# threads, at the released 4,096 on one), where a call of exactly 8 rows gave the many-row result
# bit for bit. The quantized paths are row-count invariant by design.
F32_ROW_PAD = 8


# A bf16 weight widened to float32 for one product: at the released size the router's is 7.5 MiB
# for every layer of every token. Into a fresh tensor that took 1.9 ms a layer in a full-size
# decode step, into one kept buffer 0.35 ms (the token 1.53-1.59 s -> 1.47-1.55 s here), so each
# thread widens into one kept buffer per shape. Widening is exact: the product sees the same values.
_WIDENED = threading.local()
WIDEN_IN_PLACE_BYTES = 1 << 20


def widened(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as float32: itself when it is float32 (a training master keeps its gradient), else
    its values widened, into this thread's kept buffer of that shape when it is large (the buffer
    is overwritten by the next widening of that shape: use the result before widening another)."""
    if weight.dtype == torch.float32 or weight.requires_grad or weight.numel() * 4 < WIDEN_IN_PLACE_BYTES:
        return weight.float()
    buffers = _WIDENED.__dict__.setdefault("buffers", {})
    key = (tuple(weight.shape), weight.device)
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    return buf.copy_(weight)


def f32_linear(x: torch.Tensor, weight: torch.Tensor, *, pad_f32_rows: bool) -> torch.Tensor:
    """float32 x [..., K] @ weight [N, K]^T (both taken to float32, the weight by `widened`).
    pad_f32_rows (`Numerics`): every GEMM gets exactly F32_ROW_PAD rows (the last block
    zero-padded), so a row's result does not depend on how many rows share the call (off: the
    reference's plain GEMM)."""
    if not pad_f32_rows:
        return F.linear(x.float(), widened(weight))
    w = widened(weight)
    out = in_row_blocks(lambda block: F.linear(block, w), x.float().reshape(-1, x.size(-1)))  # [M, N]
    return out.reshape(*x.shape[:-1], weight.size(0))


def in_row_blocks(product, rows: torch.Tensor) -> torch.Tensor:
    """product(rows) for a product that treats each row [M, ...] on its own, run as calls of exactly
    F32_ROW_PAD rows (the last zero-padded), so every row takes the kernel an 8-row call takes
    whatever M is. Padding alone is not enough: BLAS may pick another kernel (another K blocking)
    for 16 rows than for 8 (seen on AVX-512 Xeons), so each block is its own call."""
    n = rows.size(0)
    pad = -n % F32_ROW_PAD
    if pad:
        rows = F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, pad))
    return torch.cat([product(rows[i : i + F32_ROW_PAD]) for i in range(0, rows.size(0), F32_ROW_PAD)])[:n]


# Elementwise transcendental ops (sigmoid, softplus, exp) run SIMD over the body of a buffer and a
# scalar loop over its tail (what is left after the last pair of vectors), and the two can round
# one value differently; a one-token decode call's few values are all tail. With pad_f32_rows
# such an op runs over rows padded until the buffer is a whole number of VECTOR_BODY values, so
# every value takes the SIMD body whatever the call's row count.
VECTOR_BODY = 64  # float32 values; two AVX-512 vectors are 32


def rowwise(fn, x: torch.Tensor, *, pad_f32_rows: bool):
    """fn(x) for an fn that treats each row of x [..., W] on its own (returning one tensor or a
    tuple, each [..., *]), with the rows padded as VECTOR_BODY says when pad_f32_rows is set."""
    if not pad_f32_rows:
        return fn(x)
    rows = x.reshape(-1, x.size(-1))  # [M, W]
    n = rows.size(0)
    pad = -n % (VECTOR_BODY // math.gcd(VECTOR_BODY, rows.size(1)))
    out = fn(F.pad(rows, (0, 0, 0, pad)) if pad else rows)

    def unpad(t: torch.Tensor) -> torch.Tensor:
        return t[:n].reshape(*x.shape[:-1], *t.shape[1:])

    return tuple(unpad(t) for t in out) if isinstance(out, tuple) else unpad(out)


# ---------------------------------------------------------------------------------- weights
def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], E8M0 [ceil(N/32), ceil(K/32)]): the checkpoint's layout."""
    return quantize_fp8_blocks(w)


def dequantize_weight_fp8(values: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_weight_fp8 (what a loader does to wo_a, held in BF16 at runtime)."""
    return dequantize_fp8_blocks(values, scale, FP8_BLOCK, dtype)


def quantize_weight_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (packed float4_e2m1fn_x2 [N, K/2], E8M0 scales [N, K/32])."""
    packed, scale = quantize_fp4(w)
    return packed.view(torch.float4_e2m1fn_x2), scale


def init_random_(module: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter of `module` (and its children) from `seed`, well scaled: linears
    ~ N(0, 1/in_features) then quantized to their storage format, norms 1 + N(0, 0.01).
    Modules opt in with a `_random_init_(generator)` method for their own direct parameters;
    a parameter no module claims raises, so nothing is silently left at zero."""
    gen = torch.Generator().manual_seed(seed)
    claimed: set[int] = set()
    with torch.no_grad():
        for m in module.modules():
            init = getattr(m, "_random_init_", None)
            if init is not None:
                init(gen)
                claimed.update(id(p) for p in m.parameters(recurse=False))
    missing = [name for name, p in module.named_parameters() if id(p) not in claimed]
    if missing:
        raise TypeError(f"init_random_: no _random_init_ covers {', '.join(missing)}")
    return module


# ---------------------------------------------------------------------------------- rotary
def yarn_inv_freq(
    dim: int, original_seq_len: int, base: float, factor: float, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """float32 [dim/2] rotary frequencies; YaRN-corrected when original_seq_len > 0.

    Dimensions that turn more than beta_fast times over the training context keep their
    frequency, those turning fewer than beta_slow times are divided by `factor`, and a linear
    ramp (over dimension index) blends the band between. No attention-temperature (mscale)
    correction: the reference runtime applies none."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len <= 0:
        return inv_freq

    def dim_for_turns(turns: float) -> float:
        # the (fractional) dimension index whose wavelength fits `turns` times in the context
        return dim * math.log(original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for_turns(beta_fast)), 0)
    high = min(math.ceil(dim_for_turns(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def precompute_freqs_cis(
    dim: int, seqlen: int, original_seq_len: int, base: float, factor: float, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """complex64 [seqlen, dim/2]: e^(i * position * inv_freq), one row per position."""
    inv_freq = yarn_inv_freq(dim, original_seq_len, base, factor, beta_fast, beta_slow)
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), inv_freq)  # [seqlen, dim/2]
    return torch.polar(torch.ones_like(angles), angles)


def rotate_tail(x: torch.Tensor, freqs_cis: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """x [b, s, (h,) d] with its last rope_dim channels rotated (`apply_rotary_emb`): in place when
    x needs no gradient (inference), else a new tensor, the same values, that autograd can follow."""
    if not x.requires_grad:
        apply_rotary_emb(x[..., -rope_dim:], freqs_cis, inverse)
        return x
    return torch.cat([x[..., :-rope_dim], rotated(x[..., -rope_dim:], freqs_cis, inverse).to(x.dtype)], dim=-1)


def rotated(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """float32 x [b, s, (h,) d] rotated: adjacent pairs (2i, 2i+1) as complex numbers times freqs_cis
    [s, d/2] (or [b, s, d/2]: each row at its own positions), by the conjugate when `inverse`."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())  # [b, s, (h,) d/2]
    rot = freqs_cis.conj() if inverse else freqs_cis
    rows = rot.size(0) if rot.dim() == 3 else 1
    rot = rot.view(rows, x.size(1), *([1] * (x.dim() - 3)), x.size(-1) // 2)
    return torch.view_as_real(pairs * rot).flatten(-2)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x in place and return it (`rotated`). `inverse` rotates by the conjugate, which is how
    the attention output has its query-position rotation taken off again."""
    x.copy_(rotated(x, freqs_cis, inverse))
    return x
