"""Token streams for training and evaluation: the corpus tokenized once into a work folder, batches
drawn from a seeded generator, held-out windows in a fixed order, bytes per token for bits per byte."""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from ..core.outdir import replace_file
from .corpus import Corpus


@dataclass
class Streams:
    train: np.ndarray  # int32 [n]: every train document, EOS after each
    held_out: np.ndarray
    token_bytes: np.ndarray  # int64 [vocab]: UTF-8 bytes each id decodes to (0 for special ids)
    held_out_text: bytes  # the held-out documents joined, as the compressors read them

    def held_out_bytes(self) -> int:
        return int(self.token_bytes[self.held_out].sum())


def token_byte_lengths(tokenizer) -> np.ndarray:
    """Bytes each id stands for: a byte-level token spells one alphabet character per byte."""
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    out = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for text, token_id in vocab.items():
        out[token_id] = len(text)
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    for text in special:
        out[tokenizer.token_to_id(text)] = 0
    return out


def encode_documents(tokenizer, docs: dict[str, str], eos: int) -> np.ndarray:
    names = list(docs)
    pieces = []
    for start in range(0, len(names), 64):
        batch = [docs[n] for n in names[start : start + 64]]
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            pieces.append(np.asarray(enc.ids + [eos], dtype=np.int32))
    return np.concatenate(pieces)


def build_streams(corpus: Corpus, tokenizer, eos: int, cache: str | None = None) -> Streams:
    """The corpus tokenized (kept in `cache`, an .npz file, keyed by the corpus and tokenizer). A
    cache that cannot be read or holds what no tokenization of this corpus gives is said in one
    line on stderr and written again."""
    key = hashlib.sha256((corpus.file_list_sha256 + tokenizer.to_str()).encode()).hexdigest()[:16]
    if cache and os.path.lexists(cache):
        saved, problem = cached_streams(cache, key, corpus, tokenizer.get_vocab_size(with_added_tokens=True))
        if saved is not None:
            return Streams(*saved, token_byte_lengths(tokenizer), _joined(corpus.held_out))
        if problem:
            print(f"dsv41 train: {cache} {problem}; tokenizing the corpus again", file=sys.stderr)
    train = encode_documents(tokenizer, corpus.train, eos)
    held_out = encode_documents(tokenizer, corpus.held_out, eos)
    if cache:
        replace_file(cache, lambda tmp: _save_npz(tmp, key=np.array(key), train=train, held_out=held_out))
    return Streams(train, held_out, token_byte_lengths(tokenizer), _joined(corpus.held_out))


def _save_npz(path: str, **arrays) -> None:
    with open(path, "wb") as f:  # a file object: np.savez would add ".npz" to a name
        np.savez(f, **arrays)


def cached_streams(cache: str, key: str, corpus: Corpus, vocab: int):
    """((train, held_out), None) from the cache when it holds the streams of `key`; (None, None)
    when it holds another key's (a stale cache); (None, what is wrong) when it is unreadable or
    its arrays are not token streams of this corpus (sizes checked before anything is read)."""
    # a token is at least one byte of text, or the EOS after a document
    most = {
        name: 4 * (sum(len(t.encode("utf-8")) for t in docs.values()) + len(docs)) + 4096
        for name, docs in (("train", corpus.train), ("held_out", corpus.held_out))
    }
    try:
        with zipfile.ZipFile(cache) as archive:
            sizes = {info.filename: info.file_size for info in archive.infolist()}
        if set(sizes) != {"key.npy", "train.npy", "held_out.npy"}:
            return None, f"holds {', '.join(sorted(sizes)) or 'nothing'}, not the token streams"
        if sizes["key.npy"] > 4096 or any(sizes[f"{name}.npy"] > most[name] for name in most):
            return None, "holds arrays larger than the corpus could give"
        with np.load(cache, allow_pickle=False) as saved:
            if saved["key"].shape != () or str(saved["key"]) != key:
                return None, None
            arrays = saved["train"], saved["held_out"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        return None, f"is unreadable ({str(exc)[:80] or type(exc).__name__})"
    for array in arrays:
        if (
            array.dtype != np.int32
            or array.ndim != 1
            or not len(array)
            or int(array.min()) < 0
            or int(array.max()) >= vocab
        ):
            return None, "holds arrays that are not token ids of this tokenizer"
    return arrays, None


def _joined(docs: dict[str, str]) -> bytes:
    return "".join(docs.values()).encode("utf-8")


def train_batch(stream: np.ndarray, batch: int, seq_len: int, bos: int, generator: torch.Generator):
    """(inputs [b, s], targets [b, s]) int64: windows at random offsets, each input starting with
    BOS as every prompt does, so position 0 predicts the window's first token."""
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator).numpy()
    targets = np.stack([stream[o : o + seq_len] for o in starts]).astype(np.int64)
    inputs = np.concatenate([np.full((batch, 1), bos, dtype=np.int64), targets[:, :-1]], axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def held_out_windows(stream: np.ndarray, seq_len: int, bos: int, limit: int | None = None):
    """The held-out stream cut into consecutive windows (the tail that fills no window is left out);
    yields (inputs [1, s], targets [1, s])."""
    n = len(stream) // seq_len
    for w in range(n if limit is None else min(n, limit)):
        targets = torch.from_numpy(stream[w * seq_len : (w + 1) * seq_len].astype(np.int64)).unsqueeze(0)
        inputs = torch.cat([torch.tensor([[bos]]), targets[:, :-1]], dim=1)
        yield inputs, targets


def compressor_bits_per_byte(data: bytes) -> dict:
    """gzip -9 (Python's zlib) and zstd -19 (the zstd program, where installed) on `data`."""
    out = {"gzip -9": 8 * len(gzip.compress(data, compresslevel=9, mtime=0)) / len(data)}
    zstd = shutil.which("zstd")
    if zstd:
        done = subprocess.run([zstd, "-19", "-q", "-c"], input=data, capture_output=True, check=True)
        out["zstd -19"] = 8 * len(done.stdout) / len(data)
    else:
        out["zstd -19"] = None  # not measured: no zstd program on PATH
    return out


def nats_to_bits(nats: float) -> float:
    return nats / math.log(2)
