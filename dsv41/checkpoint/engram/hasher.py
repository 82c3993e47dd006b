"""Token ids to Engram hash ids: the compressed token map, the per-layer multipliers and the
streaming n-gram hasher."""

from __future__ import annotations

from dsv41.core.config import Config

from .layout import EngramError, EngramLayout

# Private-use code point that stands in for a token that is exactly one space while Strip runs, so
# " " keeps a key of its own instead of folding into the empty string.
_LONE_SPACE = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"

# Seed stride of the per-layer multiplier RNG (seed = stride * layer id).
_MULTIPLIER_SEED_STRIDE = 10007


# ---------------------------------------------------------------------- compressed token map
def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE, " "),
        ]
    )


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

    def __init__(self, cfg: Config, token_map, n_compressed: int, layout: EngramLayout | None = None):
        """`token_map`/`n_compressed` as build_compressed_token_map returns them; refuses to build when
        `n_compressed` differs from the config's engram_compressed_vocab_size."""
        import numpy as np

        declared = getattr(cfg, "engram_compressed_vocab_size", None)
        if declared is None:
            raise EngramError(
                f"the config does not set engram_compressed_vocab_size; the tokenizer folds to "
                f"{n_compressed:,} compressed ids, so set it to that"
            )
        if int(n_compressed) != int(declared):
            raise EngramError(
                f"the tokenizer folds to {int(n_compressed):,} compressed ids but the config "
                f"declares engram_compressed_vocab_size {int(declared):,}; hashing with either "
                f"number would read the wrong Engram rows"
            )
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
    def from_tokenizer(cls, cfg: Config, tokenizer, layout: EngramLayout | None = None) -> "NgramHasher":
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
            raise EngramError(
                f"this hasher is carrying {self._history.shape[0]} sequences but was given a "
                f"batch of {batch}; call reset() before starting a different batch"
            )
        window = np.concatenate([self._history, compressed], axis=1)  # [batch, look_back + seq]
        self._history = window[:, window.shape[1] - look_back :].copy()
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
            source = window[:, look_back - shift : look_back - shift + seq]  # the token `shift` back
            blocked |= source == self.DEAD  # sticky: a blocked n-gram blocks every longer one
            token = np.where(blocked, self.pad_id, source)
            product = token[:, :, None] * self.multipliers[:, shift]  # [batch, seq, layers]
            rolling = product if rolling is None else np.bitwise_xor(rolling, product)
            if shift:
                # the (shift+1)-gram hash, reduced into each head's prime bucket
                hashes.append(rolling[..., None] % self.primes[:, shift - 1])  # [batch, seq, layers, heads]
        return np.concatenate(hashes, axis=-1) + self.offsets  # [batch, seq, layers, cols]
