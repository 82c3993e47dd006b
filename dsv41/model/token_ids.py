"""Token ids as a caller gives them (a list, a tensor of any integer dtype) -> int64 [batch, tokens].

The one check every entry shares, the model's call and generation's prompt alike: anything that is
not whole numbers is refused, never cut (torch would turn 1.5 into 1 without a word).
"""

from __future__ import annotations

import torch


def as_token_ids(value, *, one_sequence: bool = False) -> torch.Tensor:
    """`value` ([tokens], or [batch, tokens] unless `one_sequence`) -> int64 [batch, tokens]."""
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"token ids must be whole numbers in a list or tensor, got {type(value).__name__}") from None
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"token ids must be whole numbers, got {ids.dtype} values")
    if one_sequence and ids.dim() != 1:
        raise ValueError(
            f"a prompt of token ids is one list of whole numbers, got token ids of shape {list(ids.shape)}"
        )
    if ids.dim() not in (1, 2):
        raise ValueError(f"token ids are [tokens] or [batch, tokens], got {ids.dim()} dimensions")
    return ids.long().unsqueeze(0) if ids.dim() == 1 else ids.long()
