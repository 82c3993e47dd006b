"""Sparse attention over gathered KV positions, with a per-head attention sink."""

import torch

# Positions are visited in chunks of this many, each folded into a running (online) softmax.
SPARSE_ATTN_CHUNK = 64

# Starting value of the running max. Finite on purpose: a row whose every index is -1 keeps
# its max here, and exp(-inf - (-1e30)) = 0 makes that row come out as zeros, where a -inf
# start would compute exp(-inf - (-inf)) = NaN.
SCORE_FLOOR = -1e30


def sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention of q [b, m, h, d] over kv [b, n, d] rows topk_idxs [b, m, k] (-1 = absent) -> bf16."""
    bsz, m, h, d = q.shape
    if kv.dim() != 3 or kv.size(0) != bsz or kv.size(-1) != d:
        raise ValueError(f"kv must be [{bsz}, n, {d}], got {list(kv.shape)}")
    q32, kv32 = q.float(), kv.float()
    scale = torch.tensor(softmax_scale, dtype=torch.float32, device=q.device)
    batch = torch.arange(bsz, device=q.device).view(bsz, 1, 1)

    out = q32.new_zeros(bsz, m, h, d)
    denom = q32.new_zeros(bsz, m, h)
    running_max = q32.new_full((bsz, m, h), SCORE_FLOOR)
    for start in range(0, topk_idxs.size(-1), SPARSE_ATTN_CHUNK):
        idxs = topk_idxs[..., start : start + SPARSE_ATTN_CHUNK].long()  # [b, m, c]
        present = idxs != -1
        # absent slots read row 0 and are then zeroed, so they add nothing to the output sum
        rows = kv32[batch, idxs.clamp_min(0)]  # [b, m, c, d]
        rows = torch.where(present.unsqueeze(-1), rows, 0.0)
        scores = torch.einsum("bmhd,bmcd->bmhc", q32, rows)
        # masked before scaling, as the kernel does
        scores = torch.where(present.unsqueeze(2), scores, -torch.inf) * scale

        previous_max = running_max
        running_max = torch.maximum(previous_max, scores.amax(dim=-1))
        rescale = torch.exp(previous_max - running_max)
        probs = torch.exp(scores - running_max.unsqueeze(-1))  # [b, m, h, c]
        # the denominator sums float32 probabilities; the PV product uses them rounded to bf16
        denom = denom * rescale + probs.sum(dim=-1)
        weights = probs.to(torch.bfloat16).float()
        out = out * rescale.unsqueeze(-1) + torch.einsum("bmhc,bmcd->bmhd", weights, rows)

    # the sink is one extra logit per head that takes probability mass but has no value;
    # it is compared against the running max unscaled by softmax_scale
    denom = denom + torch.exp(attn_sink.float() - running_max)
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)


def masked_attention(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """`sparse_attn` as one dense product under a mask of the rows each query reads (training's
    `Numerics(summation="fast")`): the same softmax with its sink and bf16-rounded weights, summed
    in another order, and differentiable. q [b, m, h, d], kv [b, n, d], topk_idxs [b, m, k]
    (-1 absent) -> bf16 [b, m, h, d]."""
    bsz, m, _, _ = q.shape
    n = kv.size(1)
    present = torch.zeros(bsz, m, n + 1, dtype=torch.bool, device=q.device)
    present.scatter_(-1, torch.where(topk_idxs >= 0, topk_idxs, n).long(), True)  # column n catches the absent
    present = present[..., :n].unsqueeze(2)  # [b, m, 1, n]
    scores = torch.einsum("bmhd,bnd->bmhn", q.float(), kv.float()) * softmax_scale
    scores = scores.masked_fill(~present, -torch.inf)
    top = scores.amax(dim=-1, keepdim=True).detach()  # [b, m, h, 1]
    probs = torch.exp(scores - top)
    denom = probs.sum(dim=-1) + torch.exp(attn_sink.float().view(1, 1, -1) - top.squeeze(-1))
    out = torch.einsum("bmhn,bnd->bmhd", probs.to(torch.bfloat16).float(), kv.float())
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)
