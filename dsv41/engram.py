"""The Engram hash front end: compressed token map, prime bucket layout, multipliers, n-gram hasher.

Nothing in the checkpoint names an Engram row. The row a position reads is computed from the token
ids alone: each token id is folded onto a smaller "compressed" vocabulary (tokens that normalize
alike share an id), the last `engram_max_ngram_size` compressed ids are multiplied by per-layer odd
multipliers and XOR-ed into 2-gram .. N-gram hashes, and each hash is reduced modulo a prime per
(n-gram size, head) and shifted into that prime's slice of the layer's table. Get any of these facts
wrong and every lookup reads a different, equally plausible row, so this module pins them and
checks them against the config (`EngramLayout.verify`, `dsv41 engram`).

numpy is the only heavy dependency and is imported lazily. The hasher accepts and returns torch
tensors when a caller passes one, but never imports torch otherwise, so `dsv41 engram` stays light.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from dsv41.argtypes import whole_number
from dsv41.errors import Dsv41Error

# Miller-Rabin with the first twelve primes as bases is exact for every n < 3.3e24, far beyond any
# bucket size a config can ask for.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_MR_EXACT_BELOW = 318_665_857_834_031_151_167_461

# Private-use code point that stands in for a token that is exactly one space while Strip runs, so
# " " keeps a key of its own instead of folding into the empty string.
_LONE_SPACE = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"

# Seed stride of the per-layer multiplier RNG (seed = stride * layer id).
_MULTIPLIER_SEED_STRIDE = 10007


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
    def from_config(cls, cfg: Any) -> "EngramLayout":
        """Derive the layout from a Config (engram_num_embeddings may be None: it is not needed)."""
        missing = [name for name in ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads",
                                     "engram_head_dim", "engram_vocab_size")
                   if getattr(cfg, name, None) is None]
        if missing:
            raise EngramError(f"cannot derive the Engram layout: the config does not set {', '.join(missing)}")
        layer_ids = tuple(int(i) for i in cfg.engram_layer_ids)
        n, heads = int(cfg.engram_max_ngram_size), int(cfg.engram_n_heads)
        if n < 2 or heads < 1:
            raise EngramError(f"cannot derive the Engram layout: engram_max_ngram_size {n} must be >= 2 "
                              f"and engram_n_heads {heads} >= 1")
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
            layer_ids=layer_ids, max_ngram_size=n, n_heads=heads, head_dim=int(cfg.engram_head_dim),
            vocab_size=int(cfg.engram_vocab_size), primes=tuple(primes), offsets=tuple(offsets),
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
                problems.append(f"layer {layer}: {len(row)} primes and {len(starts)} offsets for "
                                f"{self.n_hash_cols} hash columns")
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
                    problems.append(f"layer {layer} column {c}: bucket starts at {start}, the previous "
                                    f"one ends at {end} ({kind} of {abs(start - end)} rows)")
                end = start + p
            derived = self.derived_num_embeddings[k]
            if end != derived:
                problems.append(f"layer {layer}: buckets end at row {end}, the primes sum to {derived}")
        declared = self.declared_num_embeddings
        if declared is None:
            problems.append(f"engram_num_embeddings is not set; the layout derives "
                            f"{list(self.derived_num_embeddings)}")
        elif len(declared) != self.n_layers:
            problems.append(f"engram_num_embeddings has {len(declared)} entries for {self.n_layers} Engram layers")
        else:
            for layer, want, got in zip(self.layer_ids, declared, self.derived_num_embeddings):
                if want != got:
                    problems.append(f"layer {layer}: engram_num_embeddings declares {want:,} rows, the prime "
                                    f"layout derives {got:,} (difference {want - got:+,})")
        return problems


# ---------------------------------------------------------------------- compressed token map
def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE, " "),
    ])


def normalize_token_text(text: str) -> str:
    """The key a decoded token folds to (before the empty-result and U+FFFD fallbacks)."""
    return _normalizer().normalize_str(text)


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a directory holding one."""
    import os

    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise EngramError(f"{path}: no tokenizer.json there; pass the file or the directory that holds it")
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # the Rust error text is the useful part
        raise EngramError(f"{file}: not a tokenizer.json the tokenizers library can read ({exc})") from None


def _as_backend(tokenizer):
    """Accept a `tokenizers.Tokenizer`, a Transformers fast tokenizer, or a path."""
    if isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def build_compressed_token_map(tokenizer) -> tuple["np.ndarray", int]:  # noqa: F821
    """(per-token-id compressed id as an int64 array, number of distinct keys).

    Each id is decoded alone (special tokens kept). A decode containing U+FFFD (a partial UTF-8
    byte token) is keyed by its raw vocabulary string instead; otherwise the key is the normalized
    text, or the decoded text itself when normalization leaves nothing. Compressed ids are handed
    out in first-seen order over ascending token ids, so they fill [0, n) with no gap.
    """
    import numpy as np

    backend = _as_backend(tokenizer)
    normalizer = _normalizer()
    n_ids = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(n_ids)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    token_map = np.empty(n_ids, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            raw = backend.id_to_token(token_id)
            key = raw if raw is not None else text
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = keys.setdefault(key, len(keys))
    return token_map, len(keys)


# ---------------------------------------------------------------------- multipliers
def compute_hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> "np.ndarray":  # noqa: F821
    """[n_layers, max_ngram_size] int64: one odd multiplier per look-back position (0 = the current
    token), drawn from numpy's default_rng seeded with 10007 * layer_id.

    The bound divides by the compressed vocabulary so `compressed_id * multiplier` stays inside int64;
    a wrong engram_compressed_vocab_size therefore changes every multiplier and rehashes the tables.
    """
    import numpy as np

    if compressed_vocab_size < 1:
        raise EngramError(f"the compressed vocabulary size must be positive, got {compressed_vocab_size}")
    bound = max(1, (int(np.iinfo(np.int64).max) // int(compressed_vocab_size)) // 2)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(_MULTIPLIER_SEED_STRIDE * int(layer_id))
        draws = rng.integers(low=0, high=bound, size=(int(max_ngram_size),), dtype=np.int64)
        rows.append(draws * 2 + 1)  # odd, so multiplying never discards the low bit
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, int(max_ngram_size)), dtype=np.int64)


# ---------------------------------------------------------------------- hasher
class NgramHasher:
    """Token ids -> Engram hash ids `[batch, seq, n_engram_layers, n_hash_cols]`, streaming.

    Each call continues the sequences of the previous one: the last `max_ngram_size - 1` compressed
    ids of every batch row are carried over, so a prefill followed by decode steps gives the same ids
    as one call over the whole sequence. `reset()` starts new sequences.

    Look-back stops at the start of a sequence and at dead tokens (`token_mask` False, e.g. an image
    span): from the first blocked look-back position on, that n-gram and every longer one take the
    pad id's compressed id in place of real tokens. A dead token's own n-grams are all pad.
    """

    DEAD = -1  # compressed-id marker for dead tokens and for positions before the sequence start

    def __init__(self, cfg: Any, token_map, n_compressed: int, layout: EngramLayout | None = None):
        """`token_map`/`n_compressed` as build_compressed_token_map returns them; refuses to build when
        `n_compressed` differs from the config's engram_compressed_vocab_size."""
        import numpy as np

        declared = getattr(cfg, "engram_compressed_vocab_size", None)
        if declared is None:
            raise EngramError(f"the config does not set engram_compressed_vocab_size; the tokenizer folds to "
                              f"{n_compressed:,} compressed ids, so set it to that")
        if int(n_compressed) != int(declared):
            raise EngramError(f"the tokenizer folds to {int(n_compressed):,} compressed ids but the config "
                              f"declares engram_compressed_vocab_size {int(declared):,}; hashing with either "
                              f"number would read the wrong Engram rows")
        self.layout = layout if layout is not None else EngramLayout.from_config(cfg)
        self.token_map = np.asarray(token_map, dtype=np.int64)
        if self.token_map.ndim != 1 or self.token_map.size == 0:
            raise EngramError("the compressed token map must be a non-empty 1-D array of ids")
        if self.token_map.min() < 0 or self.token_map.max() >= int(n_compressed):
            raise EngramError(f"the compressed token map holds ids outside [0, {int(n_compressed)})")
        self.n_compressed = int(n_compressed)
        pad = cfg.engram_pad_id
        if pad is None or not 0 <= int(pad) < self.token_map.size:
            raise EngramError(f"engram_pad_id {pad} is not a token id of this {self.token_map.size}-id tokenizer")
        self.pad_id = int(self.token_map[int(pad)])  # compressed
        lay = self.layout
        self.multipliers = compute_hash_multipliers(lay.layer_ids, lay.max_ngram_size, self.n_compressed)
        self.primes = np.array(lay.primes, dtype=np.int64).reshape(lay.n_layers, lay.max_ngram_size - 1, lay.n_heads)
        self.offsets = np.array(lay.offsets, dtype=np.int64).reshape(lay.n_layers, lay.n_hash_cols)
        self.reset()

    @classmethod
    def from_tokenizer(cls, cfg: Any, tokenizer, layout: EngramLayout | None = None) -> "NgramHasher":
        """Build the compressed map from `tokenizer` (a Tokenizer, a fast tokenizer, or a path)."""
        token_map, n_compressed = build_compressed_token_map(tokenizer)
        return cls(cfg, token_map, n_compressed, layout)

    def reset(self) -> None:
        """Forget the carried look-back: the next call starts new sequences."""
        self._history = None  # [batch, max_ngram_size - 1] compressed ids, oldest first; DEAD = none
        self.n_positions = 0  # positions hashed since the last reset

    def state(self) -> tuple:
        """The carried look-back, to put back with `set_state` (a model's rollback and snapshots)."""
        return (None if self._history is None else self._history.copy()), self.n_positions

    def set_state(self, state: tuple) -> None:
        history, self.n_positions = state
        self._history = None if history is None else history.copy()

    def __call__(self, token_ids, token_mask=None):
        return self.hash_ids(token_ids, token_mask)

    def hash_ids(self, token_ids, token_mask=None):
        """Hash ids of the n-grams ending at each position of `token_ids` ([batch, seq] or [seq]).

        `token_mask` (same shape, bool) is False for dead tokens. Returns an int64 array (or a torch
        tensor when a tensor was passed) shaped [batch, seq, n_engram_layers, n_hash_cols]
        ([seq, n_engram_layers, n_hash_cols] for 1-D input); column order is n-gram size major.
        """
        import numpy as np

        as_torch = type(token_ids).__module__.startswith("torch")
        ids = np.asarray(token_ids.detach().cpu().numpy() if as_torch else token_ids)
        squeeze = ids.ndim == 1
        if squeeze:
            ids = ids[None, :]
        if ids.ndim != 2:
            raise EngramError(f"token ids must be [batch, seq] or [seq], got shape {list(ids.shape)}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise EngramError(f"token ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        batch, seq = ids.shape
        if ids.size and (ids.min() < 0 or ids.max() >= self.token_map.size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise EngramError(f"token id {bad} is outside this tokenizer's {self.token_map.size} ids")
        compressed = self.token_map[ids]  # [batch, seq]
        if token_mask is not None:
            mask = token_mask.detach().cpu().numpy() if type(token_mask).__module__.startswith("torch") else token_mask
            mask = np.asarray(mask, dtype=bool)
            if squeeze and mask.ndim == 1:
                mask = mask[None, :]
            if mask.shape != ids.shape:
                raise EngramError(f"token_mask has shape {list(mask.shape)}, the token ids {list(ids.shape)}")
            compressed = np.where(mask, compressed, self.DEAD)

        look_back = self.layout.max_ngram_size - 1
        if self._history is None:
            self._history = np.full((batch, look_back), self.DEAD, dtype=np.int64)
        elif self._history.shape[0] != batch:
            raise EngramError(f"this hasher is carrying {self._history.shape[0]} sequences but was given a "
                              f"batch of {batch}; call reset() before starting a different batch")
        window = np.concatenate([self._history, compressed], axis=1)  # [batch, look_back + seq]
        self._history = window[:, window.shape[1] - look_back:].copy()
        self.n_positions += seq
        out = self._hash_window(window, seq)
        if squeeze:
            out = out[0]
        if as_torch:
            import torch

            return torch.from_numpy(out).to(token_ids.device)
        return out

    def _hash_window(self, window, seq: int):
        """[batch, look_back + seq] compressed ids (DEAD where none) -> [batch, seq, layers, cols]."""
        import numpy as np

        look_back = self.layout.max_ngram_size - 1
        blocked = np.zeros((window.shape[0], seq), dtype=bool)
        rolling = None
        hashes = []
        for shift in range(self.layout.max_ngram_size):
            source = window[:, look_back - shift: look_back - shift + seq]  # the token `shift` back
            blocked |= source == self.DEAD  # sticky: a blocked n-gram blocks every longer one
            token = np.where(blocked, self.pad_id, source)
            product = token[:, :, None] * self.multipliers[:, shift]  # [batch, seq, layers]
            rolling = product if rolling is None else np.bitwise_xor(rolling, product)
            if shift:
                # the (shift+1)-gram hash, reduced into each head's prime bucket
                hashes.append(rolling[..., None] % self.primes[:, shift - 1])  # [batch, seq, layers, heads]
        return np.concatenate(hashes, axis=-1) + self.offsets  # [batch, seq, layers, cols]


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
    return {"n_splits": len(equal), "equal": equal, "all_equal": all(equal), "first_unequal": first,
            "whole": whole}


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
        layers.append({"layer": layer, "positions": seq, "rows": int(loads.size), "rows_used": int(used.size),
                       "max_load": int(loads.max()), "mean_load_used": float(used.mean()) if used.size else 0.0,
                       "outside": outside, "histogram": np.bincount(loads).tolist()})
    length = max([len(e["histogram"]) for e in layers]
                 + [len(poisson_rows(seq, row)) for row in layout.flat_primes])
    for e, row in zip(layers, layout.flat_primes):
        e["histogram"] += [0] * (length - len(e["histogram"]))  # no row holds that many
        e["poisson"] = poisson_rows(seq, row, length)
    return {"n_positions": seq, "layer_ids": list(layout.layer_ids), "layers": layers,
            "inside_buckets": all(e["outside"] == 0 for e in layers)}


# ---------------------------------------------------------------------- benchmark
def bench_hasher(n_tokens: int = 32768, cfg: Any = None, repeats: int = 5, seed: int = 0) -> dict:
    """Time hashing one `n_tokens` prompt in one call, and decode steps one token at a time.

    Uses an identity compressed map of the config's size (the released config by default), so it
    needs no tokenizer. Returns seconds (best of `repeats`).
    """
    import time

    import numpy as np

    if int(n_tokens) < 1:
        raise EngramError(f"the benchmark needs a prompt of at least one token, got {n_tokens}")
    if cfg is None:
        from dsv41.config import RELEASED as cfg
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
        hasher.hash_ids(ids[:, t:t + 1])
    per_step = (time.perf_counter() - start) / steps
    return {"n_tokens": n_tokens, "n_layers": layout.n_layers, "n_hash_cols": layout.n_hash_cols,
            "prefill_s": best, "tokens_per_s": n_tokens / best if best > 0 else float("inf"),
            "decode_step_s": per_step}


# ---------------------------------------------------------------------- report and CLI
_GIB = 1 << 30
# `dsv41 engram --bench-tokens`: at the bound the benchmark holds about 1.3 GB (the released
# geometry hashes each token into 2 x 24 int64 ids) and runs for seconds
MAX_BENCH_TOKENS = 1 << 20


def engram_report(cfg: Any, tokenizer=None, text: str | None = None, tokenizer_label: str | None = None) -> dict:
    """Everything `dsv41 engram` prints, as plain data; `problems` lists every disagreement."""
    report: dict = {"config": getattr(cfg, "source", None), "layers": [], "problems": []}
    problems = report["problems"]
    try:
        layout = EngramLayout.from_config(cfg)
    except EngramError as exc:
        problems.append(str(exc))
        return report
    problems.extend(layout.verify())
    declared_vocab = cfg.engram_compressed_vocab_size
    multipliers = None
    if declared_vocab is None:
        problems.append("engram_compressed_vocab_size is not set, so the hash multipliers are undefined")
    else:
        multipliers = compute_hash_multipliers(layout.layer_ids, layout.max_ngram_size, declared_vocab)
    declared_rows = layout.declared_num_embeddings
    for k, layer in enumerate(layout.layer_ids):
        derived = layout.derived_num_embeddings[k]
        declared = declared_rows[k] if declared_rows is not None and k < len(declared_rows) else None
        lo, hi = layout.prime_range(k)
        entry = {
            "layer": layer, "declared_rows": declared, "derived_rows": derived,
            "difference": None if declared is None else declared - derived,
            "derived_gib": layout.table_bytes(derived)[0] / _GIB,
            "derived_scale_gib": layout.table_bytes(derived)[1] / _GIB,
            "declared_gib": None if declared is None else layout.table_bytes(declared)[0] / _GIB,
            "prime_first": lo, "prime_last": hi, "n_primes": len(layout.flat_primes[k]),
            "multipliers": None if multipliers is None else [int(m) for m in multipliers[k]],
        }
        report["layers"].append(entry)
    if tokenizer is None:
        return report

    backend = _as_backend(tokenizer)
    token_map, n_compressed = build_compressed_token_map(backend)
    pad = cfg.engram_pad_id
    tok = {"path": tokenizer_label, "n_ids": int(token_map.size), "compressed_size": n_compressed,
           "config_compressed_size": declared_vocab, "pad_id": pad,
           "pad_compressed_id": int(token_map[pad]) if pad is not None and 0 <= pad < token_map.size else None}
    report["tokenizer"] = tok
    if declared_vocab is not None and n_compressed != declared_vocab:
        problems.append(f"the tokenizer folds to {n_compressed:,} compressed ids but the config declares "
                        f"engram_compressed_vocab_size {declared_vocab:,}")
    if tok["pad_compressed_id"] is None:
        problems.append(f"engram_pad_id {pad} is not a token id of this {token_map.size}-id tokenizer")
    if cfg.vocab_size is not None and token_map.size > cfg.vocab_size:
        # the embedding has no row for the tokenizer's highest ids
        problems.append(f"the tokenizer has {token_map.size:,} ids, more than the config's vocab_size {cfg.vocab_size:,}")
    if text is None:
        return report

    ids = backend.encode(text, add_special_tokens=False).ids
    entry = {"text": text, "token_ids": list(ids), "hash_ids": None, "inside_tables": None}
    report["text"] = entry
    try:
        hasher = NgramHasher(cfg, token_map, n_compressed, layout)
    except EngramError as exc:
        problems.append(f"cannot hash the text: {exc}")
        return report
    hashes = hasher.hash_ids([ids]) if ids else None  # [1, seq, layers, cols]
    if hashes is None:
        return report
    entry["hash_ids"] = hashes[0].tolist()  # [seq][layer][col]
    rows = layout.num_embeddings
    inside = True
    for k, layer in enumerate(layout.layer_ids):
        col = hashes[0, :, k, :]
        if k >= len(rows) or col.min() < 0 or col.max() >= rows[k]:
            inside = False
            limit = rows[k] if k < len(rows) else "?"
            problems.append(f"layer {layer}: hash ids span [{int(col.min())}, {int(col.max())}], outside the "
                            f"table's {limit} rows")
    entry["inside_tables"] = inside
    return report


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.01 else f"{gib * 1024:.2f} MiB"


def _print_report(report: dict) -> None:
    print(f"config: {report['config']}")
    for e in report["layers"]:
        declared = "not declared" if e["declared_rows"] is None else f"declared {e['declared_rows']:,}"
        diff = "" if e["difference"] is None else f" (difference {e['difference']:+,})"
        print(f"Engram layer {e['layer']}: {declared} rows, derived {e['derived_rows']:,}{diff}")
        gib = f"  {_size(e['derived_gib'])} FP8 + {_size(e['derived_scale_gib'])} E8M0 scales (derived)"
        if e["declared_gib"] is not None and e["difference"]:
            gib += f"; {_size(e['declared_gib'])} FP8 as declared"
        print(gib)
        print(f"  {e['n_primes']} primes {e['prime_first']:,} .. {e['prime_last']:,}")
        if e["multipliers"] is not None:
            print(f"  multipliers {e['multipliers']}")
    tok = report.get("tokenizer")
    if tok:
        cfg_size = tok["config_compressed_size"]
        print(f"tokenizer {tok['path'] or ''}: {tok['n_ids']:,} ids fold to {tok['compressed_size']:,} compressed "
              f"ids; the config declares {'nothing' if cfg_size is None else f'{cfg_size:,}'}")
        print(f"  pad id {tok['pad_id']} -> compressed id {tok['pad_compressed_id']}")
    text = report.get("text")
    if text:
        print(f"text {text['text']!r}: {len(text['token_ids'])} tokens {text['token_ids']}")
        if text["hash_ids"] is not None:
            for t, (token, per_layer) in enumerate(zip(text["token_ids"], text["hash_ids"])):
                cells = "  ".join(f"L{e['layer']} {row}" for e, row in zip(report["layers"], per_layer))
                print(f"  {t:>4} id {token:>7}: {cells}")
            print(f"  every hash id inside its table: {'yes' if text['inside_tables'] else 'NO'}")
    for p in report["problems"]:
        print(f"[problem] {p}")
    print("[ok] the Engram front end agrees with the config" if not report["problems"]
          else f"[fail] {len(report['problems'])} problem(s)")


def _not_utf8(text: str) -> str | None:
    """None when `text` encodes as UTF-8, else what stops it: a byte of the command line that was
    not UTF-8 (Python decodes it to a lone surrogate U+DC80..U+DCFF), or another lone surrogate."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            if "\udc80" <= ch <= "\udcff":
                return f"the byte \\x{ord(ch) - 0xDC00:02x} at character {i} is not UTF-8"
            return f"the lone surrogate U+{ord(ch):04X} at character {i} is not a character UTF-8 can encode"
    return None


def _json_target_problem(path: str) -> str | None:
    """Why the --json report cannot be written at `path` (checked before any work), or None."""
    import os

    if os.path.isdir(path):
        return "it is a folder"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist" if not os.path.exists(folder) else f"{folder} is not a folder"
    return None


def cli_main(argv: list[str]) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="dsv41 engram", description=(
        "Derive the Engram bucket layout and hash multipliers from a config, compare them with the "
        "declared row counts and (with --tokenizer) the compressed vocabulary; exit non-zero on any "
        "disagreement."))
    parser.add_argument("--config", metavar="PATH", help="config file or checkpoint directory (required unless --bench)")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer.json or the directory holding it")
    parser.add_argument("--text", metavar="STR", help="encode this text (UTF-8) and print its hash ids (needs --tokenizer)")
    parser.add_argument("--json", metavar="OUT", help="write the report here (also when a check fails)")
    parser.add_argument("--bench", action="store_true", help="time the hasher on a synthetic prompt and exit")
    parser.add_argument("--bench-tokens", type=whole_number(1, MAX_BENCH_TOKENS, "tokens"), default=32768, metavar="N",
                        help=f"prompt length for --bench: 1 to {MAX_BENCH_TOKENS:,} tokens (default 32,768)")
    args = parser.parse_args(argv)
    if args.text is not None and args.tokenizer is None:
        parser.error("--text needs --tokenizer to turn the text into token ids")
    if args.text is not None and (why := _not_utf8(args.text)):
        parser.error(f"argument --text: {why}; pass the text in UTF-8")
    if args.config is None and not args.bench:
        parser.error("--config is required (or --bench)")

    def fail(message: str) -> int:
        print(f"dsv41 engram: {message}", file=sys.stderr)
        return 1

    def write_json(report: dict) -> bool:
        """Write the --json report; False (after one sentence on stderr) when that fails."""
        if not args.json:
            return True
        try:
            _write_json(args.json, report, json)
        except OSError as exc:
            fail(f"--json {args.json}: cannot write the report there ({exc.strerror or exc})")
            return False
        return True

    if args.json and (why := _json_target_problem(args.json)):
        return fail(f"--json {args.json}: cannot write the report there ({why}); pass a file path in an "
                    f"existing folder")

    from dsv41.config import ConfigError, load_config

    cfg = None
    if args.config is not None:
        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            print(f"dsv41 engram: {exc}", file=sys.stderr)
            write_json({"config": args.config, "layers": [], "problems": [str(exc)]})
            return 1
        # impossible sizes first: the prime search grows with the square of the hash columns
        absurd = cfg.value_problems()
        if absurd:
            print(f"dsv41 engram: {cfg.source}: {absurd[0]}", file=sys.stderr)
            write_json({"config": cfg.source, "layers": [], "problems": absurd})
            return 1
    if args.bench:
        try:
            result = bench_hasher(args.bench_tokens, cfg)
        except EngramError as exc:
            return fail(f"cannot benchmark this config: {exc}")
        print(f"hashed a {result['n_tokens']:,}-token prompt into {result['n_layers']} layers x "
              f"{result['n_hash_cols']} columns in {result['prefill_s'] * 1e3:.1f} ms "
              f"({result['tokens_per_s'] / 1e6:.2f} M tokens/s); one decode step {result['decode_step_s'] * 1e6:.0f} us")
        return 0 if write_json({"bench": result}) else 1

    tokenizer = None
    report: dict
    try:
        if args.tokenizer is not None:
            tokenizer = load_tokenizer(args.tokenizer)
        report = engram_report(cfg, tokenizer, args.text, tokenizer_label=args.tokenizer)
    except EngramError as exc:
        report = {"config": cfg.source, "layers": [], "problems": [str(exc)]}
    _print_report(report)
    if not write_json(report):
        return 1
    return 1 if report["problems"] else 0


def _write_json(path: str | None, report: dict, json) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
