"""`dsv41 bench threads`: decode tokens/s on the embedded checkpoint (or --checkpoint) at one torch
thread and at every core, the two taking turns within one run, with the ratio and what
`dsv41.load(threads="auto")` picks for that checkpoint (`threads.auto_threads`)."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch

from .common import write_report

THREADS_PROMPT = "The harbor lights came on one by one as the ferry pulled away from the old stone pier."


def bench_threads(
    checkpoint: str,
    *,
    decode_tokens: int,
    repeats: int,
    prompt: str = THREADS_PROMPT,
    log: Callable[[str], None] = print,
) -> dict:
    """Greedy decode of `decode_tokens` tokens after `prompt` at 1 thread and at all cores
    (`threads.all_cores()`), taking turns for `repeats` rounds. Each setting's tokens/s is taken
    from its median decode time (the best is reported too: on a shared machine one lucky run
    would decide a best-of); torch's thread count is put back afterwards."""
    import dsv41
    from dsv41.core.threads import all_cores, auto_threads
    from dsv41.generation.generate import decode_n, prefill
    from dsv41.kernels import native

    before = torch.get_num_threads()
    cores = all_cores()
    settings = [1] if cores == 1 else [1, cores]
    try:
        model = dsv41.load(checkpoint, quiet=True, threads=None)
        cfg = model.cfg
        ids = model.encode(prompt)
        if len(ids) + decode_tokens > model.backbone.max_seq_len:
            raise ValueError(
                f"{len(ids)} prompt tokens + {decode_tokens} decoded exceed the model's "
                f"{model.backbone.max_seq_len} positions"
            )
        auto, why = auto_threads(cfg)
        runs = {n: [] for n in settings}
        tokens = {}
        for _ in range(max(1, repeats)):
            for n in settings:
                torch.set_num_threads(n)
                began = time.perf_counter()
                logits = prefill(model, ids)
                prefill_s = time.perf_counter() - began
                began = time.perf_counter()
                out = decode_n(model, int(logits[0].argmax()), decode_tokens)
                decode_s = time.perf_counter() - began
                runs[n].append({"prefill_s": prefill_s, "decode_s": decode_s})
                tokens.setdefault(n, out)
    finally:
        torch.set_num_threads(before)
    import statistics

    rows = {}
    for n in settings:
        decode = [r["decode_s"] for r in runs[n]]
        median = statistics.median(decode)
        rows[str(n)] = {
            "threads": n,
            "median_decode_s": median,
            "tokens_per_s": decode_tokens / median,
            "best_decode_s": min(decode),
            "best_tokens_per_s": decode_tokens / min(decode),
            "median_prefill_s": statistics.median(r["prefill_s"] for r in runs[n]),
            "runs": runs[n],
        }
    report = {
        "command": "bench threads",
        "checkpoint": checkpoint,
        "dim": cfg.dim,
        "inter": cfg.moe_inter_dim,
        "n_layers": cfg.n_layers,
        "prompt_tokens": len(ids),
        "decode_tokens": decode_tokens,
        "repeats": max(1, repeats),
        "all_cores": cores,
        "cpu_count": os.cpu_count(),
        "fused_cpu_kernel": "native" if native.available() else "torch",
        "auto_threads": auto,
        "auto_reason": why,
        "settings": rows,
        "same_tokens": len({tuple(t) for t in tokens.values()}) == 1,
        "note": "tokens_per_s from the median run; the settings take turns, so load elsewhere hits both alike",
    }
    one = rows["1"]
    log(
        f"{checkpoint}: {cfg.n_layers} layers, dim {cfg.dim}, expert inter {cfg.moe_inter_dim}; prompt {len(ids)} "
        f"tokens, {decode_tokens} decoded greedily, median of {report['repeats']} runs; "
        f"experts on the {report['fused_cpu_kernel']} CPU kernel"
    )
    log(f"{'threads':>8} {'tokens/s':>10} {'s/token':>10} {'best tok/s':>11} {'prefill s':>10}")
    for row in rows.values():
        log(
            f"{row['threads']:>8} {row['tokens_per_s']:>10.2f} {row['median_decode_s'] / decode_tokens:>10.4f} "
            f"{row['best_tokens_per_s']:>11.2f} {row['median_prefill_s']:>10.3f}"
        )
    if cores > 1:
        every = rows[str(cores)]
        report["ratio_all_over_one"] = every["tokens_per_s"] / one["tokens_per_s"]
        faster = "all cores" if report["ratio_all_over_one"] > 1 else "1 thread"
        log(f"all {cores} cores / 1 thread: {report['ratio_all_over_one']:.2f}x tokens/s, medians ({faster} is faster)")
    else:
        report["ratio_all_over_one"] = None
        log("this process may use one core only: nothing to compare")
    log(f"dsv41.load(threads='auto') picks {auto}: {why}")
    return report


# ---------------------------------------------------------------------- the subcommand
def add_parser(sub) -> None:
    th = sub.add_parser("threads", help="decode tokens/s at 1 torch thread and at all cores, and their ratio")
    th.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny one)")
    th.add_argument("--tokens", type=int, default=16, help="tokens to decode per run (default 16)")
    th.add_argument(
        "--repeats", type=int, default=5, help="runs per setting, taking turns; the median counts (default 5)"
    )
    th.add_argument("--json", metavar="OUT", help="also write the report as JSON here")


def main(args) -> int:
    from dsv41.checkpoint.checkpoint import LoadError
    from dsv41.core.cachedir import CacheError

    if args.tokens < 1 or args.repeats < 1:
        print("dsv41 bench: --tokens and --repeats must be at least 1", file=sys.stderr)
        return 2
    try:
        path = args.checkpoint
        if path is None:
            from dsv41.checkpoint.tiny import default_checkpoint

            path = default_checkpoint(progress=False)
        report = bench_threads(path, decode_tokens=args.tokens, repeats=args.repeats)
    except (LoadError, ValueError, CacheError) as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_report(args.json, report)
    return 0
