"""The Engram hash front end: compressed token map, prime bucket layout, multipliers, n-gram hasher.

Nothing in the checkpoint names an Engram row. The row a position reads is computed from the token
ids alone: each token id is folded onto a smaller "compressed" vocabulary (tokens that normalize
alike share an id), the last `engram_max_ngram_size` compressed ids are multiplied by per-layer odd
multipliers and XOR-ed into 2-gram .. N-gram hashes, and each hash is reduced modulo a prime per
(n-gram size, head) and shifted into that prime's slice of the layer's table. Get any of these facts
wrong and every lookup reads a different, equally plausible row, so this package pins them and
checks them against the config (`EngramLayout.verify`, `dsv41 engram`).

numpy is the only heavy dependency and is imported lazily. The hasher accepts and returns torch
tensors when a caller passes one, but never imports torch otherwise, so `dsv41 engram` stays light.

The package has one module per concept: `layout.py` (primes and the bucket layout a config
implies), `hasher.py` (the compressed token map, the multipliers and the streaming hasher),
`checks.py` (the measurements the notebooks and tests make of a hasher: split equality, bucket load
against Poisson, the benchmark) and `report.py` (what `dsv41 engram` prints, and its command line).
"""

from .checks import bench_hasher, bucket_load, poisson_rows, split_equality
from .hasher import (
    NgramHasher,
    build_compressed_token_map,
    compute_hash_multipliers,
    load_tokenizer,
    normalize_token_text,
)
from .layout import EngramError, EngramLayout, is_prime, next_unused_prime
from .report import MAX_BENCH_TOKENS, cli_main, engram_report

__all__ = [
    "EngramError",
    "EngramLayout",
    "MAX_BENCH_TOKENS",
    "NgramHasher",
    "bench_hasher",
    "bucket_load",
    "build_compressed_token_map",
    "cli_main",
    "compute_hash_multipliers",
    "engram_report",
    "is_prime",
    "load_tokenizer",
    "next_unused_prime",
    "normalize_token_text",
    "poisson_rows",
    "split_equality",
]
