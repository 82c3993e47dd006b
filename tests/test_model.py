"""The backbone's arithmetic against its formulas: routing, clamped SwiGLU, routed experts over packed
FP4, hyper-connection mixes / collapse / expansion, the Engram gate. No checkpoint needed."""

import math

import pytest
import torch
import torch.nn.functional as F

from dsv41.checkpoint.formats import dequantize_fp4, quantize_fp4
from dsv41.checkpoint.stores import DictExpertStore, TensorEngramTable
from dsv41.core.config import TINY
from dsv41.kernels import act_quant, hc_split_sinkhorn
from dsv41.kernels.experts import PackedExpert, clamped_swiglu
from dsv41.model.model import (
    Engram,
    engram_gate,
    hc_mixes,
    hc_post,
    hc_pre,
    identity_pre,
)
from dsv41.model.moe import Gate, RoutedExperts, expert_scores, route

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- routing
def test_sqrtsoftplus_scores():
    x = torch.tensor([-30.0, -1.0, 0.0, 2.5, 40.0])
    expected = torch.tensor([math.sqrt(math.log1p(math.exp(v))) for v in x.tolist()])
    assert torch.allclose(expert_scores(x, "sqrtsoftplus"), expected, rtol=1e-6, atol=1e-12)


def test_routing_weights_sum_to_route_scale_when_normalized():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(5, 16, generator=gen) + 0.1
    bias = torch.zeros(16)
    weights, ids = route(scores, bias, topk=4, norm_topk_prob=True, route_scale=1.5)
    assert weights.shape == ids.shape == (5, 4)
    assert torch.allclose(weights.sum(-1), torch.full((5,), 1.5), atol=1e-6)
    # the chosen experts are the four largest scores, weighted in proportion to them
    assert torch.equal(ids.sort(-1).values, scores.topk(4).indices.sort(-1).values)
    chosen = scores.gather(1, ids)
    assert torch.allclose(weights, 1.5 * chosen / chosen.sum(-1, keepdim=True), atol=1e-6)
    # without normalization the weights are the raw scores times route_scale
    raw, _ = route(scores, bias, topk=4, norm_topk_prob=False, route_scale=1.5)
    assert torch.allclose(raw, 1.5 * chosen)


def test_bias_selects_but_never_weights():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.1, 0.05]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0])  # drags expert 3 into the top 2
    weights, ids = route(scores, bias, topk=2, norm_topk_prob=False, route_scale=1.0)
    assert set(ids[0].tolist()) == {3, 0}
    # its weight is its own unbiased score, not score + bias
    by_id = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert by_id[3] == pytest.approx(0.1) and by_id[0] == pytest.approx(0.9)


def test_gate_applies_bias_vl_only_to_image_tokens():
    cfg = TINY  # has a vision tower, so the gate holds bias_vl
    gate = Gate(cfg, n_experts=16, topk=4)
    assert gate.bias_vl is not None
    with torch.no_grad():
        gate.weight.copy_(torch.randn(16, cfg.dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
        gate.bias_vl[7] = 100.0  # forces expert 7 for image-span tokens
    x = torch.randn(6, cfg.dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    image = torch.tensor([False, True, False, True, False, False])
    _, text_ids = gate(x)
    _, masked_ids = gate(x, image)
    assert all((7 in row) for row in masked_ids[image].tolist())
    # text rows route identically with or without a mask: bias_vl never reaches them
    assert torch.equal(masked_ids[~image], text_ids[~image])
    unbiased = expert_scores(x.float() @ gate.weight.float().T, "sqrtsoftplus")
    assert torch.equal(text_ids.sort(-1).values, unbiased.topk(4).indices.sort(-1).values)


def test_swiglu_clamps_up_both_ways_and_gate_from_above():
    gate = torch.tensor([-20.0, 20.0, 1.0, 1.0])
    up = torch.tensor([1.0, 1.0, 20.0, -20.0])
    out = clamped_swiglu(gate, up, limit=10.0)
    expected = torch.stack(
        [
            F.silu(torch.tensor(-20.0)) * 1.0,  # gate not clamped from below
            F.silu(torch.tensor(10.0)) * 1.0,
            F.silu(torch.tensor(1.0)) * 10.0,
            F.silu(torch.tensor(1.0)) * -10.0,
        ]
    )
    assert torch.allclose(out, expected)
    assert torch.allclose(clamped_swiglu(gate, up, limit=0.0), F.silu(gate) * up)  # 0 disables


# ---------------------------------------------------------------------- routed experts
def _packed_expert(gen, dim=64, inter=32):
    parts = []
    for rows, cols in ((inter, dim), (dim, inter), (inter, dim)):  # w1, w2, w3
        w, s = quantize_fp4(torch.randn(rows, cols, generator=gen) / math.sqrt(cols))
        parts += [w.view(torch.float4_e2m1fn_x2), s]
    return PackedExpert(*parts)


def _fp8_roundtrip(x):
    codes, scale = act_quant(x, 32)
    return (codes.float().unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)).flatten(-2)


def test_routed_experts_match_the_dequantized_formula():
    gen = torch.Generator().manual_seed(3)
    experts = {(0, e): _packed_expert(gen) for e in range(6)}
    x = (torch.randn(5, 64, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 2], [4, 3]])
    weights = torch.rand(5, 2, generator=gen)
    routed = RoutedExperts(0, DictExpertStore(experts), swiglu_limit=10.0)
    y = routed.forward(x, ids, weights)
    assert y.dtype == torch.float32 and y.shape == (5, 64)

    # the formula: FP8 activations (blocks of 32) against the FP4 weights expanded to float32
    def dense(p, name):
        w, s = getattr(p, name), getattr(p, name + "_scale")
        return dequantize_fp4(w.view(torch.uint8), s)

    expected = torch.zeros(5, 64, dtype=torch.float64)
    for t in range(5):
        for k in range(2):
            p = experts[(0, int(ids[t, k]))]
            xq = _fp8_roundtrip(x[t : t + 1].float())
            h = clamped_swiglu(xq @ dense(p, "w1").T, xq @ dense(p, "w3").T, 10.0) * weights[t, k]
            hq = _fp8_roundtrip(h.to(torch.bfloat16).float())
            expected[t] += (hq @ dense(p, "w2").T).to(torch.bfloat16).double()[0]
    assert torch.allclose(y.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())

    # tokens are independent: routing them together equals routing them one at a time, bit for bit
    alone = torch.cat([routed.forward(x[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(5)])
    assert torch.equal(y, alone)


def test_routed_experts_fetch_each_selected_expert_once_in_id_order():
    gen = torch.Generator().manual_seed(4)
    experts = {(2, e): _packed_expert(gen) for e in range(8)}
    asked = []

    class Recording(DictExpertStore):
        def fetch(self, layer, expert_ids):
            asked.append((layer, list(expert_ids)))
            return super().fetch(layer, expert_ids)

    routed = RoutedExperts(2, Recording(experts), swiglu_limit=10.0)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    routed.forward(x, torch.tensor([[6, 1], [1, 4], [6, 4], [1, 6]]), torch.ones(4, 2))
    assert asked == [(2, [1, 4, 6])]
    assert all(t.dtype in (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu) for t in experts[(2, 1)])


# ---------------------------------------------------------------------- hyper-connections
def test_hc_pre_is_the_weighted_sum_of_copies():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, 8, generator=gen).to(torch.bfloat16)
    pre = torch.rand(2, 3, 4, generator=gen)
    out = hc_pre(x, pre)
    expected = torch.einsum("bsh,bshd->bsd", pre.double(), x.double())
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 8)
    assert torch.allclose(out.double(), expected, rtol=1e-2, atol=1e-2)
    # the identity pre picks copy 0
    assert torch.equal(hc_pre(x, identity_pre(2, 3, 4)), x[:, :, 0])


def test_hc_post_mixes_residual_copies_through_comb_rows():
    out = torch.tensor([[[1.0, 2.0]]]).to(torch.bfloat16)  # [1, 1, dim 2]
    residual = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]]]).to(torch.bfloat16)  # [1, 1, hc 3, 2]
    post = torch.tensor([[[0.5, 1.0, 2.0]]])
    comb = torch.tensor(
        [
            [
                [
                    [0.0, 1.0, 0.0],  # copy 0 feeds copy 1
                    [0.0, 0.0, 1.0],  # copy 1 feeds copy 2
                    [1.0, 0.0, 0.0],
                ]
            ]
        ]
    )  # copy 2 feeds copy 0
    y = hc_post(out, residual, post, comb)[0, 0].float()
    # y_j = post_j * out + sum_i comb[i, j] * residual_i
    expected = torch.tensor([[0.5 + 2.0, 1.0 + 2.0], [1.0 + 1.0, 2.0 + 0.0], [2.0 + 0.0, 4.0 + 1.0]])
    assert torch.equal(y, expected)


def test_hc_mixes_follow_the_formula():
    gen = torch.Generator().manual_seed(6)
    hc, dim = 4, 16
    x = torch.randn(1, 3, hc, dim, generator=gen).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=gen) * 0.1
    base = torch.randn((2 + hc) * hc, generator=gen) * 0.1
    scale = torch.tensor([0.5, 0.7, 0.9])
    pre, post, comb = hc_mixes(x, fn, scale, base, hc, 20, 1e-6, 1e-20, pad_f32_rows=False)
    flat = x.flatten(2).double()
    mixes = (flat @ fn.double().T) / flat.square().mean(-1, keepdim=True).sqrt()
    assert torch.allclose(pre.double(), torch.sigmoid(mixes[..., :hc] * 0.5 + base[:hc].double()) + 1e-6, atol=1e-5)
    assert torch.allclose(
        post.double(), 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * 0.7 + base[hc : 2 * hc].double()), atol=1e-5
    )
    # comb is the kernel's Sinkhorn projection of the same logits: (near) doubly stochastic
    _, _, kernel_comb = hc_split_sinkhorn(mixes.float(), scale, base, hc, 20, 1e-6)
    assert torch.allclose(comb, kernel_comb, atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(1, 3, hc), atol=1e-3)
    assert torch.allclose(comb.sum(-1), torch.ones(1, 3, hc), atol=1e-2)


# ---------------------------------------------------------------------- Engram
def test_engram_gate_formula_and_sign():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 2, 4, 32, generator=gen)
    key = torch.randn(1, 2, 4, 32, generator=gen)
    w = torch.rand(4, 32, generator=gen)
    gate = engram_gate(x, key, w, 1e-20)
    dot = (x * w * key).sum(-1) / (x.square().mean(-1).sqrt() * key.square().mean(-1).sqrt()) / math.sqrt(32)
    expected = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
    assert torch.allclose(gate, expected, atol=1e-6)
    assert ((gate < 0.5) == (dot < 0)).all()
    # a key pointing exactly against the stream closes the gate below one half
    assert (engram_gate(x, -x, torch.ones(4, 32), 1e-20) < 0.5).all()


def test_engram_layer_adds_gated_value_and_respects_the_mask():
    cfg = TINY
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    layer = Engram(cfg, 1, cols)
    gen = torch.Generator().manual_seed(8)
    rows = 50
    table = torch.randn(rows, cfg.engram_head_dim, generator=gen)
    from dsv41.checkpoint.formats import quantize_engram_table

    layer.embed = TensorEngramTable(*quantize_engram_table(table))
    from dsv41.model.layers import init_random_

    init_random_(layer.wkv, 9)
    x = torch.randn(1, 3, cfg.hc_mult, cfg.dim, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, rows, (1, 3, cols), generator=gen)
    from dsv41.model.hooks import name_sites

    gates = []  # the layer's site sees its gates in the context
    with name_sites(layer).hooks({"": lambda name, value, context: gates.append(context["gate"])}):
        out = layer(x, ids)
    gate = gates[0]  # [1, 3, hc]
    assert gate.shape == (1, 3, cfg.hc_mult) and ((gate > 0) & (gate < 1)).all()
    mask = torch.tensor([[True, False, True]])
    masked = layer(x, ids, token_mask=mask)
    assert torch.equal(masked[0, 1], x[0, 1])  # a shut gate passes the stream through untouched
    assert torch.equal(masked[0, 0], out[0, 0]) and not torch.equal(out[0, 0], x[0, 0])
    # every copy moved along one shared value vector, scaled by its own gate
    value = (out.float() - x.float())[0] / gate[0].unsqueeze(-1)  # [3, hc, dim]
    spread = (value - value.mean(1, keepdim=True)).abs().amax()
    assert spread <= 0.02 * value.abs().amax()
