"""`dsv41 bench prefill`: one-shot prefill against the same ids in chunks, as ratios measured in one
run, with whether the chunked last logits equal one-shot's; `--real-size` also on the decode
benchmark's real-size synthetic layers."""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, Optional, Sequence

import torch

from .common import DIM, INTER, token_list, write_report


def bench_prefill(
    checkpoint: Optional[str],
    *,
    tokens: int,
    chunks: Sequence[int],
    repeats: int = 2,
    log: Callable[[str], None] = print,
) -> dict:
    """One-shot prefill of `tokens` random ids against the same ids in chunks of each size, best of
    `repeats`, in one run: seconds and each chunking's ratio to one-shot, and whether its last
    logits equal one-shot's (the reference's arithmetic, as loaded, may part; parity never does)."""
    import dsv41

    model = dsv41.load(checkpoint, quiet=True, max_seq_len=None if checkpoint is None else tokens)
    if tokens > model.backbone.max_seq_len:
        raise ValueError(f"--tokens {tokens} exceeds the model's {model.backbone.max_seq_len} positions")
    ids = torch.randint(3, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    report = {
        "command": "bench prefill",
        "checkpoint": model.report.checkpoint,
        "tokens": tokens,
        "dim": model.cfg.dim,
        "threads": torch.get_num_threads(),
        "numerics": model.numerics.as_dict(),  # as loaded
        "runs": [],
    }
    one_shot = None
    for chunk in [tokens] + [c for c in chunks if c < tokens]:
        best, logits = math.inf, None
        for _ in range(max(1, repeats)):
            began = time.perf_counter()
            for at in range(0, tokens, chunk):
                logits = model(ids[:, at : at + chunk], at)
            best = min(best, time.perf_counter() - began)
        if one_shot is None:
            one_shot = (best, logits)
            log(f"  {model.report.checkpoint}: {torch.get_num_threads()} torch threads")
        row = {
            "chunk": chunk,
            "calls": -(-tokens // chunk),
            "seconds": best,
            "ratio_to_one_shot": best / one_shot[0],
            "tokens_per_s": tokens / best,
            "last_logits_equal": bool(torch.equal(logits, one_shot[1])),
            "last_logits_max_abs_diff": float((logits - one_shot[1]).abs().max()),
        }
        report["runs"].append(row)
        logits_said = "equal" if row["last_logits_equal"] else f"differ by {row['last_logits_max_abs_diff']:.3g}"
        log(
            f"  chunks of {chunk:>5}: {row['calls']:>4} calls, {best:7.3f} s, "
            f"{row['ratio_to_one_shot']:.2f}x one-shot, {row['tokens_per_s']:,.0f} tokens/s, last logits {logits_said}"
        )
    return report


# ---------------------------------------------------------------------- the subcommand
def add_parser(sub) -> None:
    pf = sub.add_parser("prefill", help="one-shot against chunked prefill, as ratios measured in one run")
    pf.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny one)")
    pf.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    pf.add_argument("--chunks", default="512,1024", help="comma-separated chunk sizes (default 512,1024)")
    pf.add_argument("--repeats", type=int, default=2, help="runs per chunking, best kept (default 2)")
    pf.add_argument(
        "--real-size",
        action="store_true",
        help="also time the decode benchmark's real-size synthetic layers (--real-tokens tokens)",
    )
    pf.add_argument("--real-tokens", type=int, default=128, help="prompt length on the real-size layers (default 128)")
    pf.add_argument("--json", metavar="OUT", help="also write the report as JSON here")


def main(args) -> int:
    import tempfile

    from dsv41.bench.decode import write_decode_checkpoint
    from dsv41.checkpoint.checkpoint import LoadError

    try:
        chunks = token_list(args.chunks)
        if args.tokens < 2 or args.real_tokens < 2:
            raise ValueError("--tokens and --real-tokens must be at least 2")
        print(
            f"prefill of {args.tokens} tokens (one-shot scores every position against every other; a chunk "
            f"only its own queries)"
        )
        report = {"embedded": bench_prefill(args.checkpoint, tokens=args.tokens, chunks=chunks, repeats=args.repeats)}
        if args.real_size:
            with tempfile.TemporaryDirectory(prefix="dsv41-bench-prefill-") as folder:
                write_decode_checkpoint(folder)
                print(
                    f"prefill of {args.real_tokens} tokens on real-size synthetic layers (dim {DIM}, experts {INTER})"
                )
                report["real_size"] = bench_prefill(
                    folder,
                    tokens=args.real_tokens,
                    repeats=args.repeats,
                    chunks=[c for c in chunks if c < args.real_tokens] or [max(1, args.real_tokens // 4)],
                )
    except (LoadError, ValueError) as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_report(args.json, report)
    return 0
