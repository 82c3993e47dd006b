"""The fused packed-FP4 expert path against the op layer's reference GEMMs, on both CPU kernels
(native, built from native.c with this machine's C compiler, and plain torch), and the Triton
kernels through Triton's CPU interpreter (in a subprocess, since TRITON_INTERPRET is read at
import)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import native_levels

import dsv41.kernels.experts as ex
from dsv41.checkpoint.formats import quantize_fp4, quantize_fp8_blocks
from dsv41.kernels import act_quant, fp4_gemm, fp4_to_float, fp8_gemm
from dsv41.kernels.experts import (
    PackedExpert,
    e4m3_to_float,
    expert_ffn,
    expert_ffn_reference,
    fp4_gemm_fused,
    fp8_gemm_fused,
    routed_experts,
    routed_experts_reference,
)
from dsv41.kernels.operands import check_operands

REPO = Path(__file__).resolve().parents[1]
try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None


@pytest.fixture(params=[f"native-{level}" for level in native_levels()] + ["torch"])
def kernel(request):
    """Each fused-path test runs on both CPU kernels, the native one at every instruction-set
    level this CPU can run (`native.forced_isa`: its AVX-512, AVX2 and plain-C bodies, the BF16 and
    float32 many-token paths). Where a C compiler is on PATH the native one must build (a failure
    fails the test); without one it cannot, and its runs skip."""
    if request.param == "torch":
        yield "torch"
        return
    if not HAVE_CC:
        pytest.skip("no C compiler on PATH: the native kernels cannot be built here")
    with ex.native.forced_isa(request.param.removeprefix("native-")):
        yield "native"


@pytest.fixture
def small_chunks(monkeypatch):
    """A few rows per chunk, so every product crosses several chunks and a ragged last one."""
    monkeypatch.setattr(ex, "_CHUNK_VALUES", 2048)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _fp4_weight(n, k, g, lo=118, hi=131, codes=None):
    packed = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=g) if codes is None else codes
    scale = torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=g)
    return packed, scale.view(torch.float8_e8m0fnu)


def _bound(a, a_s, w_values, w_scales):
    """sum_k |a_k * w_k| in float64: what a float32 accumulation error is proportional to."""
    av = a.float().double() * a_s.float().double().repeat_interleave(32, dim=1)
    wv = w_values.double() * w_scales.double().repeat_interleave(32, dim=1)
    return av.abs() @ wv.abs().T


def _assert_gemm_close(got, ref, bound, k):
    """Same infinities and NaNs; finite entries within two float32 sums' worst-case error."""
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.equal(got[torch.isinf(got)], ref[torch.isinf(ref)])
    fin = torch.isfinite(ref)
    tol = 2 * k * 2.0**-24 * bound[fin] + 2.0**-140  # the additive part covers subnormal results
    err = (got[fin].double() - ref[fin].double()).abs()
    assert (err <= tol).all(), f"max error {err.max().item()} vs tolerance {tol[err.argmax()].item()}"


def _check_fp4(x, packed, scale, kernel):
    a, a_s = act_quant(x)
    ref = fp4_gemm(a, a_s, packed.view(torch.uint8), scale, out_dtype=torch.float32)
    got = fp4_gemm_fused(a, a_s, packed, scale, out_dtype=torch.float32, cpu_kernel=kernel)
    bound = _bound(a, a_s, fp4_to_float(packed.view(torch.uint8)), scale.float())
    _assert_gemm_close(got, ref, bound, x.size(-1))
    return got, ref


# ---------------------------------------------------------------------- the fused GEMMs
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 20])  # the native GEMV takes up to 8 tokens, then decode + GEMM
def test_fp4_fused_matches_fp4_gemm_on_random_codes(small_chunks, kernel, m):
    g = _gen(m)
    packed, scale = _fp4_weight(70, 320, g)
    x = (torch.randn(m, 320, generator=g) * 3).to(torch.bfloat16)
    got, ref = _check_fp4(x, packed, scale, kernel)
    assert ref.abs().max() > 0


def test_fp4_fused_keeps_leading_dims_and_out_dtype(kernel):
    g = _gen(1)
    packed, scale = _fp4_weight(40, 64, g)
    a, a_s = act_quant(torch.randn(2, 3, 64, generator=g).to(torch.bfloat16))
    got = fp4_gemm_fused(a, a_s, packed.view(torch.float4_e2m1fn_x2), scale, cpu_kernel=kernel)
    ref = fp4_gemm(a, a_s, packed.view(torch.float4_e2m1fn_x2), scale)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max() <= 2.0**-7 * ref.float().abs().max()


_EXTREMES = {
    # every code +-6 (nibbles 7 and 15)
    "all_six": dict(codes=[0x77, 0xFF, 0x7F, 0xF7], scale=(118, 131), x=1.0),
    # +-0 codes everywhere: the product is exactly zero
    "zeros": dict(codes=[0x00, 0x88, 0x08, 0x80], scale=(118, 131), x=1.0),
    # the largest E8M0 scale with the smallest activation scale: large but finite results
    "max_scale": dict(codes=None, scale=(254, 255), x=1e-5),
    # the smallest (a float32 subnormal) with large activations: normal results
    "min_scale_large_x": dict(codes=None, scale=(0, 1), x=1e30),
    # the smallest with ordinary activations: subnormal results
    "min_scale": dict(codes=None, scale=(0, 1), x=1.0),
}


@pytest.mark.parametrize("case", sorted(_EXTREMES))
@pytest.mark.parametrize("m", [3, 12])
def test_fp4_fused_matches_fp4_gemm_on_adversarial_codes(small_chunks, kernel, case, m):
    spec = _EXTREMES[case]
    g = _gen(7)
    n, k = 24, 128
    codes = None
    if spec["codes"] is not None:
        choice = torch.tensor(spec["codes"], dtype=torch.uint8)
        codes = choice[torch.randint(0, len(choice), (n, k // 2), generator=g)].view(torch.int8)
    packed, scale = _fp4_weight(n, k, g, *spec["scale"], codes=codes)
    x = (torch.randn(m, k, generator=g) * spec["x"]).to(torch.bfloat16)
    got, ref = _check_fp4(x, packed, scale, kernel)
    if case == "zeros":
        assert not got.any() and not ref.any()
    else:
        assert torch.isfinite(ref).all() and ref.abs().max() > 0


def test_fp4_fused_agrees_on_overflow(kernel):
    # +6 everywhere at scale 2**127 with positive activations: every block term is +inf
    n, k = 8, 64
    packed = torch.full((n, k // 2), 0x77, dtype=torch.uint8).view(torch.int8)
    scale = torch.full((n, k // 32), 254, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.rand(2, k, generator=_gen(3)).add(0.5).to(torch.bfloat16)
    got, ref = _check_fp4(x, packed, scale, kernel)
    assert torch.isinf(ref).all()


@pytest.mark.parametrize("m", [4, 11])
def test_scales_spanning_too_far_take_the_reference_rows(small_chunks, kernel, m):
    # one weight row mixes 2**-127 and 2**127 blocks; one token mixes 1e30 and 1e-30 blocks
    g = _gen(11)
    n, k = 10, 128
    packed, scale = _fp4_weight(n, k, g)
    raw = scale.view(torch.uint8).clone()
    raw[3] = torch.tensor([0, 254, 1, 253], dtype=torch.uint8)
    x = torch.randn(m, k, generator=g)
    x[2, :32] *= 1e30
    x[2, 32:] *= 1e-30
    _check_fp4(x.to(torch.bfloat16), packed, raw.view(torch.float8_e8m0fnu), kernel)


@pytest.mark.parametrize("m", [5, 13])
def test_fp8_fused_matches_fp8_gemm(small_chunks, kernel, m):
    g = _gen(5)
    n, k = 70, 160  # 70 rows: the last 32-row scale block is partial
    weight = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (3, k // 32), dtype=torch.uint8, generator=g)
    scale[1, 2] = 0  # one block spanning too far: rows 32..63 go through the reference
    scale = scale.view(torch.float8_e8m0fnu)
    a, a_s = act_quant((torch.randn(m, k, generator=g) * 2).to(torch.bfloat16))
    ref = fp8_gemm(a, a_s, weight, scale, out_dtype=torch.float32)
    got = fp8_gemm_fused(a, a_s, weight, scale, out_dtype=torch.float32, cpu_kernel=kernel)
    w_scales = scale.float().repeat_interleave(32, 0)[:n]
    _assert_gemm_close(got, ref, _bound(a, a_s, weight.float(), w_scales), k)


def test_linear_fused_is_the_op_layer_linear(kernel):
    from dsv41.kernels import linear
    from dsv41.kernels.experts import linear_fused

    g = _gen(3)
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    packed, scale = _fp4_weight(48, 128, g)
    fp8, fp8_s = quantize_fp8_blocks(torch.randn(48, 128, generator=g))
    dense = torch.randn(48, 128, generator=g).to(torch.bfloat16)
    for w, s in ((packed, scale), (fp8, fp8_s), (dense, None)):
        ref = linear(x, w.view(torch.float4_e2m1fn_x2) if w.dtype == torch.int8 else w, s)
        got = linear_fused(x, w, s, cpu_kernel=kernel)
        assert got.dtype == ref.dtype == torch.bfloat16
        assert (got.float() - ref.float()).abs().max() <= 2.0**-7 * ref.float().abs().max()


def test_e4m3_to_float_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # not the NaN codes
    fp8 = codes.view(torch.float8_e4m3fn)
    assert torch.equal(e4m3_to_float(fp8), fp8.float())


def test_flushed_subnormals_change_nothing(small_chunks, kernel):
    """With subnormals flushed the torch kernel decodes through the codec table; the native one
    reads FP4 through integers and E4M3 through IEEE halves, which need no subnormal float32.
    Either way the numbers still match the reference, E4M3 subnormal codes included."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals, so there is nothing to observe")
    try:
        assert not ex._subnormals_kept()
        g = _gen(13)
        packed, scale = _fp4_weight(20, 96, g)
        for m in (2, 10):
            _check_fp4((torch.randn(m, 96, generator=g)).to(torch.bfloat16), packed, scale, kernel)
        codes = torch.randint(0, 256, (40, 96), dtype=torch.uint8, generator=g)
        codes[:, ::3] &= 0x87  # every third value an E4M3 subnormal (exponent field 0) or zero
        codes[(codes & 0x7F) == 0x7F] = 0
        weight = codes.view(torch.float8_e4m3fn)
        w_s = torch.randint(118, 130, (2, 3), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
        for m in (2, 10):
            a, a_s = act_quant(torch.randn(m, 96, generator=g).to(torch.bfloat16))
            got = fp8_gemm_fused(a, a_s, weight, w_s, out_dtype=torch.float32, cpu_kernel=kernel)
            ref = fp8_gemm(a, a_s, weight, w_s, out_dtype=torch.float32)
            _assert_gemm_close(got, ref, _bound(a, a_s, weight.float(), w_s.float().repeat_interleave(32, 0)[:40]), 96)
    finally:
        torch.set_flush_denormal(False)
    assert ex._subnormals_kept()


# ---------------------------------------------------------------------- whole experts
def _expert(dim, inter, g, fp8=False, std=0.08):
    quant = (lambda w: quantize_fp8_blocks(w)) if fp8 else quantize_fp4
    parts = [quant(torch.randn(*shape, generator=g) * std) for shape in ((inter, dim), (dim, inter), (inter, dim))]
    return PackedExpert(*(t for p in parts for t in p))


def _routing(n, n_experts, k, g):
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g) + 0.05
    return ids, weights / weights.sum(-1, keepdim=True)


def _assert_bf16_close(got, ref):
    # GEMM outputs are rounded to bf16 at the reference's points; a float32 ordering difference
    # can move one rounding by an ulp, which the next layers carry but do not grow
    assert (got.float() - ref.float()).abs().max() <= 2.0**-7 * ref.float().abs().max()


def test_clamped_swiglu_clamps_up_on_both_sides_and_gate_from_above():
    from dsv41.kernels.experts import clamped_swiglu

    gate = torch.tensor([-20.0, 0.5, 20.0, 30.0])
    up = torch.tensor([-20.0, 5.0, 20.0, -30.0])
    want = torch.nn.functional.silu(torch.tensor([-20.0, 0.5, 10.0, 10.0])) * torch.tensor([-10.0, 5.0, 10.0, -10.0])
    assert torch.equal(clamped_swiglu(gate, up, 10.0), want)
    assert torch.equal(clamped_swiglu(gate, up, 0.0), torch.nn.functional.silu(gate) * up)  # 0: no clamp


def test_routed_experts_match_the_reference(small_chunks, kernel):
    g = _gen(17)
    dim, inter, n_experts = 256, 96, 7
    experts = {e: _expert(dim, inter, g) for e in range(n_experts)}
    x = (torch.randn(9, dim, generator=g) * 4).to(torch.bfloat16)
    ids, weights = _routing(9, n_experts, 3, g)
    limit = 1.5  # small enough that the clamp cuts in
    ref = routed_experts_reference(x, ids, weights, experts, limit)
    got = routed_experts(x, ids, weights, experts, limit, cpu_kernel=kernel)
    assert got.dtype == torch.float32 and got.shape == x.shape
    _assert_bf16_close(got, ref)
    unclamped = routed_experts(x, ids, weights, experts, 0.0, cpu_kernel=kernel)
    assert (unclamped - got).abs().max() > 0.05 * got.abs().max()  # the limit was exercised
    # a list indexed by id is the same contract as a dict
    listed = routed_experts(x, ids, weights, [experts[e] for e in range(n_experts)], limit, cpu_kernel=kernel)
    assert torch.equal(listed, got)


@pytest.mark.parametrize("first_mode", ["inference", "no_grad", "grad"])
def test_kept_buffers_take_calls_in_every_grad_mode(monkeypatch, kernel, first_mode):
    """The many-token path keeps its working buffers between calls: whichever grad mode made
    them (inference_mode, no_grad, plain), a later call in any other mode gives the same bits
    (a buffer first made under inference_mode used to refuse writes outside it)."""
    from dsv41.kernels import native

    monkeypatch.setattr(native, "_STATE", {})  # a kernels object with nothing kept yet
    g = _gen(29)
    dim, inter, n_experts = 256, 96, 4
    experts = {e: _expert(dim, inter, g) for e in range(n_experts)}
    x = (torch.randn(64, dim, generator=g) * 4).to(torch.bfloat16)
    ids, weights = _routing(64, n_experts, 2, g)
    modes = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}
    order = [first_mode] + [m for m in modes if m != first_mode] + [first_mode]
    outs = []
    for mode in order:
        with modes[mode]():
            outs.append(routed_experts(x, ids, weights, experts, 0.0, cpu_kernel=kernel).clone())
    assert all(torch.equal(out, outs[0]) for out in outs[1:]), order


def test_routed_experts_handle_one_token_and_no_tokens(kernel):
    g = _gen(19)
    dim, inter = 128, 64
    experts = {e: _expert(dim, inter, g) for e in range(8)}
    x = torch.randn(1, dim, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[5, 0, 7, 2, 3, 1]])
    weights = torch.softmax(torch.randn(1, 6, generator=g), -1)
    _assert_bf16_close(
        routed_experts(x, ids, weights, experts, 10.0, cpu_kernel=kernel),
        routed_experts_reference(x, ids, weights, experts, 10.0),
    )
    empty = routed_experts(x[:0], ids[:0], weights[:0], experts, 10.0, cpu_kernel=kernel)
    assert empty.shape == (0, dim)
    with pytest.raises(ValueError, match="expert_ids and weights"):
        routed_experts(x, ids, weights[:, :3], experts)


def test_the_default_dtype_changes_nothing(small_chunks, kernel):
    g = _gen(61)
    experts = {e: _expert(128, 64, g) for e in range(3)}
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    ids, weights = _routing(2, 3, 2, g)
    want = routed_experts(x, ids, weights, experts, 4.0, cpu_kernel=kernel)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = routed_experts(x, ids, weights, experts, 4.0, cpu_kernel=kernel)
        assert ex._subnormals_kept()
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(got, want)


def test_a_zero_expert_contributes_exactly_nothing(kernel):
    g = _gen(23)
    dim, inter = 64, 32
    zero = PackedExpert(*(torch.zeros_like(t) if t.dtype == torch.int8 else t for t in _expert(dim, inter, g)))
    other = _expert(dim, inter, g)
    x = torch.randn(3, dim, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 3)
    w = torch.full((3, 2), 0.5)
    both = routed_experts(x, ids, w, {0: zero, 1: other}, cpu_kernel=kernel)
    alone = routed_experts(x, ids[:, 1:], w[:, 1:], {1: other}, cpu_kernel=kernel)
    assert torch.equal(both, alone)


@pytest.mark.parametrize("m", [4, 10])
def test_shared_fp8_expert_matches_the_reference(kernel, m):
    g = _gen(29)
    expert = _expert(192, 96, g, fp8=True)
    x = (torch.randn(m, 192, generator=g) * 3).to(torch.bfloat16)
    _assert_bf16_close(expert_ffn(x, expert, 2.0, cpu_kernel=kernel), expert_ffn_reference(x, expert, 2.0))


def test_no_whole_weight_is_expanded(monkeypatch, kernel):
    """The fused path never calls a dense dequantizer, and its largest allocation is far below a
    BF16 copy of one weight matrix."""
    from torch.profiler import ProfilerActivity, profile

    import dsv41.checkpoint.formats as formats
    import dsv41.kernels.codecs as codecs
    import dsv41.kernels.gemm as gemm

    def forbidden(*args, **kwargs):
        raise AssertionError("a whole weight matrix was expanded")

    for module, name in [
        (codecs, "fp4_to_float"),
        (gemm, "fp4_to_float"),
        (ex, "fp4_to_float"),
        (formats, "dequantize_fp4"),
        (formats, "dequantize"),
        (formats, "fp4_values"),
    ]:
        monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(ex, "_CHUNK_VALUES", 8192)
    monkeypatch.setattr(ex, "_BF16_CHUNK_VALUES", 8192)
    g = _gen(31)
    dim, inter = 1024, 512
    experts = {e: _expert(dim, inter, g) for e in range(2)}
    tokens = 12  # past the native GEMV's 8, so the native kernel's decode buffer is measured too
    x = torch.randn(tokens, dim, generator=g).to(torch.bfloat16)
    ids, weights = torch.tensor([[0, 1], [1, 0]] * (tokens // 2)), torch.full((tokens, 2), 0.5)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        routed_experts(x, ids, weights, experts, 10.0, cpu_kernel=kernel)
    largest = max(e.cpu_memory_usage for e in prof.events())
    bf16_copy = dim * inter * 2
    assert 0 < largest <= bf16_copy // 8, (largest, bf16_copy)


# ---------------------------------------------------------------------- the native kernel
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on PATH: the native kernels cannot be built here")


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """A process that has not built or loaded the native kernels yet, with its own cache folder."""
    from dsv41.kernels import native

    monkeypatch.setenv("DSV41_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(ex, "_SAID", set())  # the "auto" fallback line not printed yet
    return native


def _gemm_cases(g):
    """(fp4 or fp8, a, a_s, weight, scale, reference output) at 3 and 12 tokens."""
    packed, scale = _fp4_weight(40, 128, g)
    fp8, fp8_s = quantize_fp8_blocks(torch.randn(40, 128, generator=g))
    for m in (3, 12):
        a, a_s = act_quant((torch.randn(m, 128, generator=g) * 2).to(torch.bfloat16))
        yield ("fp4", a, a_s, packed, scale, fp4_gemm(a, a_s, packed.view(torch.uint8), scale, out_dtype=torch.float32))
        yield ("fp8", a, a_s, fp8, fp8_s, fp8_gemm(a, a_s, fp8, fp8_s, out_dtype=torch.float32))


def _fused_gemm(kind, a, a_s, w, s, cpu_kernel):
    fn = fp4_gemm_fused if kind == "fp4" else fp8_gemm_fused
    return fn(a, a_s, w, s, out_dtype=torch.float32, cpu_kernel=cpu_kernel)


@needs_cc
def test_native_kernels_build_once_into_the_cache(fresh_native, tmp_path, monkeypatch):
    kernels = fresh_native.load()
    assert kernels is not None, fresh_native.unavailable_reason()
    assert kernels.path.parent == tmp_path / "native" and kernels.path.is_file()
    assert fresh_native.load() is kernels  # once per process
    # a new process finds the library in the cache and compiles nothing
    monkeypatch.setattr(fresh_native, "_STATE", {})
    monkeypatch.setattr(fresh_native, "_compile", lambda *args: pytest.fail("compiled again"))
    assert fresh_native.load().path == kernels.path


def _exact_block_case(m, g):
    """Operands whose 32-value block sums are exact in float32 (activations from a few small
    values, weights random), so any order of additions inside a block gives the same partial and
    only the block order and scaling are left to compare."""
    k = 256
    x = torch.tensor([0.5, 1.0, 1.5, 2.0, -1.0, -3.0])[torch.randint(0, 6, (m, k), generator=g)]
    x[:, ::32] = 4.0  # every block's amax: activation scale 4/448 rounded up to a power of two
    a, a_s = act_quant(x.to(torch.bfloat16))
    packed, scale = _fp4_weight(40, k, g, lo=100, hi=150)  # scales spanning 50 octaves across blocks
    fp8 = (torch.randn(40, k, generator=g) * 8).to(torch.float8_e4m3fn)
    fp8_s = torch.randint(100, 150, (2, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return a, a_s, packed, scale, fp8, fp8_s


@needs_cc
@pytest.mark.parametrize("m", range(1, 9))
def test_native_follows_the_reference_block_order_up_to_8_tokens(native_level, m):
    """Up to 8 tokens per weight the native kernel scales each block's partial and adds it in K
    order as fp4_gemm / fp8_gemm do: bit for bit the reference wherever block sums are exact."""
    from dsv41.kernels.native import BLOCK_ORDER_MAX_TOKENS

    assert BLOCK_ORDER_MAX_TOKENS == 8
    a, a_s, packed, scale, fp8, fp8_s = _exact_block_case(m, _gen(80 + m))
    got = fp4_gemm_fused(a, a_s, packed, scale, out_dtype=torch.float32, cpu_kernel="native")
    assert torch.equal(got, fp4_gemm(a, a_s, packed.view(torch.uint8), scale, out_dtype=torch.float32))
    got = fp8_gemm_fused(a, a_s, fp8, fp8_s, out_dtype=torch.float32, cpu_kernel="native")
    assert torch.equal(got, fp8_gemm(a, a_s, fp8, fp8_s, out_dtype=torch.float32))
    # the torch kernel sums in another order: the same case tells the two apart
    torch_got = fp4_gemm_fused(a, a_s, packed, scale, out_dtype=torch.float32, cpu_kernel="torch")
    assert not torch.equal(torch_got, fp4_gemm(a, a_s, packed.view(torch.uint8), scale, out_dtype=torch.float32))


@needs_cc
def test_a_tokens_result_does_not_depend_on_its_company_up_to_8_tokens(native_level):
    """Random operands (inexact block sums): a token gets the same bits alone or with 7 others."""
    g = _gen(90)
    packed, scale = _fp4_weight(48, 320, g)
    a, a_s = act_quant((torch.randn(8, 320, generator=g) * 3).to(torch.bfloat16))
    together = fp4_gemm_fused(a, a_s, packed, scale, out_dtype=torch.float32, cpu_kernel="native")
    for i in range(8):
        alone = fp4_gemm_fused(
            a[i : i + 1], a_s[i : i + 1], packed, scale, out_dtype=torch.float32, cpu_kernel="native"
        )
        assert torch.equal(alone[0], together[i])
        pair = fp4_gemm_fused(a[i : i + 2], a_s[i : i + 2], packed, scale, out_dtype=torch.float32, cpu_kernel="native")
        assert torch.equal(pair[0], together[i])


@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_batch_invariant_gives_each_token_its_single_token_bits(kernel, kind):
    """Past 8 tokens the default takes a BLAS GEMM; batch_invariant keeps one arithmetic for any
    token count, so a prefill's tokens get the bits they would get decoded one at a time."""
    g = _gen(95)
    if kind == "fp4":
        w, s = _fp4_weight(40, 256, g)
        fn = fp4_gemm_fused
    else:
        w, s = quantize_fp8_blocks(torch.randn(40, 256, generator=g))
        fn = fp8_gemm_fused
    m = 17  # two full groups of 8 tokens and a last group of one
    a, a_s = act_quant((torch.randn(m, 256, generator=g) * 3).to(torch.bfloat16))
    together = fn(a, a_s, w, s, out_dtype=torch.float32, cpu_kernel=kernel, batch_invariant=True)
    for i in range(m):
        alone = fn(a[i : i + 1], a_s[i : i + 1], w, s, out_dtype=torch.float32, cpu_kernel=kernel)
        assert torch.equal(alone[0], together[i]), i


def test_models_loaded_for_parity_run_their_experts_batch_invariant(tiny_checkpoint):
    import dsv41

    default = dsv41.load(tiny_checkpoint, quiet=True)
    parity = dsv41.load(tiny_checkpoint, numerics=dsv41.Numerics(pad_f32_rows=True), quiet=True)
    assert not any(b.ffn.experts.batch_invariant for b in default.backbone.layers)
    assert all(b.ffn.experts.batch_invariant for b in parity.backbone.layers)


@needs_cc
def test_products_in_one_native_call_equal_them_one_by_one(native_level):
    """A decode step hands all gate/up projections to the native kernel at once (then all down
    projections): FP4 and FP8 products of different shapes and token counts in one pass give the
    bits each gives alone, and whole experts give the same outputs either way."""
    from dsv41.kernels import native

    g = _gen(97)
    kernels = native.load()
    fp4_w, fp4_s = _fp4_weight(48, 256, g)
    fp8_w, fp8_s = quantize_fp8_blocks(torch.randn(70, 128, generator=g))
    jobs = []
    for m, (w, s, fp4, rows_per_scale) in (
        (1, (fp4_w, fp4_s, True, 1)),
        (3, (fp8_w, fp8_s, False, 32)),
        (8, (fp4_w, fp4_s, True, 1)),
    ):
        a, a_s = act_quant((torch.randn(m, w.size(1) * (2 if fp4 else 1), generator=g) * 2).to(torch.bfloat16))
        jobs.append(
            (
                fp4,
                a.view(torch.uint8),
                a_s.view(torch.uint8),
                32,
                w.view(torch.uint8),
                s.view(torch.uint8),
                rows_per_scale,
            )
        )
    together = kernels.gemm_many(jobs)
    for job, got in zip(jobs, together):
        assert torch.equal(got, kernels.gemm_many([job])[0])
    experts = {e: _expert(256, 96, g) for e in range(4)}
    x = (torch.randn(5, 256, generator=g) * 3).to(torch.bfloat16)
    ids, weights = _routing(5, 4, 2, g)
    one_by_one = routed_experts(
        x, ids, weights, experts, 4.0, product=lambda a, a_s, w, s, dtype: fp4_gemm_fused(a, a_s, w, s, out_dtype=dtype)
    )
    assert torch.equal(routed_experts(x, ids, weights, experts, 4.0), one_by_one)


@needs_cc
@pytest.mark.parametrize("fp8", [False, True])
def test_gate_and_up_sharing_one_gemm_give_each_products_own_bits(native_level, fp8):
    """Beyond 8 tokens an expert's gate and up projections decode their tokens once and share one
    GEMM per chunk of rows (the chunk spanning both weights here): each output equals that
    projection computed on its own, and whole experts equal one product at a time."""
    g = _gen(99)
    expert = _expert(256, 160, g, fp8=fp8)
    x = (torch.randn(40, 256, generator=g) * 3).to(torch.bfloat16)
    a, a_s = act_quant(x)
    ops = [
        (w, s, check_operands(a, a_s, w, s)) for w, s in ((expert.w1, expert.w1_scale), (expert.w3, expert.w3_scale))
    ]
    kernels = ex.native.load()
    for chunk in (1 << 22, 256 * 200):  # everything in one GEMM; a chunk boundary inside w3
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ex, "_BF16_CHUNK_VALUES", chunk)
            mp.setattr(ex, "_CHUNK_VALUES", chunk)
            for dtype in (torch.float32, torch.bfloat16):
                shared = ex._fused_products(a, a_s, ops, 32, kernels, False, dtype)
                for (w, s, op), got in zip(ops, shared):
                    assert torch.equal(got, ex._fused(a, a_s, w, s, op, 32, kernels, False, dtype)), (chunk, dtype)
    experts = {e: _expert(256, 96, g, fp8=fp8) for e in range(3)}
    ids, weights = _routing(40, 3, 2, g)
    gemm = fp8_gemm_fused if fp8 else fp4_gemm_fused
    one_by_one = routed_experts(
        x, ids, weights, experts, 4.0, product=lambda a, a_s, w, s, dtype: gemm(a, a_s, w, s, out_dtype=dtype)
    )
    assert torch.equal(routed_experts(x, ids, weights, experts, 4.0), one_by_one)


@needs_cc
def test_portable_build_without_simd_gives_the_same_bits(fresh_native, monkeypatch):
    """The plain-C branch of native.c (what a CPU without AVX2/FMA/F16C gets) sums in the SIMD
    branch's order up to 8 tokens, and matches the reference beyond."""
    cases = list(_gemm_cases(_gen(67)))
    simd = fresh_native.load()
    assert simd is not None, fresh_native.unavailable_reason()
    want = [_fused_gemm(kind, a, a_s, w, s, "native") for kind, a, a_s, w, s, _ in cases]
    with fresh_native.forced_isa("plain") as portable:
        assert portable is not None and not portable.simd and portable.flags == ["-O3"]
        got_all = [_fused_gemm(kind, a, a_s, w, s, "native") for kind, a, a_s, w, s, _ in cases]
    for (kind, a, a_s, w, s, ref), simd_out, got in zip(cases, want, got_all):
        if a.size(0) <= 8:
            assert torch.equal(got, simd_out), kind
        w_values = fp4_to_float(w.view(torch.uint8)) if kind == "fp4" else w.float()
        w_scales = s.float() if kind == "fp4" else s.float().repeat_interleave(32, 0)[:40]
        _assert_gemm_close(got, ref, _bound(a, a_s, w_values, w_scales), 128)


def _act_quant_inputs(g):
    """Activations that reach every branch of act_quant: ordinary blocks at scales far apart,
    E4M3 subnormals and the 1e-4 amax floor, NaN, infinities, saturation, float32 subnormals, and
    raw bit patterns."""
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("nan"),
            float("inf"),
            -float("inf"),
            1e-45,
            -1e-45,
            1e-38,
            448.0,
            449.0,
            464.0,
            480.0,
            1e30,
            -1e30,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-10,
            1e-4,
            5e-5,
        ]
    )
    for trial in range(120):
        m, k = int(torch.randint(1, 6, (1,), generator=g)), 128 * int(torch.randint(1, 4, (1,), generator=g))
        x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-40, 40, (m, 1), generator=g).float())
        if trial % 4 == 1:
            pick = specials[torch.randint(0, len(specials), (m, k), generator=g)]
            x = torch.where(torch.rand(m, k, generator=g) < 0.1, pick, x)
        elif trial % 4 == 2:
            x = (torch.rand(m, k, generator=g) * 2 - 1) * 1e-5
        elif trial % 4 == 3:
            x = torch.randint(-(2**31), 2**31 - 1, (m, k), generator=g, dtype=torch.int32).view(torch.float32)
        yield x


def _assert_act_quant_is_the_definition(g):
    from dsv41.kernels.quant import _act_quant_torch

    kernels = ex.native.load()
    assert kernels is not None, ex.native.unavailable_reason()
    for x in _act_quant_inputs(g):
        for dtype in (torch.float32, torch.bfloat16):
            for block in (32, 128):
                xi = x.to(dtype)
                codes, scales = kernels.act_quant(xi, block)
                want_codes, want_scales = _act_quant_torch(xi, block, True, torch.float8_e8m0fnu, False)
                assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (dtype, block)
                assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8)), (dtype, block)


@needs_cc
def test_native_act_quant_gives_the_definitions_bytes(native_level):
    """act_quant takes the native kernel on the CPU: its E4M3 codes and E8M0 scales equal the
    tensor-operation definition byte for byte, special values included."""
    _assert_act_quant_is_the_definition(_gen(83))
    x = torch.randn(3, 4, 256, generator=_gen(84)).to(torch.bfloat16)
    codes, scales = act_quant(x)
    assert codes.shape == x.shape and scales.shape == (3, 4, 8)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu


@needs_cc
def test_portable_act_quant_gives_the_definitions_bytes(fresh_native, monkeypatch):
    """The same with native.c's plain-C branch (a CPU without AVX2/FMA/F16C)."""
    with fresh_native.forced_isa("plain") as portable:
        assert not portable.simd
        _assert_act_quant_is_the_definition(_gen(85))


@needs_cc
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_native_results_do_not_depend_on_the_thread_count(native_level, out_dtype):
    """Both many-token layouts (float32; BF16, which takes the BF16 GEMM where the CPU has it) and
    the block order give the same bits at 1 and 3 threads."""
    threads = torch.get_num_threads()
    try:
        for kind, a, a_s, w, s, _ in _gemm_cases(_gen(71)):
            fn = fp4_gemm_fused if kind == "fp4" else fp8_gemm_fused
            torch.set_num_threads(1)
            one = fn(a, a_s, w, s, out_dtype=out_dtype, cpu_kernel="native")
            torch.set_num_threads(3)  # more threads than cores is allowed; rows split unevenly
            assert torch.equal(fn(a, a_s, w, s, out_dtype=out_dtype, cpu_kernel="native"), one), kind
    finally:
        torch.set_num_threads(threads)


def test_without_a_compiler_auto_says_so_once_and_native_refuses(fresh_native, monkeypatch, capsys):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert fresh_native.load() is None and "no C compiler" in fresh_native.unavailable_reason()
    for kind, a, a_s, w, s, _ in _gemm_cases(_gen(73)):
        assert torch.equal(_fused_gemm(kind, a, a_s, w, s, "auto"), _fused_gemm(kind, a, a_s, w, s, "torch"))
        with pytest.raises(RuntimeError, match="no C compiler"):
            _fused_gemm(kind, a, a_s, w, s, "native")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "plain-PyTorch" in lines[0], lines


def test_a_failed_build_is_reported_with_the_compiler_error(fresh_native, monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'native.c:1: error: this compiler is broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert fresh_native.load() is None
    reason = fresh_native.unavailable_reason()
    assert "did not build" in reason and "this compiler is broken" in reason
    assert not list((tmp_path / "native").glob("*.so"))  # nothing half-written left behind


def test_misshapen_weights_are_refused_by_every_entry_point(kernel):
    g = _gen(3)
    good = _expert(64, 32, g)
    bad = good._replace(w1_scale=good.w1_scale[:, :1])  # [inter, 1] where [inter, dim/32] belongs
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    ids, weights = torch.tensor([[0], [0]]), torch.ones(2, 1)
    a, a_s = act_quant(x)
    with pytest.raises(ValueError, match=r"weight scales must be \[32, 2\]"):
        routed_experts(x, ids, weights, {0: bad}, cpu_kernel=kernel)
    with pytest.raises(ValueError, match=r"weight scales must be \[32, 2\]"):
        fp4_gemm_fused(a, a_s, bad.w1, bad.w1_scale, cpu_kernel=kernel)
    with pytest.raises(TypeError, match="weight must be float8_e4m3fn"):
        fp8_gemm_fused(a, a_s, good.w1, good.w1_scale, cpu_kernel=kernel)


def test_cpu_kernel_names_are_checked():
    a, a_s = act_quant(torch.randn(1, 64).to(torch.bfloat16))
    packed, scale = _fp4_weight(4, 64, _gen(2))
    with pytest.raises(ValueError, match="cpu_kernel must be one of auto, native, torch"):
        fp4_gemm_fused(a, a_s, packed, scale, cpu_kernel="fast")


# ---------------------------------------------------------------------- Triton
_INTERPRET_SCRIPT = r"""
import json, torch
from dsv41.kernels import act_quant, fp4_gemm
from dsv41.kernels.triton_experts import fp4_gemm_triton, GEMV_MAX_TOKENS
from dsv41.kernels.experts import routed_experts, routed_experts_reference, PackedExpert
from dsv41.checkpoint.formats import quantize_fp4
g = torch.Generator().manual_seed(0)
out = {}
def rel(got, ref):
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
cases = {"random": (None, 118, 131, 1.0), "all_six": ([0x77, 0xFF, 0x7F, 0xF7], 118, 131, 1.0),
         "zeros": ([0x00, 0x88], 118, 131, 1.0), "max_scale": (None, 254, 255, 1e-5),
         "min_scale": (None, 0, 1, 1e30)}
for name, (codes, lo, hi, xs) in cases.items():
    for m in (1, 3, 20):  # GEMV kernel up to GEMV_MAX_TOKENS, then the tl.dot kernel
        n, k = 40, 128
        if codes is None:
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        else:
            w = torch.tensor(codes, dtype=torch.uint8)[torch.randint(0, len(codes), (n, k // 2), generator=g)]
        s = torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
        a, a_s = act_quant((torch.randn(m, k, generator=g) * xs).to(torch.bfloat16))
        ref = fp4_gemm(a, a_s, w, s, out_dtype=torch.float32)
        got = fp4_gemm_triton(a, a_s, w.view(torch.int8), s, out_dtype=torch.float32)
        out[f"{name}/{m}"] = {"rel": rel(got, ref), "zero": bool(not ref.any()), "exact_zero": bool(not got.any()),
                              "finite": bool(torch.isfinite(got).all())}
dim, inter = 128, 64
def expert():
    return PackedExpert(*[t for shape in ((inter, dim), (dim, inter), (inter, dim))
                          for t in quantize_fp4(torch.randn(*shape, generator=g) * 0.1)])
experts = {e: expert() for e in range(5)}
x = (torch.randn(6, dim, generator=g) * 3).to(torch.bfloat16)
ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(6)])
wts = torch.rand(6, 2, generator=g)
product = lambda a, a_s, w, s, dtype: fp4_gemm_triton(a, a_s, w, s, out_dtype=dtype)
ref = routed_experts_reference(x, ids, wts, experts, 2.0)
got = routed_experts(x, ids, wts, experts, 2.0, product=product)
out["routed"] = {"rel": rel(got, ref)}
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed")
def test_triton_kernels_in_the_interpreter_match_the_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRET_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 16
    for key, r in results.items():
        assert r["rel"] <= 1e-5, (key, r)
        if key.startswith("zeros/"):
            assert r["zero"] and r["exact_zero"], key
        elif key != "routed":
            assert r["finite"], key


def test_expert_devices_without_cuda_print_one_line(monkeypatch, capsys):
    from dsv41.kernels import triton_experts as te

    if te.available():
        pytest.skip("CUDA is present here, so there is no fallback to observe")
    monkeypatch.setattr(ex, "_SAID", set())
    assert ex.expert_devices("cuda") == [torch.device("cpu")]
    assert ex.expert_devices(["cuda:0", "cuda:1"]) == [torch.device("cpu")]
    assert ex.expert_devices(None) == [torch.device("cpu")]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "CPU" in lines[0]
    with pytest.raises(ValueError, match="all be cpu or all be cuda"):
        ex.expert_devices(["cpu", "cuda"])


def test_routed_experts_on_cpu_experts_take_the_fused_path():
    from dsv41.kernels.experts import device_for

    g = _gen(47)
    experts = {e: _expert(64, 32, g) for e in range(4)}
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    ids, weights = _routing(5, 4, 2, g)
    fused = routed_experts(
        x, ids, weights, experts, 3.0, product=lambda a, a_s, w, s, dtype: fp4_gemm_fused(a, a_s, w, s, out_dtype=dtype)
    )
    assert torch.equal(routed_experts(x, ids, weights, experts, 3.0), fused)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [device_for(e, devices).index for e in range(4)] == [0, 1, 0, 1]


_GPU = pytest.mark.skipif(
    not (HAVE_TRITON and torch.cuda.is_available()),
    reason="needs a CUDA GPU with Triton; the kernels are checked on CPU through TRITON_INTERPRET above",
)


@pytest.mark.gpu
@_GPU
@pytest.mark.parametrize("m", [1, 4, 64])
def test_triton_fp4_gemm_on_gpu_matches_the_reference(m):
    from dsv41.kernels.triton_experts import fp4_gemm_triton

    g = _gen(53)
    packed, scale = _fp4_weight(2304, 5120, g)
    a, a_s = act_quant((torch.randn(m, 5120, generator=g) * 2).to(torch.bfloat16))
    ref = fp4_gemm(a, a_s, packed.view(torch.uint8), scale, out_dtype=torch.float32)
    got = fp4_gemm_triton(a.cuda(), a_s.cuda(), packed.cuda(), scale.cuda(), out_dtype=torch.float32).cpu()
    _assert_gemm_close(got, ref, _bound(a, a_s, fp4_to_float(packed.view(torch.uint8)), scale.float()), 5120)


@pytest.mark.gpu
@_GPU
def test_routed_experts_with_experts_on_gpu():
    g = _gen(59)
    experts = {e: _expert(512, 256, g) for e in range(6)}
    x = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    ids, weights = _routing(5, 6, 3, g)
    ref = routed_experts_reference(x, ids, weights, experts, 5.0)
    got = routed_experts(x, ids, weights, {e: p.to("cuda") for e, p in experts.items()}, 5.0)
    assert got.device == x.device
    _assert_bf16_close(got, ref)


# ---------------------------------------------------------------------- the many-token BF16 path
def test_prefill_path_follows_the_cpu_features(monkeypatch):
    """Dispatch is read at run time from the CPU's features: AMX, then AVX-512 BF16, then the
    float32 GEMM over rows decoded with AVX2 or plain C; a level held lower takes the lower path."""
    import dsv41.kernels.native as native

    amx = {
        "avx2": True,
        "fma3": True,
        "f16c": True,
        "avx512_f": True,
        "avx512_bw": True,
        "avx512_dq": True,
        "avx512_vl": True,
        "avx512_bf16": True,
        "amx_tile": True,
        "amx_bf16": True,
    }
    without = lambda *names: {k: v for k, v in amx.items() if k not in names}  # noqa: E731
    cpus = [
        (amx, "amx"),
        (without("amx_bf16"), "avx512_bf16"),
        (without("amx_tile", "avx512_bf16"), "avx512"),
        (without("avx512_vl"), "avx2"),
        (without("f16c"), "plain"),
        ({}, "plain"),
    ]
    for caps, level in cpus:
        monkeypatch.setattr(native, "cpu_capability", lambda caps=caps: caps)
        assert native.cpu_isa_level() == level, caps
    monkeypatch.setattr(native, "cpu_capability", lambda: amx)
    kernels = lambda level, simd: type("K", (), {"level": level, "simd": simd})()  # noqa: E731
    cases = [
        ("amx", True, "amx"),
        ("avx512_bf16", True, "avx512_bf16"),
        ("avx512", True, "avx2"),
        ("avx2", True, "avx2"),
        ("plain", False, "plain"),
    ]
    for level, simd, want in cases:
        assert native.prefill_path(kernels(level, simd)) == want
    assert native.prefill_path.__module__ == native.__name__ and set(native.PREFILL_PATHS) == {c[2] for c in cases}


def test_isa_level_is_forced_by_the_environment_and_refused_above_the_cpu(monkeypatch):
    import dsv41.kernels.native as native

    monkeypatch.setattr(native, "cpu_capability", lambda: {"avx2": True, "fma3": True, "f16c": True})
    assert native.isa_level() == "avx2" and native.runnable_isa_levels() == ("plain", "avx2")
    monkeypatch.setenv(native.ISA_ENV, "plain")
    assert native.isa_level() == "plain"
    with native.forced_isa("avx2"):  # the Python override wins over the environment
        assert native.isa_level() == "avx2"
    assert native.isa_level() == "plain"
    monkeypatch.setenv(native.ISA_ENV, "avx512_bf16")
    with pytest.raises(ValueError, match=r"above what this CPU has \(avx2\)"):
        native.isa_level()
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="use one of plain, avx2, avx512, avx512_bf16, amx"):
        native.isa_level()


def _exact_sum_case(m, n, k, g, fp8=False):
    """Operands whose whole dot products are exact in float32 whatever the order (small integer
    codes, one scale byte per operand), so every path must give the reference's bits."""
    x = torch.randint(-3, 4, (m, k), generator=g).float()
    x[:, ::32] = 4.0  # every block's amax: one activation scale for all
    a, a_s = act_quant(x.to(torch.bfloat16))
    if fp8:
        w = torch.randint(-8, 9, (n, k), generator=g).float().to(torch.float8_e4m3fn)
        s = torch.full((-(-n // 32), k // 32), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return a, a_s, w, s
    codes = torch.randint(0, 16, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.full((n, k // 32), 124, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return a, a_s, codes.view(torch.int8), s


@pytest.mark.parametrize("path", ["avx512_bf16", "avx2"])
@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_many_token_paths_are_the_reference_rounded_to_bf16(monkeypatch, native_level, path, kind):
    """Both many-token paths, forced on every build this CPU runs: BF16 operands (exact: E2M1 /
    E4M3 times powers of two; the decode has an AVX-512 BF16, an AVX2 and a plain-C form) with
    float32 accumulation, or float32 operands; on exact sums both give the reference's bits, and
    on random operands they stay within float32 addition order of it."""
    import dsv41.kernels.native as native

    # the BF16 GEMM runs on any CPU (torch emulates it where the CPU lacks it), so the BF16 path is
    # forced here past the level's own choice, to test its decode on every build
    monkeypatch.setattr(native, "prefill_path", lambda kernels=None: path)
    g = _gen(50)
    a, a_s, w, s = _exact_sum_case(20, 72, 256, g, fp8=kind == "fp8")
    ref = (
        fp4_gemm(a, a_s, w.view(torch.uint8), s, out_dtype=torch.float32)
        if kind == "fp4"
        else fp8_gemm(a, a_s, w, s, out_dtype=torch.float32)
    )
    fused = fp4_gemm_fused if kind == "fp4" else fp8_gemm_fused
    got = fused(a, a_s, w, s, out_dtype=torch.bfloat16, cpu_kernel="native")
    assert torch.equal(got, ref.to(torch.bfloat16))

    packed, scale = _fp4_weight(64, 320, g)
    x = (torch.randn(24, 320, generator=g) * 3).to(torch.bfloat16)
    a, a_s = act_quant(x)
    ref = fp4_gemm(a, a_s, packed.view(torch.uint8), scale, out_dtype=torch.float32)
    got = fp4_gemm_fused(a, a_s, packed, scale, out_dtype=torch.bfloat16, cpu_kernel="native").float()
    # one BF16 rounding of a float32 sum that differs from the reference's by addition order only
    assert ((got - ref).abs() <= 2.0**-8 * ref.abs() + 2.0**-16 * ref.abs().max()).all()


def test_routed_experts_on_the_bf16_path_match_the_reference(monkeypatch, native_level):
    import dsv41.kernels.native as native

    monkeypatch.setattr(native, "prefill_path", lambda kernels=None: "avx512_bf16")  # on every build
    g = _gen(51)
    experts = {e: _expert(128, 64, g) for e in range(4)}
    x = (torch.randn(24, 128, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    weights = torch.rand(24, 2, generator=g)
    got = routed_experts(x, ids, weights, experts, 10.0, cpu_kernel="native")
    ref = routed_experts_reference(x, ids, weights, experts, 10.0)
    _assert_bf16_close(got, ref)


@needs_cc
@pytest.mark.parametrize("k", [288, 512])
@pytest.mark.parametrize("kind", ["fp4", "fp8"])
def test_one_tokens_products_have_the_portable_bits_at_every_level(fresh_native, k, kind):
    """Products of up to 8 tokens take a different body per level (the BF16 dot product, the
    AVX-512 and AVX2 float bodies, plain C), one token's another again: each gives plain C's bits,
    on activations of every E4M3 byte (NaN, -0, subnormals), every E2M1 code or E4M3 weight byte
    (-0 and 0x7F included), scales 50 octaves apart, an odd last block (k = 288) and a row count
    that is not a multiple of four."""
    g = _gen(311)
    codes = torch.randint(0, 256, (8, k), dtype=torch.uint8, generator=g)
    codes[1:][(codes[1:] & 0x7F) == 0x7F] = 0x7E  # tokens 1 and 2 without E4M3's NaN
    codes[0, : min(k, 256)] = torch.arange(min(k, 256), dtype=torch.uint8)  # every byte once
    a = codes.view(torch.float8_e4m3fn)
    a_s = torch.randint(100, 150, (8, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    packed, scale = _fp4_weight(42, k, g, lo=100, hi=150)
    if kind == "fp8":
        packed = torch.randint(0, 256, (42, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        scale = torch.randint(100, 150, (2, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    product = fp4_gemm_fused if kind == "fp4" else fp8_gemm_fused
    got = {}
    for level in fresh_native.runnable_isa_levels():
        with fresh_native.forced_isa(level) as kernels:
            assert kernels is not None, fresh_native.unavailable_reason()
            dot = kernels.fp4_dot if kind == "fp4" else kernels.fp8_dot
            if level in ("avx512_bf16", "amx") and (kind == "fp4" or fresh_native.cpu_capability().get("avx512_vbmi")):
                assert dot, "a CPU with AVX-512 BF16 (and VBMI for FP8) takes the dot-product body"
            elif level not in ("avx512_bf16", "amx"):
                assert not dot
            calls = [(0, 1), (1, 2), (2, 3), (0, 3), (1, 5), (0, 8)]  # one token, then groups of 2-8
            got[level] = [
                product(a[i:j], a_s[i:j], packed, scale, out_dtype=torch.float32, cpu_kernel="native") for i, j in calls
            ]
    for level, outs in got.items():
        for call, out, want in zip(calls, outs, got["plain"]):
            assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (level, call)
    plain = got["plain"]
    assert plain[0].isnan().all() and plain[1].isfinite().all() and plain[2].isfinite().all()
    assert torch.equal(plain[5][1:5].view(torch.int32), plain[4].view(torch.int32))  # a token's bits, any company


@needs_cc
@pytest.mark.skipif(
    not __import__("dsv41.kernels.native", fromlist=["x"]).cpu_capability().get("avx512_bf16"),
    reason="no AVX-512 BF16 on this CPU: the dot-product bodies are not built here",
)
def test_a_cpu_with_bf16_but_no_vbmi_takes_the_fp4_dot_and_the_fp8_float_body(fresh_native, monkeypatch):
    """A CPU with AVX-512 BF16 but no VBMI (Cooper Lake) builds the FP4 dot-product body and keeps
    FP8 on the float body: the same build flags with VBMI turned off give that mix here, and its
    products of 1 and 5 tokens are the portable build's bits."""
    g = _gen(313)
    k = 288  # an odd last block as well
    codes = torch.randint(0, 256, (5, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    a, a_s = codes.view(torch.float8_e4m3fn), torch.randint(100, 150, (5, k // 32), dtype=torch.uint8, generator=g)
    a_s = a_s.view(torch.float8_e8m0fnu)
    fp4, fp4_s = _fp4_weight(42, k, g, lo=100, hi=150)
    fp8 = torch.randint(0, 256, (42, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    fp8_s = torch.randint(100, 150, (2, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)

    def products():
        return [
            fn(a[:m], a_s[:m], w, s, out_dtype=torch.float32, cpu_kernel="native")
            for fn, w, s in ((fp4_gemm_fused, fp4, fp4_s), (fp8_gemm_fused, fp8, fp8_s))
            for m in (1, 5)
        ]

    with fresh_native.forced_isa("plain"):
        want = products()
    flag_sets = fresh_native._flag_sets
    monkeypatch.setattr(
        fresh_native, "_flag_sets", lambda level: [flags + ["-mno-avx512vbmi"] for flags in flag_sets(level)]
    )
    with fresh_native.forced_isa("avx512_bf16") as kernels:
        assert kernels is not None and kernels.fp4_dot and not kernels.fp8_dot
        got = products()
    for i, (out, ref) in enumerate(zip(got, want)):
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), i
