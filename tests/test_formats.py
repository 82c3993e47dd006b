"""Storage encodings: FP8 32x32 blocks, Engram 1x32 rows, packed FP4 experts, safetensors writing."""

import math

import pytest
import torch

from dsv41.checkpoint import formats
from dsv41.checkpoint.formats import (
    dequantize,
    dequantize_engram_rows,
    dequantize_fp4,
    dequantize_fp8_blocks,
    fp4_values,
    infer_fp8_block,
    pow2_exponent,
    quantize_engram_table,
    quantize_fp4,
    quantize_fp8_blocks,
    save_safetensors,
)

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _randn(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def _scale_values(scale):
    return scale.view(torch.uint8).to(torch.int32) - 127  # exponents


# ---------------------------------------------------------------------- scales
def test_pow2_exponent_is_the_smallest_power_that_fits():
    amax = torch.tensor([448.0, 448.1, 224.0, 1.0, 0.0, 3e38, 1e-45])
    e = pow2_exponent(amax, 448.0)
    assert e.tolist()[:4] == [0, 1, -1, math.ceil(math.log2(1 / 448))]
    assert e[4] == -127  # all-zero block: smallest scale
    assert e[5] == math.ceil(math.log2(float(amax[5]) / 448))
    assert e[6] == -127  # below E8M0's range: clamped, never wraps
    fits = amax[:4] / torch.exp2(e[:4].double())
    assert (fits <= 448).all() and (fits > 224).all()


def test_fp8_scales_are_powers_of_two_and_blocks_fit():
    w = _randn(96, 160, std=0.05)
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(q.shape) == (96, 160) and tuple(s.shape) == (3, 5)
    sv = s.float()
    mant, _ = torch.frexp(sv)
    assert (mant == 0.5).all(), "every E8M0 scale is an exact power of two"
    # the chosen scale is the smallest power of two that keeps the block amax inside 448
    amax = w.abs().view(3, 32, 5, 32).amax(dim=(1, 3))
    assert (amax / sv <= 448).all() and (amax / sv > 224).all()


def test_fp8_block_round_trip_error_bound():
    w = _randn(64, 96, seed=1)
    q, s = quantize_fp8_blocks(w)
    d = dequantize_fp8_blocks(q, s)
    scale = s.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    # E4M3: 3 mantissa bits (half-ulp 2**-4 relative), subnormal step 2**-9 of the scale
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((d - w).abs() <= bound + 1e-12).all()
    assert (d - w).abs().max() > 0  # it is a lossy format: the bound is not vacuous


def test_fp8_dequant_is_weight_times_block_scale():
    w = _randn(64, 64, seed=2)
    q, s = quantize_fp8_blocks(w)
    d = dequantize_fp8_blocks(q, s)
    # block (1, 0) by hand
    by_hand = q[32:, :32].float() * s[1, 0].float()
    assert torch.equal(d[32:, :32], by_hand)


def test_fp8_non_multiple_shapes_use_ceil_blocks():
    w = _randn(40, 70, seed=3)
    q, s = quantize_fp8_blocks(w)
    assert tuple(s.shape) == (2, 3)
    d = dequantize_fp8_blocks(q, s, block=(32, 32))
    assert d.shape == w.shape and ((d - w).abs() <= w.abs() * 2.0**-4 + 1e-2).all()


def test_fp8_scale_extremes_and_zeros():
    big = torch.full((32, 32), 1e30)
    q, s = quantize_fp8_blocks(big)
    assert torch.isfinite(dequantize(q, s)).all()
    assert torch.allclose(dequantize(q, s), big, rtol=2.0**-4)
    tiny = torch.full((32, 32), 1e-30)
    q, s = quantize_fp8_blocks(tiny)
    assert torch.allclose(dequantize(q, s), tiny, rtol=2.0**-4)
    zeros = torch.zeros(32, 64)
    q, s = quantize_fp8_blocks(zeros)
    assert torch.equal(dequantize(q, s), zeros)
    assert (s.view(torch.uint8) != 255).all(), "never the NaN byte"
    # a block mixing a huge value with small ones: the small ones flush towards zero, no NaN
    mixed = torch.zeros(32, 32)
    mixed[0, 0], mixed[1, 1] = 448.0 * 2**20, 1.0
    d = dequantize(*quantize_fp8_blocks(mixed))
    assert d[0, 0] == mixed[0, 0] and d[1, 1] == 0 and torch.isfinite(d).all()


def test_fp8_exact_values_survive():
    # values already on the E4M3 grid times a power of two come back bit for bit
    grid = torch.tensor([448.0, -448.0, 1.0, 0.5, -0.015625, 2.0**-9, 0.0, 3.5] * 4)
    w = grid.repeat(32, 1) * 2.0**-3
    assert torch.equal(dequantize(*quantize_fp8_blocks(w)), w)


def test_fp8_rejects_non_finite():
    w = torch.zeros(32, 32)
    w[3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8_blocks(w)


def test_infer_block_from_shapes():
    assert infer_fp8_block((64, 128), (2, 4)) == (32, 32)
    assert infer_fp8_block((64, 128), (64, 4)) == (1, 32)
    with pytest.raises(ValueError):
        infer_fp8_block((64, 128), (3, 4))


# ---------------------------------------------------------------------- Engram rows
def test_engram_rows_have_their_own_scale_and_dequantize_alone():
    t = _randn(50, 64, seed=4)
    t[7] *= 1000.0  # one loud row must not cost the others precision
    q, s = quantize_engram_table(t)
    assert tuple(q.shape) == (50, 64) and tuple(s.shape) == (50, 2)
    full = dequantize(q, s)
    assert ((full - t).abs() <= t.abs() * 2.0**-4 + s.float().repeat_interleave(32, 1) * 2.0**-10).all()
    rows = torch.tensor([[3, 7], [49, 0]])
    gathered = dequantize_engram_rows(q[rows], s[rows])
    assert gathered.shape == (2, 2, 64)
    assert torch.equal(gathered, full[rows])
    assert _scale_values(s)[7].min() > _scale_values(s)[8].max()


# ---------------------------------------------------------------------- FP4
def test_fp4_nibble_order_low_first():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.0, -6.0  # E2M1 codes 2 and 8|7 = 15
    packed, scale = quantize_fp4(x)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (1, 16)
    assert scale.view(torch.uint8).item() == 127  # amax 6 fits with scale 1
    assert packed.view(torch.uint8)[0, 0].item() == 0xF2  # element 0 low nibble, element 1 high
    # torch's own float4 x2 dtype reads the same bytes
    as_x2 = packed.view(torch.uint8).view(torch.float4_e2m1fn_x2)
    assert torch.equal(fp4_values(as_x2), fp4_values(packed))


def test_fp4_round_trip_grid_values_exact():
    grid = torch.tensor(E2M1_GRID + [-v for v in E2M1_GRID])  # 16 values, amax 6
    w = torch.cat([grid, grid.flip(0)]).repeat(8, 1) * 0.25  # [8, 32]; a power-of-two rescale
    packed, scale = quantize_fp4(w)
    assert torch.equal(dequantize_fp4(packed, scale), w)
    assert (_scale_values(scale) == -2).all()


def test_fp4_adversarial_values():
    # +-6 at the edge, exact ties (round to even), signed zeros, an all-zero group
    w = torch.zeros(2, 64)
    w[0, :8] = torch.tensor([6.0, -6.0, 0.25, 0.75, 2.5, 5.0, -0.0, 1.25])
    packed, scale = quantize_fp4(w)
    d = dequantize_fp4(packed, scale)
    assert d[0, :8].tolist() == [6.0, -6.0, 0.0, 1.0, 2.0, 4.0, 0.0, 1.0]
    assert torch.equal(d[1], torch.zeros(64)) and torch.equal(d[0, 32:], torch.zeros(32))
    assert torch.isfinite(d).all()


def test_fp4_random_round_trip_bound_and_scales():
    w = _randn(16, 128, seed=5, std=0.1)
    packed, scale = quantize_fp4(w)
    assert tuple(packed.shape) == (16, 64) and tuple(scale.shape) == (16, 4)
    s = scale.float()
    assert (torch.frexp(s)[0] == 0.5).all()
    amax = w.abs().view(16, 4, 32).amax(-1)
    assert (amax / s <= 6).all() and (amax / s > 3).all()
    d = dequantize_fp4(packed, scale)
    # E2M1: largest gap 2 (between 4 and 6), so the error is at most one scale unit
    assert ((d - w).abs() <= s.repeat_interleave(32, 1) + 1e-12).all()
    assert torch.equal(dequantize(packed, scale), d)


def test_fp4_rejects_bad_shapes():
    with pytest.raises(ValueError):
        quantize_fp4(torch.zeros(4, 48))
    packed, scale = quantize_fp4(torch.zeros(4, 64))
    with pytest.raises(ValueError):
        dequantize_fp4(packed, scale[:, :1])


# ---------------------------------------------------------------------- files
def test_safetensors_writes_release_dtypes_and_reads_back(tmp_path):
    from safetensors import safe_open

    w = _randn(64, 64, seed=6)
    q, s = quantize_fp8_blocks(w)
    p, ps = quantize_fp4(w)
    tensors = {
        "a.weight": q,
        "a.scale": s,
        "e.weight": p,
        "e.scale": ps,
        "n.weight": torch.ones(64, dtype=torch.bfloat16),
        "sink": torch.zeros(4),
    }
    path = tmp_path / "x.safetensors"
    save_safetensors(tensors, str(path))
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    import json

    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert {k: v["dtype"] for k, v in header.items() if k != "__metadata__"} == {
        "a.weight": "F8_E4M3",
        "a.scale": "F8_E8M0",
        "e.weight": "I8",
        "e.scale": "F8_E8M0",
        "n.weight": "BF16",
        "sink": "F32",
    }
    assert header["e.weight"]["shape"] == [64, 32]
    with safe_open(str(path), "pt") as f:
        back = {k: f.get_tensor(k) for k in f.keys()}
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8))
    assert torch.equal(dequantize(back["a.weight"], back["a.scale"]), dequantize(q, s))
    # same tensors, same bytes
    path2 = tmp_path / "y.safetensors"
    save_safetensors(tensors, str(path2))
    assert path.read_bytes() == path2.read_bytes()


def test_safetensors_rejects_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="complex"):
        save_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "c.safetensors"))


def test_dtype_names():
    assert formats.torch_dtype("F8_E8M0") is torch.float8_e8m0fnu
    with pytest.raises(ValueError):
        formats.torch_dtype("F4")


def test_fp4_storage_rounds_ties_to_even_with_the_low_nibble_first():
    # amax 6 in each block makes the scale exactly 1, so the stored codes are the values' own
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    row = torch.cat([ties, -ties, torch.zeros(16)]).unsqueeze(0)  # [1, 32]
    packed, scale = formats.quantize_fp4(row)
    assert scale.float().tolist() == [[1.0]]
    back = formats.dequantize_fp4(packed, scale)[0, :16].tolist()
    assert back == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -6.0]
    # element 0 (0.25 -> code 0) in the low nibble, element 1 (0.75 -> code 2, value 1.0) in the high
    assert packed.view(torch.uint8)[0, 0].item() == 0x20
