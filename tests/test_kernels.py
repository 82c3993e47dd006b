"""The op layer's contracts, pinned with fixtures derived by hand or from the defining formula.

Where a plausible misreading of the arithmetic would also "work", the test computes that
alternative too and asserts it gives a different answer, so the fixture really tells them apart.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from dsv41.kernels import (
    E2M1_VALUES,
    act_quant,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    fp4_act_quant,
    fp4_gemm,
    fp8_gemm,
    hc_split_sinkhorn,
    linear,
    pack_fp4,
    pow2_ceil,
    sparse_attn,
    to_e4m3,
    unpack_fp4,
)

# The E2M1 grid as the OCP MX spec lists it, codes 0..15 (bit 3 = sign).
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def bf16(values):
    return torch.tensor(values, dtype=torch.bfloat16)


def e8m0_value(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes by the definition 2**(byte - 127), in float64."""
    return torch.pow(2.0, scale.view(torch.uint8).double() - 127)


def decode_fp4_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Decode packed FP4 by hand: low nibble is the even element."""
    raw = packed.view(torch.uint8).long()
    table = torch.tensor(SPEC_E2M1, dtype=torch.float64)
    return torch.stack([table[raw & 15], table[raw >> 4]], dim=-1).flatten(-2)


# --- codecs ---------------------------------------------------------------------------------


def test_e2m1_table_matches_the_spec_including_negative_zero():
    assert list(E2M1_VALUES) == SPEC_E2M1
    decoded = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert decoded.tolist() == SPEC_E2M1
    assert torch.signbit(decoded[8]) and not torch.signbit(decoded[0])


def test_e2m1_rounds_ties_to_even_not_away_from_zero():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # the neighbour with a clear mantissa bit wins each tie
    even = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_decode(e2m1_encode(ties)).tolist() == even
    assert e2m1_decode(e2m1_encode(-ties)).tolist() == [-v for v in even]
    half_away = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert even != half_away
    # just off a tie, plain nearest rounding
    off = torch.tensor([0.26, 0.74, 2.49, 2.51, 5.01, 6.0])
    assert e2m1_decode(e2m1_encode(off)).tolist() == [0.5, 0.5, 2.0, 3.0, 6.0, 6.0]


def test_e2m1_encode_is_exact_on_the_grid_and_keeps_the_sign_of_zero():
    grid = torch.tensor(SPEC_E2M1)
    assert e2m1_encode(grid).tolist() == list(range(16))
    assert e2m1_encode(torch.tensor([-0.1])).item() == 8  # rounds to -0.0


def test_fp4_packing_puts_the_even_element_in_the_low_nibble():
    packed = pack_fp4(torch.tensor([1, 2, 15, 8], dtype=torch.uint8))
    assert packed.dtype == torch.float4_e2m1fn_x2
    assert packed.view(torch.uint8).tolist() == [0x21, 0x8F]
    assert unpack_fp4(packed).tolist() == [1, 2, 15, 8]


def test_pow2_ceil_rounds_up_to_a_power_of_two():
    x = torch.tensor([1.0, 1.5, 3.0, 0.3, 2.0**-20, 1.0 + 2.0**-23, 448.0])
    assert pow2_ceil(x).tolist() == [1.0, 2.0, 4.0, 0.5, 2.0**-20, 2.0, 512.0]


def test_e8m0_round_trips_every_exponent_and_agrees_with_torch():
    exps = torch.arange(-127, 128, dtype=torch.float64)
    pow2 = torch.pow(2.0, exps).float()
    encoded = e8m0_encode(pow2)
    assert encoded.dtype == torch.float8_e8m0fnu
    assert encoded.view(torch.uint8).tolist() == list(range(255))
    assert torch.equal(e8m0_decode(encoded), pow2)
    assert torch.equal(encoded.float(), pow2)
    assert torch.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()


def test_e4m3_saturates_and_rounds_ties_to_even():
    x = torch.tensor([1000.0, -1000.0, 1.0625, 1.1875, 448.0])
    # 1.0625 sits halfway between 1.0 and 1.125; 1.1875 between 1.125 and 1.25
    assert to_e4m3(x).float().tolist() == [448.0, -448.0, 1.0, 1.25, 448.0]


# --- act_quant (FP8) ---------------------------------------------------------------------------


def test_act_quant_scales_are_powers_of_two_rounded_up_from_amax_over_448():
    # one block of 32 per amax; amax 0 falls back to the 1e-4 floor
    amaxes = [448.0, 464.0, 1.0, 0.0, 3.0]
    x = torch.zeros(len(amaxes), 32, dtype=torch.bfloat16)
    x[:, 5] = bf16(amaxes)
    q, s = act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 32)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (5, 1)
    expected = [2.0 ** math.ceil(math.log2(max(a, 1e-4) / 448)) for a in amaxes]
    assert e8m0_value(s).flatten().tolist() == expected == [1.0, 2.0, 2.0**-8, 2.0**-22, 2.0**-7]
    # the unrounded scale amax/448 is not a power of two and would be a different scale
    assert 464.0 / 448 not in expected


def test_act_quant_blocks_are_independent_and_dequantize_close():
    torch.manual_seed(0)
    x = (torch.randn(3, 4, 128) * torch.logspace(-3, 2, 128)).bfloat16()
    q, s = act_quant(x)
    assert s.shape == (3, 4, 4)
    deq = (q.double().unflatten(-1, (4, 32)) * e8m0_value(s).unsqueeze(-1)).flatten(-2)
    amax = x.double().unflatten(-1, (4, 32)).abs().amax(-1, keepdim=True)
    # E4M3 keeps 3 mantissa bits: error at most half an ulp of the block's largest binade,
    # plus the flush of values far below the block amax
    err = (deq - x.double()).unflatten(-1, (4, 32)).abs()
    assert (err <= amax * 2.0**-3).all()
    # a block's scale depends on its own amax only
    x2 = x.clone()
    x2[..., :32] *= 64
    _, s2 = act_quant(x2)
    assert torch.equal(s2[..., 1:].view(torch.uint8), s[..., 1:].view(torch.uint8))
    assert (s2[..., 0].view(torch.uint8) == s[..., 0].view(torch.uint8) + 6).all()


def test_act_quant_inplace_is_the_dequantized_pair_written_back():
    torch.manual_seed(1)
    x = torch.randn(2, 5, 64).bfloat16()
    q, s = act_quant(x)
    expected = (q.float().unflatten(-1, (2, 32)) * s.float().unsqueeze(-1)).flatten(-2).bfloat16()
    y = x.clone()
    out = act_quant(y, 32, "ue8m0", torch.float8_e8m0fnu, True)
    assert out is y
    assert torch.equal(y, expected)
    assert not torch.equal(y, x)


def test_act_quant_without_ue8m0_keeps_float32_scales():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 464.0
    q, s = act_quant(x, 32, None, torch.float32)
    assert s.dtype == torch.float32
    assert s.item() == (torch.tensor(464.0) * torch.tensor(1 / 448, dtype=torch.float32)).item()
    assert s.item() != pow2_ceil(s).item()
    with pytest.raises(ValueError):
        act_quant(x, 32, None, torch.float8_e8m0fnu)


# --- fp4_act_quant ---------------------------------------------------------------------------


def test_fp4_e8m0_scales_are_powers_of_two_rounded_up_from_amax_over_6():
    amaxes = [6.0, 6.5, 3.0, 0.0]
    x = torch.zeros(len(amaxes), 32, dtype=torch.bfloat16)
    x[:, 0] = bf16(amaxes)
    packed, s = fp4_act_quant(x)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (4, 16)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (4, 1)
    # an all-zero block falls back to amax 6 * 2**-126
    assert e8m0_value(s).flatten().tolist() == [1.0, 2.0, 0.5, 2.0**-126]


def test_fp4_quantizer_rounds_ties_to_even():
    # amax 6 gives scale 1, so the block's values are rounded onto the grid as they are
    x = bf16([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, -0.75] + [0.0] * 22])
    packed, _ = fp4_act_quant(x)
    got = decode_fp4_bytes(packed)[0, :10].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0, -1.0]


def test_fp4_packed_output_puts_the_even_element_low():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :2] = bf16([0.5, 6.0])  # codes 1 and 7
    packed, _ = fp4_act_quant(x)
    assert packed.view(torch.uint8)[0, 0].item() == 0x71


def test_fp4_e4m3_scale_is_amax_over_6_rounded_to_e4m3():
    # amax 10: 10/6 = 1.667 rounds to 1.625 on the E4M3 grid (step 0.125 in [1, 2))
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    x[0, 3] = 10.0
    x[1, 0] = 7.5  # 7.5/6 = 1.25 exactly
    packed, s = fp4_act_quant(x, 16, False, torch.float8_e4m3fn)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (2, 1)
    assert s.float().flatten().tolist() == [1.625, 1.25]
    # misreadings that also round-trip: E4M3 of amax itself, or the E8M0 power of two
    assert to_e4m3(torch.tensor([10.0, 7.5])).tolist() == [10.0, 7.5]
    _, s_e8m0 = fp4_act_quant(x, 16)
    assert e8m0_value(s_e8m0).flatten().tolist() == [2.0, 2.0]
    # 10 / 1.625 = 6.15 saturates at the top code: the value comes back as 6 * 1.625
    assert decode_fp4_bytes(packed)[0, 3].item() == 6.0
    y = x.clone()
    fp4_act_quant(y, 16, True, torch.float8_e4m3fn)
    assert y[0, 3].item() == 9.75 and y[1, 0].item() == 7.5


def test_fp4_e4m3_all_zero_block_gets_a_nonzero_scale():
    x = torch.zeros(1, 3, 16, dtype=torch.bfloat16)
    x[0, 1, 0] = 1.0
    packed, s = fp4_act_quant(x, 16, False, torch.float8_e4m3fn)
    # floor 6 * 2**-9: the scale becomes 2**-9, the smallest E4M3 subnormal
    assert s[0, 0, 0].float().item() == 2.0**-9 > 0
    assert s[0, 2, 0].float().item() == 2.0**-9
    assert (packed[0, 0].view(torch.uint8) == 0).all()
    # the float32 floor the E8M0 branch uses would give a zero E4M3 scale
    assert to_e4m3(torch.tensor([2.0**-126])).float().item() == 0.0


def test_fp4_inplace_is_the_dequantized_pair_written_back():
    torch.manual_seed(2)
    x = torch.randn(3, 2, 64).bfloat16()
    for block, scale_dtype in ((32, torch.float8_e8m0fnu), (16, torch.float8_e4m3fn)):
        packed, s = fp4_act_quant(x, block, False, scale_dtype)
        values = decode_fp4_bytes(packed).unflatten(-1, (-1, block))
        scales = e8m0_value(s) if scale_dtype == torch.float8_e8m0fnu else s.double()
        expected = (values * scales.unsqueeze(-1)).flatten(-2).bfloat16()
        y = x.clone()
        assert fp4_act_quant(y, block, True, scale_dtype) is y
        assert torch.equal(y, expected)


# --- GEMMs -----------------------------------------------------------------------------------


def _fp8_weight(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = to_e4m3(torch.randn(n, k, generator=gen) * 100)
    exps = torch.randint(-10, 3, (-(-n // 32), k // 32), generator=gen)
    scales = e8m0_encode(torch.pow(2.0, exps.float()))
    return w, scales


def _fp4_weight(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    raw = codes[:, 0::2] | (codes[:, 1::2] << 4)  # packed by hand, even element low
    exps = torch.randint(-8, 4, (n, k // 32), generator=gen)
    scales = e8m0_encode(torch.pow(2.0, exps.float()))
    return raw.view(torch.float4_e2m1fn_x2), scales


def _assert_close_to_float64(out, ref, a_abs, w_abs):
    # float32 accumulation: each partial and each running sum carries a relative 2**-24
    bound = (a_abs @ w_abs.T) * 2.0**-24 * 64 + 1e-30
    assert ((out.double() - ref).abs() <= bound).all()


def test_fp8_gemm_equals_dequantize_then_matmul_in_float64():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 96).bfloat16()
    a, a_s = act_quant(x)
    w, w_s = _fp8_weight(40, 96, seed=4)  # 40 rows: the last scale row covers a partial block
    out = fp8_gemm(a, a_s, w, w_s, out_dtype=torch.float32)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32

    a64 = (a.double().unflatten(-1, (3, 32)) * e8m0_value(a_s).unsqueeze(-1)).flatten(-2)
    w_scale = e8m0_value(w_s).repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)
    w64 = w.double() * w_scale
    ref = a64 @ w64.T
    _assert_close_to_float64(out, ref, a64.abs(), w64.abs())
    # per-block weight scales matter: one scale for the whole weight would be far off
    flat = a64 @ (w.double() * e8m0_value(w_s)[0, 0]).T
    assert not torch.allclose(out.double(), flat, rtol=1e-2)
    assert fp8_gemm(a, a_s, w, w_s).dtype == torch.bfloat16


@pytest.mark.parametrize("act_block", [32, 128])
def test_fp4_gemm_equals_dequantize_then_matmul_in_float64(act_block):
    torch.manual_seed(5)
    x = torch.randn(4, 256).bfloat16()
    a, a_s = act_quant(x, act_block)
    w, w_s = _fp4_weight(24, 256, seed=6)
    out = fp4_gemm(a, a_s, w, w_s, act_block_size=act_block, out_dtype=torch.float32)
    assert out.shape == (4, 24)

    a64 = (a.double().unflatten(-1, (-1, act_block)) * e8m0_value(a_s).unsqueeze(-1)).flatten(-2)
    w64 = decode_fp4_bytes(w) * e8m0_value(w_s).repeat_interleave(32, 1)
    ref = a64 @ w64.T
    _assert_close_to_float64(out, ref, a64.abs(), w64.abs())
    # the nibble order matters: swapping the two halves of each byte changes the product
    swapped = decode_fp4_bytes(w).unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    wrong = a64 @ (swapped * e8m0_value(w_s).repeat_interleave(32, 1)).T
    assert not torch.allclose(out.double(), wrong, rtol=1e-2)


def test_linear_picks_the_path_from_the_weight_dtype():
    torch.manual_seed(7)
    x = torch.randn(2, 3, 64).bfloat16()
    w8, s8 = _fp8_weight(32, 64, seed=8)
    a, a_s = act_quant(x, 32)
    # the reference kernel here; the native one is pinned in test_dense_linear.py
    y8 = linear(x, w8, s8, kernel="reference")
    assert y8.dtype == torch.bfloat16 and y8.shape == (2, 3, 32)
    assert torch.equal(y8, fp8_gemm(a, a_s, w8, s8))
    assert linear(x, w8, s8).shape == (2, 3, 32)

    w4, s4 = _fp4_weight(16, 64, seed=9)
    y4 = linear(x, w4, s4, kernel="reference")
    assert torch.equal(y4, fp4_gemm(a, a_s, w4, s4))

    wb = torch.randn(8, 64).bfloat16()
    assert torch.equal(linear(x, wb), F.linear(x, wb))
    with pytest.raises(ValueError):
        linear(x, w8)


# --- sparse_attn ---------------------------------------------------------------------------


def _dense_reference(q, kv, sink, idxs, scale, floor):
    """Softmax over the k slots plus the sink logit, in float64; absent slots score -inf.

    `floor` is where the row max starts, so passing -inf shows what that choice would do.
    """
    present = idxs != -1
    rows = kv.double()[torch.arange(q.size(0))[:, None, None], idxs.clamp_min(0).long()]
    rows = torch.where(present.unsqueeze(-1), rows, 0.0)  # [b, m, k, d]
    logits = torch.einsum("bmhd,bmkd->bmhk", q.double(), rows) * scale
    logits = torch.where(present.unsqueeze(2), logits, -math.inf)
    top = torch.maximum(torch.tensor(floor, dtype=torch.float64), logits.amax(-1))
    probs = torch.exp(logits - top.unsqueeze(-1))
    denom = probs.sum(-1) + torch.exp(sink.double() - top)
    return torch.einsum("bmhk,bmkd->bmhd", probs, rows) / denom.unsqueeze(-1)


def test_sparse_attn_matches_softmax_with_sink_over_present_indices():
    torch.manual_seed(10)
    b, m, h, d, n, k = 2, 3, 4, 16, 100, 80  # k > 64: several online-softmax chunks
    q = torch.randn(b, m, h, d).bfloat16()
    kv = torch.randn(b, n, d).bfloat16()
    sink = torch.randn(h)
    idxs = torch.randint(0, n, (b, m, k), dtype=torch.int32)
    idxs[torch.rand(b, m, k) < 0.3] = -1
    out = sparse_attn(q, kv, sink, idxs, d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (b, m, h, d)
    ref = _dense_reference(q, kv, sink, idxs, d**-0.5, -1e30)
    # probabilities enter the value sum rounded to bf16, and the output is bf16
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_sparse_attn_sink_is_not_scaled_by_softmax_scale():
    # q.k = 2, softmax_scale 0.5: score 1 against a sink logit of 1 -> weight exactly 1/2
    q = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    q[..., :2] = 1.0
    kv = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    kv[..., :2] = 1.0
    out = sparse_attn(q, kv, torch.tensor([1.0]), torch.zeros(1, 1, 1, dtype=torch.int32), 0.5)
    assert out[0, 0, 0, :3].tolist() == [0.5, 0.5, 0.0]
    scaled_sink_weight = math.exp(1) / (math.exp(1) + math.exp(0.5))
    assert abs(scaled_sink_weight - 0.5) > 0.1


def test_sparse_attn_all_absent_row_is_zero_not_nan():
    torch.manual_seed(11)
    q = torch.randn(1, 2, 2, 8).bfloat16()
    kv = torch.randn(1, 5, 8).bfloat16()
    idxs = torch.tensor([[[-1, -1, -1], [0, -1, 3]]], dtype=torch.int32)
    sink = torch.tensor([0.5, -0.5])
    out = sparse_attn(q, kv, sink, idxs, 0.3)
    assert torch.equal(out[0, 0], torch.zeros(2, 8, dtype=torch.bfloat16))
    assert torch.isfinite(out).all() and out[0, 1].abs().sum() > 0
    # an -inf running-max floor turns the same row into NaN
    assert torch.isnan(_dense_reference(q, kv, sink, idxs, 0.3, -math.inf)[0, 0]).all()


def test_sparse_attn_weights_values_with_bf16_probabilities():
    # scores 0.29 and 0 against a negligible sink: the second key's probability exp(-0.29)
    # = 0.7483 enters the value sum as bf16 0.75, but the denominator keeps it in float32
    q = torch.zeros(1, 1, 1, 4, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    kv = torch.eye(4, dtype=torch.bfloat16)[:2].unsqueeze(0)  # rows e0 and e1
    idxs = torch.tensor([[[0, 1]]], dtype=torch.int32)
    out = sparse_attn(q, kv, torch.tensor([-100.0]), idxs, 0.29)
    p = math.exp(-0.29)
    assert out[0, 0, 0, 1].item() == bf16([0.75 / (1 + p)]).item() == 0.4296875
    assert bf16([p / (1 + p)]).item() == 0.427734375  # unrounded probabilities


def test_sparse_attn_absent_slots_ignore_whatever_row_0_holds():
    torch.manual_seed(12)
    q = torch.randn(1, 1, 2, 8).bfloat16()
    kv = torch.randn(1, 4, 8).bfloat16()
    idxs = torch.tensor([[[2, -1, 3]]], dtype=torch.int32)
    base = sparse_attn(q, kv, torch.zeros(2), idxs, 0.5)
    kv2 = kv.clone()
    kv2[0, 0] = math.inf  # a zero weight times inf would be NaN: absent rows are selected out
    assert torch.equal(sparse_attn(q, kv2, torch.zeros(2), idxs, 0.5), base)


# --- hc_split_sinkhorn -----------------------------------------------------------------------


def _sinkhorn64(logits, iters, eps, column_step_first=True, body=("row", "column")):
    """The normalization in float64, with switches for the plausible other orders."""
    dims = {"row": -1, "column": -2}
    comb = torch.softmax(logits.double(), -1) + eps
    if column_step_first:
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        for step in body:
            comb = comb / (comb.sum(dims[step], keepdim=True) + eps)
    return comb


def _mixes_for(comb_logits, hc):
    mixes = torch.zeros((2 + hc) * hc)
    mixes[2 * hc :] = comb_logits.flatten()
    return mixes


def test_sinkhorn_hand_derived_two_by_two():
    # rows softmax to [1/4, 3/4] and [1/2, 1/2]; the column step gives [[1/3, 3/5], [2/3, 2/5]];
    # one more row-then-column round gives [[4/11, 12/19], [7/11, 7/19]]
    logits = torch.tensor([[0.0, math.log(3)], [0.0, 0.0]])
    ones, zeros = torch.ones(3), torch.zeros(8)
    _, _, one = hc_split_sinkhorn(_mixes_for(logits, 2), ones, zeros, 2, 1, 0.0)
    _, _, two = hc_split_sinkhorn(_mixes_for(logits, 2), ones, zeros, 2, 2, 0.0)
    assert torch.allclose(one, torch.tensor([[1 / 3, 3 / 5], [2 / 3, 2 / 5]]), atol=1e-6)
    assert torch.allclose(two, torch.tensor([[4 / 11, 12 / 19], [7 / 11, 7 / 19]]), atol=1e-6)
    # a loop body that ends on rows would give [[5/14, 9/14], [5/8, 3/8]] instead
    ends_on_rows = _sinkhorn64(logits, 2, 0.0, body=("column", "row"))
    assert torch.allclose(ends_on_rows, torch.tensor([[5 / 14, 9 / 14], [5 / 8, 3 / 8]], dtype=torch.float64))
    assert not torch.allclose(two.double(), ends_on_rows, atol=1e-2)


def test_sinkhorn_order_is_column_then_row_column_rounds():
    torch.manual_seed(13)
    hc, iters, eps = 4, 3, 1e-6
    mixes = torch.randn(2, 3, (2 + hc) * hc) * 3
    scale = torch.tensor([0.7, 1.3, 1.9])
    base = torch.randn((2 + hc) * hc)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
    assert pre.shape == post.shape == (2, 3, hc) and comb.shape == (2, 3, hc, hc)
    assert comb.dtype == pre.dtype == post.dtype == torch.float32

    # comb[..., i, j] comes from mixes[..., 2*hc + i*hc + j]
    logits = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    expected = _sinkhorn64(logits, iters, eps)
    assert torch.allclose(comb.double(), expected, atol=1e-5)
    # (a full row-then-column round in place of the first column step would be no test:
    # softmax rows already sum to one, so that leading row step is nearly the identity)
    for other in (
        _sinkhorn64(logits, iters, eps, body=("column", "row")),
        _sinkhorn64(logits, iters, eps, column_step_first=False),
        _sinkhorn64(logits.transpose(-1, -2), iters, eps),
    ):
        assert (comb.double() - other).abs().max() > 1e-3
    # ending on a column step: columns sum to one (up to eps), rows only roughly
    assert torch.allclose(comb.sum(-2), torch.ones(2, 3, hc), atol=1e-5)


def test_pre_and_post_gates_formulas_and_ranges():
    hc, eps = 4, 1e-6
    width = (2 + hc) * hc
    mixes = torch.zeros(4, width)
    mixes[0, : 2 * hc] = 1.0
    mixes[1, : 2 * hc] = -200.0
    mixes[2, : 2 * hc] = 200.0
    scale = torch.tensor([2.0, 3.0, 1.0])
    pre, post, _ = hc_split_sinkhorn(mixes, scale, torch.zeros(width), hc, 20, eps)
    # the scale slots are per part: pre uses hc_scale[0], post hc_scale[1]
    assert torch.allclose(pre[0], torch.full((hc,), 1 / (1 + math.exp(-2)) + eps))
    assert torch.allclose(post[0], torch.full((hc,), 2 / (1 + math.exp(-3))))
    # pre is floored at eps, post spans (0, 2); an all-zero row gives the midpoints
    assert torch.equal(pre[1], torch.full((hc,), eps))
    assert (post[1] == 0).all() and (post[2] == 2).all()
    assert torch.allclose(pre[2], torch.full((hc,), 1 + eps))
    assert torch.allclose(pre[3], torch.full((hc,), 0.5 + eps)) and (post[3] == 1).all()
