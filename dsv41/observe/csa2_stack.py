"""`AttentionStack`: one attention layer per backbone layer over a shared runtime, the harness
the CSA2 notebooks and tests run attention on without the rest of the model."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import Config
from ..core.numerics import Numerics
from ..model.attention import Attention, AttentionRuntime, CacheBytes, cache_bytes, check_cache_format
from ..model.hooks import name_sites
from ..model.layers import init_random_


class AttentionStack(nn.Module):
    """One Attention per backbone layer and one shared runtime, for tests and notebooks.

    `forward` runs a residual chain (each layer reads the RMS-normalized stream, parameter-free,
    and adds its output back); `forward_each` feeds the same input to every layer and returns each
    layer's output, so a difference in one layer cannot leak into the next. Both advance the
    caches; call `reset_state()` before an unrelated sequence. `numerics` reaches every layer (the
    reference's arithmetic by default), and so does `cache_format` ("packed" by default, or
    "bf16"; `cache_bytes()` measures what it allocates). Built under `torch.device("meta")` a stack
    of any size allocates nothing and still reports its `cache_bytes()`.

    Its layers' sites are named as in a model (`layers.N.attn`, `layers.N.attn.indexer`, ...), so a
    trace or an activation cache subscribes to a stack as to a model: `with
    trace.recording(stack.sites):` or `with stack.hooks({pattern: observer}):`.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        numerics: Numerics = Numerics(),
        max_batch_size: int = 1,
        max_seq_len: int = 4096,
        seed: Optional[int] = None,
        cache_format: str = "packed",
    ):
        super().__init__()
        self.cfg, self.numerics = cfg, numerics
        self.cache_format = check_cache_format(cache_format)
        self.runtime = AttentionRuntime()
        self.layers = nn.ModuleList(
            Attention(
                cfg,
                i,
                numerics=numerics,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                cache_format=cache_format,
            )
            for i in range(cfg.n_layers)
        )
        if seed is not None:
            init_random_(self, seed)
        self.sites = name_sites(self, {f"layers.{i}": f"layers.{i}.attn" for i in range(cfg.n_layers)})

    def hooks(self, observers, strict: bool = True):
        """`with stack.hooks({pattern: observer, ...}):` observers subscribed for the block."""
        return self.sites.hooks(observers, strict)

    def cache_bytes(self) -> CacheBytes:
        return cache_bytes(self.layers)

    @torch.inference_mode()  # the caches take in-place writes whichever grad mode made them
    def reset_state(self) -> None:
        for layer in self.layers:
            layer.reset_state()
        self.runtime.reset()

    @torch.inference_mode()  # the caches take in-place writes whichever grad mode made them
    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        h = x
        for layer in self.layers:
            normed = F.rms_norm(h.float(), (h.size(-1),), eps=self.cfg.norm_eps).to(h.dtype)
            h = h + layer(normed, start_pos, self.runtime)
        return h

    @torch.inference_mode()  # the caches take in-place writes whichever grad mode made them
    def forward_each(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """[n_layers, b, s, dim]: every layer's output on the same input x."""
        return torch.stack([layer(x, start_pos, self.runtime) for layer in self.layers])
