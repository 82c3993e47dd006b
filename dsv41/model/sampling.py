"""The one sampler: greedy, and seeded Gumbel-max draws from softmax(logits / temperature).

Plain generation, the speculative verify (its bonus tokens and the target's distributions the
rejection rule reads) and the draft stack's proposals all draw through here, so a seed means the
same random stream everywhere: one Exponential(1) variate per vocabulary entry and row, taken from
the caller's `torch.Generator` in one `exponential_` call, and the argmax of p / noise. Dividing by
Exponential(1) noise and taking the argmax picks id i with probability p_i; `torch.multinomial` is
never used for a token choice, so a draw costs the same whatever the distribution.
"""

from __future__ import annotations

from typing import Optional

import torch

# A temperature is floored here before it divides the logits: below it the softmax would be a
# division by (almost) zero; at or above it nothing changes.
TEMPERATURE_FLOOR = 1e-5


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; among equal maxima the lowest id (torch.argmax's documented rule)."""
    return logits.argmax(dim=-1)


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) over the last dim, in float32 (temperature > 0)."""
    return torch.softmax(logits.float() / max(temperature, TEMPERATURE_FLOOR), dim=-1)


def gumbel_max(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One id per row of `probs` [..., vocab], drawn with noise from `generator` -> [...]."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next ids [...] from logits [..., vocab]: greedy at temperature 0, else Gumbel-max from `generator`."""
    if temperature <= 0:
        return greedy(logits)
    return gumbel_max(probabilities(logits, temperature), generator)
