"""The model: `Model` is where a forward starts; below it the backbone of blocks (the mixture of
experts from `moe.py`, hyper-connections, the Engram consumer, CSA2 attention from the `attention`
package) and the head. What a forward overwrote, rollback and snapshots are `sequence.py`'s.

`Model(cfg, tokenizer=..., hasher=...)` holds the backbone, the attention runtime, the n-gram
hasher and the sequence position; `model(ids, start_pos)` runs a forward, `encode` / `decode` turn
text into ids and back. A Model is built empty: `loader.load` fills its parameters by name and
attaches the routed-expert store and the Engram tables (`attach`); generation is the free
functions of `generate.py`, which take the model (`generate(model, prompt)`).

A block carries its residual stream as `hc_mult` parallel copies. Each of its two sites (attention,
then the FFN) collapses the copies into one input with a `pre` weighting, runs the sublayer, and
expands back with `post` and a doubly stochastic `comb` mix of the old copies. The three
coefficient sets come from one projection of the site's own input (`hc_mixes`), but the `pre` a
site computes is used one site later: the attention collapse uses the `pre` the previous block's
FFN site produced, the FFN collapse uses the one this block's attention site produced, and the
last block's FFN `pre` collapses the stream before the final norm. There is no separate head mix.

Dtypes follow the released runtime: activations bf16 between sublayers, every mix, norm statistic,
router score and the head in float32. Quantized linears quantize their input to FP8 first (the op
layer's `linear`). Routed experts stay packed FP4 and are computed straight from the packed bytes
(the fused path of `kernels.experts`) by a `RoutedExperts` object that a store (the loader's
expert cache, or a dict in tests) feeds; Engram tables likewise stay wherever the store keeps them
and are read a row at a time.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.formats import dequantize_engram_rows
from ..checkpoint.stores import EngramTable, ExpertStore
from ..core.config import Config
from ..core.numerics import Numerics
from ..core.text import is_whole
from ..kernels import hc_split_sinkhorn
from . import sequence
from .attention import Attention, AttentionRuntime, CacheBytes, cache_bytes, check_cache_format
from .hooks import NO_SITES, ReentrantCallError, name_sites, site
from .layers import Linear, RMSNorm, activation_dtype, f32_linear, linear_dtype, param, rowwise
from .moe import MoE
from .token_ids import as_token_ids
from .trace import Trace
from .vision import IMAGE_END, IMAGE_NEWLINE, IMAGE_START, Aligner, Prompt, ViT, encode_image, write_spans
from .vision import prepare as prepare_prompt

# Floor on |dot| before the Engram gate's signed square root.
ENGRAM_GATE_FLOOR = 1e-6


# calls and resets write the caches in place, as rollbacks and restores do: one grad-mode rule for
# all of them (see `sequence.any_grad_mode`)
_any_grad_mode = sequence.any_grad_mode


def runtime_config(cfg: Config) -> Config:
    """`cfg` as the forward's modules read it: every value of its verified view
    (`Config.verified()`: the defaults applied where the file is silent, ConfigError when a field a
    model needs is unset), kept in a Config so that its derived facts (`layer_mode`, `moe_shape`)
    stay at hand. The modules below read fields as given, without defending against None."""
    verified = cfg.verified()
    return cfg.replace(**{f.name: getattr(verified, f.name) for f in dataclasses.fields(verified)})


# ---------------------------------------------------------------------- modules
class Engram(nn.Module):
    """Adds an n-gram lookup into the residual stream, gated per hyper-connection copy.

    The layer's hash ids pick one table row per column; `wkv` maps the concatenated rows to one
    key per copy plus one shared value. Each copy's gate is sigmoid(signed sqrt(d)) of d, the
    RMS-normalized dot product of the copy with its key (normalized per copy over dim), and the
    copy receives gate * value. Its site (`layers.N.engram`) spans the whole update; the exit sees
    the updated stream with the gates [b, s, hc] and the stream before it, x, in the context, and
    takes a replacement (the stream with another contribution, or x: none)."""

    SITES = REPLACEABLE = ("",)
    named_sites = NO_SITES

    def __init__(self, cfg: Config, layer: int, n_hash_cols: int):
        super().__init__()
        self.layer, self.dim, self.hc_mult, self.eps = layer, cfg.dim, cfg.hc_mult, cfg.norm_eps
        self.head_dim = cfg.engram_head_dim
        self.wkv = Linear(n_hash_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), linear_dtype(cfg))
        act = activation_dtype(cfg)
        self.q_weight = param(torch.ones(cfg.hc_mult, cfg.dim, dtype=act))
        self.k_weight = param(torch.ones(cfg.hc_mult, cfg.dim, dtype=act))
        # where the rows are read from (`stores.EngramTable`), attached by the loader; not a
        # parameter, named as the checkpoint names the table (training attaches float32 masters)
        self.embed: Optional[EngramTable] = None
        self.pad_f32_rows = False  # the block's Numerics.pad_f32_rows, set by the block

    def forward(
        self, x: torch.Tensor, hash_ids: torch.Tensor, token_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """x [b, s, hc, dim]; hash_ids [b, s, n_hash_cols]; token_mask [b, s] (False: no update)."""
        own = site(self, "")
        if own:
            own.enter()
        if self.embed is None:
            raise RuntimeError(f"layer {self.layer}: no Engram table attached (load the model with dsv41.load)")
        rows, scales = self.embed.gather(hash_ids.to(torch.long))  # [b, s, cols, D], [b, s, cols, D/32]
        scales = None if scales is None else scales.to(x.device)
        emb = dequantize_engram_rows(rows.to(x.device), scales, torch.bfloat16)  # [b, s, cols, D]
        kv = self.wkv(emb.flatten(-2))  # [b, s, (hc + 1) * dim] bf16
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.dim))  # [b, s, hc, dim]
        gate = engram_gate(
            x, key, self.q_weight.float() * self.k_weight.float(), self.eps, pad_f32_rows=self.pad_f32_rows
        )  # [b, s, hc]
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
        out = (x.float() + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)
        if own:
            out = own.exit(out, {"gate": gate, "x": x})
        return out


def engram_gate(
    x: torch.Tensor, key: torch.Tensor, weight: torch.Tensor, eps: float, *, pad_f32_rows: bool = False
) -> torch.Tensor:
    """x, key [b, s, hc, dim], weight [hc, dim] -> gate [b, s, hc] float32 (pad_f32_rows: the
    sigmoid over a token's hc values as layers.rowwise runs it)."""
    h = x.float()
    dim = h.size(-1)
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [b, s, hc]
    dot = (h * weight * key).sum(-1) * rstd * dim**-0.5
    return rowwise(
        torch.sigmoid, torch.copysign(dot.abs().clamp_min(ENGRAM_GATE_FLOOR).sqrt(), dot), pad_f32_rows=pad_f32_rows
    )


# ---------------------------------------------------------------------- hyper-connections
def hc_mixes(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    pad_f32_rows: bool,
    split=hc_split_sinkhorn,
):
    """x [b, s, hc, dim] -> float32 (pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc]).

    One projection of the whole flattened stream, RMS-normalized with one statistic per token
    (pad_f32_rows: see layers.f32_linear). `split`: hc_split_sinkhorn or a compiled form of it
    (training's)."""
    flat = x.flatten(2).float()  # [b, s, hc * dim]
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = f32_linear(flat, fn, pad_f32_rows=pad_f32_rows) * rstd  # [b, s, (2 + hc) * hc]
    # the split's sigmoids and exps see a token's few values (see layers.rowwise)
    return rowwise(lambda rows: split(rows, scale, base, hc_mult, iters, hc_eps), mixes, pad_f32_rows=pad_f32_rows)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse [b, s, hc, dim] to [b, s, dim]: sum_i pre_i * x_i in float32, back in x's dtype."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a sublayer output [b, s, dim] back to copies: y_j = post_j * out + sum_i comb_ij * residual_i."""
    mixed = (comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(dim=2)  # [b, s, hc(j), dim]
    return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).to(out.dtype)


def hc_pre_fast(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`hc_pre` as one batched float32 product (Numerics(summation="fast"): the four-term sums in another order)."""
    return torch.einsum("bsi,bsid->bsd", pre, x.float()).to(x.dtype)


def hc_post_fast(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`hc_post` as one batched float32 product."""
    mixed = torch.einsum("bsij,bsid->bsjd", comb, residual.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(out.dtype)


def identity_pre(batch: int, seq: int, hc_mult: int, device=None) -> torch.Tensor:
    """The first block's collapse weights: copy 0 only (all copies are equal at the embedding)."""
    pre = torch.zeros(batch, seq, hc_mult, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0
    return pre


# ---------------------------------------------------------------------- the stack
class Block(nn.Module):
    """Engram (at its layers), then attention and the MoE, each between a hyper-connection
    collapse and expansion. Parameter names are the checkpoint's (`layers.N.` + name).

    Sites: `resid_pre` (the stream [b, s, hc, dim] after Engram: what the attention site reads and
    a draft stack is fed), `resid_mid` (after the attention site's expansion) and `resid_post`
    (after the FFN site's); `hc_attn` and `hc_ffn`, the float32 mixes (pre, post, comb) each
    site computes (its post and comb expand that site, its pre collapses the next one); attention's
    own are `layers.N.attn` and below (`attention.Attention`). All of them take replacements."""

    SITES = REPLACEABLE = ("resid_pre", "resid_mid", "resid_post", "hc_attn", "hc_ffn")
    named_sites = NO_SITES

    attention_type = Attention  # a draft stage's block attends another way (dspark.DraftAttention)

    def __init__(
        self,
        cfg: Config,
        layer: int,
        *,
        numerics: Numerics = Numerics(),
        max_batch_size: int = 1,
        max_seq_len: int = 4096,
        cache_format: str = "packed",
    ):
        super().__init__()
        self.layer, self.hc_mult = layer, cfg.hc_mult
        self.norm_eps, self.hc_eps, self.hc_iters = cfg.norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self.pad_f32_rows = numerics.pad_f32_rows
        self.collapse, self.expand = (hc_pre_fast, hc_post_fast) if numerics.summation == "fast" else (hc_pre, hc_post)
        self.hc_split = hc_split_sinkhorn  # the trainer may put a compiled one here (the same arithmetic)
        self.feeds_draft = False  # a DSpark target layer (set by Model.attach_draft)
        act = activation_dtype(cfg)
        self.attn = self.attention_type(
            cfg,
            layer,
            numerics=numerics,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            cache_format=cache_format,
        )
        self.ffn = MoE(cfg, layer, numerics=numerics)
        engram_layers = cfg.engram_layer_ids
        self.engram = None
        if layer in engram_layers:
            self.engram = Engram(cfg, layer, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads)
            self.engram.pad_f32_rows = self.pad_f32_rows
            self.engram_index = engram_layers.index(layer)  # its column block in the hash ids
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=act)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=act)
        mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        for branch in ("attn", "ffn"):
            setattr(self, f"hc_{branch}_fn", param(torch.zeros(mix, width, dtype=torch.float32)))
            setattr(self, f"hc_{branch}_base", param(torch.zeros(mix, dtype=torch.float32)))
            setattr(self, f"hc_{branch}_scale", param(torch.zeros(3, dtype=torch.float32)))

    def mixes(self, x: torch.Tensor, site: str):
        return hc_mixes(
            x,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_scale"),
            getattr(self, f"hc_{site}_base"),
            self.hc_mult,
            self.hc_iters,
            self.hc_eps,
            self.norm_eps,
            pad_f32_rows=self.pad_f32_rows,
            split=self.hc_split,
        )

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        pre: torch.Tensor,
        runtime: AttentionRuntime,
        hash_ids: Optional[torch.Tensor] = None,
        image_mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, hc, dim], pre [b, s, hc] (from the previous block) -> (x, the next block's pre).

        hash_ids [b, s, n_hash_cols] for an Engram layer; image_mask [b, s] True inside image spans
        (their routing uses bias_vl and they get no Engram update)."""
        if self.engram is not None:
            if hash_ids is None:
                raise ValueError(f"layer {self.layer} is an Engram layer and needs its hash ids")
            x = self.engram(x, hash_ids, None if image_mask is None else ~image_mask)
        resid_pre = site(self, "resid_pre")
        if resid_pre:
            x = resid_pre.exit(x)
        return self.sublayers(x, pre, lambda h: self.attn(h, start_pos, runtime), image_mask)

    def sublayers(
        self, x: torch.Tensor, pre: torch.Tensor, attend, image_mask: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention site (`attend`: [b, s, dim] -> [b, s, dim]) and the FFN site, each between a
        collapse and an expansion -> (x, the next block's pre)."""
        residual = x
        attn_pre, post, comb = self.mixes(x, "attn")
        hc_attn = site(self, "hc_attn")
        if hc_attn:
            attn_pre, post, comb = hc_attn.exit((attn_pre, post, comb))
        h = self.attn_norm(self.collapse(x, pre))  # [b, s, dim]
        h = attend(h)
        x = self.expand(h, residual, post, comb)  # [b, s, hc, dim]
        resid_mid = site(self, "resid_mid")
        if resid_mid:
            x = resid_mid.exit(x)

        residual = x
        ffn_pre, post, comb = self.mixes(x, "ffn")
        hc_ffn = site(self, "hc_ffn")
        if hc_ffn:
            ffn_pre, post, comb = hc_ffn.exit((ffn_pre, post, comb))
        h = self.ffn_norm(self.collapse(x, attn_pre))
        h = self.ffn(h, image_mask)
        x = self.expand(h, residual, post, comb)
        resid_post = site(self, "resid_post")
        if resid_post:
            x = resid_post.exit(x)
        return x, ffn_pre

    def reset_state(self) -> None:
        self.attn.reset_state()


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype=torch.bfloat16):
        super().__init__()
        self.dtype = dtype
        self.weight = param(torch.zeros(vocab_size, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> rows [b, s, dim] in the stored dtype (a float32 master's rows rounded to it)."""
        return F.embedding(ids, self.weight).to(self.dtype)


class Head(nn.Module):
    """The output projection, held in float32 (stored bf16) so the logits come out float32. Its
    site (`head`) spans the projection; the exit sees the logits and takes a replacement."""

    SITES = REPLACEABLE = ("",)
    named_sites = NO_SITES

    def __init__(self, vocab_size: int, dim: int, *, numerics: Numerics = Numerics()):
        super().__init__()
        self.pad_f32_rows = numerics.pad_f32_rows
        self.weight = param(torch.zeros(vocab_size, dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
        """x [b, s, dim] -> float32 [b, vocab] for the last position ([b, s, vocab] with all_positions)."""
        own = site(self, "")
        if own:
            own.enter()
        if not all_positions:
            x = x[:, -1]
        logits = f32_linear(x, self.weight, pad_f32_rows=self.pad_f32_rows)
        if own:
            logits = own.exit(logits)
        return logits


class Backbone(nn.Module):
    """Embedding, the blocks, the final collapse (with the last block's FFN pre), norm and head.

    Holds only dense parameters, named as in the checkpoint; routed experts and Engram tables are
    attached by `Model.attach`. `max_batch_size` and `max_seq_len` size the attention caches,
    `cache_format` says how they hold their values (`attention.QuantizedCache`); `numerics` reaches
    every layer that reads it. `site_registry` holds the named sites of everything under it
    (`hooks`); its own is `embed` (the embedding, image spans written; it takes a replacement)."""

    SITES = REPLACEABLE = ("embed",)
    named_sites = NO_SITES

    def __init__(
        self,
        cfg: Config,
        *,
        numerics: Numerics = Numerics(),
        max_batch_size: int = 1,
        max_seq_len: int = 4096,
        cache_format: str = "packed",
    ):
        super().__init__()
        self.cfg, self.hc_mult, self.numerics = cfg, cfg.hc_mult, numerics
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.cache_format = check_cache_format(cache_format)
        self.embed = Embedding(cfg.vocab_size, cfg.dim, activation_dtype(cfg))
        self.layers = nn.ModuleList(
            Block(
                cfg,
                i,
                numerics=numerics,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                cache_format=cache_format,
            )
            for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=activation_dtype(cfg))
        self.head = Head(cfg.vocab_size, cfg.dim, numerics=numerics)
        if cfg.vision_n_layers:  # the vision tower and the learned span delimiters, named as stored
            self.vision, self.aligner = ViT(cfg), Aligner(cfg)
            for name in ("image_start", "image_newline", "image_end"):
                setattr(self, name, param(torch.zeros(cfg.dim, dtype=activation_dtype(cfg))))
        self.feeds_draft = False  # collect main_hidden for a draft stack (Model.attach_draft)
        self.main_hidden: Optional[torch.Tensor] = None  # the last forward's, when feeds_draft
        self.site_registry = name_sites(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        runtime: AttentionRuntime,
        hash_ids: Optional[torch.Tensor] = None,
        image_mask: Optional[torch.Tensor] = None,
        all_positions: bool = False,
        images=(),
    ) -> torch.Tensor:
        """input_ids [b, s] -> float32 logits [b, vocab] of the last position ([b, s, vocab] with
        all_positions). hash_ids [b, s, n_engram_layers, n_hash_cols] from the n-gram hasher;
        `images` (batch 1): the `vision.ImageInput`s whose spans this call holds, written over the
        embedding (their `features` encoded here when not yet set). With a draft stack attached, the
        target layers' `resid_pre` sites feed `main_hidden`. Runs in the caller's grad mode: the
        public calls (`Model.__call__`) run it under inference mode, training over master weights
        with a runtime that keeps no cache (`AttentionRuntime(cache=False)`)."""
        feed = _DraftFeed() if self.feeds_draft else None
        observers = {} if feed is None else {f"layers.{b.layer}.resid_pre": feed for b in self.layers if b.feeds_draft}
        args = (input_ids, start_pos, runtime, hash_ids, image_mask, all_positions, images)
        if not observers:
            logits = self._run(*args)
        else:
            with self.site_registry.hooks(observers, strict=False):
                logits = self._run(*args)
        # [b, s, dim * n_targets], the target layers in layer order: what the draft stack reads
        self.main_hidden = torch.cat(feed.rows, dim=-1) if feed is not None and feed.rows else None
        return logits

    def _run(self, input_ids, start_pos, runtime, hash_ids, image_mask, all_positions, images):
        bsz, seqlen = input_ids.shape
        h = self.embed(input_ids)  # [b, s, dim]
        if images:
            write_spans(
                h,
                [
                    image if image.features is not None else replace(image, features=self.encode_image(image))
                    for image in images
                ],
                {IMAGE_START: self.image_start, IMAGE_NEWLINE: self.image_newline, IMAGE_END: self.image_end},
            )
        embed = site(self, "embed")
        if embed:
            h = embed.exit(h)
        h = h.unsqueeze(2).repeat(1, 1, self.hc_mult, 1)  # [b, s, hc, dim]: equal copies
        pre = identity_pre(bsz, seqlen, self.hc_mult, h.device)
        for block in self.layers:
            ids = hash_ids[:, :, block.engram_index] if block.engram is not None and hash_ids is not None else None
            h, pre = block(h, start_pos, pre, runtime, ids, image_mask)
        h = self.norm(self.layers[-1].collapse(h, pre))  # the last block's FFN pre is the final collapse
        return self.head(h, all_positions)

    def reset_state(self) -> None:
        for block in self.layers:
            block.reset_state()

    @torch.inference_mode()
    def encode_image(self, image) -> torch.Tensor:
        """One `vision.ImageInput` through the ViT and the aligner -> its rows [cells, dim]."""
        if not hasattr(self, "vision"):
            raise ValueError("this model has no vision tower (the config's vision_n_layers is 0)")
        return encode_image(self.vision, self.aligner, image)


class _DraftFeed:
    """Collects the draft stack's target layers' inputs during a forward, copies averaged."""

    def __init__(self):
        self.rows: list = []

    def __call__(self, name: str, value: torch.Tensor, context: dict) -> None:
        self.rows.append(value.mean(dim=2))  # [b, s, dim]


# ---------------------------------------------------------------------- the runtime root
class Model:
    """The runtime root: `model(input_ids, start_pos)` -> float32 logits [batch, vocab] of the last
    position. A call at start_pos 0 starts a new sequence (a prefill); later calls feed one token
    at the next position. `reset()` forgets the sequence.

    Built empty from a config; `loader.load` fills `backbone` by checkpoint name and `attach`es the
    routed-expert store and the Engram tables (`report`, `checkpoint`: what it loaded from).
    `cache_format` (kept by the backbone, as `max_seq_len` is): the attention caches hold the stored
    formats, decoded when read ("packed", the default: FP8 window rings, FP4 compressed KV and index
    keys with their scales) or the same values in BF16 ("bf16"); the logits are the same bit for bit,
    `cache_bytes()` measures the difference.

    The verbs over a model are free functions in the modules that own them, each taking the model
    first: generation in `dsv41.generation.generate` (`generate(model, prompt)`, `prefill`, `decode_one`,
    `decode_n`, `compare_prefill_decode`), `dsv41.generation.conversation.chat`, `dsv41.model.hooks.run_with_hooks`,
    and `dsv41.model.sequence`'s `rollback`, `rollback_limit`, `snapshot`, `restore`. `model.experts.clear()`
    starts the expert cache cold."""

    def __init__(
        self,
        cfg: Config,
        *,
        numerics: Numerics = Numerics(),
        max_batch_size: int = 1,
        max_seq_len: int = 4096,
        tokenizer=None,
        tokenizer_meta: Optional[dict] = None,
        hasher=None,
        undo_calls: int = 64,
        cache_format: str = "packed",
    ):
        self.cfg, self.numerics = cfg, numerics  # the config as loaded; the modules read runtime_config(cfg)
        self.backbone = Backbone(
            runtime_config(cfg),
            numerics=numerics,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            cache_format=cache_format,
        )
        self.runtime = AttentionRuntime()
        self.hasher = hasher
        self.tokenizer, self.tokenizer_meta = tokenizer, dict(tokenizer_meta or {})
        self.experts: Optional[ExpertStore] = None
        self.engram_tables: dict[int, EngramTable] = {}
        self.draft_stack = None  # a dspark.DraftStack, attached by the loader (attach_draft)
        self.report = self.checkpoint = None
        self.position = 0  # positions consumed since the last reset
        self.token_ids = torch.zeros(1, 0, dtype=torch.long)  # [b, position]: what the sequence holds
        self.undo_records: deque = deque(maxlen=undo_calls)  # sequence.CallRecord per call, oldest first
        self._in_forward = False  # a backbone forward is running (its observers may not call back in)

    def attach(self, experts: ExpertStore, engram_tables: dict[int, EngramTable], routed=None) -> None:
        """Where routed experts and Engram rows are read from (neither is a parameter); `routed`:
        see `MoE.attach_store`."""
        self.experts, self.engram_tables = experts, dict(engram_tables)
        blocks = list(self.backbone.layers)
        for block, after in zip(blocks, blocks[1:] + [None]):
            block.ffn.attach_store(experts, routed)
            if after is not None and routed is None:  # the guess a store may read the next layer's experts by
                block.ffn.experts.next_gate = after.ffn.gate
            if block.engram is not None:
                block.engram.embed = self.engram_tables[block.layer]

    def attach_draft(self, stack) -> None:
        """Run a DSpark draft stack beside the backbone: its target layers hand their main hidden
        state over on every forward, and `draft` proposes from it."""
        self.draft_stack = stack
        targets = set(self.backbone.cfg.dspark_target_layer_ids)
        for block in self.backbone.layers:
            block.feeds_draft = block.layer in targets
        self.backbone.feeds_draft = True

    def draft(self, token_id, *, temperature: float = 0.0, generator=None):
        """A DSpark draft (`dspark.DraftBlock`) after the sequence's last position, starting from
        `token_id`, the target's next token (not yet fed): greedy, or sampled at `temperature`."""
        if self.draft_stack is None:
            raise ValueError(
                "this model has no draft stack: the checkpoint has no mtp.* stages, its "
                "dspark_block_size is 0, or it was loaded with dspark=False"
            )
        if self.position == 0:
            raise ValueError("a draft continues a sequence: run the model on a prompt first")
        if isinstance(token_id, torch.Tensor) and token_id.numel() == 1 and not token_id.dtype.is_floating_point:
            token_id = int(token_id)
        if not is_whole(token_id) or not 0 <= token_id < self.cfg.vocab_size:
            raise ValueError(f"a draft starts from one token id in [0, {self.cfg.vocab_size}), got {token_id!r}")
        return self.draft_stack.draft(token_id, self.position - 1, temperature=temperature, generator=generator)

    def cache_bytes(self) -> CacheBytes:
        """The attention caches' allocated bytes, measured from their buffers: by component and
        part, fixed (window rings, compressor tails) and growing, and `per_token` (the compressed KV
        and index keys per position of one sequence); `.summary()` says it in one line."""
        return cache_bytes(block.attn for block in self.backbone.layers)

    @_any_grad_mode
    def reset(self) -> None:
        """Start a new sequence: attention caches, the shared runtime and the n-gram look-back."""
        self._refuse_inside_forward("model.reset()")
        self.backbone.reset_state()
        if self.draft_stack is not None:
            self.draft_stack.reset_state()
        self.runtime.reset()
        if self.hasher is not None:
            self.hasher.reset()
        self.position = 0
        self.token_ids = torch.zeros(1, 0, dtype=torch.long)
        self.undo_records.clear()

    @property
    def sites(self):
        """The named sites of the forward (`hooks.Sites`: name -> Site, in module order)."""
        return self.backbone.site_registry

    def hooks(self, observers):
        """`with model.hooks({pattern: observer, ...}):` observers subscribed for the block."""
        return self.backbone.site_registry.hooks(observers)

    def intervene(self, interventions):
        """`with model.intervene({pattern: fn, ...}):` fn(name, value, context) returns the value
        to use in place of `value` at every call of a matching site inside the block (see
        `dsv41.model.interventions`; named ones are `dsv41.model.ablations`'). The context also holds the
        call's first position, "start_pos"."""
        from .interventions import intervene

        return intervene(self.backbone.site_registry, interventions, position=lambda: self.position)

    def _refuse_inside_forward(self, verb: str) -> None:
        # an observer that called back in would run a second forward over caches the first is
        # half-way through writing
        if self._in_forward:
            raise ReentrantCallError(
                f"{verb} was called from an observer inside this model's own forward, and "
                f"re-entrancy is refused; record what you need in the observer and call the "
                f"model after its call returns"
            )

    @_any_grad_mode
    def __call__(
        self, input_ids, start_pos: int = 0, *, trace=None, image_mask=None, all_positions: bool = False
    ) -> torch.Tensor:
        self._refuse_inside_forward("model(...)")
        prompt = input_ids if isinstance(input_ids, Prompt) else None  # ids with image spans (Model.prepare)
        if prompt is not None:
            if image_mask is not None:
                raise ValueError("a Prompt carries its own image mask; pass image_mask only with plain ids")
            input_ids = prompt.ids
            image_mask = prompt.image_mask() if prompt.image_positions else None
        ids = as_token_ids(input_ids)  # [b, s]: whole numbers or an error
        bsz, seqlen = ids.shape
        if seqlen == 0:
            raise ValueError("no input ids")
        # every check before anything changes: a refused call leaves the sequence as it was
        if not is_whole(start_pos):
            raise ValueError(f"start_pos must be a whole number, got {start_pos!r}")
        if start_pos != 0 and start_pos != self.position:
            raise ValueError(
                f"start_pos {start_pos}, but this sequence has {self.position} positions; continue "
                f"at {self.position} or start again at 0"
            )
        if start_pos + seqlen > self.backbone.max_seq_len:
            raise ValueError(
                f"positions {start_pos} to {start_pos + seqlen - 1} exceed max_seq_len "
                f"{self.backbone.max_seq_len}; load with a larger max_seq_len"
            )
        if bsz > self.backbone.max_batch_size or (start_pos and bsz != self.token_ids.size(0)):
            raise ValueError(
                f"a batch of {bsz} sequences, but the caches hold {self.backbone.max_batch_size}"
                + (f" and this sequence has {self.token_ids.size(0)}" if start_pos else "")
            )
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if trace is not None and not isinstance(trace, Trace):
            raise TypeError(
                f"trace must be a dsv41.model.trace.Trace (a ForwardTrace records the whole forward), "
                f"got {type(trace).__name__}"
            )
        if start_pos == 0:
            self.reset()
            self.token_ids = torch.zeros(bsz, 0, dtype=torch.long)
        undo = sequence.record_call(self, start_pos, ids, image_mask, prompt)
        try:
            hash_ids = None
            if self.hasher is not None:
                mask = None if image_mask is None else ~torch.as_tensor(image_mask, dtype=torch.bool)
                hash_ids = self.hasher(ids, mask)  # [b, s, n_engram_layers, n_hash_cols]
            counters = getattr(self.experts, "counters", None)  # a store without counters counts nothing
            if counters is not None:
                counters.begin_step(start_pos, seqlen)
            # a trace is one more set of observers, subscribed for this call
            with trace.recording(self.sites, start_pos) if trace is not None else nullcontext(), self._forward():
                logits = self.backbone(
                    ids,
                    start_pos,
                    self.runtime,
                    hash_ids,
                    image_mask,
                    all_positions,
                    images=prompt.images if prompt is not None else (),
                )
            if self.draft_stack is not None:
                self.draft_stack.feed(self.backbone.main_hidden, start_pos)
        except BaseException:
            sequence.undo_call(self, undo)  # nothing half-applied: the caches as they were before the call
            raise
        self.undo_records.append(undo)
        self.token_ids = torch.cat([self.token_ids, ids], dim=1)
        self.position = start_pos + seqlen
        return logits

    @contextmanager
    def _forward(self) -> Iterator[None]:
        self._in_forward = True
        try:
            yield
        finally:
            self._in_forward = False

    # ------------------------------------------------------------------ text
    @property
    def add_bos(self) -> bool:
        return bool(self.tokenizer_meta.get("add_bos_token", True)) and self.cfg.bos_token_id is not None

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.cfg.bos_token_id] if self.add_bos else []) + ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def prepare(self, text: str, images: Sequence = ()) -> Prompt:
        """Text and images (paths, bytes or PIL images) -> a `vision.Prompt`: each image placeholder
        in the text (the token `image_token_id`) becomes the next image's span; a text without one
        takes the images first (after the BOS). Bad images raise `vision.ImageError`."""
        return prepare_prompt(self.cfg, self.encode(text), images, insert_at=1 if self.add_bos else 0)

    def encode_images(self, prompt: Prompt) -> Prompt:
        """The same prompt with every image's aligner rows computed (the ViT and aligner run here,
        once, rather than inside the forward that first reaches the span)."""
        return replace(
            prompt,
            images=tuple(
                image if image.features is not None else replace(image, features=self.backbone.encode_image(image))
                for image in prompt.images
            ),
        )

    def __repr__(self) -> str:
        where = self.report.checkpoint if self.report is not None else "not loaded"
        return f"Model({where!r}, {self.cfg.summary()})"
