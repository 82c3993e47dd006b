"""The learning-rate schedule both training phases follow (`loop.Trainer` for the backbone,
`draft.DraftTrainer` for the draft stack), in a module of its own so that each imports it and
neither imports the other for it."""

import math


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warm-up, then cosine down to floor * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
