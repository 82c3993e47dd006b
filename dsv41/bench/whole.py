"""`dsv41 bench whole`: the whole released geometry (all 40 layers, 384 experts each, both Engram
tables, the FP32 head) loaded under a memory budget, a prompt prefilled and tokens decoded, each
decode token split into phases that add up to its measured seconds, every phase against its floor
from a bandwidth measured in the same run.

The checkpoint is `dsv41 make-synthetic`'s (written into --checkpoint once, reused after) or the
real download. The phases of a decode token:

- dense phases (attention, shared expert, head, other: embedding, hyper-connections, norms, the
  router, Python): the bytes the model holds for them, read once, at the memory read bandwidth;
- expert reads: the seconds the forward waited on missed experts, against the missed bytes at the
  expert source's read rate (measured on the same shards with the same reads in flight);
- expert compute: the rest of the routed-expert spans, against the bytes of every expert used at
  the memory read bandwidth, and against the expert kernel's own rate on experts held in memory
  (one token, one layer's k experts, measured in the run: what the FP4 arithmetic allows here);
- Engram gathers: the hashed rows, at the memory read bandwidth (their floor is tiny: the time is
  the gathers' latency).
The floor of the token is the sum of the phases' floors; a fraction above 100% is flagged as a
measurement error, except the expert reads' when reads ahead (`SlotCache.read_ahead`) overlap them
with compute: then the forward waits less than the reads take, and the report says so.

After the measured tokens the same number is decoded with reading ahead switched the other way
(on, where the model was loaded without it: the default), so the two are compared in one run.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch

from .common import BenchError, PhaseClock, check_report_path, read_bandwidth, reset_peak_rss, rss_bytes, write_report

PHASES = ("attention", "shared expert", "head", "other", "expert reads", "expert compute", "Engram")
_CLOCK_PHASES = ("attention", "routed experts", "shared expert", "Engram", "head")


def _expert_shard(folder: str, cfg) -> str:
    from dsv41.checkpoint.checkpoint import Checkpoint

    ck = Checkpoint(folder)
    name = f"layers.{cfg.n_layers // 2}.ffn.experts.0.w1.weight"
    return ck.entries[name][0]


def source_read_rate(shard: str, nbytes: int, threads: int) -> float:
    """Bytes per second of `threads` positioned readers over `nbytes` of an expert shard's middle,
    the page cache dropped first: what a miss can read at."""
    from .stream import disk_bandwidth

    return disk_bandwidth(shard, nbytes, threads, offset=os.path.getsize(shard) // 3)


def _floor(seconds: float, nbytes: float, rate: float, *, overlapped: bool = False) -> dict:
    floor = nbytes / rate if rate > 0 else 0.0
    fraction = floor / seconds if seconds > 0 else None
    above = fraction is not None and fraction > 1.0
    return {
        "seconds": seconds,
        "bytes": int(nbytes),
        "floor_seconds": floor,
        "fraction_of_floor": fraction,
        "measurement_error": above and not overlapped,
        "overlapped": above and overlapped,
    }


def expert_kernel_rate(model, layer: int, repeats: int = 5) -> float:
    """Bytes per second the routed-expert kernel computes at on one token and k experts of `layer`
    that the pool holds now (read once more if it holds fewer): the arithmetic's own limit, with
    no read in the way."""
    from dsv41.kernels.experts import routed_experts

    cfg, cache = model.cfg, model.experts
    k = cfg.n_activated_experts
    held = cache.cached(layer)
    others = sorted(set(range(cfg.n_routed_experts)) - set(held))
    ids = (held + others)[:k]
    experts = dict(zip(ids, (p for p in cache.fetch(layer, ids))))
    x = torch.randn(1, cfg.dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expert_ids, weights = torch.tensor([ids]), torch.full((1, k), 1.0 / k)
    limit = float(cfg.swiglu_limit)
    routed_experts(x, expert_ids, weights, experts, limit)  # warm: the weights in the CPU's caches as in decode
    began = time.perf_counter()
    for _ in range(repeats):
        routed_experts(x, expert_ids, weights, experts, limit)
    seconds = (time.perf_counter() - began) / repeats
    return sum(p.nbytes for p in experts.values()) / seconds


def _decode(model, cache, token: int, n: int, clock=None) -> tuple:
    """(seconds per token, the ids, stats delta, hits, misses) of n decode steps from `token`."""
    from dsv41.generation.generate import decode_n

    stats0 = cache.stats.as_dict()
    hits0, misses0 = sum(cache.counters.hits.values()), sum(cache.counters.misses.values())
    began = time.perf_counter()
    if clock is None:
        tokens = decode_n(model, token, n)
    else:
        with clock.timing(model):
            tokens = decode_n(model, token, n)
    seconds = (time.perf_counter() - began) / n
    stats = {k: v - stats0[k] for k, v in cache.stats.as_dict().items()}
    return (
        seconds,
        tokens,
        stats,
        sum(cache.counters.hits.values()) - hits0,
        sum(cache.counters.misses.values()) - misses0,
    )


def measure_whole(
    folder: str,
    *,
    memory,
    prompt_tokens: int,
    decode_tokens: int,
    io_threads: int = 8,
    probe_bytes: int = 2 << 30,
    log: Callable[[str], None] = print,
) -> dict:
    """One run on the checkpoint in `folder` (see the module's text); returns the report."""
    import dsv41
    from dsv41.checkpoint.inventory import shard_names
    from dsv41.core.config import load_config
    from dsv41.generation.generate import prefill

    from .released import decode_token_bytes
    from .stream import drop_page_cache

    cfg = load_config(folder)
    files = [os.path.join(folder, name) for name in shard_names(cfg)]
    page_cache = drop_page_cache(files)
    memory_rate = read_bandwidth(1 << 30)
    shard = _expert_shard(folder, cfg)
    source_before = source_read_rate(shard, probe_bytes, io_threads)
    peak_reset = reset_peak_rss()
    began = time.perf_counter()
    model = dsv41.load(folder, quiet=True, memory=memory, max_seq_len=prompt_tokens + decode_tokens + 8)
    load_s = time.perf_counter() - began
    cache = model.experts
    cache.set_io_threads(io_threads)
    plan = model.report.budget_plan
    after_load = rss_bytes()
    log(
        f"loaded in {load_s:.1f} s: {after_load['rss_bytes'] / 2**30:.2f} GiB resident, {cache.slots:,} expert "
        f"slots ({cache.pool_bytes / 2**30:.2f} GiB) under {plan['memory'] / 2**30:.2f} GiB"
    )

    g = torch.Generator().manual_seed(0)
    ids = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    stats0, misses0 = cache.stats.as_dict(), sum(cache.counters.misses.values())
    began = time.perf_counter()
    logits = prefill(model, ids)
    prefill_s = time.perf_counter() - began
    stats1, misses1 = cache.stats.as_dict(), sum(cache.counters.misses.values())
    prefill_bytes = stats1["bytes_read"] - stats0["bytes_read"]
    prefill_read_s = stats1["read_seconds"] - stats0["read_seconds"]
    log(
        f"prefill of {prompt_tokens} tokens: {prefill_s:.1f} s, {misses1 - misses0:,} experts read "
        f"({prefill_bytes / 1e9:.2f} GB, reads in flight {prefill_read_s:.1f} s)"
    )

    per_token = decode_token_bytes(model)
    clock = PhaseClock(_CLOCK_PHASES)
    ahead = cache.read_ahead
    token_s, tokens, decoded, hits, misses = _decode(model, cache, int(logits[0].argmax()), decode_tokens, clock)
    cache.read_ahead = not ahead  # the same number of tokens again, reading ahead the other way
    other_s, _, other, _, _ = _decode(model, cache, tokens[-1], decode_tokens)
    cache.read_ahead = ahead
    (with_s, with_ahead), (without_s, without) = ((token_s, decoded), (other_s, other))[:: 1 if ahead else -1]
    kernel_rate = expert_kernel_rate(model, cfg.n_layers - 1)
    source_after = source_read_rate(shard, probe_bytes, io_threads)
    source = max(source_before, source_after)  # a probe slowed by other work would flatter the reads
    end = rss_bytes()

    n = decode_tokens
    read_bytes = decoded["bytes_read"] / n
    wait_s = decoded["wait_seconds"] / n
    read_s = decoded["read_seconds"] / n
    secs = {k: v / n for k, v in clock.seconds.items()}
    expert_bytes = per_token["routed_expert_bytes"]
    used_bytes = cfg.n_layers * cfg.n_activated_experts * expert_bytes
    compute_s = max(0.0, secs["routed experts"] - wait_s)
    phases = {
        "attention": _floor(secs["attention"], per_token["phases"]["attention"], memory_rate),
        "shared expert": _floor(secs["shared expert"], per_token["phases"]["shared expert"], memory_rate),
        "head": _floor(secs["head"], per_token["phases"]["head"], memory_rate),
        "expert reads": _floor(wait_s, read_bytes, source, overlapped=ahead),
        "expert compute": _floor(compute_s, used_bytes, memory_rate),
        "Engram": _floor(secs["Engram"], per_token["phases"]["Engram"], memory_rate),
    }
    covered = sum(c["seconds"] for c in phases.values())
    phases["other"] = _floor(max(0.0, token_s - covered), per_token["phases"]["other"], memory_rate)
    floor = sum(c["floor_seconds"] for c in phases.values())
    report = {
        "command": "bench whole",
        "checkpoint": folder,
        "n_layers": cfg.n_layers,
        "experts": cfg.n_routed_experts,
        "memory": plan["memory"],
        "budget": plan,
        "page_cache": page_cache,
        "expert_reads": {"reader": cache.reader, "how": cache.page_cache},
        "kernels": _kernel_paths(),
        "io_threads": io_threads,
        "threads": torch.get_num_threads(),
        "memory_read_bytes_per_s": memory_rate,
        "source_read_bytes_per_s_before": source_before,
        "source_read_bytes_per_s_after": source_after,
        "source_read_bytes_per_s": source,
        "load_s": load_s,
        "resident_after_load_bytes": after_load["rss_bytes"],
        "prefill_tokens": prompt_tokens,
        "prefill_s": prefill_s,
        "prefill_experts_read": misses1 - misses0,
        "prefill_bytes_read": prefill_bytes,
        "prefill_read_seconds": prefill_read_s,
        "prefill_read_fraction_of_source": (prefill_bytes / prefill_s / source) if prefill_s > 0 else None,
        "decode_tokens": n,
        "tokens": tokens,
        "seconds_per_token": token_s,
        "hits": hits,
        "misses": misses,
        "read_ahead": {
            "in_the_phases": ahead,
            "experts_read_ahead": with_ahead["read_ahead"],
            "used_by_the_next_layer": with_ahead["read_ahead_used"],
            "share_used": (
                with_ahead["read_ahead_used"] / with_ahead["read_ahead"] if with_ahead["read_ahead"] else None
            ),
            "seconds_per_token_with": with_s,
            "seconds_per_token_without": without_s,
            "bytes_read_per_token_with": with_ahead["bytes_read"] / n,
            "bytes_read_per_token_without": without["bytes_read"] / n,
            "waited_per_token_with": with_ahead["wait_seconds"] / n,
            "waited_per_token_without": without["wait_seconds"] / n,
            "speedup": without_s / with_s if with_s > 0 else None,
        },
        "expert_kernel_bytes_per_s": kernel_rate,
        "expert_compute_vs_kernel": {
            "floor_seconds": used_bytes / kernel_rate,
            "fraction": used_bytes / kernel_rate / compute_s if compute_s > 0 else None,
        },
        "bytes_read_per_token": read_bytes,
        "read_seconds_per_token": read_s,
        "reads_in_flight_fraction": (read_bytes / read_s / source) if read_s > 0 else None,
        "phases": phases,
        "token": {
            "seconds": token_s,
            "floor_seconds": floor,
            "fraction_of_floor": floor / token_s if token_s > 0 else None,
        },
        "peak_rss_bytes": end["peak_rss_bytes"],
        "peak_rss_since_load": peak_reset,
        "peak_rss_over_budget": end["peak_rss_bytes"] / plan["memory"],
    }
    _log(report, log)
    cache.close()
    return report


def _kernel_paths() -> dict:
    """Which CPU kernel bodies this run's products took (`native`'s level and its dot-product bodies)."""
    from dsv41.kernels import native

    kernels = native.load()
    if kernels is None:
        return {"native": False, "why": native.unavailable_reason()}
    return {"native": True, "level": kernels.level, "fp4_dot": kernels.fp4_dot, "fp8_dot": kernels.fp8_dot}


def _log(r: dict, log: Callable[[str], None]) -> None:
    gb = 1e9
    k = r["kernels"]
    body = {True: "BF16 dot product", False: "float body"}
    bodies = (
        f"native kernels at {k['level']}, one to eight tokens' FP4 / FP8 products on the "
        f"{body[k['fp4_dot']]} / {body[k['fp8_dot']]}"
        if k["native"]
        else f"no native kernels ({k['why']})"
    )
    log(f"{bodies}; expert misses read {r['expert_reads']['how']}")
    log(
        f"memory read {r['memory_read_bytes_per_s'] / gb:.2f} GB/s; "
        f"expert source {r['source_read_bytes_per_s_before'] / gb:.2f} GB/s before, "
        f"{r['source_read_bytes_per_s_after'] / gb:.2f} after ({r['io_threads']} reads in flight)"
    )
    log(
        f"decode: {r['seconds_per_token']:.2f} s/token over {r['decode_tokens']} tokens; {r['hits']:,} hits, "
        f"{r['misses']:,} misses, {r['bytes_read_per_token'] / gb:.2f} GB read per token"
    )
    log(f"  {'phase':<15} {'s/token':>8} {'GB':>7} {'floor s':>8} {'of floor':>9}")
    for name in PHASES:
        c = r["phases"][name]
        frac = "-" if c["fraction_of_floor"] is None else f"{c['fraction_of_floor']:.0%}"
        log(
            f"  {name:<15} {c['seconds']:>8.3f} {c['bytes'] / gb:>7.2f} {c['floor_seconds']:>8.3f} {frac:>9}"
            + (" (measurement error)" if c["measurement_error"] else "")
            + (" (reads ahead hid part of the reads behind compute)" if c.get("overlapped") else "")
        )
    t = r["token"]
    log(f"  {'token':<15} {t['seconds']:>8.3f} {'':>7} {t['floor_seconds']:>8.3f} {t['fraction_of_floor']:>9.0%}")
    kernel = r["expert_compute_vs_kernel"]
    kernel_frac = "-" if kernel["fraction"] is None else f"{kernel['fraction']:.0%}"
    log(
        f"expert kernel on experts in memory: {r['expert_kernel_bytes_per_s'] / gb:.2f} GB/s; expert compute at "
        f"{kernel_frac} of that rate ({kernel['floor_seconds']:.3f} s/token)"
    )
    a = r["read_ahead"]
    share = "-" if a["share_used"] is None else f"{a['share_used']:.0%}"
    log(
        f"read ahead: {a['experts_read_ahead']:,} experts guessed, {share} used by the next layer; "
        f"{a['seconds_per_token_with']:.2f} s/token with it (waited {a['waited_per_token_with']:.2f} s, "
        f"{a['bytes_read_per_token_with'] / gb:.2f} GB read), {a['seconds_per_token_without']:.2f} without "
        f"(waited {a['waited_per_token_without']:.2f} s, {a['bytes_read_per_token_without'] / gb:.2f} GB): "
        f"{a['speedup']:.2f}x with it"
    )
    log(
        f"prefill {r['prefill_tokens']} tokens: {r['prefill_s']:.1f} s, {r['prefill_experts_read']:,} experts read, "
        f"{r['prefill_read_fraction_of_source']:.0%} of the source's read rate over the whole prefill; peak resident "
        f"{r['peak_rss_bytes'] / 2**30:.2f} GiB = {r['peak_rss_over_budget']:.0%} of the budget"
    )


def main(args) -> int:
    from dsv41.checkpoint.checkpoint import LoadError
    from dsv41.checkpoint.released_synthetic import SyntheticError, read_marker, write_released_synthetic
    from dsv41.core.argtypes import byte_size
    from dsv41.core.outdir import OutDirError

    try:
        memory = byte_size(args.memory)
        if args.json:
            check_report_path(args.json)
        folder = os.path.abspath(args.checkpoint)
        has_config = os.path.isfile(os.path.join(folder, "config.json"))
        marker = read_marker(folder) if os.path.isdir(folder) else None
        if not has_config or (marker is not None and not marker.get("complete")):
            write_released_synthetic(folder, small=args.small, progress=sys.stderr.isatty())
        runs = []
        for i in range(args.runs):
            print(f"run {i + 1} of {args.runs}")
            runs.append(
                measure_whole(
                    folder,
                    memory=memory,
                    prompt_tokens=args.prompt,
                    decode_tokens=args.tokens,
                    io_threads=args.io_threads,
                    probe_bytes=args.probe_mib << 20,
                )
            )
            if args.json:  # each run's report kept as soon as it is measured: a run takes minutes
                write_report(args.json, {"command": "bench whole", "runs": runs})
    except (BenchError, SyntheticError, OutDirError, LoadError, ValueError) as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    report = {"command": "bench whole", "runs": runs}
    if len(runs) > 1:
        report["ranges"] = {
            key: [min(r[key] for r in runs), max(r[key] for r in runs)]
            for key in ("seconds_per_token", "load_s", "prefill_s", "peak_rss_over_budget")
        }
        report["ranges"]["token_fraction_of_floor"] = [
            min(r["token"]["fraction_of_floor"] for r in runs),
            max(r["token"]["fraction_of_floor"] for r in runs),
        ]
        print("over the runs: " + "; ".join(f"{k} {lo:.3g}-{hi:.3g}" for k, (lo, hi) in report["ranges"].items()))
    if args.json:
        write_report(args.json, report)
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "whole",
        help="the whole released geometry under a memory budget: load, prefill, and "
        "each decode token split into phases against floors measured in the run",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a checkpoint of the released geometry; an empty or new folder gets make-synthetic's",
    )
    parser.add_argument("--memory", default="20GiB", help="the memory budget (default 20GiB)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens to prefill (default 512)")
    parser.add_argument("--tokens", type=int, default=4, help="tokens to decode (default 4)")
    parser.add_argument("--runs", type=int, default=1, help="measured runs, each loading afresh (default 1)")
    parser.add_argument("--io-threads", type=int, default=8, help="expert reads in flight (default 8)")
    parser.add_argument(
        "--probe-mib", type=int, default=2048, help="MiB read to measure the expert source (default 2048)"
    )
    parser.add_argument("--small", action="store_true", help="write the small variant when writing (tests)")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
