"""One CSA2 attention layer: which window rows each query reads (`window_rows`) and `Attention`."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ...core.config import Config
from ...core.numerics import WINDOW_LAYOUTS, Numerics
from ...kernels import masked_attention, sparse_attn
from ..hooks import NO_SITES, site
from ..layers import (
    Linear,
    RMSNorm,
    activation_dtype,
    in_row_blocks,
    linear_dtype,
    master_product,
    precompute_freqs_cis,
    rotate_tail,
)
from .caches import (
    CACHE_PARTS,
    COMPRESSED_ENCODING,
    COMPRESSED_KV,
    COMPRESSOR_TAILS,
    WINDOW_ENCODING,
    WINDOW_RING,
    QuantizedCache,
    check_cache_format,
)
from .compressor import Compressor
from .indexer import Indexer
from .runtime import AttentionRuntime, HeldRows, Published
from .state import LayerRows


def window_rows(start_pos: int, seqlen: int, window: int, layout: str = "reference", device=None) -> torch.Tensor:
    """Which rows of the window KV each query attends to, int64 [s, width] (a decode step's single
    query: [1, width]), -1 = absent. The window KV is the call's own KV on a prefill (row =
    position), the ring on a decode step (row = position % window), and on a call of several
    tokens at a later position the ring as it was before the call followed by the call's own KV
    (row = position % window before start_pos, window + position - start_pos from it on).

    "reference", the released runtime: a prefill has min(seqlen, window) columns, present positions
    oldest first, then -1; a decode step lists all `window` ring slots starting after the newest,
    so while the ring is still filling its empty slots come first, and once full the oldest
    position does. "uniform": `window` columns on both, present positions oldest first, then -1.

    sparse_attn sums a row in column order, 64 columns at a time, so where the two orderings give
    the same query different columns (a prefill row narrower than the window, a decode row with
    empty slots in front) their float32 sums can round differently; "uniform" gives a query the
    same columns either way, so prefill and decode agree bit for bit. A call of several tokens at a
    later position (the reference has none) lists `window` columns, oldest first, in either layout."""
    if layout not in WINDOW_LAYOUTS:
        raise ValueError(f"window_layout must be one of {', '.join(map(repr, WINDOW_LAYOUTS))}, got {layout!r}")
    if layout == "reference" and start_pos > 0 and seqlen == 1:
        slots = (start_pos + 1 + torch.arange(window, device=device)) % window  # ring order from the oldest
        return torch.where(slots <= start_pos, slots, -1).unsqueeze(0)  # a slot past start_pos is unwritten
    positions = torch.arange(start_pos, start_pos + seqlen, device=device)
    width = min(seqlen, window) if layout == "reference" and start_pos == 0 else window
    seen = (positions - window + 1).clamp_min(0).unsqueeze(-1) + torch.arange(width, device=device)  # [s, width]
    if start_pos == 0:
        rows = seen
    elif seqlen == 1:
        rows = seen % window
    else:
        rows = torch.where(seen >= start_pos, window + seen - start_pos, seen % window)
    return torch.where(seen <= positions.unsqueeze(-1), rows, -1)


class Attention(nn.Module):
    """One CSA2 attention layer: low-rank queries, a shared K=V latent, a sliding window ring of
    FP8-QAT KV plus (ratio > 0) the selected compressed positions as FP4 (E4M3 scales over 16),
    one sparse_attn call with a per-head sink, and a grouped low-rank output projection.

    Parameter names and runtime dtypes are the checkpoint's / reference runtime's (wo_a is held in
    BF16 although the checkpoint stores it FP8; ratio > 1 compressor projections in float32).
    `max_batch_size` and `max_seq_len` size the caches and the RoPE table; `numerics` says how the
    index rows are laid out (`window_rows`), whether stale index keys are fixed (`Indexer`) and
    whether the compressor's float32 projections pad their rows (`layers.f32_linear`).
    `cache_format` how the caches hold their values (`QuantizedCache`): "packed" (default, the
    stored formats) or "bf16" (the reference runtime's BF16 buffers); the outputs are the same bit
    for bit.

    Sites (`hooks`): the layer's own (`layers.N.attn`: entered when a call starts, its exit sees the
    output [b, s, dim] with the call's layer, mode, ratio and start_pos in the context) and `topk`
    (ratio > 0: the compressed positions each query attends to, -1 padded to index_topk, with the
    index source they came from, "selected_by", start_pos and compress_ratio); the compressor's and
    the indexer's own. The layer's own and `topk` take replacements: at `topk`, the positions the
    layer reads, [b, s, any width], -1 for none.
    """

    SITES = REPLACEABLE = ("", "topk")
    named_sites = NO_SITES

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
        n_total = cfg.n_layers + cfg.n_mtp_layers
        if not 0 <= layer < n_total:
            raise ValueError(f"layer {layer} is outside the config's {n_total} layers")
        self.layer, self.numerics = layer, numerics
        self.dim, self.n_heads, self.head_dim = cfg.dim, cfg.n_heads, cfg.head_dim
        self.rope_head_dim = cfg.rope_head_dim
        self.n_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window_size = cfg.window_size
        self.index_topk = cfg.index_topk
        self.ratio = cfg.compress_ratios[layer]
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.cache_format = check_cache_format(cache_format)
        self.softmax_scale = self.head_dim**-0.5
        # MTP layers are never sources; within the backbone the config decides
        self.mode = cfg.layer_mode(layer) if layer < cfg.n_layers else "reuse"
        if self.mode != "reuse" and self.ratio == 0:
            raise ValueError(f"layer {layer} is a {self.mode} layer with compress ratio 0")
        act, lin = activation_dtype(cfg), linear_dtype(cfg)
        if not self.ratio:
            self.SITES = ("",)  # a pure window layer selects no compressed positions

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dtype=lin)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype=act)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=lin)
        self.wkv = Linear(cfg.dim, self.head_dim, dtype=lin)
        self.kv_norm = RMSNorm(self.head_dim, cfg.norm_eps, dtype=act)
        # block-diagonal over groups: group g projects only its own heads, applied by einsum
        self.wo_a = Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, dtype=act)
        self.wo_b = Linear(self.n_groups * self.o_lora_rank, cfg.dim, dtype=lin)

        self.compressor = Compressor(cfg, layer, max_batch_size, numerics=numerics) if self.mode == "full" else None
        self.indexer = (
            Indexer(cfg, layer, max_batch_size, max_seq_len, numerics=numerics, cache_format=cache_format)
            if self.mode in ("full", "reindex")
            else None
        )

        self.window_kv_cache = QuantizedCache(
            WINDOW_ENCODING, max_batch_size, self.window_size, self.head_dim, act, cache_format
        )
        if self.mode == "full":
            self.compress_kv_cache = QuantizedCache(
                COMPRESSED_ENCODING, max_batch_size, max_seq_len // self.ratio, self.head_dim, act, cache_format
            )
        # layers reading compressed positions rotate at compress_rope_theta with YaRN; pure window
        # layers at rope_theta without
        if self.ratio:
            base, original = cfg.compress_rope_theta, cfg.original_seq_len
        else:
            base, original = cfg.rope_theta, 0
        freqs = precompute_freqs_cis(
            self.rope_head_dim, max_seq_len, original, base, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow
        )
        self.register_buffer("freqs_cis", freqs, persistent=False)

    # ------------------------------------------------------------------ state
    def reset_state(self) -> None:
        """Forget everything a previous forward left behind (window ring, compressor tail,
        compressed KV, index keys)."""
        self.window_kv_cache.reset()
        if self.compressor is not None:
            self.compressor.reset_state()
            self.compress_kv_cache.reset()
        if self.indexer is not None:
            self.indexer.reset_state()

    def capture(self, start: int, end: int) -> LayerRows:
        """Copies of the cache rows a call over positions [start, end) may write (`LayerRows`);
        `restore` writes them back, `truncate` the part of them a shorter call would not have
        overwritten."""
        win = self.window_size
        slots = torch.arange(max(start, end - win), end, device=self.window_kv_cache.values.device) % win
        rows = LayerRows(start, end, slots, self.window_kv_cache.save(slots))
        if self.ratio:
            rows.groups = slice(start // self.ratio, end // self.ratio)
            if self.compressor is not None:
                rows.compressed = self.compress_kv_cache.save(rows.groups)
                if self.compressor.ratio > 1:
                    rows.tail = self.compressor.capture()
            if self.indexer is not None and self.indexer.owns_k:
                rows.index_keys = self.indexer.k_cache.save(rows.groups)
        return rows

    def restore(self, rows: LayerRows) -> None:
        self.window_kv_cache.load(rows.slots, rows.window)
        if rows.compressed is not None:
            self.compress_kv_cache.load(rows.groups, rows.compressed)
        if rows.tail is not None:
            self.compressor.restore(rows.tail)
        if rows.index_keys is not None:
            self.indexer.k_cache.load(rows.groups, rows.index_keys)

    def truncatable(self, start: int, end: int) -> bool:
        """Whether the last call, over [start, end), can be cut short in place (`truncate`): no
        longer than the window (so its undo record holds every slot it wrote) and, for a pooling
        compressor, with that call's projections still kept."""
        if end - start > self.window_size:
            return False
        if self.compressor is not None and self.compressor.ratio > 1:
            return self.compressor.truncatable(start, end)
        return True

    def truncate(self, rows: LayerRows, keep_end: int) -> None:
        """Cut the last call (`rows` its undo record) back to [rows.start, keep_end): the slots and
        groups of the dropped positions get their earlier contents again, the partial group is
        rebuilt; the rows the call computed for the kept positions stay. The same bytes as running
        [start, keep_end) as its own call wherever a row's arithmetic does not depend on how many
        rows share the call (Numerics.parity())."""
        start, end = rows.start, rows.end
        positions = torch.arange(max(start, end - self.window_size), end, device=rows.slots.device)
        dropped = positions >= keep_end
        self.window_kv_cache.load(rows.slots[dropped], tuple(part[:, dropped] for part in rows.window))
        if self.ratio:
            first, kept = start // self.ratio, keep_end // self.ratio
            groups, offset = slice(kept, end // self.ratio), kept - first
            if rows.compressed is not None:
                self.compress_kv_cache.load(groups, tuple(part[:, offset:] for part in rows.compressed))
            if rows.tail is not None:
                self.compressor.truncate(rows.tail, start, keep_end)
            if rows.index_keys is not None:
                self.indexer.k_cache.load(groups, tuple(part[:, offset:] for part in rows.index_keys))

    def publishes(self, published: Published, start: int, end: int) -> Published:
        """What a runtime holding `published` holds after this layer ran a call over [start, end):
        a Full layer publishes its compressed KV; an index-key owner its keys when one of its
        groups completed in the call (on every call, with the stale-key fix), as `forward` does."""
        if self.mode == "full":
            published = replace(published, compress_kv=self.compress_kv_cache, compress_kv_from=self.layer)
        indexer = self.indexer
        if (
            indexer is not None
            and indexer.owns_k
            and (self.numerics.fix_stale_index_keys or end // self.ratio > start // self.ratio)
        ):
            published = replace(published, index_k=indexer.k_cache, index_k_from=self.layer)
        return published

    def cache_bytes(self) -> dict[str, int]:
        """Allocated bytes of this layer's caches by part ('window ring data' / 'scales',
        'compressed KV data' / 'scales', 'index key data' / 'scales', 'compressor tails'), zero
        for what the layer does not hold; RoPE tables are not caches."""
        out = dict.fromkeys(CACHE_PARTS, 0)
        caches = [(WINDOW_RING, self.window_kv_cache)]
        if self.compressor is not None:
            caches.append((COMPRESSED_KV, self.compress_kv_cache))
            if self.compressor.ratio > 1:
                out[COMPRESSOR_TAILS] = sum(
                    b.numel() * b.element_size() for b in (self.compressor.kv_state, self.compressor.score_state)
                )
        if self.indexer is not None and self.indexer.owns_k:
            caches.append(("index key", self.indexer.k_cache))
        for name, cache in caches:
            for part, n in cache.nbytes().items():
                out[f"{name} {part}"] = n
        return out

    def _random_init_(self, gen: torch.Generator) -> None:
        self.attn_sink.copy_(torch.randn(self.n_heads, generator=gen) * 0.5)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, start_pos: int, runtime: AttentionRuntime) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, dim]: any number of tokens at start_pos (0 starts a sequence; a
        later call continues it: one token is a decode step, several a chunk, causal inside it).
        Reads and writes `runtime`; a runtime without a cache takes the whole sequence at 0."""
        bsz, seqlen, _ = x.shape
        if not runtime.cache and start_pos:
            raise ValueError(f"layer {self.layer}: a runtime without a cache runs a whole sequence from position 0")
        if start_pos + seqlen > self.max_seq_len or bsz > self.max_batch_size:
            raise ValueError(
                f"layer {self.layer}: batch {bsz} x positions up to {start_pos + seqlen} exceed the "
                f"caches ({self.max_batch_size} x {self.max_seq_len}); build with larger limits"
            )
        own = site(self, "")
        if own:
            own.enter()
        freqs = self.freqs_cis[start_pos : start_pos + seqlen]
        qr, q = self.queries(x, freqs)

        kv, idxs = self._window(x, freqs, start_pos, runtime.cache)  # [b, n_kv, head_dim], [b, s, w]
        if self.ratio:
            cache, selected = self._compressed(x, qr, start_pos, runtime)
            topk = site(self, "topk")
            if topk:  # one width in every call; what the selection was made from in the context
                padded = self._pad_topk(selected)
                context = {
                    "selected_by": runtime.topk_from,
                    "start_pos": start_pos,
                    "compress_ratio": self.ratio,
                    "x": x,
                    "qr": qr,
                    "q": q,
                    "compressed_kv": cache,
                    "index_keys": runtime.index_k,
                    "attention": self,
                }
                if (given := topk.exit(padded, context)) is not padded:  # an intervention chose them
                    selected = given
            compress_kv, rows = self._compressed_rows(cache, bsz, (start_pos + seqlen) // self.ratio, selected)
            # the selections index the compressed rows appended after the window rows
            idxs = torch.cat([idxs, torch.where(rows >= 0, rows + kv.size(1), -1)], dim=-1)
            kv = torch.cat([kv, compress_kv], dim=1)

        # Numerics(summation="fast"): training's dense masked form of sparse_attn
        attend = masked_attention if self.numerics.summation == "fast" else sparse_attn
        o = attend(q, kv, self.attn_sink, idxs, self.softmax_scale)  # [b, s, heads, head_dim]
        out = self.project_out(o, freqs)
        if own:
            out = own.exit(
                out, {"layer": self.layer, "mode": self.mode, "compress_ratio": self.ratio, "start_pos": start_pos}
            )
        return out

    def queries(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, dim] -> (the low-rank query qr [b, s, q_lora_rank], the rotated query heads
        [b, s, heads, head_dim])."""
        qr = self.q_norm(self.wq_a(x))  # [b, s, q_lora_rank]
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [b, s, heads, head_dim]
        return qr, rotate_tail(q, freqs, self.rope_head_dim)

    def window_kv(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim] -> window KV rows [b, s, head_dim], RoPE tail rotated, not yet quantized."""
        kv = self.kv_norm(self.wkv(x))  # [b, s, head_dim]
        return rotate_tail(kv, freqs, self.rope_head_dim)

    def write_window(self, parts: tuple[torch.Tensor, ...], start_pos: int) -> None:
        """Store the window ring's parts [b, s, ...] (`quantize`d rows of positions start_pos..):
        position p takes slot p % window, so of a call longer than the window its last `window`
        positions stay."""
        seqlen, win = parts[0].size(1), self.window_size
        if seqlen == 1:
            slot = start_pos % win
            self.window_kv_cache.write(slice(slot, slot + 1), parts)
            return
        keep = min(seqlen, win)
        slots = torch.arange(start_pos + seqlen - keep, start_pos + seqlen, device=parts[0].device) % win
        self.window_kv_cache.write(slots, tuple(part[:, seqlen - keep :] for part in parts))

    def project_out(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """sparse_attn's output o [b, s, heads, head_dim] -> [b, s, dim]: the query's rotation taken
        off (the values carry their key's, so relative position is left), then the grouped low-rank
        output projection."""
        bsz, seqlen = o.shape[:2]
        o = rotate_tail(o, freqs, self.rope_head_dim, inverse=True)
        o = o.reshape(bsz, seqlen, self.n_groups, -1)  # [b, s, groups, heads/groups * head_dim]
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        if wo_a.dtype != o.dtype:  # a float32 master weight (training)
            o = master_product(torch.einsum, o, wo_a, "bsgd,grd->bsgr", fast=self.wo_a.fast)
        elif self.numerics.pad_f32_rows:  # parity: one kernel for any row count
            rows = o.flatten(0, 1)  # [b * s, groups, heads/groups * head_dim]
            o = in_row_blocks(lambda block: torch.einsum("mgd,grd->mgr", block, wo_a), rows).unflatten(0, (bsz, seqlen))
        else:
            o = torch.einsum("bsgd,grd->bsgr", o, wo_a)  # [b, s, groups, o_lora_rank]
        return self.wo_b(o.flatten(2))

    def _window(self, x: torch.Tensor, freqs: torch.Tensor, start_pos: int, cache: bool):
        """This layer's window KV (FP8 QAT over 32, RoPE tail included) and, per query, the rows of
        it to attend, [b, s, width] laid out by `window_rows`."""
        bsz, seqlen, _ = x.shape
        win, ring = self.window_size, self.window_kv_cache
        if not cache:
            kv = ring.encoding.on_grid(self.window_kv(x, freqs))  # FP8 E4M3 values, nothing stored
            idxs = window_rows(0, seqlen, win, self.numerics.window_layout, x.device)
            return kv, idxs.int().unsqueeze(0).expand(bsz, seqlen, -1)
        parts, kv = ring.quantize(self.window_kv(x, freqs))  # FP8 E4M3, one E8M0 scale per 32
        if start_pos > 0 and seqlen == 1:
            self.write_window(parts, start_pos)
            window_kv = ring.read(bsz)
        else:
            # a later chunk reads the earlier positions from the ring as it was: [b, win + s, head_dim]
            window_kv = kv if start_pos == 0 else torch.cat([ring.read(bsz), kv], dim=1)
            self.write_window(parts, start_pos)
        idxs = window_rows(start_pos, seqlen, win, self.numerics.window_layout, x.device)  # [s or 1, width]
        return window_kv, idxs.int().unsqueeze(0).expand(bsz, seqlen, -1)

    @staticmethod
    def _compressed_rows(
        cache: "QuantizedCache", bsz: int, width: int, selected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed rows for sparse_attn, where each selection sits in them: like `selected`).

        BF16 storage hands over every reachable row [b, T, head_dim], indexed by position (the
        reference's kv). Packed storage decodes only the rows some query selected, [b, P, head_dim]
        in ascending position, and renumbers the selections to match: sparse_attn gathers the same
        row contents in the same column order, so its output is the same bit for bit, while a
        decode step decodes and converts index_topk rows instead of the whole context."""
        if not cache.packed:
            return cache.read(bsz, width), selected
        picked = torch.unique(selected[selected >= 0]).long()  # ascending positions
        rows = torch.searchsorted(picked, selected.long().clamp_min(0)).to(selected.dtype)
        return cache.gather(bsz, picked), torch.where(selected >= 0, rows, -1)

    def _compressed(self, x, qr, start_pos, runtime: AttentionRuntime):
        """The shared compressed-KV cache and each query's selected compressed positions, -1 where
        unreachable: [b, s, min(index_topk, T)] as the reference has them, or -1 padded to
        [b, s, index_topk] under the uniform layout. Full layers compress and publish first; the
        indexer takes the latent before it is rotated and quantized into the cache."""
        bsz, seqlen, _ = x.shape
        ratio = self.ratio
        width = (start_pos + seqlen) // ratio
        latent = None
        if self.mode == "full":
            latent = self.compressor(x, start_pos, keep_tail=runtime.cache)
            runtime.compress_kv, runtime.compress_kv_from = self.compress_kv_cache, self.layer

        if self.indexer is not None:
            if width == 0:
                selected = self.indexer.unreachable(bsz, seqlen, x.device)
            else:
                selected = self.indexer(x, qr, latent, start_pos, self.freqs_cis, runtime)
            selected = selected.int()
            if self.numerics.window_layout == "uniform":  # one width for prefill and decode (see window_rows)
                selected = self._pad_topk(selected)
            runtime.topk, runtime.topk_from, runtime.topk_call = selected, self.layer, (start_pos, seqlen)
        else:
            if runtime.topk is None or runtime.topk_call != (start_pos, seqlen) or runtime.topk.size(0) != bsz:
                raise RuntimeError(
                    f"layer {self.layer} reuses an index source's top-k, but none ran for this call; "
                    f"run the layers in order"
                )
            selected = runtime.topk

        if latent is not None:
            first = start_pos // ratio
            group_pos = (first + torch.arange(latent.size(1), device=x.device)) * ratio
            # one latent stands for its whole group and is rotated at the group's first token
            latent = rotate_tail(latent, self.freqs_cis[group_pos], self.rope_head_dim)
            if runtime.cache:
                parts, _ = self.compress_kv_cache.quantize(latent)  # FP4, one E4M3 scale per 16
                self.compress_kv_cache.write(slice(first, first + latent.size(1)), parts)
            else:
                runtime.compress_kv = HeldRows(self.compress_kv_cache.encoding.on_grid(latent))
        elif self.mode == "full" and not runtime.cache:  # no group complete yet: nothing to read
            runtime.compress_kv = HeldRows(x.new_zeros(bsz, 0, self.head_dim))
        if runtime.compress_kv is None:
            raise RuntimeError(f"layer {self.layer} reads compressed KV, but no KV source has run")
        return runtime.compress_kv, selected

    def _pad_topk(self, selected: torch.Tensor) -> torch.Tensor:
        return F.pad(selected, (0, self.index_topk - selected.size(-1)), value=-1)
