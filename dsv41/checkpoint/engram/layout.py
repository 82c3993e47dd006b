"""Primes and the Engram bucket layout: which rows of each table every hash column owns,
derived from the config alone and checked against its declared row counts."""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.core.config import Config
from dsv41.core.errors import Dsv41Error

# Miller-Rabin with the first twelve primes as bases is exact for every n < 3.3e24, far beyond any
# bucket size a config can ask for.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_MR_EXACT_BELOW = 318_665_857_834_031_151_167_461


class EngramError(Dsv41Error, ValueError):
    """An Engram fact that disagrees with the config or the tokenizer."""


# ---------------------------------------------------------------------- primes
def is_prime(n: int) -> bool:
    """Deterministic primality (Miller-Rabin over fixed bases; exact below 3.3e24)."""
    n = int(n)
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    if n >= _MR_EXACT_BELOW:
        raise ValueError(f"is_prime is only exact below {_MR_EXACT_BELOW}, got {n}")
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(at_least: int, taken: set[int] | frozenset[int] = frozenset()) -> int:
    """The smallest prime >= `at_least` that is not in `taken`."""
    candidate = max(int(at_least), 2)
    while candidate in taken or not is_prime(candidate):
        candidate += 1
    return candidate


# ---------------------------------------------------------------------- layout
@dataclass(frozen=True)
class EngramLayout:
    """Prime-sized bucket ranges of every Engram table, derived from the config alone.

    Each Engram layer hashes a position into `n_hash_cols = (max_ngram_size - 1) * n_heads` columns,
    ordered n-gram size major, head minor (2-gram head 0, 2-gram head 1, ..., N-gram head H-1).
    Column c of layer k owns rows [offsets[k][c], offsets[k][c] + primes[k][c]) of that layer's
    table, so the table needs exactly sum(primes[k]) rows (`derived_num_embeddings`).

    Primes are handed out in ascending order starting at `engram_vocab_size`, layer by layer,
    n-gram size by n-gram size, head by head, and never reused — so no two columns anywhere share a
    modulus.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int  # engram_vocab_size: primes start here
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][n-gram size - 2][head]
    offsets: tuple[tuple[int, ...], ...]  # [layer][column], running sum of the flattened primes
    declared_num_embeddings: tuple[int, ...] | None = None  # engram_num_embeddings, if the config states it

    @classmethod
    def from_config(cls, cfg: Config) -> "EngramLayout":
        """Derive the layout from a Config (engram_num_embeddings may be None: it is not needed)."""
        missing = [
            name
            for name in (
                "engram_layer_ids",
                "engram_max_ngram_size",
                "engram_n_heads",
                "engram_head_dim",
                "engram_vocab_size",
            )
            if getattr(cfg, name, None) is None
        ]
        if missing:
            raise EngramError(f"cannot derive the Engram layout: the config does not set {', '.join(missing)}")
        layer_ids = tuple(int(i) for i in cfg.engram_layer_ids)
        n, heads = int(cfg.engram_max_ngram_size), int(cfg.engram_n_heads)
        if n < 2 or heads < 1:
            raise EngramError(
                f"cannot derive the Engram layout: engram_max_ngram_size {n} must be >= 2 "
                f"and engram_n_heads {heads} >= 1"
            )
        taken: set[int] = set()
        primes = []
        for _ in layer_ids:
            per_layer = []
            for _ in range(n - 1):
                per_ngram = []
                for _ in range(heads):
                    # each search restarts at the vocabulary size; skipping `taken` is what keeps the
                    # sequence ascending and reuse-free across n-gram sizes and layers
                    p = next_unused_prime(cfg.engram_vocab_size, taken)
                    taken.add(p)
                    per_ngram.append(p)
                per_layer.append(tuple(per_ngram))
            primes.append(tuple(per_layer))
        offsets = []
        for per_layer in primes:
            running, starts = 0, []
            for p in (p for per_ngram in per_layer for p in per_ngram):
                starts.append(running)
                running += p
            offsets.append(tuple(starts))
        declared = cfg.engram_num_embeddings
        return cls(
            layer_ids=layer_ids,
            max_ngram_size=n,
            n_heads=heads,
            head_dim=int(cfg.engram_head_dim),
            vocab_size=int(cfg.engram_vocab_size),
            primes=tuple(primes),
            offsets=tuple(offsets),
            declared_num_embeddings=None if declared is None else tuple(int(r) for r in declared),
        )

    # ------------------------------------------------------------------ derived facts
    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def flat_primes(self) -> tuple[tuple[int, ...], ...]:
        """[layer][column] moduli, in hash-column order."""
        return tuple(tuple(p for per_ngram in per_layer for p in per_ngram) for per_layer in self.primes)

    @property
    def derived_num_embeddings(self) -> tuple[int, ...]:
        """Rows each table needs: the sum of its primes (the largest hash id is that sum minus one)."""
        return tuple(sum(row) for row in self.flat_primes)

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """The declared row counts where the config states them, else the derived ones."""
        return self.declared_num_embeddings if self.declared_num_embeddings is not None else self.derived_num_embeddings

    def prime_range(self, layer_index: int) -> tuple[int, int]:
        """(smallest, largest) prime of the layer at position `layer_index` in layer_ids."""
        row = self.flat_primes[layer_index]
        return min(row), max(row)

    def table_bytes(self, rows: int) -> tuple[int, int]:
        """(FP8 payload, E8M0 scale) bytes of a table with `rows` rows: one byte per channel, one
        scale byte per 32 channels."""
        return rows * self.head_dim, rows * (self.head_dim // 32)

    def verify(self) -> list[str]:
        """Every disagreement between the declared row counts and the derivation, one sentence each;
        also re-checks that the primes are prime, distinct, and that the buckets tile each table."""
        problems = []
        seen: set[int] = set()
        for k, (layer, row, starts) in enumerate(zip(self.layer_ids, self.flat_primes, self.offsets)):
            if len(row) != self.n_hash_cols or len(starts) != self.n_hash_cols:
                problems.append(
                    f"layer {layer}: {len(row)} primes and {len(starts)} offsets for {self.n_hash_cols} hash columns"
                )
                continue
            for c, p in enumerate(row):
                if p < self.vocab_size or not is_prime(p):
                    problems.append(f"layer {layer} column {c}: bucket size {p} is not a prime >= {self.vocab_size}")
                if p in seen:
                    problems.append(f"layer {layer} column {c}: prime {p} is used twice")
                seen.add(p)
            # the buckets tile [0, rows): each starts where the previous one ended
            end = 0
            for c, (p, start) in enumerate(zip(row, starts)):
                if start != end:
                    kind = "gap" if start > end else "overlap"
                    problems.append(
                        f"layer {layer} column {c}: bucket starts at {start}, the previous "
                        f"one ends at {end} ({kind} of {abs(start - end)} rows)"
                    )
                end = start + p
            derived = self.derived_num_embeddings[k]
            if end != derived:
                problems.append(f"layer {layer}: buckets end at row {end}, the primes sum to {derived}")
        declared = self.declared_num_embeddings
        if declared is None:
            problems.append(f"engram_num_embeddings is not set; the layout derives {list(self.derived_num_embeddings)}")
        elif len(declared) != self.n_layers:
            problems.append(f"engram_num_embeddings has {len(declared)} entries for {self.n_layers} Engram layers")
        else:
            for layer, want, got in zip(self.layer_ids, declared, self.derived_num_embeddings):
                if want != got:
                    problems.append(
                        f"layer {layer}: engram_num_embeddings declares {want:,} rows, the prime "
                        f"layout derives {got:,} (difference {want - got:+,})"
                    )
        return problems
