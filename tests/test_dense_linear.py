"""Dense quantized linears on the native kernel (`kernels.gemm.linear`, kernel "auto" / "native"):
the block order written out in plain torch, bit for bit; the reference within float32 rounding
of the block sums; a token's bits independent of its company; no float32 copy of the weight."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import native_levels

from dsv41.checkpoint.formats import quantize_fp4, quantize_fp8_blocks
from dsv41.kernels import act_quant, fp4_gemm, fp8_gemm, linear
from dsv41.kernels.codecs import e8m0_decode, fp4_to_float

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler on PATH: the native kernels cannot be built here",
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _fp8_weight(n, k, g):
    return quantize_fp8_blocks(torch.randn(n, k, generator=g) / k**0.5)


def _fp4_weight(n, k, g):
    packed, scale = quantize_fp4(torch.randn(n, k, generator=g))
    return packed.view(torch.float4_e2m1fn_x2), scale


def _native_order(a, a_s, w, w_s):
    """The native kernel's arithmetic in plain torch: per 32-value block, lane l (0..7) sums its
    four products as (p0 + p1) + (p2 + p3), FP8 lanes reading elements l, l+8, l+16, l+24 and FP4
    lanes the arranged order (even elements, then odd: 2l, 16+2l, 2l+1, 17+2l); the block is
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); FP8 partials are scaled by the product of
    the two scales, FP4 ones by the activation scale then the weight scale; blocks are added in
    K order. Returns float32 [M, N]."""
    fp4 = w.dtype == torch.float4_e2m1fn_x2
    m, k = a.reshape(-1, a.size(-1)).shape
    n, nb = w.size(0), k // 32
    av = a.reshape(m, k).float()
    wv = fp4_to_float(w) if fp4 else w.float()  # [N, K]: a test may expand; the kernel must not
    sa = e8m0_decode(a_s.reshape(m, nb))  # [M, nb]
    sw = e8m0_decode(w_s)
    sw = sw if fp4 else sw.repeat_interleave(32, 0)[:n]  # [N, nb]
    prods = av.view(m, 1, nb, 32) * wv.view(1, n, nb, 32)  # [M, N, nb, 32], each product exact
    if fp4:
        lanes = [
            (prods[..., 2 * l] + prods[..., 16 + 2 * l]) + (prods[..., 2 * l + 1] + prods[..., 17 + 2 * l])
            for l in range(8)
        ]
    else:
        lanes = [(prods[..., l] + prods[..., l + 8]) + (prods[..., l + 16] + prods[..., l + 24]) for l in range(8)]
    block = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    acc = torch.zeros(m, n)
    for b in range(nb):
        if fp4:
            partial = (block[..., b] * sa[:, b : b + 1]) * sw[:, b]
        else:
            partial = block[..., b] * (sa[:, b : b + 1] * sw[:, b])
        acc = acc + partial
    return acc


@needs_cc
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 20])
@pytest.mark.parametrize("k", [320, 352])  # an even and an odd number of blocks (one token takes them in pairs)
def test_native_linear_is_the_written_out_block_order_bit_for_bit(native_level, kind, m, k):
    g = _gen(10 + m)
    w, s = (_fp8_weight if kind == "fp8" else _fp4_weight)(72, k, g)  # 72 rows: a ragged FP8 scale block
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    a, a_s = act_quant(x)
    want = _native_order(a, a_s, w, s).to(torch.bfloat16)
    got = linear(x, w, s, kernel="native")
    assert got.dtype == torch.bfloat16 and got.shape == (m, 72) and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(linear(x, w, s), got)  # "auto" takes the native kernel where it builds


@needs_cc
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_native_linear_equals_the_reference_up_to_block_sum_rounding(kind):
    """The reference sums a block's 32 exact products in BLAS order; the two sums differ by float32
    rounding only: at most 32 * 2**-24 of the block's absolute products, summed over blocks."""
    g = _gen(3)
    w, s = (_fp8_weight if kind == "fp8" else _fp4_weight)(96, 512, g)
    x = (torch.randn(5, 512, generator=g) * 2).to(torch.bfloat16)
    a, a_s = act_quant(x)
    gemm = fp8_gemm if kind == "fp8" else fp4_gemm
    ref = gemm(a, a_s, w, s, out_dtype=torch.float32)
    native = torch.cat([linear(x[i : i + 1].float(), w, s, kernel="native") for i in range(5)])
    # the float32 output of both: the same act_quant of x (bf16 -> float32 is exact)
    assert torch.equal(linear(x, w, s, kernel="reference"), gemm(a, a_s, w, s))
    av = a.float().abs() * e8m0_decode(a_s).repeat_interleave(32, 1)
    wv = (
        (fp4_to_float(w) * e8m0_decode(s).repeat_interleave(32, 1))
        if kind == "fp4"
        else w.float().abs() * e8m0_decode(s).repeat_interleave(32, 0)[:96].repeat_interleave(32, 1)
    )
    bound = 2 * 32 * 2.0**-24 * (av @ wv.abs().T)
    assert ((native - ref).abs() <= bound).all()


@needs_cc
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_a_tokens_bits_do_not_depend_on_how_many_share_the_call(native_level, kind):
    """Any token count, prefill-sized ones included, so a prefill equals its tokens decoded one at
    a time (the parity the chunked prefill relies on)."""
    g = _gen(5)
    w, s = (_fp8_weight if kind == "fp8" else _fp4_weight)(64, 256, g)
    x = (torch.randn(1, 37, 256, generator=g) * 3).to(torch.bfloat16)
    together = linear(x, w, s)
    assert together.shape == (1, 37, 64)
    for i in (0, 7, 8, 15, 36):
        assert torch.equal(linear(x[:, i : i + 1], w, s)[0, 0], together[0, i])
    assert torch.equal(linear(x[:, 3:14], w, s), together[:, 3:14])


@needs_cc
def test_the_weight_is_never_copied_to_float32(monkeypatch):
    """The native path reads the stored bytes: its largest allocation is far below a float32 copy."""
    from torch.profiler import ProfilerActivity, profile

    import dsv41.kernels.gemm as gemm

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference GEMM ran")

    monkeypatch.setattr(gemm, "fp8_gemm", forbidden)
    g = _gen(9)
    w, s = _fp8_weight(1024, 1024, g)
    x = torch.randn(1, 1024, generator=g).to(torch.bfloat16)
    linear(x, w, s)  # builds the library outside the profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        linear(x, w, s)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= w.numel() * 4 // 64, largest


def test_off_the_native_kernel_auto_is_the_reference_and_native_says_why(monkeypatch):
    import dsv41.kernels.native as native

    g = _gen(4)
    w, s = _fp8_weight(32, 64, g)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    a, a_s = act_quant(x)
    float_scales = e8m0_decode(s)  # float32 scales: the native kernel reads E8M0 bytes only
    assert torch.equal(linear(x, w, float_scales), fp8_gemm(a, a_s, w, float_scales))
    with pytest.raises(RuntimeError, match="weight scales are torch.float32"):
        linear(x, w, float_scales, kernel="native")
    monkeypatch.setattr(native, "_STATE", {native.isa_level(): (None, "no C compiler (cc) on PATH")})
    assert torch.equal(linear(x, w, s), fp8_gemm(a, a_s, w, s))
    with pytest.raises(RuntimeError, match="no C compiler"):
        linear(x, w, s, kernel="native")
    with pytest.raises(ValueError, match="kernel must be one of"):
        linear(x, w, s, kernel="fast")


@needs_cc
def test_layers_linear_runs_the_native_kernel():
    from dsv41.model.layers import Linear, init_random_

    lin = init_random_(Linear(128, 96), seed=1)
    x = torch.randn(3, 128, generator=_gen(2)).to(torch.bfloat16)
    a, a_s = act_quant(x)
    assert torch.equal(lin(x), _native_order(a, a_s, lin.weight, lin.scale).to(torch.bfloat16))


@needs_cc
def test_every_instruction_set_build_gives_the_same_bits(monkeypatch, tmp_path):
    """The AVX-512 body (one token, block pairs), the AVX2 body and plain C, each forced by its
    level's build (every level this CPU can run), agree bit for bit with the written-out order,
    for both formats."""
    import dsv41.kernels.native as native

    g = _gen(21)
    cases = []
    for _kind, make in (("fp8", _fp8_weight), ("fp4", _fp4_weight)):
        w, s = make(40, 352, g)
        for m in (1, 3):
            x = (torch.randn(m, 352, generator=g) * 3).to(torch.bfloat16)
            a, a_s = act_quant(x)
            cases.append((x, w, s, _native_order(a, a_s, w, s).to(torch.bfloat16)))
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    bodies = {}
    for level in native_levels():
        with native.forced_isa(level) as kernels:
            assert kernels is not None and kernels.level == level, native.unavailable_reason()
            bodies[level] = (kernels.avx512, kernels.simd)
            for x, w, s, want in cases:
                assert torch.equal(linear(x, w, s, kernel="native"), want), level
    # each level builds the body it names
    assert bodies["plain"] == (False, False)
    assert bodies.get("avx2", (False, True)) == (False, True)
    assert all(bodies[level] == (True, True) for level in native_levels()[2:])


@needs_cc
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_stays_non_finite(native_level, bad):
    """The kernel decodes E4M3 codes as numbers; a token whose activation holds the NaN code
    (what act_quant makes of a NaN or Inf) gets NaN outputs, as the reference GEMM gives it, so
    the finite checks find it; the other tokens are untouched."""
    g = _gen(3)
    w, w_s = _fp8_weight(64, 128, g)
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    clean = linear(x, w, w_s, kernel="native")
    x[1, 5] = bad
    for kernel in ("auto", "native", "reference"):
        y = linear(x, w, w_s, kernel=kernel)
        assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any(), kernel
    assert torch.equal(linear(x, w, w_s, kernel="native")[0], clean[0])


@needs_cc
@pytest.mark.parametrize("tokens", [3, 12])  # the block-order path and the many-token path
def test_a_non_finite_activation_stays_non_finite_through_routed_experts(native_level, tokens):
    from dsv41.bench import make_experts
    from dsv41.kernels.experts import routed_experts

    routed, _ = make_experts(4, 128, 64)
    experts = [routed[i] for i in range(4)] if isinstance(routed, dict) else routed
    g = _gen(4)
    x = torch.randn(tokens, 128, generator=g).to(torch.bfloat16)
    x[1, 3] = float("nan")
    ids = torch.stack([torch.arange(tokens) % 4, (torch.arange(tokens) + 1) % 4], dim=1)
    y = routed_experts(x, ids, torch.full((tokens, 2), 0.5), experts, 10.0)
    finite = torch.isfinite(y).all(dim=-1)
    assert not finite[1] and finite[torch.arange(tokens) != 1].all()
