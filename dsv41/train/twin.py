"""A differentiable forward of the V4.1 architecture for training: the same arithmetic as the
inference `Model` on a whole sequence from position 0, over float32 master weights named as the
checkpoint names them.

Why a twin and not the inference modules with a training switch: those hold quantized storage
(packed FP4 experts behind a store, FP8 linears through native kernels), write caches in place and
rotate in place, none of which autograd can run through. What the twin shares with them is every
piece of arithmetic that is a pure function (`model.hc_mixes` / `hc_pre` / `hc_post` /
`engram_gate`, `moe.expert_scores` / `route`, `attention.window_rows`, the candidate blocks and
`select_positions`, `kernels.sparse_attn`, `clamped_swiglu`, the cache encodings' quantizers), so
one definition holds for both. Its exact mode (`exact=True`, with `qat=True`) runs the quantized
linears through the op layer's own `linear` on the stored bytes and every bf16 product in bf16, so
its logits equal the loaded release checkpoint's bit for bit (`tests/test_train.py`, at every
native kernel level); it is for evaluation, not gradients. The fast mode trains: float32 products,
batched hyper-connection sums, a masked dense form of the sparse attention, rounded where
inference rounds (bf16 between sublayers) with straight-through gradients.

Quantization: the caches' grids (FP8 window rows, FP4 compressed rows and index keys, FP4 index
queries) are always applied, as inference applies them, with a straight-through gradient. With
`qat=True` the weights are also rounded to their storage formats (FP8 32x32 blocks, FP4 E2M1 with
E8M0 per 32, BF16) and the activations entering FP8/FP4 linears to FP8 per 32, as the inference
linears quantize them: the quantization-aware phase.

Beside the logits a forward returns what training needs: each index source's KL divergence from
the attention it predicts (the indexer's loss; its inputs are detached, as DeepSeek trains its
sparse-attention indexer, so the language-model loss does not reach it), the routed tokens per
expert (for the bias balancing) and the DSpark target layers' main hidden state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..attention import select_candidate_blocks, window_rows
from ..attention.caches import COMPRESSED_ENCODING, INDEX_FP4_BLOCK, INDEX_KEY_ENCODING, WINDOW_ENCODING
from ..attention.indexer import select_positions
from ..formats import dequantize_fp4, dequantize_fp8_blocks, infer_fp8_block, quantize_fp4, quantize_fp8_blocks
from ..inventory import expected_tensors
from ..kernels import act_quant, fp4_act_quant, hc_split_sinkhorn, sparse_attn
from ..kernels import linear as kernel_linear
from ..kernels.experts import clamped_swiglu
from ..layers import precompute_freqs_cis
from ..model import engram_gate, hc_mixes, hc_post, hc_pre, identity_pre
from ..moe import expert_scores, route

# Stored dtypes whose linears quantize their input to FP8 first (the op layer's `linear`).
QUANTIZED_STORAGE = ("F8_E4M3", "I8")
# What the trainer leaves at its initial values: the vision tower stays random (it must only load).
UNTRAINED_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded`'s values with x's gradient."""
    return x + (rounded - x).detach()


def on_grid(x: torch.Tensor, encoding) -> torch.Tensor:
    """x rounded to a cache encoding's grid (the values inference stores), gradient straight through."""
    return straight_through(x, encoding.fake_quantize_(x.detach().float().clone()))


def fp8_activation(x: torch.Tensor) -> torch.Tensor:
    return straight_through(x, act_quant(x.detach().float().clone(), 32, "ue8m0", torch.float8_e8m0fnu, inplace=True))


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 where inference holds the value in bf16 (the cast passes its gradient)."""
    return x.to(torch.bfloat16).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return bf16(weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)))


def hc_pre_fast(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`model.hc_pre` as one batched product (the four-term sums in another order)."""
    return torch.einsum("bsi,bsid->bsd", pre, x.float())


def hc_post_fast(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`model.hc_post` as one batched product."""
    return post.unsqueeze(-1) * out.float().unsqueeze(-2) + torch.einsum("bsij,bsid->bsjd", comb, residual.float())


def masked_attention(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idxs: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """`kernels.sparse_attn` as one dense product under a mask built from idxs (the rows each query
    reads): the same softmax with its sink and bf16-rounded weights, summed in another order.
    q [b, m, h, d], kv [b, n, d], idxs [b, m, k] (-1 absent) -> float32 [b, m, h, d]."""
    bsz, m, _, _ = q.shape
    n = kv.size(1)
    present = torch.zeros(bsz, m, n + 1, dtype=torch.bool, device=q.device)
    present.scatter_(-1, torch.where(idxs >= 0, idxs, n).long(), True)  # column n catches the absent
    present = present[..., :n].unsqueeze(2)  # [b, m, 1, n]
    scores = torch.einsum("bmhd,bnd->bmhn", q.float(), kv.float()) * softmax_scale
    scores = scores.masked_fill(~present, -torch.inf)
    top = scores.amax(dim=-1, keepdim=True).detach()  # [b, m, h, 1]
    probs = torch.exp(scores - top)
    denom = probs.sum(dim=-1) + torch.exp(attn_sink.float().view(1, 1, -1) - top.squeeze(-1))
    out = torch.einsum("bmhn,bnd->bmhd", bf16(probs), kv.float())
    return out / denom.unsqueeze(-1)


def rotate(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """`layers.apply_rotary_emb` without writing in place: x [b, s, (h,) d], its last rope_dim
    channels rotated as interleaved pairs by freqs [s, rope_dim / 2] (or [b, s, rope_dim / 2])."""
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
    rot = freqs.conj() if inverse else freqs
    rows = rot.size(0) if rot.dim() == 3 else 1  # freqs [b, s, rope_dim / 2]: each row its own positions
    rot = rot.view(rows, x.size(1), *([1] * (x.dim() - 3)), rope_dim // 2)
    return bf16(torch.cat([head.float(), torch.view_as_real(pairs * rot).flatten(-2)], dim=-1))


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


def weight_specs(cfg) -> dict:
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


# ---------------------------------------------------------------------- outputs
@dataclass
class TwinOutput:
    logits: torch.Tensor  # float32 [b, s, vocab]
    index_kl: dict[int, torch.Tensor] = field(default_factory=dict)  # index source layer -> mean KL
    expert_load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> routed tokens per expert [E]
    main_hidden: Optional[torch.Tensor] = None  # [b, s, dim * n_targets]
    selected: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> compressed positions [b, s, k]
    # index source layer -> what its heads attend to among the compressed positions, heads
    # averaged [b, s, T] (the indexer's distillation target); filled when forward(keep_targets=True)
    attention_target: Optional[dict[int, torch.Tensor]] = None


@dataclass
class _Shared:
    """What one layer publishes to the later ones within a forward (the runtime's role)."""

    compress_kv: Optional[torch.Tensor] = None
    index_k: Optional[torch.Tensor] = None
    topk: Optional[torch.Tensor] = None
    candidates: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------- the twin
class Twin:
    """Float32 master weights `params` (name -> leaf tensor, logical shapes) of `cfg` and the
    forward over them. `params` holds every value tensor of the checkpoint, the vision tower's too."""

    def __init__(self, cfg, params: dict[str, torch.Tensor], *, exact: bool = True, split=None):
        from ..model import runtime_config

        self.cfg = runtime_config(cfg)
        self.specs = weight_specs(cfg)
        missing = sorted(set(self.specs) - set(params))
        if missing:
            raise ValueError(f"the twin needs {len(missing)} more tensors, e.g. {missing[0]}")
        self.params = params
        # exact: the hyper-connection sums, the attention and the bf16 products in the inference's
        # order (bit-equal logits); off, batched float32 products, which training prefers (several
        # times faster; float32 rounding apart)
        self.exact = exact
        self._stored: dict = {}  # name -> (value, stored weight, scale): see `stored`
        self.hc_pre, self.hc_post = (hc_pre, hc_post) if exact else (hc_pre_fast, hc_post_fast)
        self.attend = sparse_attn if exact else masked_attention
        self.split = split or hc_split_sinkhorn  # training passes a compiled one
        c = self.cfg
        self.window_freqs = precompute_freqs_cis(
            c.rope_head_dim, c.max_seq_len, 0, c.rope_theta, c.rope_factor, c.beta_fast, c.beta_slow
        )
        self.compressed_freqs = precompute_freqs_cis(
            c.rope_head_dim,
            c.max_seq_len,
            c.original_seq_len,
            c.compress_rope_theta,
            c.rope_factor,
            c.beta_fast,
            c.beta_slow,
        )

    @classmethod
    def initialized(cls, cfg, seed: int, **kw) -> "Twin":
        """Weights drawn as the embedded random checkpoint draws them (`tiny._values`), float32."""
        from ..tiny import _values

        params = {
            name: _values(seed, name, logical_shape(spec)).float() for name, (spec, _) in weight_specs(cfg).items()
        }
        return cls(cfg, params, **kw)

    @classmethod
    def from_checkpoint(cls, path: str) -> "Twin":
        """The weights of a checkpoint in the release format, decoded to float32."""
        from ..checkpoint import Checkpoint
        from ..config import load_config
        from ..formats import dequantize

        cfg = load_config(path)
        ckpt = Checkpoint(path)
        params = {}
        for name, (_spec, scale_spec) in weight_specs(cfg).items():
            value = ckpt.read(name)
            params[name] = dequantize(value, ckpt.read(scale_spec.name) if scale_spec is not None else None).float()
        return cls(cfg, params)

    def trainable(self, prefix: str = "", exclude: tuple = ()) -> list[str]:
        return trainable_names(self.params, prefix, exclude)

    def weights(self, qat: bool) -> dict[str, torch.Tensor]:
        """What a forward reads: the master weights, or (qat) each on its storage grid with the
        master's gradient."""
        if not qat:
            return self.params
        out = {}
        for name, value in self.params.items():
            spec, scale = self.specs[name]
            out[name] = (
                straight_through(value, round_to_storage(value, spec, scale))
                if value.requires_grad
                else round_to_storage(value, spec, scale)
            )
        return out

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        ids: torch.Tensor,
        hash_ids: Optional[torch.Tensor],
        *,
        qat: bool = False,
        index_loss: bool = True,
        want_main_hidden: bool = False,
        weights: Optional[dict] = None,
        keep_targets: bool = False,
    ) -> TwinOutput:
        """ids int64 [b, s] from position 0; hash_ids [b, s, n_engram_layers, n_hash_cols] (the
        model's n-gram hasher) -> TwinOutput (with keep_targets, its attention_target too)."""
        c = self.cfg
        W = weights if weights is not None else self.weights(qat)
        bsz, seqlen = ids.shape
        out = TwinOutput(logits=None, attention_target={} if keep_targets else None)
        h = bf16(W["embed.weight"][ids])  # [b, s, dim], read as stored (bf16)
        h = h.unsqueeze(2).expand(bsz, seqlen, c.hc_mult, c.dim)  # [b, s, hc, dim]
        pre = identity_pre(bsz, seqlen, c.hc_mult, h.device)
        shared = _Shared()
        hidden = []
        targets = set(c.dspark_target_layer_ids or ())
        for layer in range(c.n_layers):
            p = f"layers.{layer}."
            if layer in c.engram_layer_ids:
                cols = hash_ids[:, :, c.engram_layer_ids.index(layer)]
                h = self.engram(W, layer, h, cols, qat)
            if want_main_hidden and layer in targets:
                hidden.append(h.mean(dim=2))
            h, pre = self.block_sites(
                W,
                p,
                h,
                pre,
                qat,
                lambda a: self.attention(W, layer, a, shared, qat, out, index_loss),
                lambda f: self.moe(W, p + "ffn.", f, qat, out, layer),
            )
        h = rms_norm(bf16(self.hc_pre(h, pre)), W["norm.weight"], c.norm_eps)
        out.logits = F.linear(h, W["head.weight"])
        if hidden:
            out.main_hidden = torch.cat(hidden, dim=-1)
        return out

    def block_sites(self, W, p: str, h, pre, qat: bool, attend, ffn):
        """`Block.sites`: the attention site and the FFN site, each between a collapse and an
        expansion -> (h, the next block's pre)."""
        c = self.cfg
        residual = h
        attn_pre, post, comb = hc_mixes(
            h,
            W[p + "hc_attn_fn"],
            W[p + "hc_attn_scale"],
            W[p + "hc_attn_base"],
            c.hc_mult,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.norm_eps,
            pad_f32_rows=False,
            split=self.split,
        )
        a = attend(rms_norm(bf16(self.hc_pre(h, pre)), W[p + "attn_norm.weight"], c.norm_eps))
        h = bf16(self.hc_post(a, residual, post, comb))
        residual = h
        ffn_pre, post, comb = hc_mixes(
            h,
            W[p + "hc_ffn_fn"],
            W[p + "hc_ffn_scale"],
            W[p + "hc_ffn_base"],
            c.hc_mult,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.norm_eps,
            pad_f32_rows=False,
            split=self.split,
        )
        f = ffn(rms_norm(bf16(self.hc_pre(h, attn_pre)), W[p + "ffn_norm.weight"], c.norm_eps))
        return bf16(self.hc_post(f, residual, post, comb)), ffn_pre

    def linear(self, W, name: str, x: torch.Tensor, qat: bool) -> torch.Tensor:
        """A `layers.Linear` (not the float32 projections): FP8 input for quantized weights (qat),
        output in bf16."""
        if self.specs[name][0].dtype in QUANTIZED_STORAGE:
            if self.exact and qat:  # the op layer's own quantized product, on the stored bytes
                return kernel_linear(x.to(torch.bfloat16), *self.stored(name, W[name])).float()
            return bf16(F.linear(fp8_activation(x) if qat else x.float(), W[name]))
        return self.bf16_product(F.linear, x, W[name])

    def stored(self, name: str, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scale) of `value` as the checkpoint stores it, kept while `value` is the same tensor."""
        held = self._stored.get(name)
        if held is None or held[0] is not value:
            spec, scale_spec = self.specs[name]
            with torch.no_grad():
                if spec.dtype == "I8":
                    packed, scale = quantize_fp4(value.detach().float())
                    held = (value, packed.view(torch.float4_e2m1fn_x2), scale)
                else:
                    held = (
                        value,
                        *quantize_fp8_blocks(value.detach().float(), infer_fp8_block(spec.shape, scale_spec.shape)),
                    )
            self._stored[name] = held
        return held[1], held[2]

    def bf16_product(self, product, x, w, *args):
        """A product inference runs in bf16 (bf16 linears, the grouped output projection): exact,
        through the same bf16 kernel, whose float32 accumulation order depends on the row count;
        else in float32, rounded to bf16 after."""
        if self.exact:
            return product(*args, x.to(torch.bfloat16), w.to(torch.bfloat16)).float()
        return bf16(product(*args, x.float(), w))

    # ------------------------------------------------------------------ Engram
    def engram(self, W, layer: int, h, hash_cols, qat: bool):
        c = self.cfg
        p = f"layers.{layer}.engram."
        rows = W[p + "embed.weight"][hash_cols.long()]  # [b, s, cols, engram_head_dim]
        kv = self.linear(W, p + "wkv.weight", rows.flatten(-2), qat)  # [b, s, (hc + 1) * dim]
        key, value = kv.split([c.hc_mult * c.dim, c.dim], dim=-1)
        key = key.unflatten(-1, (c.hc_mult, c.dim))  # [b, s, hc, dim]
        gate = engram_gate(h, key, W[p + "q_weight"] * W[p + "k_weight"], c.norm_eps)  # [b, s, hc]
        return bf16(h + gate.unsqueeze(-1) * value.unsqueeze(-2))

    # ------------------------------------------------------------------ attention
    def attention(self, W, layer: int, x, shared: _Shared, qat: bool, out: TwinOutput, index_loss: bool):
        c = self.cfg
        p = f"layers.{layer}.attn."
        bsz, seqlen, _ = x.shape
        ratio, rope = c.compress_ratios[layer], c.rope_head_dim
        table = self.compressed_freqs if ratio else self.window_freqs
        freqs = table[:seqlen]
        qr = rms_norm(self.linear(W, p + "wq_a.weight", x, qat), W[p + "q_norm.weight"], c.norm_eps)
        q = self.linear(W, p + "wq_b.weight", qr, qat).unflatten(-1, (c.n_heads, c.head_dim))
        q = rotate(q, freqs, rope)  # [b, s, heads, head_dim]
        kv = rms_norm(self.linear(W, p + "wkv.weight", x, qat), W[p + "kv_norm.weight"], c.norm_eps)
        kv = on_grid(rotate(kv, freqs, rope), WINDOW_ENCODING)  # [b, s, head_dim]
        idxs = window_rows(0, seqlen, c.window_size, "reference", x.device).int()
        idxs = idxs.unsqueeze(0).expand(bsz, seqlen, -1)  # [b, s, w]
        if ratio:
            mode = c.layer_mode(layer)
            n_groups = seqlen // ratio
            group_freqs = table[torch.arange(n_groups, device=x.device) * ratio]
            if mode == "full":
                latent = self.compressor(W, p + "compressor.", x, ratio)  # [b, groups, head_dim]
                if layer in c.kv_source_layers:
                    k = rms_norm(
                        self.linear(W, p + "indexer.wk.weight", latent, False),
                        W[p + "indexer.k_norm.weight"],
                        c.norm_eps,
                    )
                    shared.index_k = on_grid(rotate(k, group_freqs, rope), INDEX_KEY_ENCODING)
                shared.compress_kv = on_grid(rotate(latent, group_freqs, rope), COMPRESSED_ENCODING)
            if mode in ("full", "reindex"):
                shared.topk = self.indexer(W, layer, x, qr, q, shared, qat, out, index_loss)
            out.selected[layer] = shared.topk
            rows = torch.where(shared.topk >= 0, shared.topk + seqlen, -1)
            idxs = torch.cat([idxs, rows.to(idxs.dtype)], dim=-1)
            kv = torch.cat([kv, shared.compress_kv], dim=1)
        o = bf16(self.attend(q, kv, W[p + "attn_sink"], idxs, c.head_dim**-0.5))  # [b, s, heads, head_dim]
        o = rotate(o, freqs, rope, inverse=True).view(bsz, seqlen, c.o_groups, -1)
        wo_a = W[p + "wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
        o = self.bf16_product(torch.einsum, o, wo_a, "bsgd,grd->bsgr")  # [b, s, groups, o_lora_rank]
        return self.linear(W, p + "wo_b.weight", o.flatten(2), qat)

    def compressor(self, W, p: str, x, ratio: int):
        """`Compressor` on a whole sequence from position 0: the complete groups' latents, pre-RoPE."""
        c = self.cfg
        if ratio == 1:
            return rms_norm(self.linear(W, p + "wkv.weight", x, False), W[p + "norm.weight"], c.norm_eps)
        n_groups = x.size(1) // ratio
        kv = F.linear(x, W[p + "wkv.weight"])[:, : n_groups * ratio].unflatten(1, (n_groups, ratio))
        score = F.linear(x, W[p + "wgate.weight"])[:, : n_groups * ratio].unflatten(1, (n_groups, ratio))
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)  # [b, groups, head_dim]
        return rms_norm(bf16(pooled), W[p + "norm.weight"], c.norm_eps)

    def indexer(self, W, layer: int, x, qr, q, shared: _Shared, qat: bool, out: TwinOutput, index_loss: bool):
        """The compressed positions each query attends to [b, s, min(index_topk, T)] (`Indexer`),
        and, with index_loss, the KL divergence of the indexer's distribution over the reachable
        positions from the attention's own (heads averaged) into out.index_kl."""
        c = self.cfg
        p = f"layers.{layer}.attn.indexer."
        seqlen, ratio = x.size(1), c.compress_ratios[layer]
        width = seqlen // ratio
        freqs = self.compressed_freqs[:seqlen]
        # the indexer learns from its own loss only: its inputs are cut from the model's graph
        xd, qrd, keys = x.detach(), qr.detach(), shared.index_k.detach()[:, :width]
        qi = self.linear(W, p + "wq_b.weight", qrd, qat).unflatten(-1, (c.index_n_heads, c.index_head_dim))
        qi = fp4_on_grid(rotate(qi, freqs, c.rope_head_dim))  # [b, s, heads, index_head_dim]
        mix = bf16(
            self.linear(W, p + "weights_proj.weight", xd, False) * (c.index_head_dim**-0.5 * c.index_n_heads**-0.5)
        )
        reachable = (torch.arange(seqlen, device=x.device) + 1) // ratio  # [s]
        unreachable = torch.arange(width, device=x.device) >= reachable.unsqueeze(-1)  # [s, T]
        lens = reachable.unsqueeze(-1)

        with torch.no_grad():  # the selection, in the activation dtype as inference scores it
            act = torch.bfloat16
            s16 = torch.einsum("bshd,btd->bsht", qi.detach().to(act), keys.to(act))
            s16 = (s16.relu() * mix.detach().to(act).unsqueeze(-1)).sum(dim=2).masked_fill(unreachable, -torch.inf)
            if layer == c.candidate_source_layer:
                shared.candidates = select_candidate_blocks(s16, lens, c.candidate_topk_blocks, c.candidate_block_size)
            elif 0 <= c.candidate_source_layer < layer:
                s16 = s16.masked_fill(~shared.candidates, -torch.inf)
            selected = select_positions(s16, lens, c.index_topk).int()

        if (index_loss or out.attention_target is not None) and width:
            with torch.no_grad():  # what the layer's heads attend to among the compressed positions
                logits = torch.einsum("bshd,btd->bsht", q.detach(), shared.compress_kv.detach()) * c.head_dim**-0.5
                target = logits.masked_fill(unreachable.unsqueeze(1), -torch.inf).softmax(dim=-1).nan_to_num(0.0)
                target = target.mean(dim=2)  # [b, s, T]
            if out.attention_target is not None:
                out.attention_target[layer] = target
        if index_loss and width:
            score = (torch.einsum("bshd,btd->bsht", qi, keys).relu() * mix.unsqueeze(-1)).sum(dim=2)  # [b, s, T]
            log_q = score.masked_fill(unreachable, -1e9).log_softmax(dim=-1)
            rows = reachable > 0
            kl = (target * (target.clamp_min(1e-12).log() - log_q)).sum(-1)  # [b, s]
            out.index_kl[layer] = kl[:, rows].mean()
        return selected

    # ------------------------------------------------------------------ mixture of experts
    def moe(self, W, p: str, x, qat: bool, out: TwinOutput, layer: int):
        c = self.cfg
        n_experts, topk = c.moe_shape(layer)
        shape = x.shape
        flat = x.reshape(-1, c.dim)  # [n, dim]
        scores = expert_scores(F.linear(flat, W[p + "gate.weight"]), c.score_func)
        weights, ids = route(scores, W[p + "gate.bias"].detach(), topk, c.norm_topk_prob, float(c.route_scale))
        out.expert_load[layer] = torch.bincount(ids.flatten(), minlength=n_experts)
        y = torch.zeros_like(flat)
        order = ids.flatten().argsort(stable=True)
        counts = out.expert_load[layer].tolist()
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            picks = order[start : start + count]
            start += count
            rows, slot = picks // topk, picks % topk
            h = self.expert(W, f"{p}experts.{e}.", flat[rows], qat, weights[rows, slot].unsqueeze(-1))
            y = y.index_add(0, rows, h)
        y = y + self.expert(W, p + "shared_experts.", flat, qat, None)
        return bf16(y).reshape(shape)

    def expert(self, W, p: str, x, qat: bool, route_weight: Optional[torch.Tensor]):
        """One SwiGLU expert; the routing weight scales the activation before the down projection."""
        h = clamped_swiglu(
            self.linear(W, p + "w1.weight", x, qat),
            self.linear(W, p + "w3.weight", x, qat),
            float(self.cfg.swiglu_limit),
        )
        if route_weight is not None:
            h = route_weight * h
        return self.linear(W, p + "w2.weight", bf16(h), qat)


def fp4_on_grid(x: torch.Tensor) -> torch.Tensor:
    """The indexer queries' FP4 rounding (E8M0 per INDEX_FP4_BLOCK), gradient straight through."""
    return straight_through(x, fp4_act_quant(x.detach().float().clone(), INDEX_FP4_BLOCK, inplace=True))


def total_parameters(params: dict, prefix: str = "") -> int:
    return sum(v.numel() for n, v in params.items() if n.startswith(prefix))


def bits_per_byte(nats: float, n_bytes: int) -> float:
    return nats / math.log(2) / n_bytes
