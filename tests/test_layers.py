"""Shared building blocks: YaRN against its formula, rotation, RMSNorm, quantized Linear, init."""

import math

import pytest
import torch
from torch import nn

from dsv41.core.config import RELEASED, TINY
from dsv41.kernels import act_quant, e8m0_decode
from dsv41.model import layers
from dsv41.model.layers import (
    Linear,
    RMSNorm,
    apply_rotary_emb,
    dequantize_weight_fp8,
    init_random_,
    precompute_freqs_cis,
    quantize_weight_fp8,
    yarn_inv_freq,
)


def _yarn_by_hand(dim, original, base, factor, beta_fast, beta_slow):
    """YaRN written per dimension in float64, from the formula rather than from the module."""
    out = []
    turns_dim = lambda r: dim * math.log(original / (r * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(turns_dim(beta_fast)), 0)
    high = min(math.ceil(turns_dim(beta_slow)), dim - 1)
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        # ramp 0: interpolation off (the frequency kept); ramp 1: fully interpolated (theta / factor)
        out.append(theta * (1 - ramp) + theta / factor * ramp)
    return torch.tensor(out, dtype=torch.float64), low, high


@pytest.mark.parametrize("cfg", [RELEASED, TINY], ids=["released", "tiny"])
def test_yarn_frequencies_follow_the_formula(cfg):
    dim = cfg.rope_head_dim
    got = yarn_inv_freq(
        dim, cfg.original_seq_len, cfg.compress_rope_theta, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow
    )
    want, low, high = _yarn_by_hand(
        dim, cfg.original_seq_len, cfg.compress_rope_theta, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow
    )
    assert got.dtype == torch.float32 and got.shape == (dim // 2,)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    plain = 1.0 / cfg.compress_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    # fast dimensions (index <= low) untouched, slow ones (index >= high) divided by the factor
    torch.testing.assert_close(got.double()[: low + 1], plain[: low + 1], rtol=1e-6, atol=0)
    if high < dim // 2:
        torch.testing.assert_close(got.double()[high:], plain[high:] / cfg.rope_factor, rtol=1e-6, atol=0)
    # and the correction is really on: some dimension moved
    assert not torch.allclose(got.double(), plain, rtol=1e-3)


def test_yarn_is_off_without_an_original_length():
    got = yarn_inv_freq(32, 0, 10000.0, 16, 32, 1)
    want = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_freqs_cis_are_unit_rotations_at_position_times_frequency():
    inv = yarn_inv_freq(32, 256, 160000.0, 16, 32, 1)
    table = precompute_freqs_cis(32, 50, 256, 160000.0, 16, 32, 1)
    assert table.dtype == torch.complex64 and table.shape == (50, 16)
    angles = torch.arange(50, dtype=torch.float64).unsqueeze(1) * inv.double()
    torch.testing.assert_close(table.angle().double(), torch.atan2(angles.sin(), angles.cos()), atol=2e-5, rtol=0)
    torch.testing.assert_close(table.abs(), torch.ones(50, 16), atol=1e-6, rtol=0)


def test_rotation_pairs_adjacent_channels_and_inverse_undoes_it():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=gen)
    table = precompute_freqs_cis(8, 5, 0, 10000.0, 1, 32, 1)
    y = apply_rotary_emb(x.clone(), table)
    # channel pair (2i, 2i+1) at position p rotates by angle p * theta_i
    ang = table.angle()  # [5, 4]
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    torch.testing.assert_close(y[..., 0::2], even * c - odd * s, atol=1e-5, rtol=0)
    torch.testing.assert_close(y[..., 1::2], even * s + odd * c, atol=1e-5, rtol=0)
    torch.testing.assert_close(apply_rotary_emb(y.clone(), table, inverse=True), x, atol=1e-5, rtol=0)
    # in place on a slice, as the attention uses it: the other channels are untouched
    z = x.clone()
    apply_rotary_emb(z[..., -4:], precompute_freqs_cis(4, 5, 0, 10000.0, 1, 32, 1))
    assert torch.equal(z[..., :4], x[..., :4]) and not torch.equal(z[..., -4:], x[..., -4:])


def test_rmsnorm_normalizes_in_float32_and_returns_the_input_dtype():
    norm = RMSNorm(64, 1e-6)
    init_random_(norm, 3)
    x = (torch.randn(3, 64) * 40).bfloat16()
    got = norm(x)
    x64 = x.double()
    want = (x64 / (x64.square().mean(-1, keepdim=True) + 1e-6).sqrt() * norm.weight.double()).bfloat16()
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


def test_fp8_weight_quantization_round_trips_within_e4m3_precision():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 70, generator=gen)  # neither dimension a multiple of 32
    values, scale = quantize_weight_fp8(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (40, 70)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3)
    s = e8m0_decode(scale)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    back = dequantize_weight_fp8(values, scale, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2**-4 + 1e-3).all()


def test_quantized_linear_quantizes_the_activation_to_fp8_first():
    lin = init_random_(Linear(64, 32, dtype=torch.float8_e4m3fn), 0)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    w = dequantize_weight_fp8(lin.weight, lin.scale, torch.float64)
    codes, a_s = act_quant(x, 32)
    xq = (codes.double().unflatten(-1, (-1, 32)) * e8m0_decode(a_s).double().unsqueeze(-1)).flatten(-2)
    got = lin(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), (xq @ w.T).bfloat16().double(), atol=0, rtol=2**-7)
    # with the activation left unquantized the result is measurably different
    assert not torch.equal(got, (x.double() @ w.T).bfloat16())


def test_fp4_linear_holds_packed_weights_with_one_scale_per_32():
    lin = init_random_(Linear(64, 16, dtype=torch.float4_e2m1fn_x2), 0)
    assert lin.weight.shape == (16, 32) and lin.scale.shape == (16, 2)
    out = lin(torch.randn(3, 64).bfloat16())
    assert out.shape == (3, 16) and torch.isfinite(out.float()).all()


def test_float32_linear_is_the_plain_gemm_and_pads_rows_only_when_asked():
    ref = init_random_(Linear(128, 64, dtype=torch.float32), 0)
    padded = init_random_(Linear(128, 64, dtype=torch.float32, pad_f32_rows=True), 0)
    x = torch.randn(1, 13, 128, generator=torch.Generator().manual_seed(4))
    # the default is the reference's GEMM, bit for bit
    assert torch.equal(ref(x), torch.nn.functional.linear(x, ref.weight))
    # padded, a row's bits do not depend on the rows that come with it
    together = padded(x)
    assert torch.equal(together, torch.cat([padded(x[:, i : i + 1]) for i in range(13)], dim=1))
    # unpadded, one row alone may take another BLAS kernel: apart by no more than two float32 dot
    # products' rounding bound (K * u * sum |x_k w_k| each), whatever the kernel
    alone = torch.cat([ref(x[:, i : i + 1]) for i in range(13)], dim=1)
    u = torch.finfo(torch.float32).eps / 2
    bound = 2 * 128 * u * (x.abs() @ ref.weight.abs().T)
    assert ((ref(x) - alone).abs() <= bound).all()


def test_init_random_is_seeded_and_refuses_unclaimed_parameters():
    a = init_random_(Linear(64, 32), 7)
    b = init_random_(Linear(64, 32), 7)
    c = init_random_(Linear(64, 32), 8)
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    assert not torch.equal(a.weight.view(torch.uint8), c.weight.view(torch.uint8))
    # well scaled: the dequantized weight has std close to 1/sqrt(in_features)
    w = dequantize_weight_fp8(a.weight, a.scale, torch.float32)
    assert 0.8 / 8 < w.std() < 1.2 / 8

    class Stray(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = Linear(32, 32)
            self.loose = nn.Parameter(torch.zeros(3))

    with pytest.raises(TypeError, match="loose"):
        init_random_(Stray(), 0)


def test_linear_dtype_follows_the_config():
    import dataclasses

    assert layers.linear_dtype(TINY) == torch.float8_e4m3fn
    assert layers.linear_dtype(dataclasses.replace(TINY, dtype="bf16")) == torch.bfloat16


def test_parity_float32_products_and_elementwise_ops_do_not_depend_on_the_row_count():
    # a row alone (a decode step) against the same row among many (a prefill): equal bit for bit
    from dsv41.model.layers import f32_linear, rowwise

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(100, 512, generator=gen)
    x = torch.randn(37, 512, generator=gen)
    together = f32_linear(x, w, pad_f32_rows=True)
    alone = torch.cat([f32_linear(x[i : i + 1], w, pad_f32_rows=True) for i in range(len(x))])
    assert torch.equal(together, alone)
    z = torch.randn(37, 4, generator=gen) * 4
    together = rowwise(torch.sigmoid, z, pad_f32_rows=True)
    alone = torch.cat([rowwise(torch.sigmoid, z[i : i + 1], pad_f32_rows=True) for i in range(len(z))])
    assert torch.equal(together, alone)


def test_a_large_bf16_weight_is_widened_into_one_kept_buffer_per_thread():
    import threading

    from dsv41.model.layers import WIDEN_IN_PLACE_BYTES, f32_linear, widened

    g = torch.Generator().manual_seed(0)
    # the released router's shape: 384 experts x 5,120 (7.5 MiB widened)
    gate = torch.randn(RELEASED.n_routed_experts, RELEASED.dim, generator=g).to(torch.bfloat16)
    assert gate.numel() * 4 >= WIDEN_IN_PLACE_BYTES
    first = widened(gate)
    assert first.dtype == torch.float32 and torch.equal(first, gate.float())  # exact: the same values
    other = torch.randn(gate.shape, generator=g).to(torch.bfloat16)
    again = widened(other)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, other.float())  # the buffer, reused
    there = {}
    worker = threading.Thread(target=lambda: there.setdefault("ptr", widened(gate).data_ptr()))
    worker.start()
    worker.join()
    assert there["ptr"] != first.data_ptr()  # another thread widens into its own
    # the product is the plain one's, bit for bit, with and without padded rows
    x = torch.randn(3, RELEASED.dim, generator=g)
    for pad in (False, True):
        want = torch.nn.functional.linear(x, gate.float()) if not pad else None
        got = f32_linear(x, gate, pad_f32_rows=pad)
        if want is not None:
            assert torch.equal(got, want)
        assert torch.equal(got, f32_linear(x, gate.float(), pad_f32_rows=pad))
    # a float32 weight is used as it is (a training master keeps its gradient); a small one is copied
    master = gate.float().requires_grad_()
    assert widened(master) is master
    small = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    one, two = widened(small), widened(small)  # both alive: fresh tensors, no shared buffer
    assert one.data_ptr() != two.data_ptr() and torch.equal(one, small.float())
