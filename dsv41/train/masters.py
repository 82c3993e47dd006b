"""Training through the model itself: float32 master weights held in the modules' parameter slots
for a call, and what a training step reads at the model's named sites.

The trainer keeps one float32 master per checkpoint tensor (`params`, named as the checkpoint names
them, logical shapes). `trainable_model` builds the inference `Model` with the routed experts and
the Engram tables as modules of master weights (`moe.TrainableExperts`, `stores.MasterEngramTable`)
and the draft stack attached; `holding(model, weights)` puts a dict of weights into the parameter
slots for a block, as `torch.func.functional_call` does for one module, but across the backbone and
the draft stack, which share the embedding and the head. `forward` runs the backbone over a whole
sequence from position 0 with a runtime that keeps no cache (`AttentionRuntime(cache=False)`), so
training, evaluation and inference run one forward: under `Numerics()` with `set_qat(model, True)`
and the master weights on their storage grid (`weights(..., qat=True)`) its logits are the loaded
checkpoint's bit for bit; training builds the model with `Numerics(summation="fast")`.

Beside the logits a step needs: each index source's KL divergence from the attention it predicts
(read at the `attn.topk` sites: the indexer's inputs there are detached, as DeepSeek trains its
sparse-attention indexer, so the language-model loss does not reach it), the routed tokens per
expert (each `TrainableExperts.load`, for the bias balancing) and the draft stack's main hidden
state (the backbone's `main_hidden`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from ..checkpoint.formats import (
    dequantize_fp4,
    dequantize_fp8_blocks,
    infer_fp8_block,
    quantize_fp4,
    quantize_fp8_blocks,
)
from ..checkpoint.inventory import expected_tensors
from ..checkpoint.stores import MasterEngramTable
from ..core.config import Config
from ..core.numerics import Numerics
from ..model.attention import AttentionRuntime, attention_target
from ..model.dspark import DraftStack
from ..model.layers import Linear, straight_through
from ..model.model import Model
from ..model.moe import TrainableExperts

# What the trainer leaves at its initial values: the vision tower stays random (it must only load).
UNTRAINED_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")


# ---------------------------------------------------------------------- weights
def trainable_names(names, prefix: str = "", exclude: tuple = ()) -> list[str]:
    """Of `names`, those the optimizer updates: under `prefix`, neither untrained nor a routing
    bias (the balancing sets those) nor under one of `exclude`."""
    return [
        n
        for n in names
        if n.startswith(prefix)
        and not n.startswith(UNTRAINED_PREFIXES + exclude)
        and not n.endswith(("gate.bias", "gate.bias_vl"))
    ]


def logical_shape(spec) -> tuple[int, ...]:
    """A stored tensor's unquantized shape (packed FP4 holds two values a byte)."""
    return (spec.shape[0], spec.shape[1] * 2) if spec.dtype == "I8" else tuple(spec.shape)


def weight_specs(cfg: Config) -> dict:
    """name -> (TensorSpec, its scale's TensorSpec or None) for every value tensor of the checkpoint."""
    specs = expected_tensors(cfg)
    by_name = {s.name: s for s in specs}
    out = {}
    for spec in specs:
        if spec.dtype == "F8_E8M0":
            continue
        scale = by_name.get(spec.name[: -len("weight")] + "scale") if spec.name.endswith(".weight") else None
        out[spec.name] = (spec, scale)
    return out


def round_to_storage(value: torch.Tensor, spec, scale_spec) -> torch.Tensor:
    """value (float32, logical shape) as the checkpoint stores it, decoded back to float32."""
    with torch.no_grad():
        v = value.detach().float()
        if spec.dtype == "F8_E4M3":
            block = infer_fp8_block(spec.shape, scale_spec.shape)
            codes, scale = quantize_fp8_blocks(v, block)
            return dequantize_fp8_blocks(codes, scale, block, torch.float32)
        if spec.dtype == "I8":
            packed, scale = quantize_fp4(v)
            return dequantize_fp4(packed, scale, dtype=torch.float32)
        if spec.dtype in ("BF16", "F16"):
            return v.to(torch.bfloat16 if spec.dtype == "BF16" else torch.float16).float()
        return v


def weights(params: dict[str, torch.Tensor], specs: dict, qat: bool) -> dict[str, torch.Tensor]:
    """What a forward reads: the master weights, or (qat) each on its storage grid with the
    master's gradient."""
    if not qat:
        return params
    return {name: straight_through(value, round_to_storage(value, *specs[name])) for name, value in params.items()}


def initialized_params(cfg: Config, seed: int) -> dict[str, torch.Tensor]:
    """Weights drawn as the embedded random checkpoint draws them (`tiny._values`), float32."""
    from ..checkpoint.tiny import _values

    return {name: _values(seed, name, logical_shape(spec)).float() for name, (spec, _) in weight_specs(cfg).items()}


def checkpoint_params(path: str) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint in the release format, decoded to float32."""
    from ..checkpoint.checkpoint import Checkpoint
    from ..checkpoint.formats import dequantize
    from ..core.config import load_config

    ckpt = Checkpoint(path)
    return {
        name: dequantize(ckpt.read(name), ckpt.read(scale.name) if scale is not None else None).float()
        for name, (_spec, scale) in weight_specs(load_config(path)).items()
    }


# ---------------------------------------------------------------------- the model over masters
def trainable_model(cfg: Config, *, numerics: Numerics, batch: int, seq_len: int, split=None) -> Model:
    """The inference `Model` of `cfg` for whole sequences of `seq_len` tokens, its routed experts
    and Engram tables modules of master weights, the draft stack attached when the config has one;
    `split`: a compiled `hc_split_sinkhorn` for its blocks (the same arithmetic, faster)."""
    model = Model(cfg, numerics=numerics, max_batch_size=batch, max_seq_len=seq_len)
    c = model.backbone.cfg
    blocks = list(model.backbone.layers)
    if c.n_mtp_layers and c.dspark_block_size and c.dspark_target_layer_ids:
        stack = DraftStack(
            cfg, model.backbone.embed, model.backbone.head, numerics=numerics, max_batch_size=batch, max_seq_len=seq_len
        )
        model.attach_draft(stack)
        blocks += list(stack.mtp)
    specs = weight_specs(cfg)
    for block in blocks:
        block.ffn.experts = TrainableExperts(c, block.layer)
        if block.engram is not None:
            block.engram.embed = MasterEngramTable(*specs[f"layers.{block.layer}.engram.embed.weight"][0].shape)
        if split is not None:
            block.hc_split = split
    for linear in _linears(model):
        linear.fast = numerics.summation == "fast"
    return model


def set_qat(model: Model, on: bool) -> None:
    """The quantization-aware phase on or off: the activations entering FP8 / FP4 linears quantized
    to FP8 per 32, as the inference linears quantize them (the weights' rounding is `weights`')."""
    for linear in _linears(model):
        linear.qat = on


def _linears(model: Model) -> Iterator[Linear]:
    for root in _roots(model):
        yield from (m for m in root.modules() if isinstance(m, Linear))


def _roots(model: Model) -> list:
    return [model.backbone] + ([model.draft_stack] if model.draft_stack is not None else [])


@contextmanager
def holding(model: Model, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """The model's parameters named in `values` (checkpoint names: `mtp.*` in the draft stack, the
    rest in the backbone) replaced by those tensors for the block, then put back."""
    swapped = []
    try:
        for name, value in values.items():
            root = model.draft_stack if name.startswith("mtp.") else model.backbone
            owner_name, _, attr = name.rpartition(".")
            try:
                owner = root.get_submodule(owner_name)
            except AttributeError:
                raise KeyError(f"the model has no parameter {name!r}") from None
            if attr not in owner._parameters:
                raise KeyError(f"the model has no parameter {name!r}")
            swapped.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = value  # a plain tensor in the slot: read as the parameter
        yield
    finally:
        for owner, attr, old in reversed(swapped):
            owner._parameters[attr] = old


# ---------------------------------------------------------------------- one forward
@dataclass
class Forward:
    logits: torch.Tensor  # float32 [b, s, vocab]
    index_kl: dict[int, torch.Tensor] = field(default_factory=dict)  # index source layer -> mean KL
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> routed tokens per expert [E]
    main_hidden: Optional[torch.Tensor] = None  # [b, s, dim * n_targets], with a draft stack


def forward(model: Model, ids: torch.Tensor, hash_ids: Optional[torch.Tensor], *, index_loss: bool = True) -> Forward:
    """ids int64 [b, s] from position 0, hash_ids [b, s, n_engram_layers, n_hash_cols] (the model's
    n-gram hasher), the weights `holding` put in place -> Forward. The backbone's own forward, with
    a runtime that keeps no cache; index_loss: each index source's KL read at its `attn.topk` site."""
    out = Forward(logits=None)
    observers = {"layers.*.attn.topk": _IndexLoss(out.index_kl)} if index_loss else {}
    with model.backbone.site_registry.hooks(observers, strict=False):
        out.logits = model.backbone(ids, 0, AttentionRuntime(cache=False), hash_ids, all_positions=True)
    out.main_hidden = model.backbone.main_hidden
    out.expert_load = {block.layer: block.ffn.experts.load for block in model.backbone.layers}
    return out


class _IndexLoss:
    """At an index source's `attn.topk` site: the KL divergence of its indexer's distribution over
    the reachable compressed positions from the attention's own (heads averaged), its inputs cut
    from the model's graph (the indexer learns from this loss only)."""

    def __init__(self, into: dict):
        self.into = into

    def __call__(self, name: str, value: torch.Tensor, context: dict) -> None:
        attention = context["attention"]
        indexer = attention.indexer
        if indexer is None:  # a Reuse layer selects nothing of its own
            return
        x, qr = context["x"].detach(), context["qr"].detach()
        seqlen, ratio = x.size(1), attention.ratio
        width = seqlen // ratio
        if not width:
            return
        keys = context["index_keys"].read(x.size(0), width).detach()
        target = attention_target(
            context["q"].detach(), context["compressed_kv"].read(x.size(0), width).detach(), ratio
        )
        score, reachable = indexer.scores(x, qr, keys, 0, attention.freqs_cis)  # [b, s, T]
        unreachable = torch.arange(width, device=x.device) >= reachable.unsqueeze(-1)
        log_q = score.float().masked_fill(unreachable, -1e9).log_softmax(dim=-1)
        kl = (target * (target.clamp_min(1e-12).log() - log_q)).sum(-1)  # [b, s]
        self.into[attention.layer] = kl[:, reachable > 0].mean()
