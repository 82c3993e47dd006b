"""The hyper-connection split: one projection of the stream into pre / post / comb coefficients."""

from typing import Tuple

import torch


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int = 4,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2+hc)*hc] -> float32 pre [..., hc], post [..., hc], comb [..., hc, hc]."""
    hc = hc_mult
    mix_width = (2 + hc) * hc
    if mixes.size(-1) != mix_width:
        raise ValueError(f"mixes must end in {mix_width} = (2 + {hc}) * {hc}, got {mixes.size(-1)}")
    if hc_scale.numel() != 3 or hc_base.numel() != mix_width:
        raise ValueError(f"hc_scale must hold 3 values and hc_base {mix_width}")
    mixes, hc_scale, hc_base = mixes.float(), hc_scale.float(), hc_base.float()

    # pre is floored at eps; post spans (0, 2)
    pre = torch.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc])

    logits = mixes[..., 2 * hc :] * hc_scale[2] + hc_base[2 * hc :]
    logits = logits.unflatten(-1, (hc, hc))  # [..., hc, hc]: row i, column j
    # softmax along each row (eps added after, not in the denominator)
    comb = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    # a column step comes first, so the iteration as a whole starts and ends on columns
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
