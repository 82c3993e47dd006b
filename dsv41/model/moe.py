"""The mixture-of-experts sublayer a block holds (`layers.N.ffn`): the router (`Gate`, `route`),
the routed half computed from the store's packed experts (`RoutedExperts`) and the shared expert,
summed in float32 (`MoE`). The model's own forward and the rest of a block are `model.py`'s.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.stores import ExpertStore, FetchedExperts
from ..core.numerics import Numerics
from ..kernels.experts import clamped_swiglu, routed_experts
from .hooks import NO_SITES, site
from .layers import Linear, f32_linear, linear_dtype, param, rowwise

# Added to the top-k routing weight sum before dividing; a training constant, not norm_eps.
ROUTE_SUM_EPS = 1e-20


# ---------------------------------------------------------------------- routing
def expert_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Router logits -> affinities. The release uses sqrtsoftplus: sqrt(softplus(logit))."""
    if score_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if score_func == "sigmoid":
        return logits.sigmoid()
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"unknown score_func {score_func!r}")


def route(
    scores: torch.Tensor, bias: torch.Tensor, topk: int, norm_topk_prob: bool, route_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [n, E] float32 -> (weights [n, k] float32, expert ids [n, k] int64).

    The bias only chooses which experts run; the weights are the unbiased scores of the chosen
    ones, normalized to sum to one (norm_topk_prob, k > 1) and then scaled by route_scale."""
    ids = (scores + bias).topk(topk, dim=-1).indices
    weights = scores.gather(-1, ids)
    if norm_topk_prob and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTE_SUM_EPS)
    return weights * route_scale, ids


class RoutedExperts:
    """The routed half of one MoE layer: y = sum_k weight_k * expert_{id_k}(x), float32.

    The one interface a faster implementation replaces: `forward(x [n, dim], expert_ids [n, k],
    weights [n, k]) -> float32 [n, dim]`. The selected experts are fetched once (ascending id) and
    run through the fused packed-FP4 path (`kernels.experts.routed_experts`: Triton where the
    store placed an expert on CUDA, the fused CPU kernels otherwise): tokens quantized to FP8
    once, each expert once on all of its tokens, never a float32 or bf16 copy of a whole weight
    matrix. It equals the op layer's reference
    `fp4_gemm` path up to the order of float32 additions. `last_fetch` holds the most recent
    call's cache hits and misses (a `FetchedExperts` of counts). `batch_invariant`: a token's output does
    not depend on how many tokens an expert sees (see `kernels.experts`). `next_gate`, the next
    layer's router where the model sets it (`Model.attach`): applied to this layer's input, it
    names the experts the store may read ahead (`SlotCache.read_ahead`); the guess moves reads
    earlier and changes no arithmetic."""

    def __init__(self, layer: int, store: ExpertStore, swiglu_limit: float, *, batch_invariant: bool = False):
        self.layer, self.store, self.swiglu_limit = layer, store, swiglu_limit
        self.batch_invariant = batch_invariant
        self.last_fetch: Optional[FetchedExperts] = None
        self.next_gate: Optional["Gate"] = None

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        selected = torch.unique(expert_ids).tolist()  # sorted ascending: each expert fetched once per call
        # the experts a store holds are computed while it reads the rest (`SlotCache`; the other
        # stores hand every expert in one batch)
        y = routed_experts(
            x,
            expert_ids,
            weights.float(),
            None,
            self.swiglu_limit,
            batch_invariant=self.batch_invariant,
            batches=self.store.stream(self.layer, selected, ahead=self._guess(x)),
        )
        self.last_fetch = FetchedExperts((), *self.store.last_counts)
        return y

    __call__ = forward

    def _guess(self, x: torch.Tensor) -> Optional[tuple]:
        """(next layer, the experts its router picks from this layer's input x [n, dim]), or None.
        One-token calls only (decode): a longer call's guess would name most of the next layer's
        experts and mostly read what its own call reads anyway, each once."""
        if self.next_gate is None or x.size(0) != 1 or not self.store.read_ahead:
            return None
        with torch.no_grad():
            guess = self.next_gate(x)[1]
        return self.layer + 1, torch.unique(guess).tolist()


class TrainableExperts(nn.ModuleList):
    """The routed half over float32 master weights, for training: `forward` as `RoutedExperts`'s,
    one expert at a time through `Linear.master_forward` (expert E's `E.w1` / `w2` / `w3`, under
    `ffn.experts`, named as the checkpoint names them, filled for each call by `dsv41.train.masters.holding`).
    Under the reference summation with qat its output equals the packed experts' bit for bit."""

    def __init__(self, cfg, layer: int):
        n_experts, _ = cfg.moe_shape(layer)
        limit = float(cfg.swiglu_limit)
        # each expert has the shared expert's form, stored FP4 (children "0".."E-1": checkpoint names)
        super().__init__(
            SharedExpert(cfg.dim, cfg.moe_inter_dim, limit, torch.float4_e2m1fn_x2) for _ in range(n_experts)
        )
        self.layer, self.n_experts = layer, n_experts
        self.last_fetch: Optional[FetchedExperts] = None  # nothing is fetched: the weights are in memory
        self.load: Optional[torch.Tensor] = None  # the last call's routed tokens per expert [E] (balancing)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [n, dim], expert_ids / weights [n, k] -> float32 [n, dim]."""
        topk = expert_ids.size(-1)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        order = expert_ids.flatten().argsort(stable=True)  # [n * k]: picks grouped by expert, token order kept
        self.load = torch.bincount(expert_ids.flatten(), minlength=self.n_experts)
        start = 0
        for expert, count in zip(self, self.load.tolist()):
            picks = order[start : start + count]
            start += count
            if not count:
                continue
            rows, slot = picks // topk, picks % topk
            y = y.index_add(0, rows, expert(x[rows], weights[rows, slot].unsqueeze(-1)).float())
        return y


class Gate(nn.Module):
    """The router `ffn.gate`: bf16 weight [E, dim], float32 selection bias [E], and (with a vision
    tower) `bias_vl` [E], the selection bias of image-span tokens. Text never applies bias_vl."""

    def __init__(self, cfg, n_experts: int, topk: int, dtype=torch.bfloat16, *, numerics: Numerics = Numerics()):
        super().__init__()
        self.topk, self.score_func = topk, cfg.score_func
        self.pad_f32_rows = numerics.pad_f32_rows
        self.norm_topk_prob = cfg.norm_topk_prob
        self.route_scale = float(cfg.route_scale)
        self.weight = param(torch.zeros(n_experts, cfg.dim, dtype=dtype))
        self.bias = param(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = param(torch.zeros(n_experts, dtype=torch.float32)) if cfg.vision_n_layers else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, dim] -> the router logits [n, E] float32, before the score function."""
        return f32_linear(x, self.weight, pad_f32_rows=self.pad_f32_rows)

    def affinities(self, logits: torch.Tensor) -> torch.Tensor:
        """Router logits [n, E] -> the unbiased affinities [n, E] float32, through the score function."""
        return rowwise(lambda rows: expert_scores(rows, self.score_func), logits, pad_f32_rows=self.pad_f32_rows)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, dim] -> the unbiased affinities [n, E] float32 the routing chooses from."""
        return self.affinities(self.logits(x))

    def forward(self, x: torch.Tensor, image_mask: Optional[torch.Tensor] = None):
        """x [n, dim] -> (weights [n, k] float32, ids [n, k]); image_mask [n] bool selects bias_vl."""
        return route(self.scores(x), self.selection_bias(image_mask), self.topk, self.norm_topk_prob, self.route_scale)

    def selection_bias(self, image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The bias the top-k chooses with: `bias` [E], or per token [n, E] bias_vl inside image spans."""
        if image_mask is not None and self.bias_vl is not None:
            return torch.where(image_mask.unsqueeze(-1), self.bias_vl, self.bias)
        return self.bias


class SharedExpert(nn.Module):
    """The always-on expert `ffn.shared_experts`: FP8 w1 (gate) / w3 (up) / w2 (down)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float, dtype=torch.float8_e4m3fn):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype)
        self.w2 = Linear(inter_dim, dim, dtype)
        self.w3 = Linear(dim, inter_dim, dtype)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, route_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [n, dim] -> [n, dim]; route_weight [n, 1] (a routed expert's, `TrainableExperts`)
        scales the activation before the down projection."""
        h = clamped_swiglu(self.w1(x), self.w3(x), self.swiglu_limit)
        if route_weight is not None:
            h = route_weight * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    """Routed experts (top-k of E, through `experts`) plus the shared expert, summed in float32.

    Sites (`hooks`): `gate` ((weights, ids) as routed, with the router's input x [n, dim], the
    image mask and the gate in the context), `routed` and `shared` (around each half, their float32
    outputs), and the layer's own (`layers.N.ffn`: its output, with the routing in the context:
    ids, weights, the input, the image mask, the gate and the experts). Each takes a replacement:
    the experts computed are the ids and weights the gate site lets through."""

    SITES = REPLACEABLE = ("", "gate", "routed", "shared")
    named_sites = NO_SITES

    def __init__(self, cfg, layer: int, *, numerics: Numerics = Numerics()):
        super().__init__()
        n_experts, topk = cfg.moe_shape(layer)
        self.layer, self.dim, self.numerics = layer, cfg.dim, numerics
        self.swiglu_limit = float(cfg.swiglu_limit)
        self.gate = Gate(cfg, n_experts, topk, numerics=numerics)
        self.shared_experts = SharedExpert(cfg.dim, cfg.moe_inter_dim, self.swiglu_limit, linear_dtype(cfg))
        self.experts: Optional[RoutedExperts] = None  # see attach_store (not a parameter)
        self.shared_forward = None  # see attach_store: None runs shared_experts

    def attach_store(self, store: ExpertStore, routed=None, shared=None) -> None:
        """Read this layer's routed experts from `store`. Under pad_f32_rows they run
        batch-invariant: the padding's purpose, one arithmetic for any row count, extends to them.
        `routed` builds the routed half instead of `RoutedExperts`, with its constructor's
        arguments (the expert-parallel group's `distributed.ExpertParallelExperts`); `shared`, a
        function [n, dim] -> [n, dim], computes the shared expert instead of `shared_experts` (a
        benchmark's other form of it)."""
        self.experts = (routed or RoutedExperts)(
            self.layer, store, self.swiglu_limit, batch_invariant=self.numerics.pad_f32_rows
        )
        self.shared_forward = shared

    def forward(self, x: torch.Tensor, image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.experts is None:
            raise RuntimeError(f"layer {self.layer}: no routed experts attached (load the model with dsv41.load)")
        shape = x.shape
        flat = x.reshape(-1, self.dim)  # [n, dim]
        flat_mask = None if image_mask is None else image_mask.reshape(-1)  # [n]
        weights, ids = self.gate(flat, flat_mask)
        gate_site = site(self, "gate")
        if gate_site:
            weights, ids = gate_site.exit((weights, ids), {"x": flat, "image_mask": flat_mask, "gate": self.gate})
        routed, shared = site(self, "routed"), site(self, "shared")
        y = (
            routed.around(self.experts.forward, flat, ids, weights)
            if routed
            else self.experts.forward(flat, ids, weights)
        )  # [n, dim] float32
        shared_forward = self.shared_forward or self.shared_experts
        y = y + (shared.around(shared_forward, flat) if shared else shared_forward(flat))
        out = y.to(x.dtype).reshape(shape)
        own = site(self, "")
        if own:
            out = own.exit(
                out,
                {
                    "ids": ids,
                    "weights": weights,
                    "x": x,
                    "image_mask": image_mask,
                    "gate": self.gate,
                    "experts": self.experts,
                },
            )
        return out
