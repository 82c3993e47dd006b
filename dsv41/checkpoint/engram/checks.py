"""Measurements of a hasher: prefill/decode split equality, bucket load against uniform hashing,
and the hashing benchmark."""

from __future__ import annotations

from dsv41.core.config import Config

from .hasher import NgramHasher
from .layout import EngramError, EngramLayout


# ---------------------------------------------------------------------- streaming and load checks
def split_equality(hasher: NgramHasher, token_ids, token_mask=None) -> dict:
    """For every split point k in 1 .. seq-1: hash `token_ids[..., :k]` in one call, then the rest
    one token per call, and compare with one call over the whole sequence.

    Resets `hasher` before each run and once more at the end. Returns plain data: n_splits, equal
    (one bool per split, k = 1 first), all_equal, first_unequal (k or None), and whole (the
    one-call hash ids, [..., seq, layers, cols]).
    """
    import numpy as np

    ids = np.asarray(token_ids)
    mask = None if token_mask is None else np.asarray(token_mask, dtype=bool)
    seq = ids.shape[-1]
    seq_axis = ids.ndim - 1  # the output keeps the input's leading axes, then [seq, layers, cols]

    def part(a, b):
        return hasher.hash_ids(ids[..., a:b], None if mask is None else mask[..., a:b])

    hasher.reset()
    whole = part(0, seq)
    equal = []
    for k in range(1, seq):
        hasher.reset()
        pieces = [part(0, k)] + [part(t, t + 1) for t in range(k, seq)]
        equal.append(bool(np.array_equal(np.concatenate(pieces, axis=seq_axis), whole)))
    hasher.reset()
    first = next((k for k, ok in enumerate(equal, start=1) if not ok), None)
    return {"n_splits": len(equal), "equal": equal, "all_equal": all(equal), "first_unequal": first, "whole": whole}


def poisson_rows(n_positions: int, primes, length: int | None = None) -> list[float]:
    """Expected bucket rows holding 0, 1, 2, ... positions if `n_positions` positions landed uniformly
    and independently in each column of bucket sizes `primes`: the sum over columns of
    p * Poisson(n; n_positions / p). `length` entries, or by default up to the first count past
    the mean whose expectation falls below a thousandth of a row (so the curve sums to the rows and
    the positions up to a negligible tail)."""
    from math import exp, lgamma, log

    primes = [int(p) for p in primes]

    def expected(n: int) -> float:
        total = 0.0
        for p in primes:
            lam = n_positions / p
            if n == 0 or lam > 0:
                # log-space: lam ** n / n! overflows long before the expectation is negligible
                total += p * exp(n * log(lam) - lam - lgamma(n + 1)) if n else p * exp(-lam)
        return total

    if length is not None:
        return [expected(n) for n in range(length)]
    out = [expected(0)]
    while len(out) <= n_positions / min(primes) or out[-1] >= 1e-3:
        out.append(expected(len(out)))
    return out


def bucket_load(layout: EngramLayout, hash_ids) -> dict:
    """How many positions land on each bucket row, per Engram layer, as plain data.

    `hash_ids` [seq, layers, cols] (one sequence, as `NgramHasher.hash_ids` returns for 1-D ids).
    Per layer: positions, rows (the sum of its primes), rows_used, max_load, mean_load_used (over the
    rows used), outside (ids that miss their column's bucket and are not counted; 0 for a correct
    hasher), histogram (rows holding 0, 1, 2, ... positions; sums to rows) and poisson (the same
    counts expected under uniform independent hashing, `poisson_rows`). All histograms and curves
    share one length, so they plot on one axis. Repeated n-grams land on one row by design, so real
    text has a heavier tail than the Poisson curve. inside_buckets: no id missed its bucket.
    """
    import numpy as np

    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.ndim != 3 or ids.shape[1:] != (layout.n_layers, layout.n_hash_cols):
        raise EngramError(f"hash ids must be [seq, {layout.n_layers}, {layout.n_hash_cols}], got {list(ids.shape)}")
    seq = ids.shape[0]
    layers = []
    for k, layer in enumerate(layout.layer_ids):
        counts, outside = [], 0
        for c, (p, start) in enumerate(zip(layout.flat_primes[k], layout.offsets[k])):
            rel = ids[:, k, c] - start  # row inside the column's bucket
            ok = (rel >= 0) & (rel < p)
            outside += int((~ok).sum())
            counts.append(np.bincount(rel[ok], minlength=p))
        loads = np.concatenate(counts)  # positions per bucket row, every column of the layer
        used = loads[loads > 0]
        layers.append(
            {
                "layer": layer,
                "positions": seq,
                "rows": int(loads.size),
                "rows_used": int(used.size),
                "max_load": int(loads.max()),
                "mean_load_used": float(used.mean()) if used.size else 0.0,
                "outside": outside,
                "histogram": np.bincount(loads).tolist(),
            }
        )
    length = max([len(e["histogram"]) for e in layers] + [len(poisson_rows(seq, row)) for row in layout.flat_primes])
    for e, row in zip(layers, layout.flat_primes):
        e["histogram"] += [0] * (length - len(e["histogram"]))  # no row holds that many
        e["poisson"] = poisson_rows(seq, row, length)
    return {
        "n_positions": seq,
        "layer_ids": list(layout.layer_ids),
        "layers": layers,
        "inside_buckets": all(e["outside"] == 0 for e in layers),
    }


# ---------------------------------------------------------------------- benchmark
def bench_hasher(n_tokens: int = 32768, cfg: Config | None = None, repeats: int = 5, seed: int = 0) -> dict:
    """Time hashing one `n_tokens` prompt in one call, and decode steps one token at a time.

    Uses an identity compressed map of the config's size (the released config by default), so it
    needs no tokenizer. Returns seconds (best of `repeats`).
    """
    import time

    import numpy as np

    if int(n_tokens) < 1:
        raise EngramError(f"the benchmark needs a prompt of at least one token, got {n_tokens}")
    if cfg is None:
        from dsv41.core.config import RELEASED as cfg
    if cfg.engram_compressed_vocab_size is None:
        raise EngramError("the config does not set engram_compressed_vocab_size, which the benchmark's map needs")
    n = int(cfg.engram_compressed_vocab_size)
    layout = EngramLayout.from_config(cfg)
    hasher = NgramHasher(cfg, np.arange(n, dtype=np.int64), n, layout)
    ids = np.random.default_rng(seed).integers(0, n, size=(1, n_tokens), dtype=np.int64)
    best = float("inf")
    for _ in range(repeats):
        hasher.reset()
        start = time.perf_counter()
        hasher.hash_ids(ids)
        best = min(best, time.perf_counter() - start)
    steps = min(256, n_tokens)
    hasher.reset()
    start = time.perf_counter()
    for t in range(steps):
        hasher.hash_ids(ids[:, t : t + 1])
    per_step = (time.perf_counter() - start) / steps
    return {
        "n_tokens": n_tokens,
        "n_layers": layout.n_layers,
        "n_hash_cols": layout.n_hash_cols,
        "prefill_s": best,
        "tokens_per_s": n_tokens / best if best > 0 else float("inf"),
        "decode_step_s": per_step,
    }
