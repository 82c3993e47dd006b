"""`dsv41 engram`: the report of what a config (and tokenizer) implies, printed or written as
JSON, and its command line."""

from __future__ import annotations

import sys

from dsv41.core.argtypes import whole_number
from dsv41.core.config import Config

from .checks import bench_hasher
from .hasher import NgramHasher, _as_backend, build_compressed_token_map, compute_hash_multipliers, load_tokenizer
from .layout import EngramError, EngramLayout

# ---------------------------------------------------------------------- report and CLI
_GIB = 1 << 30
# `dsv41 engram --bench-tokens`: at the bound the benchmark holds about 1.3 GB (the released
# geometry hashes each token into 2 x 24 int64 ids) and runs for seconds
MAX_BENCH_TOKENS = 1 << 20


def engram_report(cfg: Config, tokenizer=None, text: str | None = None, tokenizer_label: str | None = None) -> dict:
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
            "layer": layer,
            "declared_rows": declared,
            "derived_rows": derived,
            "difference": None if declared is None else declared - derived,
            "derived_gib": layout.table_bytes(derived)[0] / _GIB,
            "derived_scale_gib": layout.table_bytes(derived)[1] / _GIB,
            "declared_gib": None if declared is None else layout.table_bytes(declared)[0] / _GIB,
            "prime_first": lo,
            "prime_last": hi,
            "n_primes": len(layout.flat_primes[k]),
            "multipliers": None if multipliers is None else [int(m) for m in multipliers[k]],
        }
        report["layers"].append(entry)
    if tokenizer is None:
        return report

    backend = _as_backend(tokenizer)
    token_map, n_compressed = build_compressed_token_map(backend)
    pad = cfg.engram_pad_id
    tok = {
        "path": tokenizer_label,
        "n_ids": int(token_map.size),
        "compressed_size": n_compressed,
        "config_compressed_size": declared_vocab,
        "pad_id": pad,
        "pad_compressed_id": int(token_map[pad]) if pad is not None and 0 <= pad < token_map.size else None,
    }
    report["tokenizer"] = tok
    if declared_vocab is not None and n_compressed != declared_vocab:
        problems.append(
            f"the tokenizer folds to {n_compressed:,} compressed ids but the config declares "
            f"engram_compressed_vocab_size {declared_vocab:,}"
        )
    if tok["pad_compressed_id"] is None:
        problems.append(f"engram_pad_id {pad} is not a token id of this {token_map.size}-id tokenizer")
    if cfg.vocab_size is not None and token_map.size > cfg.vocab_size:
        # the embedding has no row for the tokenizer's highest ids
        problems.append(
            f"the tokenizer has {token_map.size:,} ids, more than the config's vocab_size {cfg.vocab_size:,}"
        )
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
            problems.append(
                f"layer {layer}: hash ids span [{int(col.min())}, {int(col.max())}], outside the table's {limit} rows"
            )
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
        print(
            f"tokenizer {tok['path'] or ''}: {tok['n_ids']:,} ids fold to {tok['compressed_size']:,} compressed "
            f"ids; the config declares {'nothing' if cfg_size is None else f'{cfg_size:,}'}"
        )
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
    print(
        "[ok] the Engram front end agrees with the config"
        if not report["problems"]
        else f"[fail] {len(report['problems'])} problem(s)"
    )


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

    parser = argparse.ArgumentParser(
        prog="dsv41 engram",
        description=(
            "Derive the Engram bucket layout and hash multipliers from a config, compare them with the "
            "declared row counts and (with --tokenizer) the compressed vocabulary; exit non-zero on any "
            "disagreement."
        ),
    )
    parser.add_argument(
        "--config", metavar="PATH", help="config file or checkpoint directory (required unless --bench)"
    )
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer.json or the directory holding it")
    parser.add_argument(
        "--text", metavar="STR", help="encode this text (UTF-8) and print its hash ids (needs --tokenizer)"
    )
    parser.add_argument("--json", metavar="OUT", help="write the report here (also when a check fails)")
    parser.add_argument("--bench", action="store_true", help="time the hasher on a synthetic prompt and exit")
    parser.add_argument(
        "--bench-tokens",
        type=whole_number(1, MAX_BENCH_TOKENS, "tokens"),
        default=32768,
        metavar="N",
        help=f"prompt length for --bench: 1 to {MAX_BENCH_TOKENS:,} tokens (default 32,768)",
    )
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
        return fail(
            f"--json {args.json}: cannot write the report there ({why}); pass a file path in an existing folder"
        )

    from dsv41.core.config import ConfigError, load_config

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
        print(
            f"hashed a {result['n_tokens']:,}-token prompt into {result['n_layers']} layers x "
            f"{result['n_hash_cols']} columns in {result['prefill_s'] * 1e3:.1f} ms "
            f"({result['tokens_per_s'] / 1e6:.2f} M tokens/s); one decode step {result['decode_step_s'] * 1e6:.0f} us"
        )
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
