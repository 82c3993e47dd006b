"""`dsv41 bench experts`: the fused packed-FP4 expert path against expand-to-BF16-then-matmul.

One run builds real-size experts (dim 5120, intermediate 2304: packed FP4 with E8M0 scales for
the routed ones, FP8 with 32x32 E8M0 blocks for the shared one), measures this machine's memory
copy bandwidth, and for each token count times one MoE layer's expert work (6 routed experts per
token plus the shared expert) these ways:

- baseline: every selected expert expanded to BF16 (the op layer's codec times its scales), then
  BF16 matmuls -- what the earlier runtime did on each step;
- bf16 GEMM: the same matmuls on weights expanded ahead of timing, torch's own GEMM with nothing
  to decode (the best this CPU's library does);
- fused: `routed_experts` + `expert_ffn` straight from the packed bytes, once per CPU kernel
  (`--kernels`, default both): "native" (the SIMD kernels built from native.c, the default where
  they build) and "torch" (the plain-PyTorch fallback).

Per shape it reports the best time of a few runs, the speedup over the baseline and the packed
bytes each fused kernel read per second, as a fraction of the copy bandwidth (bytes of the source
tensor per second of a large tensor copy; the copy's read+write traffic is twice that), and, at the
released sizes, how the numbers stand against the targets (decode: 30x and 40% of copy; 512-token
prefill: 3x and 80% of the bf16 GEMM's throughput), and which path each shape took (block order
up to 8 tokens; beyond, `native.prefill_path()`: AMX, AVX-512 BF16, AVX2 or plain). Times on a
shared machine move with its load: compare numbers from one run.
`--device cuda` times the Triton kernels instead, against the device's own copy bandwidth (target:
the decode GEMVs at 60% of it).

`dsv41 bench decode`: end-to-end tokens/s through `dsv41.load` on a synthetic checkpoint in the
release format with the released expert sizes but two layers and eight routed experts (written by
the bench, or an existing one with --checkpoint), once with the earlier runtime's experts (each
routed expert expanded to BF16 per call, the shared expert held in BF16) and once fused (packed
routed experts, FP8 shared expert), with a per-phase table: attention, routed experts, shared
expert, Engram, head and the rest. `--geometry released` instead writes every released dimension
(attention, vocabulary, FP32 head, experts) on a few layers and reports, at one thread and at every
core, each phase's seconds per token against the bytes it must read and the copy bandwidth floor,
and the 40-layer prediction (`bench_decode_released`).

`dsv41 bench threads`: decode tokens/s on the embedded checkpoint (or --checkpoint) at one torch
thread and at every core, the two taking turns within one run, with the ratio and what
`dsv41.load(threads="auto")` picks for that checkpoint (`loader.auto_threads`).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

# The released expert geometry and routing width.
DIM, INTER, TOPK = 5120, 2304, 6
SWIGLU_LIMIT = 10.0


def _best_time(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best wall time of up to `repeats` calls, stopping early once `budget_s` is spent."""
    return _best_times({"fn": fn}, repeats, budget_s)["fn"]


def _best_times(fns: dict, repeats: int, budget_s: float) -> dict:
    """Best wall time of each function over up to `repeats` rounds, the functions taking turns
    within a round so that a burst of load elsewhere hits them alike; stops once `budget_s` is spent."""
    best, spent = dict.fromkeys(fns, float("inf")), 0.0
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            took = time.perf_counter() - began
            best[name], spent = min(best[name], took), spent + took
        if spent > budget_s:
            break
    return best


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes per second of copying one large uint8 tensor into another (source bytes / time)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    return nbytes / _best_time(lambda: dst.copy_(src), repeats, budget_s=10.0)


def rss_bytes() -> dict:
    """Resident memory now and at its peak (Linux /proc; ru_maxrss elsewhere)."""
    out = {"rss_bytes": None, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    out["peak_rss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------- synthetic experts
def make_experts(n_experts: int, dim: int, inter: int, seed: int = 0):
    """(routed: {id: PackedExpert} packed FP4, shared: PackedExpert FP8), random codes and scales."""
    from dsv41.kernels.experts import PackedExpert

    g = torch.Generator().manual_seed(seed)

    def fp4(rows, cols):
        codes = torch.randint(-128, 128, (rows, cols // 2), dtype=torch.int8, generator=g)
        # scales around 2**-6..2**-3 (bytes 121..124): weights of a trained layer's magnitude
        scale = torch.randint(121, 125, (rows, cols // 32), dtype=torch.uint8, generator=g)
        return codes, scale.view(torch.float8_e8m0fnu)

    def fp8(rows, cols):
        codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
        scale = torch.randint(112, 116, (-(-rows // 32), cols // 32), dtype=torch.uint8, generator=g)
        return codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)

    routed = {e: PackedExpert(*fp4(inter, dim), *fp4(dim, inter), *fp4(inter, dim)) for e in range(n_experts)}
    shared = PackedExpert(*fp8(inter, dim), *fp8(dim, inter), *fp8(inter, dim))
    return routed, shared


def make_routing(tokens: int, n_experts: int, topk: int, seed: int = 0):
    """(expert_ids [tokens, topk] distinct per token, weights [tokens, topk] summing to 1)."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else \
        torch.empty(0, topk, dtype=torch.long)
    weights = torch.rand(tokens, topk, generator=g) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


# ---------------------------------------------------------------------- the baseline
def _expand_bf16(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A whole stored weight -> BF16 [N, K], as the earlier runtime expanded each expert."""
    from dsv41.kernels import fp4_to_float

    if weight.dtype == torch.float8_e4m3fn:
        n, k = weight.shape
        s = scale.float().repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
        return (weight.float() * s).to(torch.bfloat16)
    values = fp4_to_float(weight.view(torch.uint8))  # [N, K]
    n, k = values.shape
    return (values.view(n, k // 32, 32) * scale.float().unsqueeze(-1)).view(n, k).to(torch.bfloat16)


def _baseline_expert(x, expert, limit, weights=None):
    gate = F.linear(x, _expand_bf16(expert.w1, expert.w1_scale)).float()
    up = F.linear(x, _expand_bf16(expert.w3, expert.w3_scale)).float()
    from dsv41.kernels.experts import clamped_swiglu

    h = clamped_swiglu(gate, up, limit)
    if weights is not None:
        h = weights * h
    return F.linear(h.to(x.dtype), _expand_bf16(expert.w2, expert.w2_scale))


def baseline_moe(x, ids, weights, routed, shared, limit):
    """Routed + shared experts, each expanded to BF16 first; float32 [n, dim]."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        y.index_add_(0, rows, _baseline_expert(x[rows], routed[e], limit, weights[rows, slot, None]).float())
    return y + _baseline_expert(x, shared, limit).float()


def expand_experts(experts: dict) -> dict:
    """Each expert's three matrices expanded to BF16 once, ahead of timing (`expanded_moe`)."""
    from dsv41.kernels.experts import PackedExpert

    return {e: PackedExpert(_expand_bf16(p.w1, p.w1_scale), None, _expand_bf16(p.w2, p.w2_scale), None,
                            _expand_bf16(p.w3, p.w3_scale), None) for e, p in experts.items()}


def expanded_moe(x, ids, weights, routed_bf16, shared_bf16, limit):
    """The baseline's arithmetic on weights already expanded to BF16: torch's own BF16 GEMMs with
    nothing to decode, the best this CPU's library does; float32 [n, dim]."""
    from dsv41.kernels.experts import clamped_swiglu

    def ffn(h, w, wts=None):
        a = clamped_swiglu(F.linear(h, w.w1), F.linear(h, w.w3), limit)
        if wts is not None:
            a = wts * a
        return F.linear(a.to(h.dtype), w.w2).float()

    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        y.index_add_(0, rows, ffn(x[rows], routed_bf16[e], weights[rows, slot, None]))
    return y + ffn(x, shared_bf16)


def kernel_path(kernel: str, tokens: int) -> str:
    """Which path a fused product of `tokens` tokens takes on CPU kernel `kernel`: the native
    block order (AVX2 or plain C) up to 8 tokens, else `native.prefill_path()`; "torch" for the
    plain-PyTorch kernel."""
    from dsv41.kernels import native

    if kernel != "native":
        return "torch"
    lib = native.load()
    if tokens <= native.BLOCK_ORDER_MAX_TOKENS:  # one token's four-row body has an AVX-512 form
        isa = "avx512" if tokens == 1 and lib is not None and lib.avx512 else \
            "avx2" if lib is not None and lib.simd else "plain"
        return "block order, " + isa
    path = native.prefill_path(lib)
    return f"{path}, {'BF16' if path in ('amx', 'avx512_bf16') else 'float32'} GEMM"


def fused_moe(x, ids, weights, routed, shared, limit, cpu_kernel="auto"):
    """Routed + shared experts from the packed weights; float32 [n, dim]."""
    from dsv41.kernels.experts import expert_ffn, routed_experts

    y = routed_experts(x, ids, weights, routed, limit, cpu_kernel=cpu_kernel)
    return y + expert_ffn(x, shared, limit, cpu_kernel=cpu_kernel).float()


def packed_bytes_read(ids, routed, shared) -> int:
    """Packed weight and scale bytes one MoE call reads: each selected expert once, the shared one."""
    return sum(routed[e].nbytes for e in torch.unique(ids).tolist()) + shared.nbytes


# ---------------------------------------------------------------------- the command
# The expert bench's targets on a two-core machine, checked at the released sizes only:
# (tokens, least speedup over the baseline, least fraction of copy bandwidth or None, least
# fraction of the throughput of torch's BF16 GEMM on pre-expanded weights or None)
TARGETS = ((1, 30.0, 0.40, None), (512, 3.0, None, 0.80))


def bench_experts(tokens: list[int], *, n_experts: int, dim: int, inter: int, repeats: int,
                  kernels: tuple[str, ...] = ("native", "torch"), copy_bytes: int = 256 << 20,
                  log: Callable[[str], None] = print) -> dict:
    """Run the expert benchmark; returns the report (see the module docstring)."""
    from dsv41.kernels import native

    if n_experts < TOPK:
        raise ValueError(f"--experts must be at least {TOPK} (the routing width), got {n_experts}")
    report = {
        "command": "bench experts", "dim": dim, "inter": inter, "n_experts": n_experts, "topk": TOPK,
        "swiglu_limit": SWIGLU_LIMIT, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "note": "wall times on a possibly shared machine; compare within one run",
    }
    if "native" in kernels and not native.available():
        log(f"native kernel skipped: {native.unavailable_reason()}")
        report["native_unavailable"] = native.unavailable_reason()
        kernels = tuple(k for k in kernels if k != "native")
    report["kernels"] = list(kernels)
    if native.available():
        lib = native.load()
        report["native_build"] = {"path": str(lib.path), "flags": lib.flags, "simd": lib.simd, "openmp": lib.openmp}
    copy_bw = copy_bandwidth(copy_bytes)
    report["copy_bandwidth_bytes_per_s"] = copy_bw
    report["copy_bandwidth_definition"] = f"source bytes per second of a {copy_bytes >> 20} MiB uint8 tensor copy"
    log(f"memory copy bandwidth: {copy_bw / 1e9:.2f} GB/s (source bytes / s; {report['threads']} threads)")
    report["peak_rss_reset"] = _reset_peak_rss()  # the copy's 512 MiB is not the experts' footprint

    routed, shared = make_experts(n_experts, dim, inter)
    routed_bf16, shared_bf16 = expand_experts(routed), expand_experts({0: shared})[0]
    report["routed_expert_bytes"] = next(iter(routed.values())).nbytes
    report["shared_expert_bytes"] = shared.nbytes
    report["after_build"] = rss_bytes()
    log(f"{n_experts} routed experts of {report['routed_expert_bytes'] / 2**20:.1f} MiB packed, shared expert "
        f"{shared.nbytes / 2**20:.1f} MiB; RSS {report['after_build']['rss_bytes'] / 2**20:.0f} MiB")

    shapes = []
    log(f"prefill path of this CPU: {native.prefill_path()} (products of more than "
        f"{native.BLOCK_ORDER_MAX_TOKENS} tokens)")
    report["prefill_path"] = native.prefill_path()
    log(f"{'tokens':>6} {'baseline':>10} {'bf16 GEMM':>10}" +
        "".join(f" {k:>9} {'speedup':>8} {'GB/s':>6} {'of copy':>8} {'of GEMM':>8}" for k in kernels))
    for t in tokens:
        x = torch.randn(t, dim, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        ids, weights = make_routing(t, n_experts, TOPK, seed=t)
        nbytes = packed_bytes_read(ids, routed, shared)
        fns = {"baseline": lambda: baseline_moe(x, ids, weights, routed, shared, SWIGLU_LIMIT),
               "bf16 GEMM": lambda: expanded_moe(x, ids, weights, routed_bf16, shared_bf16, SWIGLU_LIMIT)}
        for k in kernels:
            fns[k] = lambda k=k: fused_moe(x, ids, weights, routed, shared, SWIGLU_LIMIT, cpu_kernel=k)
        times = _best_times(fns, repeats, 60.0)
        base_s, gemm_s = times["baseline"], times["bf16 GEMM"]
        row = {"tokens": t, "experts_selected": len(torch.unique(ids)), "packed_bytes": nbytes,
               "baseline_s": base_s, "bf16_gemm_s": gemm_s, "kernels": {}}
        line = f"{t:>6} {base_s:>9.3f}s {gemm_s:>9.3f}s"
        paths = []
        for k in kernels:
            k_s = times[k]
            row["kernels"][k] = cell = {"s": k_s, "speedup": base_s / k_s, "bytes_per_s": nbytes / k_s,
                                        "fraction_of_copy": nbytes / k_s / copy_bw,
                                        "fraction_of_bf16_gemm": gemm_s / k_s, "path": kernel_path(k, t)}
            line += (f" {k_s:>8.3f}s {cell['speedup']:>7.1f}x {cell['bytes_per_s'] / 1e9:>6.2f} "
                     f"{cell['fraction_of_copy']:>7.1%} {cell['fraction_of_bf16_gemm']:>7.0%}")
            paths.append(f"{k}: {cell['path']}")
        log(line + "   (" + "; ".join(paths) + ")")
        shapes.append(row)
    report["shapes"] = shapes
    if (dim, inter) == (DIM, INTER) and kernels:
        report["targets"] = _check_targets(shapes, kernels[0], log)
    report["end"] = rss_bytes()
    log(f"resident memory: {report['end']['rss_bytes'] / 2**20:.0f} MiB now, "
        f"{report['end']['peak_rss_bytes'] / 2**20:.0f} MiB peak (the baseline's BF16 copies included)")
    return report


def _check_targets(shapes: list[dict], kernel: str, log: Callable[[str], None]) -> list[dict]:
    """The measured numbers of `kernel` against TARGETS, for the token counts that were run."""
    results = []
    by_tokens = {row["tokens"]: row["kernels"][kernel] for row in shapes}
    for t, speedup, fraction, of_gemm in TARGETS:
        if t not in by_tokens:
            continue
        cell = by_tokens[t]
        gemm = cell.get("fraction_of_bf16_gemm") if of_gemm is not None else None
        met = (cell["speedup"] >= speedup and (fraction is None or cell["fraction_of_copy"] >= fraction)
               and (gemm is None or gemm >= of_gemm))
        want = (f">= {speedup:g}x" + (f" and >= {fraction:.0%} of copy" if fraction is not None else "")
                + (f" and >= {of_gemm:.0%} of the BF16 GEMM" if gemm is not None else ""))
        got = (f"{cell['speedup']:.1f}x" + (f", {cell['fraction_of_copy']:.0%}" if fraction is not None else "")
               + (f", {gemm:.0%}" if gemm is not None else ""))
        log(f"target {t} token{'s' if t > 1 else ''} ({kernel}): {want}: measured {got}: {'met' if met else 'NOT met'}")
        results.append({"tokens": t, "kernel": kernel, "speedup_target": speedup, "fraction_target": fraction,
                        "bf16_gemm_fraction_target": of_gemm if gemm is not None else None,
                        "speedup": cell["speedup"], "fraction_of_copy": cell["fraction_of_copy"],
                        "fraction_of_bf16_gemm": gemm, "met": met})
    return results


# ---------------------------------------------------------------------- on a GPU
# The GPU target: the decode GEMV's packed bytes per second against the device's copy.
GPU_GEMV_TARGET = 0.60


def bench_experts_gpu(tokens: list[int], *, n_experts: int, dim: int, inter: int, repeats: int, device: str,
                      copy_bytes: int = 1 << 30, log: Callable[[str], None] = print) -> dict:
    """The routed experts on a CUDA device through the Triton kernels: per token count the MoE
    layer's routed work (`routed_experts`), and for one token the bare GEMVs (each selected
    expert's three matrices through `fp4_gemm_triton`), as packed bytes per second against the
    device's own copy bandwidth measured in the same run."""
    from dsv41.kernels import act_quant
    from dsv41.kernels.experts import routed_experts
    from dsv41.kernels.triton_experts import available, fp4_gemm_triton

    if not available():
        raise ValueError(f"--device {device} needs a CUDA device and Triton; this machine has "
                         f"{'no CUDA device' if not torch.cuda.is_available() else 'no Triton'}")
    dev = torch.device(device)
    if dev.type != "cuda" or (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device} is not one of this machine's {torch.cuda.device_count()} CUDA devices")

    def timed(fn):
        def run():
            fn()
            torch.cuda.synchronize(dev)
        return run

    report = {"command": "bench experts", "device": str(dev), "device_name": torch.cuda.get_device_name(dev),
              "dim": dim, "inter": inter, "n_experts": n_experts, "topk": TOPK, "torch": torch.__version__,
              "note": "wall times with the device synchronized; compare within one run"}
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bw = copy_bytes / _best_time(timed(lambda: dst.copy_(src)), max(3, repeats), budget_s=10.0)
    del src, dst
    report["copy_bandwidth_bytes_per_s"] = copy_bw
    report["copy_bandwidth_definition"] = f"source bytes per second of a {copy_bytes >> 20} MiB uint8 copy on the device"
    log(f"{report['device_name']}: device copy bandwidth {copy_bw / 1e9:.1f} GB/s (source bytes / s)")

    routed, _ = make_experts(n_experts, dim, inter)
    routed = {e: p.to(dev) for e, p in routed.items()}
    report["routed_expert_bytes"] = next(iter(routed.values())).nbytes
    shapes = []
    log(f"{'tokens':>6} {'routed s':>10} {'GB/s':>8} {'of copy':>8}")
    for t in tokens:
        x = torch.randn(t, dim, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(dev)
        ids, weights = make_routing(t, n_experts, TOPK, seed=t)
        selected = torch.unique(ids).tolist()
        nbytes = sum(routed[e].nbytes for e in selected)
        ids, weights = ids.to(dev), weights.to(dev)
        fn = timed(lambda: routed_experts(x, ids, weights, routed, SWIGLU_LIMIT))
        fn()  # compiles the kernels for this shape
        sec = _best_time(fn, repeats, budget_s=30.0)
        row = {"tokens": t, "experts_selected": len(selected), "packed_bytes": nbytes, "routed_s": sec,
               "bytes_per_s": nbytes / sec, "fraction_of_copy": nbytes / sec / copy_bw}
        line = f"{t:>6} {sec:>9.5f}s {row['bytes_per_s'] / 1e9:>8.1f} {row['fraction_of_copy']:>7.1%}"
        if t == 1:  # the bare decode GEMVs: every selected expert's three matrices, one token
            a, a_s = act_quant(x)
            mats = [(m, s) for e in selected for m, s in ((routed[e].w1, routed[e].w1_scale),
                                                           (routed[e].w3, routed[e].w3_scale))]
            h_q, h_s = act_quant(torch.randn(1, inter, device=dev).to(torch.bfloat16))
            down = [(routed[e].w2, routed[e].w2_scale) for e in selected]

            def gemvs():
                for m, s in mats:
                    fp4_gemm_triton(a, a_s, m, s, out_dtype=torch.bfloat16)
                for m, s in down:
                    fp4_gemm_triton(h_q, h_s, m, s, out_dtype=torch.bfloat16)

            gemv = timed(gemvs)
            gemv()
            gemv_s = _best_time(gemv, repeats, budget_s=30.0)
            row.update({"gemv_s": gemv_s, "gemv_bytes_per_s": nbytes / gemv_s,
                        "gemv_fraction_of_copy": nbytes / gemv_s / copy_bw})
            line += f"   GEMVs alone {gemv_s:.5f}s, {row['gemv_fraction_of_copy']:.1%} of copy"
        log(line)
        shapes.append(row)
    report["shapes"] = shapes
    decode = next((r for r in shapes if r["tokens"] == 1), None)
    if decode is not None and (dim, inter) == (DIM, INTER):
        met = decode["gemv_fraction_of_copy"] >= GPU_GEMV_TARGET
        report["targets"] = [{"tokens": 1, "gemv_fraction_target": GPU_GEMV_TARGET,
                              "gemv_fraction_of_copy": decode["gemv_fraction_of_copy"], "met": met}]
        log(f"target decode GEMV: >= {GPU_GEMV_TARGET:.0%} of device copy: measured "
            f"{decode['gemv_fraction_of_copy']:.0%}: {'met' if met else 'NOT met'}")
    return report


# ---------------------------------------------------------------------- expert parallel
def bench_experts_parallel(tokens: list[int], *, n_experts: int, dim: int, inter: int, repeats: int,
                           log: Callable[[str], None] = print) -> dict:
    """One MoE layer's expert work across the ranks of a torchrun group (`dsv41.distributed`):
    each rank computes the routed experts it owns (e % world_size == rank) and the shared expert,
    then the pairs are exchanged and added in the single process's order. Per token count: the
    layer's wall time (the slowest rank's), each rank's compute and exchange seconds and the bytes
    it sent and received, against one process computing every expert itself; the sums are checked
    bit for bit against that single process. Only rank 0 logs; every rank returns the report."""
    import torch.distributed as dist

    from dsv41 import distributed
    from dsv41.kernels.experts import expert_ffn, routed_experts
    from dsv41.model import DictExpertStore

    if n_experts < TOPK:
        raise ValueError(f"--experts must be at least {TOPK} (the routing width), got {n_experts}")
    ranks = distributed.init()
    say = log if ranks.is_main else (lambda line: None)
    routed, shared = make_experts(n_experts, dim, inter)  # the same bytes on every rank (one seed)
    owned = {e: p for e, p in routed.items() if ranks.owns(e)}
    counters = distributed.ExchangeCounters()
    layer = distributed.ExpertParallelExperts(0, DictExpertStore({(0, e): p for e, p in owned.items()}), SWIGLU_LIMIT,
                                              ranks=ranks, counters=counters)
    report = {"command": "bench experts --expert-parallel", "rank": ranks.rank, "world_size": ranks.world_size,
              "backend": ranks.backend, "dim": dim, "inter": inter, "n_experts": n_experts, "topk": TOPK,
              "threads": torch.get_num_threads(), "experts_held": sorted(owned),
              "bytes_held": sum(p.nbytes for p in owned.values()) + shared.nbytes,
              "note": "bytes: each rank's share of pair outputs (and one status value) sent to every peer, "
                      "the peers' shares received; times are the best of the repeats"}
    say(f"{ranks.world_size} ranks ({ranks.backend}); rank 0 holds {len(owned)} of {n_experts} routed experts "
        f"and the shared one, {report['bytes_held'] / 2**20:.1f} MiB")
    say(f"{'tokens':>6} {'one process':>12} {'parallel':>9} {'compute':>9} {'exchange':>9} "
        f"{'sent/token':>11} {'recv/token':>11}  equal")
    shapes = []
    for t in tokens:
        x = torch.randn(t, dim, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        ids, weights = make_routing(t, n_experts, TOPK, seed=t)

        def parallel():
            dist.barrier()
            return layer(x, ids, weights) + expert_ffn(x, shared, SWIGLU_LIMIT).float()

        def single():
            return routed_experts(x, ids, weights, routed, SWIGLU_LIMIT) + expert_ffn(x, shared, SWIGLU_LIMIT).float()

        single_s = _best_time(single, repeats, 60.0)
        equal = bool(torch.equal(parallel(), single()))
        counters.reset()
        parallel_s = _best_time(parallel, repeats, 60.0)
        totals = counters.totals()
        calls = max(totals["calls"], 1)
        mine = {"rank": ranks.rank, "pairs": totals["pairs"] / calls, "compute_s": totals["compute_s"] / calls,
                "exchange_s": totals["exchange_s"] / calls, "bytes_sent": totals["bytes_sent"] / calls,
                "bytes_received": totals["bytes_received"] / calls, "parallel_s": parallel_s,
                "single_s": single_s, "equal": equal}
        per_rank = [None] * ranks.world_size
        dist.all_gather_object(per_rank, mine)
        row = {"tokens": t, "single_process_s": max(r["single_s"] for r in per_rank),
               "parallel_s": max(r["parallel_s"] for r in per_rank), "ranks": per_rank,
               "bit_identical": all(r["equal"] for r in per_rank)}
        sent = max(r["bytes_sent"] for r in per_rank) / t
        received = max(r["bytes_received"] for r in per_rank) / t
        say(f"{t:>6} {row['single_process_s']:>11.4f}s {row['parallel_s']:>8.4f}s "
            f"{max(r['compute_s'] for r in per_rank):>8.4f}s {max(r['exchange_s'] for r in per_rank):>8.4f}s "
            f"{sent / 1024:>8.1f} KiB {received / 1024:>8.1f} KiB  {row['bit_identical']}")
        shapes.append(row)
    report["shapes"] = shapes
    return report


# ---------------------------------------------------------------------- bench decode
def decode_config(dim: int = DIM, inter: int = INTER):
    """The tiny preset reshaped for timing: the given expert sizes, 2 backbone layers (the second
    compresses, indexes and reads Engram) plus 1 MTP layer, 8 routed experts with 6 active."""
    from dsv41.inventory import derived_engram_rows
    from dsv41.tiny import tiny_config

    cfg = tiny_config().replace(
        dim=dim, moe_inter_dim=inter, n_layers=2, n_mtp_layers=1, compress_ratios=(0, 2, 0),
        kv_source_layers=(1,), index_source_layers=(1,), candidate_source_layer=1, engram_layer_ids=(1,),
        engram_num_embeddings=None, dspark_target_layer_ids=(1,), n_routed_experts=8, n_activated_experts=TOPK,
        dspark_n_routed_experts=6, dspark_n_activated_experts=2, vision_n_layers=0)
    cfg = cfg.replace(engram_num_embeddings=derived_engram_rows(cfg))
    problems = cfg.verify()
    if problems:
        raise ValueError(f"the decode benchmark's config does not verify: {problems[0]}")
    return cfg


def _synthetic(name: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    """float32 values for a dense tensor: ones for norms, zeros for sinks and biases, small mixes,
    unit-variance outputs elsewhere. Timing only needs finite, plausibly scaled numbers."""
    import math

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "attn_sink" or (leaf == "bias" and ".gate." not in name):
        return torch.zeros(shape)
    if (leaf == "weight" and "norm" in name.rsplit(".", 2)[-2]) or leaf in ("q_weight", "k_weight"):
        return torch.ones(shape)
    std = 0.02 if leaf.startswith("hc_") or len(shape) == 1 else \
        1.0 if name.endswith("embed.weight") else 1.0 / math.sqrt(math.prod(shape[1:]))
    return torch.randn(shape, generator=g) * std


def write_decode_checkpoint(out_dir: str, dim: int = DIM, inter: int = INTER, seed: int = 0, *, cfg=None) -> str:
    """Write the decode benchmark's checkpoint (release layout, `decode_config`, or `cfg`) into
    out_dir. Routed experts are random FP4 bytes with E8M0 scales; FP8 tensors are quantized from
    random values; everything else is written as stored."""
    from dsv41 import formats
    from dsv41.config import write_config_pair
    from dsv41.headers import write_index
    from dsv41.inventory import expected_tensors, shard_names
    from dsv41.tokenizer import build_tiny_tokenizer, tokenizer_config

    cfg = cfg if cfg is not None else decode_config(dim, inter)
    os.makedirs(out_dir, exist_ok=True)
    specs = expected_tensors(cfg)
    by_name = {spec.name: spec for spec in specs}
    g = torch.Generator().manual_seed(seed)
    for shard in shard_names(cfg):
        tensors = {}
        for spec in (sp for sp in specs if sp.shard == shard):
            if spec.dtype == "F8_E8M0":
                continue  # written with its weight
            if spec.dtype == "I8":
                tensors[spec.name] = torch.randint(-128, 128, spec.shape, dtype=torch.int8, generator=g)
                scale = by_name[spec.name[: -len("weight")] + "scale"]
                tensors[scale.name] = torch.randint(121, 125, scale.shape, dtype=torch.uint8,
                                                    generator=g).view(torch.float8_e8m0fnu)
            elif spec.dtype == "F8_E4M3":
                scale = by_name[spec.name[: -len("weight")] + "scale"]
                block = formats.infer_fp8_block(spec.shape, scale.shape)
                tensors[spec.name], tensors[scale.name] = formats.quantize_fp8_blocks(
                    _synthetic(spec.name, spec.shape, g), block)
            else:
                tensors[spec.name] = _stored(spec.name, spec.shape, formats.torch_dtype(spec.dtype), g)
        formats.save_safetensors(tensors, os.path.join(out_dir, shard))
        del tensors
    write_index(out_dir, specs)
    write_config_pair(cfg, out_dir)
    tokenizer = build_tiny_tokenizer(cfg)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer.to_str(pretty=True))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(cfg), f, indent=2)
        f.write("\n")
    return out_dir


def _stored(name: str, shape: tuple, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """`_synthetic` values in the stored dtype, drawn a slab of rows at a time, so the released
    embedding and head (129,280 x 5,120) never exist in float32 at once."""
    rows = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
    if len(shape) < 2 or shape[0] <= rows:
        return _synthetic(name, shape, g).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        # the slab's values as `_synthetic` scales the whole tensor (by its fan-in, not its rows)
        out[r0:r1] = _synthetic(name, (r1 - r0,) + tuple(shape[1:]), g).to(dtype)
    return out


PHASES = ("attention", "routed experts", "shared expert", "Engram", "head")


class _Clock:
    """Seconds per phase, accumulated by module hooks and the experts wrapper."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._began: dict = {}

    def start(self, key):
        self._began[key] = time.perf_counter()

    def stop(self, key, phase):
        self.seconds[phase] += time.perf_counter() - self._began.pop(key)

    def hook(self, module, phase):
        key = id(module)
        pre = module.register_forward_pre_hook(lambda *_: self.start(key))
        post = module.register_forward_hook(lambda *_: self.stop(key, phase))
        return pre, post


class _BenchExperts:
    """Stands in for a layer's RoutedExperts (same forward and store): routed experts fetched from
    the loader's cache, then run fused or expanded to BF16."""

    def __init__(self, inner, fused: bool, clock: _Clock):
        self.inner, self.fused, self.clock = inner, fused, clock
        self.layer, self.store, self.swiglu_limit = inner.layer, inner.store, inner.swiglu_limit

    def forward(self, x, expert_ids, weights):
        from dsv41.kernels.experts import routed_experts

        self.clock.start(self)
        selected = torch.unique(expert_ids).tolist()
        experts = dict(zip(selected, self.store.fetch(self.layer, selected)))
        if self.fused:
            y = routed_experts(x, expert_ids, weights, experts, self.swiglu_limit)
        else:
            y = torch.zeros(x.shape, dtype=torch.float32)
            for e in selected:
                rows, slot = torch.where(expert_ids == e)
                y.index_add_(0, rows, _baseline_expert(x[rows], experts[e], self.swiglu_limit,
                                                       weights[rows, slot, None]).float())
        self.clock.stop(self, "routed experts")
        return y

    __call__ = forward


def _install(model, fused: bool, clock: _Clock) -> Callable[[], None]:
    """Swap the model's experts for the benchmark's and hook the phases; returns the undo."""
    from dsv41.kernels.experts import PackedExpert, expert_ffn

    undo, handles = [], []
    backbone = model.backbone
    for block in backbone.layers:
        moe, shared = block.ffn, block.ffn.shared_experts
        original = moe.experts
        moe.experts = _BenchExperts(original, fused, clock)
        undo.append(lambda moe=moe, original=original: setattr(moe, "experts", original))
        packed = PackedExpert(shared.w1.weight, shared.w1.scale, shared.w2.weight, shared.w2.scale,
                              shared.w3.weight, shared.w3.scale)
        if fused:
            shared.forward = lambda x, packed=packed, limit=shared.swiglu_limit: expert_ffn(x, packed, limit)
        else:  # the earlier runtime held the shared expert dequantized to BF16 from load time on
            bf16 = PackedExpert(*(w for t, s in zip(packed[0::2], packed[1::2]) for w in (_expand_bf16(t, s), None)))

            def dense(x, w=bf16, limit=shared.swiglu_limit):
                from dsv41.kernels.experts import clamped_swiglu

                h = clamped_swiglu(F.linear(x, w.w1), F.linear(x, w.w3), limit)
                return F.linear(h.to(x.dtype), w.w2)

            shared.forward = dense
        undo.append(lambda shared=shared: shared.__dict__.pop("forward", None))
        handles += clock.hook(block.attn, "attention") + clock.hook(shared, "shared expert")
        if block.engram is not None:
            handles += clock.hook(block.engram, "Engram")
    handles += clock.hook(backbone.head, "head")

    return _restorer(undo, handles)


def _restorer(undo: list, handles: list) -> Callable[[], None]:
    """What puts a model back after the timing hooks: the undo steps, then the hooks removed."""
    def restore():
        for fn in undo:
            fn()
        for h in handles:
            h.remove()

    return restore


def bench_decode(checkpoint: str, *, prompt_tokens: int, decode_tokens: int,
                 log: Callable[[str], None] = print) -> dict:
    """Prefill then decode greedily, baseline then fused; tokens/s and per-phase seconds per token."""
    import dsv41
    from dsv41.kernels import native

    # threads=None: the bench's own --threads (default: torch's) governs, not the loader's "auto"
    model = dsv41.load(checkpoint, quiet=True, max_seq_len=prompt_tokens + decode_tokens + 8, threads=None)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    report = {"command": "bench decode", "checkpoint": checkpoint, "dim": cfg.dim, "inter": cfg.moe_inter_dim,
              "n_layers": cfg.n_layers, "n_experts": cfg.n_routed_experts, "topk": cfg.n_activated_experts,
              "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "threads": torch.get_num_threads(),
              "fused_cpu_kernel": "native" if native.available() else "torch", "modes": {}}
    for mode in ("baseline", "fused"):
        clock = _Clock()
        restore = _install(model, mode == "fused", clock)
        try:
            model.prefill(prompt)  # warms the expert cache and the allocations
            began = time.perf_counter()
            logits = model.prefill(prompt)
            prefill_s = time.perf_counter() - began
            clock.seconds = dict.fromkeys(PHASES, 0.0)
            token = int(logits[0].argmax())
            began = time.perf_counter()
            tokens = model.decode_n(token, decode_tokens)
            decode_s = time.perf_counter() - began
        finally:
            restore()
        per_token = {phase: t / decode_tokens for phase, t in clock.seconds.items()}
        per_token["other"] = decode_s / decode_tokens - sum(per_token.values())
        report["modes"][mode] = {"prefill_s": prefill_s, "decode_s": decode_s, "tokens_per_s": decode_tokens / decode_s,
                                 "phases_s_per_token": per_token, "tokens": tokens}
    base, fused = report["modes"]["baseline"], report["modes"]["fused"]
    report["speedup"] = fused["tokens_per_s"] / base["tokens_per_s"]
    report["same_tokens"] = base["tokens"] == fused["tokens"]
    log(f"{cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} routed experts ({cfg.n_activated_experts} "
        f"active) of inter {cfg.moe_inter_dim}; prompt {prompt_tokens} tokens, {decode_tokens} decoded; "
        f"fused experts on the {report['fused_cpu_kernel']} CPU kernel")
    log(f"{'s per decoded token':<20} {'baseline':>10} {'fused':>10}")
    for phase in (*PHASES, "other"):
        log(f"{phase:<20} {base['phases_s_per_token'][phase]:>10.4f} {fused['phases_s_per_token'][phase]:>10.4f}")
    log(f"{'tokens/s':<20} {base['tokens_per_s']:>10.3f} {fused['tokens_per_s']:>10.3f}   ({report['speedup']:.1f}x)")
    log(f"{'prefill s':<20} {base['prefill_s']:>10.3f} {fused['prefill_s']:>10.3f}")
    report["end"] = rss_bytes()
    log(f"resident memory: {report['end']['rss_bytes'] / 2**20:.0f} MiB now, "
        f"{report['end']['peak_rss_bytes'] / 2**20:.0f} MiB peak")
    return report


# ---------------------------------------------------------------------- bench decode --speculative
def bench_speculative(checkpoint: str, *, prompt_tokens: int, decode_tokens: int,
                      log: Callable[[str], None] = print) -> dict:
    """Greedy decoding three ways on one model, in one run: plain (one forward per token), speculative
    with the checkpoint's draft stack, and speculative with a forced-acceptance draft source that
    proposes plain decoding's own continuation (every proposal right: the best case, labelled so).
    Tokens/s, target forwards per token, and whether each produced plain decoding's tokens."""
    import dsv41
    from dsv41.numerics import Numerics

    # parity numerics: a verify and one-token steps are the same arithmetic, so the tokens must agree
    model = dsv41.load(checkpoint, quiet=True, max_seq_len=prompt_tokens + decode_tokens + 8, threads=None,
                       numerics=Numerics.parity())
    if model.draft_stack is None:
        raise ValueError(f"{checkpoint} has no DSpark draft stack (mtp.* stages with dspark_block_size > 0)")
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    n = decode_tokens + 1  # the first token comes from the prefill

    model.generate(prompt, max_new_tokens=2, stop_at_eos=False)  # warms the caches and allocations
    plain = model.generate(prompt, max_new_tokens=n, stop_at_eos=False)
    everything = plain.prompt_ids + plain.ids

    def forced(m, anchor, k):
        start = m.position
        return everything[start + 1 : start + 1 + k], [20.0] * k

    runs = {"plain": plain,
            "speculative (draft stack)": model.generate(prompt, max_new_tokens=n, stop_at_eos=False, speculative=True,
                                                        min_confidence=0.0),
            "speculative (forced acceptance: best case)": model.generate(prompt, max_new_tokens=n, stop_at_eos=False,
                                                                         speculative=True, draft_source=forced)}
    report = {"command": "bench decode --speculative", "checkpoint": checkpoint, "dim": cfg.dim,
              "n_layers": cfg.n_layers, "draft_block": cfg.dspark_block_size, "prompt_tokens": prompt_tokens,
              "decode_tokens": decode_tokens, "threads": torch.get_num_threads(), "numerics": "parity", "runs": {}}
    log(f"{cfg.n_layers} layers, dim {cfg.dim}, draft block {cfg.dspark_block_size}; prompt {prompt_tokens} tokens, "
        f"{decode_tokens} decoded greedily; numerics parity (speculation must give plain decoding's tokens)")
    log(f"{'run':<44} {'tokens/s':>9} {'forwards/token':>15} {'same tokens':>12}")
    for name, r in runs.items():
        spec = r.speculation
        forwards = spec.target_forwards if spec is not None else len(r.ids) - 1
        row = {"tokens_per_s": r.timings["tokens_per_s"], "target_forwards": forwards,
               "forwards_per_token": forwards / (len(r.ids) - 1), "same_tokens": r.ids == plain.ids,
               "mean_accepted": None if spec is None else spec.mean_accepted}
        report["runs"][name] = row
        log(f"{name:<44} {row['tokens_per_s']:>9.2f} {row['forwards_per_token']:>15.2f} {str(row['same_tokens']):>12}")
    base = report["runs"]["plain"]["tokens_per_s"]
    report["speedup"] = {name: row["tokens_per_s"] / base for name, row in report["runs"].items()}
    log("tokens/s against plain: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["speedup"].items() if k != "plain"))
    return report


# ---------------------------------------------------------------------- bench decode --geometry released
# Phases of a released-geometry decode token, in print order; "other" is what no hook covers
# (embedding, hyper-connection mixes and Sinkhorn, norms, the router, Python).
RELEASED_PHASES = ("attention", "routed experts", "shared expert", "Engram", "head", "other")
# The released-geometry decode targets for one run: the whole token at this fraction of its
# floor or more, and every phase at PHASE_TARGET or more but the latency-bound ones: "other"
# reads 8 MB spread over hundreds of small operations per layer, whose dispatch, not their bytes,
# takes the time.
TOKEN_TARGET, PHASE_TARGET, LATENCY_BOUND_PHASES = 0.50, 0.30, ("other",)
# Small Engram tables for the synthetic checkpoint: the lookup reads a handful of rows per token
# whatever the table size, so only the disk footprint changes with it.
_SMALL_ENGRAM_VOCAB = 4096
# A released-shaped checkpoint shrunk for tests (`--small`): same layer plan, tiny dims.
_SMALL_DIMS = dict(vocab_size=129280, dim=128, moe_inter_dim=64, n_heads=4, head_dim=64, rope_head_dim=32,
                   q_lora_rank=64, o_groups=2, o_lora_rank=32, window_size=8, index_n_heads=2, index_head_dim=32,
                   index_topk=8, candidate_topk_blocks=4, candidate_block_size=2, engram_n_heads=2,
                   engram_head_dim=32, dspark_markov_rank=32)


def released_decode_config(layers: int = 2, experts: int = 8, *, small: bool = False):
    """The released geometry (dim 5120, 64 heads of 512, q LoRA 1280, 8 output groups of 1024,
    indexer 32 x 128, window 128, index_topk 512, routed experts of 2304 with 6 active, the shared
    expert, vocab 129,280) with `layers` backbone layers and `experts` routed experts: layer 0 is a
    Full layer (ratio-2 compressor, indexer, candidate blocks), the others Reuse layers reading
    it, Engram (small tables) on layer 1, one MTP layer. `small`: the same plan at tiny dims."""
    from dsv41.config import RELEASED
    from dsv41.engram import build_compressed_token_map
    from dsv41.inventory import derived_engram_rows
    from dsv41.tokenizer import build_tiny_tokenizer

    if layers < 2:
        raise ValueError(f"--layers must be at least 2 (one Full and one Reuse layer), got {layers}")
    if experts < TOPK:
        raise ValueError(f"--experts must be at least {TOPK} (the routing width), got {experts}")
    cfg = RELEASED.replace(
        n_layers=layers, n_mtp_layers=1, compress_ratios=(2,) * layers + (0,), kv_source_layers=(0,),
        index_source_layers=(0,), candidate_source_layer=0, engram_layer_ids=(1,),
        engram_vocab_size=_SMALL_ENGRAM_VOCAB, engram_num_embeddings=None, dspark_target_layer_ids=(layers - 1,),
        n_routed_experts=experts, dspark_n_routed_experts=experts, dspark_n_activated_experts=3,
        vision_n_layers=0, **(_SMALL_DIMS if small else {}))
    _, n_compressed = build_compressed_token_map(build_tiny_tokenizer(cfg))
    cfg = cfg.replace(engram_compressed_vocab_size=int(n_compressed))
    cfg = cfg.replace(engram_num_embeddings=derived_engram_rows(cfg))
    problems = cfg.verify()
    if problems:
        raise ValueError(f"the released-geometry benchmark's config does not verify: {problems[0]}")
    return cfg


def _phase_of(name: str) -> str:
    """The phase a backbone parameter is read in (see RELEASED_PHASES)."""
    parts = name.split(".")
    if parts[0] == "layers":
        if parts[2] == "attn":
            return "attention"
        if parts[2] == "engram":
            return "Engram"
        if parts[2:4] == ["ffn", "shared_experts"]:
            return "shared expert"
    return "head" if parts[0] == "head" else "other"


def decode_token_bytes(model) -> dict:
    """Bytes one decode token must read, per phase and per layer, from the tensors as the model
    holds them (wo_a in BF16, the head in FP32): every dense weight once, one embedding row, the
    Engram table rows the hash picks, `n_activated_experts` packed routed experts per layer.
    Returns {"phases": {phase: bytes}, "layers": {layer: {phase: bytes}}}; KV-cache reads (under
    a megabyte at a benchmark's context) are left out."""
    cfg = model.cfg
    phases = dict.fromkeys(RELEASED_PHASES, 0)
    layers = {i: dict.fromkeys(RELEASED_PHASES, 0) for i in range(cfg.n_layers)}
    for name, p in model.backbone.named_parameters():
        if name.startswith(("aligner.", "image_")):
            continue  # the vision path: not read by a text token
        nbytes = p.numel() * p.element_size()
        if name == "embed.weight":
            nbytes = p.size(1) * p.element_size()  # one row per token
        phase = _phase_of(name)
        phases[phase] += nbytes
        if name.startswith("layers."):
            layers[int(name.split(".")[1])][phase] += nbytes
    # routed experts: I8 [inter, dim/2] x 2 and [dim, inter/2], one E8M0 byte per 32 values
    expert = 3 * (cfg.moe_inter_dim * cfg.dim // 2 + cfg.moe_inter_dim * cfg.dim // 32)
    # Engram rows: one FP8 row of engram_head_dim plus its E8M0 scales per hash column
    rows = cfg.n_hash_cols * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
    for i in range(cfg.n_layers):
        layers[i]["routed experts"] += cfg.n_activated_experts * expert
        phases["routed experts"] += cfg.n_activated_experts * expert
        if i in cfg.engram_layer_ids:
            layers[i]["Engram"] += rows
            phases["Engram"] += rows
    return {"phases": phases, "layers": layers, "routed_expert_bytes": expert}


class _TimedExperts:
    """Times a layer's RoutedExperts call and passes everything through unchanged."""

    def __init__(self, inner, clock, key):
        self.inner, self.clock, self.key = inner, clock, key

    def __call__(self, *args, **kwargs):
        self.clock.start(self.key)
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.clock.stop(self.key, "routed experts")

    forward = __call__  # MoE calls .forward

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _LayerClock(_Clock):
    """_Clock that also keeps each (layer, phase)'s seconds."""

    def __init__(self):
        super().__init__()
        self.seconds = dict.fromkeys(RELEASED_PHASES, 0.0)
        self.by_layer: dict = {}

    def stop(self, key, phase):
        began = self._began.pop(key)
        took = time.perf_counter() - began
        self.seconds[phase] += took
        layer = key[0] if isinstance(key, tuple) else None
        if layer is not None:
            self.by_layer[(layer, phase)] = self.by_layer.get((layer, phase), 0.0) + took

    def hook(self, module, phase, layer=None):
        key = (layer, phase)
        pre = module.register_forward_pre_hook(lambda *_: self.start(key))
        post = module.register_forward_hook(lambda *_: self.stop(key, phase))
        return pre, post


def _hook_phases(model, clock: _LayerClock) -> Callable[[], None]:
    """Time the model's own modules, computing exactly what they compute; returns the undo."""
    handles, undo = [], []
    backbone = model.backbone
    for i, block in enumerate(backbone.layers):
        moe = block.ffn
        original = moe.experts
        moe.experts = _TimedExperts(original, clock, (i, "routed experts"))
        undo.append(lambda moe=moe, original=original: setattr(moe, "experts", original))
        handles += clock.hook(block.attn, "attention", i) + clock.hook(moe.shared_experts, "shared expert", i)
        if block.engram is not None:
            handles += clock.hook(block.engram, "Engram", i)
    handles += clock.hook(backbone.head, "head")

    return _restorer(undo, handles)


def _floor_cells(seconds: float, nbytes: int, bandwidth: float) -> dict:
    floor = nbytes / bandwidth
    return {"seconds": seconds, "bytes": nbytes, "floor_seconds": floor,
            "fraction_of_floor": floor / seconds if seconds > 0 else None}


def _released_counts():
    """How many layers of each kind the released model has: Full / Reindex (own indexer queries)
    and Reuse layers, and its Engram layers."""
    from dsv41.config import RELEASED

    modes = RELEASED.layer_modes
    return {"full": sum(m != "reuse" for m in modes), "reuse": sum(m == "reuse" for m in modes),
            "engram": len(RELEASED.engram_layer_ids), "layers": RELEASED.n_layers}


def predict_released(per_layer_s: dict, per_layer_bytes: dict, head_s: float, head_bytes: int,
                     other_s: float, other_bytes: int, n_layers: int, bandwidth: float) -> dict:
    """Seconds and bytes of a decode token of the 40-layer released model from one run's
    measurements (experts resident in memory): per layer kind the measured layer's attention
    (`per_layer_*["full"|"reuse"]["attention"]`), the mean routed and shared expert time, Engram
    per Engram layer, the head once, and `other` per layer. A prediction, not a measurement."""
    counts = _released_counts()
    seconds, nbytes = head_s, head_bytes
    per_layer_other_s, per_layer_other_b = other_s / n_layers, other_bytes / n_layers
    for kind in ("full", "reuse"):
        cell_s, cell_b = per_layer_s[kind], per_layer_bytes[kind]
        seconds += counts[kind] * (cell_s["attention"] + cell_s["routed experts"] + cell_s["shared expert"]
                                   + per_layer_other_s)
        nbytes += counts[kind] * (cell_b["attention"] + cell_b["routed experts"] + cell_b["shared expert"]
                                  + per_layer_other_b)
    seconds += counts["engram"] * per_layer_s["engram"]
    nbytes += counts["engram"] * per_layer_bytes["engram"]
    return {"layers": counts["layers"], "layer_kinds": counts, "seconds_per_token": seconds,
            "tokens_per_s": 1.0 / seconds, "bytes": int(nbytes), "floor_seconds": nbytes / bandwidth,
            "fraction_of_floor": nbytes / bandwidth / seconds,
            "note": "a prediction from the measured layers, not a measurement of the released model"}


def bench_decode_released(checkpoint: str, *, prompt_tokens: int, decode_tokens: int, repeats: int,
                          thread_settings: Sequence[int], copy_bytes: int = 256 << 20, device: str = "cpu",
                          log: Callable[[str], None] = print) -> dict:
    """Decode on a released-geometry checkpoint at each thread count (taking turns, `repeats`
    rounds, the fastest round kept per setting): per phase seconds per token, the bytes it reads
    (`decode_token_bytes`), its floor at the copy bandwidth measured at that thread count, the
    fraction of the floor, the whole token likewise, and the 40-layer prediction. `device` "cuda"
    (or "cuda:N") holds and runs the routed experts there, the dense layers staying on the host;
    their floor is then still counted at the host's copy bandwidth."""
    import dsv41
    from dsv41.kernels import native

    before = torch.get_num_threads()
    _require_cuda(device)
    model = dsv41.load(checkpoint, quiet=True, max_seq_len=prompt_tokens + decode_tokens + 8, threads=None,
                       expert_device=device)
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    nbytes = decode_token_bytes(model)
    modes = cfg.layer_modes
    report = {"command": "bench decode", "geometry": "released", "checkpoint": checkpoint,
              "checkpoint_bytes": _folder_bytes(checkpoint), "dim": cfg.dim, "n_heads": cfg.n_heads,
              "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "n_layers": cfg.n_layers,
              "layer_modes": list(modes), "engram_layers": list(cfg.engram_layer_ids),
              "n_experts": cfg.n_routed_experts, "topk": cfg.n_activated_experts, "inter": cfg.moe_inter_dim,
              "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens, "cpu_count": os.cpu_count(),
              "fused_cpu_kernel": "native" if native.available() else "torch",
              "dense_kernel": "native" if native.available() else "reference", "expert_device": device,
              "bytes_definition": "weights as held at run time read once per token (wo_a BF16, head FP32), one "
                                  "embedding row, the Engram rows hashed, 6 packed routed experts per layer",
              "note": "wall times on a possibly shared machine; compare within one run", "settings": {}}
    bandwidth, runs = {}, {n: [] for n in thread_settings}
    try:
        for n in thread_settings:
            torch.set_num_threads(n)
            bandwidth[n] = copy_bandwidth(copy_bytes)
        for _ in range(max(1, repeats)):
            for n in thread_settings:
                torch.set_num_threads(n)
                clock = _LayerClock()
                restore = _hook_phases(model, clock)
                try:
                    logits = model.prefill(prompt)  # also warms the expert cache: experts resident
                    clock.seconds = dict.fromkeys(RELEASED_PHASES, 0.0)
                    clock.by_layer = {}
                    began = time.perf_counter()
                    tokens = model.decode_n(int(logits[0].argmax()), decode_tokens)
                    decode_s = time.perf_counter() - began
                finally:
                    restore()
                runs[n].append((decode_s, dict(clock.seconds), dict(clock.by_layer), tokens))
    finally:
        torch.set_num_threads(before)

    for n in thread_settings:
        decode_s, phase_s, layer_s, tokens = min(runs[n], key=lambda r: r[0])
        per_token = {phase: t / decode_tokens for phase, t in phase_s.items()}
        per_token["other"] = decode_s / decode_tokens - sum(v for k, v in per_token.items() if k != "other")
        bw = bandwidth[n]
        phases = {phase: _floor_cells(per_token[phase], nbytes["phases"][phase], bw) for phase in RELEASED_PHASES}
        token = _floor_cells(decode_s / decode_tokens, sum(nbytes["phases"].values()), bw)
        layer_cells = {}
        for i in range(cfg.n_layers):
            layer_cells[str(i)] = {"mode": modes[i], **{
                phase: _floor_cells(layer_s.get((i, phase), 0.0) / decode_tokens, nbytes["layers"][i][phase], bw)
                for phase in ("attention", "routed experts", "shared expert", "Engram")}}
        full = [i for i in range(cfg.n_layers) if modes[i] != "reuse"]
        reuse = [i for i in range(cfg.n_layers) if modes[i] == "reuse"]
        engram = list(cfg.engram_layer_ids)

        def mean(layers, phase, key):
            return sum(layer_cells[str(i)][phase][key] for i in layers) / len(layers)

        per_layer_s = {kind: {ph: mean(ls, ph, "seconds") for ph in ("attention", "routed experts", "shared expert")}
                       for kind, ls in (("full", full), ("reuse", reuse))}
        per_layer_b = {kind: {ph: mean(ls, ph, "bytes") for ph in ("attention", "routed experts", "shared expert")}
                       for kind, ls in (("full", full), ("reuse", reuse))}
        per_layer_s["engram"], per_layer_b["engram"] = mean(engram, "Engram", "seconds"), mean(engram, "Engram", "bytes")
        prediction = predict_released(per_layer_s, per_layer_b, phases["head"]["seconds"], phases["head"]["bytes"],
                                      phases["other"]["seconds"], phases["other"]["bytes"], cfg.n_layers, bw)
        report["settings"][str(n)] = {
            "threads": n, "copy_bandwidth_bytes_per_s": bw, "decode_s": decode_s,
            "tokens_per_s": decode_tokens / decode_s, "phases": phases, "token": token, "layers": layer_cells,
            "prediction_released": prediction, "tokens": tokens,
            "round_seconds": [r[0] for r in runs[n]]}
    # the top-level phases and token are those of the last setting (every core)
    last = report["settings"][str(thread_settings[-1])]
    report.update(threads=thread_settings[-1], copy_bandwidth_bytes_per_s=last["copy_bandwidth_bytes_per_s"],
                  phases=last["phases"], token=last["token"], prediction_released=last["prediction_released"])
    report["same_tokens"] = len({tuple(s["tokens"]) for s in report["settings"].values()}) == 1
    from dsv41.config import RELEASED

    if all(getattr(cfg, f) == getattr(RELEASED, f) for f in ("dim", "n_heads", "head_dim", "moe_inter_dim")):
        for cell in report["settings"].values():
            cell["targets"] = _released_targets(cell)
    _log_released(report, thread_settings, log)
    report["end"] = rss_bytes()
    log(f"resident memory: {report['end']['rss_bytes'] / 2**30:.2f} GiB now, "
        f"{report['end']['peak_rss_bytes'] / 2**30:.2f} GiB peak")
    return report


def _log_released(report: dict, thread_settings: Sequence[int], log: Callable[[str], None]) -> None:
    modes = ", ".join(f"{i} {m}" for i, m in enumerate(report["layer_modes"]))
    log(f"released geometry: dim {report['dim']}, {report['n_heads']} heads of {report['head_dim']}, vocab "
        f"{report['vocab_size']:,}; {report['n_layers']} layers ({modes}; Engram on {report['engram_layers']}), "
        f"{report['n_experts']} routed experts ({report['topk']} active) of {report['inter']}; checkpoint "
        f"{report['checkpoint_bytes'] / 2**30:.2f} GiB; prompt {report['prompt_tokens']}, "
        f"{report['decode_tokens']} decoded; dense and expert products on the {report['dense_kernel']} kernel")
    for n in thread_settings:
        cell = report["settings"][str(n)]
        log(f"{n} thread{'s' if n > 1 else ''}: copy bandwidth {cell['copy_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
        log(f"  {'phase':<16} {'s/token':>9} {'MB read':>9} {'floor s':>9} {'of floor':>9}")
        for name, c in [*cell["phases"].items(), ("token", cell["token"])]:
            frac = "" if c["fraction_of_floor"] is None else f"{c['fraction_of_floor']:.0%}"
            log(f"  {name:<16} {c['seconds']:>9.4f} {c['bytes'] / 1e6:>9.1f} {c['floor_seconds']:>9.4f} {frac:>9}")
        p = cell["prediction_released"]
        log(f"  {cell['tokens_per_s']:.2f} tokens/s; predicted for the {p['layers']} released layers (experts "
            f"resident): {p['seconds_per_token']:.2f} s/token, {p['tokens_per_s']:.2f} tokens/s, "
            f"{p['bytes'] / 1e9:.2f} GB/token, {p['fraction_of_floor']:.0%} of its floor (a prediction)")
        if "targets" not in cell:  # judged at the released dimensions only
            continue
        t = cell["targets"]
        lowest = t["lowest_phase"]
        log(f"  target: the token >= {TOKEN_TARGET:.0%} of its floor, every phase >= {PHASE_TARGET:.0%} but the "
            f"latency-bound {', '.join(LATENCY_BOUND_PHASES)}: measured {t['token_fraction']:.0%}, lowest "
            f"{lowest} {t['lowest_phase_fraction']:.0%}: {'met' if t['met'] else 'NOT met'}")
    if len(thread_settings) > 1:
        one, every = (report["settings"][str(n)]["tokens_per_s"] for n in (thread_settings[0], thread_settings[-1]))
        report["ratio_all_over_one"] = every / one
        log(f"{thread_settings[-1]} threads / {thread_settings[0]}: {every / one:.2f}x tokens/s")


def _released_targets(cell: dict) -> dict:
    """One thread setting's cells against TOKEN_TARGET and PHASE_TARGET."""
    token = cell["token"]["fraction_of_floor"]
    bounded = {name: c["fraction_of_floor"] for name, c in cell["phases"].items()
               if name not in LATENCY_BOUND_PHASES and c["fraction_of_floor"] is not None}
    lowest = min(bounded, key=bounded.get)
    return {"token_target": TOKEN_TARGET, "phase_target": PHASE_TARGET,
            "latency_bound_phases": list(LATENCY_BOUND_PHASES), "token_fraction": token,
            "lowest_phase": lowest, "lowest_phase_fraction": bounded[lowest],
            "met": token is not None and token >= TOKEN_TARGET and bounded[lowest] >= PHASE_TARGET}


def _require_cuda(device: str) -> None:
    """Refuse a device other than the CPU where the Triton expert kernels cannot run."""
    if device == "cpu":
        return
    from dsv41.kernels.triton_experts import available

    if not available():
        raise ValueError(f"--device {device} needs a CUDA device and Triton; this machine has "
                         f"{'no CUDA device' if not torch.cuda.is_available() else 'no Triton'}")
    if not device.startswith("cuda"):
        raise ValueError(f"--device takes cpu, cuda or cuda:N, got {device!r}")


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------------- bench threads
THREADS_PROMPT = "The harbor lights came on one by one as the ferry pulled away from the old stone pier."


def bench_prefill(checkpoint: Optional[str], *, tokens: int, chunks: Sequence[int], repeats: int = 2,
                  log: Callable[[str], None] = print) -> dict:
    """One-shot prefill of `tokens` random ids against the same ids in chunks of each size, best of
    `repeats`, in one run: seconds and each chunking's ratio to one-shot, and whether its last
    logits equal one-shot's (the reference's arithmetic, as loaded, may part; parity never does)."""
    import dsv41

    model = dsv41.load(checkpoint, quiet=True, max_seq_len=None if checkpoint is None else tokens)
    if tokens > model.max_seq_len:
        raise ValueError(f"--tokens {tokens} exceeds the model's {model.max_seq_len} positions")
    ids = torch.randint(3, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    report = {"command": "bench prefill", "checkpoint": model.report.checkpoint, "tokens": tokens,
              "dim": model.cfg.dim, "threads": torch.get_num_threads(), "numerics": model.numerics.as_dict(),  # as loaded
              "runs": []}
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
        row = {"chunk": chunk, "calls": -(-tokens // chunk), "seconds": best, "ratio_to_one_shot": best / one_shot[0],
               "tokens_per_s": tokens / best, "last_logits_equal": bool(torch.equal(logits, one_shot[1])),
               "last_logits_max_abs_diff": float((logits - one_shot[1]).abs().max())}
        report["runs"].append(row)
        log(f"  chunks of {chunk:>5}: {row['calls']:>4} calls, {best:7.3f} s, {row['ratio_to_one_shot']:.2f}x one-shot, "
            f"{row['tokens_per_s']:,.0f} tokens/s, last logits {'equal' if row['last_logits_equal'] else 'differ by %.3g' % row['last_logits_max_abs_diff']}")
    return report


def bench_threads(checkpoint: str, *, decode_tokens: int, repeats: int, prompt: str = THREADS_PROMPT,
                  log: Callable[[str], None] = print) -> dict:
    """Greedy decode of `decode_tokens` tokens after `prompt` at 1 thread and at all cores
    (`loader.all_cores()`), taking turns for `repeats` rounds. Each setting's tokens/s is taken
    from its median decode time (the best is reported too: on a shared machine one lucky run
    would decide a best-of); torch's thread count is put back afterwards."""
    import dsv41
    from dsv41.kernels import native
    from dsv41.loader import all_cores, auto_threads

    before = torch.get_num_threads()
    cores = all_cores()
    settings = [1] if cores == 1 else [1, cores]
    try:
        model = dsv41.load(checkpoint, quiet=True, threads=None)
        cfg = model.cfg
        ids = model.encode(prompt)
        if len(ids) + decode_tokens > model.max_seq_len:
            raise ValueError(f"{len(ids)} prompt tokens + {decode_tokens} decoded exceed the model's "
                             f"{model.max_seq_len} positions")
        auto, why = auto_threads(cfg)
        runs = {n: [] for n in settings}
        tokens = {}
        for _ in range(max(1, repeats)):
            for n in settings:
                torch.set_num_threads(n)
                began = time.perf_counter()
                logits = model.prefill(ids)
                prefill_s = time.perf_counter() - began
                began = time.perf_counter()
                out = model.decode_n(int(logits[0].argmax()), decode_tokens)
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
        rows[str(n)] = {"threads": n, "median_decode_s": median, "tokens_per_s": decode_tokens / median,
                        "best_decode_s": min(decode), "best_tokens_per_s": decode_tokens / min(decode),
                        "median_prefill_s": statistics.median(r["prefill_s"] for r in runs[n]), "runs": runs[n]}
    report = {"command": "bench threads", "checkpoint": checkpoint, "dim": cfg.dim, "inter": cfg.moe_inter_dim,
              "n_layers": cfg.n_layers, "prompt_tokens": len(ids), "decode_tokens": decode_tokens,
              "repeats": max(1, repeats), "all_cores": cores, "cpu_count": os.cpu_count(),
              "fused_cpu_kernel": "native" if native.available() else "torch",
              "auto_threads": auto, "auto_reason": why, "settings": rows,
              "same_tokens": len({tuple(t) for t in tokens.values()}) == 1,
              "note": "tokens_per_s from the median run; the settings take turns, so load elsewhere hits both alike"}
    one = rows["1"]
    log(f"{checkpoint}: {cfg.n_layers} layers, dim {cfg.dim}, expert inter {cfg.moe_inter_dim}; prompt {len(ids)} "
        f"tokens, {decode_tokens} decoded greedily, median of {report['repeats']} runs; "
        f"experts on the {report['fused_cpu_kernel']} CPU kernel")
    log(f"{'threads':>8} {'tokens/s':>10} {'s/token':>10} {'best tok/s':>11} {'prefill s':>10}")
    for row in rows.values():
        log(f"{row['threads']:>8} {row['tokens_per_s']:>10.2f} {row['median_decode_s'] / decode_tokens:>10.4f} "
            f"{row['best_tokens_per_s']:>11.2f} {row['median_prefill_s']:>10.3f}")
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


def _token_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--tokens needs positive token counts, got {text!r}")
    return values


def cli_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="dsv41 bench", description=(
        "Benchmarks. `experts`: one MoE layer's expert work (6 routed FP4 experts per token plus the "
        "shared FP8 expert) at the released sizes, fused from packed bytes against expanding to BF16."))
    sub = parser.add_subparsers(dest="what", required=True)
    ex = sub.add_parser("experts", help="fused packed-FP4 experts vs expand-to-BF16 baseline")
    ex.add_argument("--tokens", default="1,16,512", help="comma-separated token counts (default 1,16,512)")
    ex.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    ex.add_argument("--experts", type=int, default=16, help="distinct routed experts built (default 16)")
    ex.add_argument("--repeats", type=int, default=3, help="runs per measurement, best kept (default 3)")
    ex.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ex.add_argument("--device", default="cpu",
                    help="cpu (default), or cuda / cuda:N for the Triton kernels against the device's copy bandwidth")
    ex.add_argument("--kernels", default="native,torch",
                    help="fused CPU kernels to time: native, torch or both (default native,torch)")
    ex.add_argument("--expert-parallel", action="store_true",
                    help="under torchrun: the layer's experts split over the ranks (e %% world_size == rank), "
                         "time and bytes each rank sends and receives, against one process")
    # smaller experts and copy for tests: DIM,INTER and MiB
    ex.add_argument("--dims", default=f"{DIM},{INTER}", help=argparse.SUPPRESS)
    ex.add_argument("--copy-mib", type=int, default=256, help=argparse.SUPPRESS)
    de = sub.add_parser("decode", help="end-to-end tokens/s and phases on a synthetic checkpoint, baseline vs fused")
    de.add_argument("--checkpoint", metavar="DIR", help="use this checkpoint; an empty or missing folder is "
                    "filled with the synthetic one and kept (default: a temporary folder)")
    de.add_argument("--tokens", type=int, default=4, help="tokens to decode (default 4)")
    de.add_argument("--prompt", type=int, default=8, help="prompt length (default 8)")
    de.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    de.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    de.add_argument("--dims", default=f"{DIM},{INTER}", help=argparse.SUPPRESS)
    de.add_argument("--geometry", choices=("experts", "released"), default="experts",
                    help="experts (default): the embedded attention with released expert sizes, baseline vs "
                         "fused; released: every released dimension on a few layers, per phase against the "
                         "bandwidth floor, at 1 thread and at every core, with the 40-layer prediction")
    de.add_argument("--layers", type=int, default=2, help="backbone layers with --geometry released (default 2)")
    de.add_argument("--experts", type=int, default=8, help="routed experts per layer with --geometry released "
                    "(default 8)")
    de.add_argument("--repeats", type=int, default=2, help="rounds per thread setting with --geometry released, "
                    "the fastest kept (default 2)")
    de.add_argument("--device", default="cpu", help="with --geometry released: cpu (default), or cuda / cuda:N "
                    "to hold and run the routed experts there (dense layers on the host)")
    de.add_argument("--speculative", action="store_true",
                    help="plain greedy decoding against speculative decoding with the draft stack and with a "
                         "forced-acceptance draft source (the best case), on the experts geometry")
    de.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # the released plan at tiny dims
    de.add_argument("--copy-mib", type=int, default=256, help=argparse.SUPPRESS)
    pf = sub.add_parser("prefill", help="one-shot against chunked prefill, as ratios measured in one run")
    pf.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny one)")
    pf.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    pf.add_argument("--chunks", default="512,1024", help="comma-separated chunk sizes (default 512,1024)")
    pf.add_argument("--repeats", type=int, default=2, help="runs per chunking, best kept (default 2)")
    pf.add_argument("--real-size", action="store_true",
                    help="also time the decode benchmark's real-size synthetic layers (--real-tokens tokens)")
    pf.add_argument("--real-tokens", type=int, default=128, help="prompt length on the real-size layers (default 128)")
    pf.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    vi = sub.add_parser("vision", help="one image through the vision tower (ViT and aligner) at the released geometry")
    vi.add_argument("--size", default="1344x1344", metavar="WxH",
                    help="the image's pixel size before the resize plan (default 1344x1344: the full token budget)")
    vi.add_argument("--repeats", type=int, default=1, help="runs, best kept (default 1)")
    vi.add_argument("--device", default="cpu", help="cpu (default) or a CUDA device")
    vi.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    vi.add_argument("--blocks", type=int, default=None, help=argparse.SUPPRESS)  # fewer ViT blocks, for tests
    th = sub.add_parser("threads", help="decode tokens/s at 1 torch thread and at all cores, and their ratio")
    th.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny one)")
    th.add_argument("--tokens", type=int, default=16, help="tokens to decode per run (default 16)")
    th.add_argument("--repeats", type=int, default=5, help="runs per setting, taking turns; the median counts (default 5)")
    th.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    args = parser.parse_args(argv)
    if args.what == "decode":
        return _decode_main(args)
    if args.what == "threads":
        return _threads_main(args)
    if args.what == "vision":
        return _vision_main(args)
    if args.what == "prefill":
        return _prefill_main(args)

    try:
        tokens = _token_list(args.tokens)
        dim, inter = (int(v) for v in args.dims.split(","))
        if dim % 32 or inter % 32:
            raise ValueError(f"--dims must be multiples of 32, got {args.dims}")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if args.copy_mib < 1:
            raise ValueError(f"--copy-mib must be positive, got {args.copy_mib}")
        kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
        if not kernels or set(kernels) - {"native", "torch"}:
            raise ValueError(f"--kernels takes native, torch or native,torch, got {args.kernels!r}")
        if args.expert_parallel:
            from dsv41 import distributed

            try:
                report = bench_experts_parallel(tokens, n_experts=args.experts, dim=dim, inter=inter,
                                                repeats=args.repeats)
            finally:  # leave the group before exit: a group torn down at interpreter exit can abort
                distributed.shutdown()
        elif args.device != "cpu":
            report = bench_experts_gpu(tokens, n_experts=args.experts, dim=dim, inter=inter, repeats=args.repeats,
                                       device=args.device)
        else:
            report = bench_experts(tokens, n_experts=args.experts, dim=dim, inter=inter, repeats=args.repeats,
                                   kernels=kernels, copy_bytes=args.copy_mib << 20)
    except ValueError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # ExpertParallelError: no group, or a rank that failed
        if not args.expert_parallel:
            raise
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 1
    if args.json and report.get("rank", 0) == 0:  # under --expert-parallel rank 0 writes it
        _write_report(args.json, report)
    return 0


def _write_report(path: str, report: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _prefill_main(args) -> int:
    import tempfile

    from dsv41.loader import LoadError

    try:
        chunks = _token_list(args.chunks)
        if args.tokens < 2 or args.real_tokens < 2:
            raise ValueError("--tokens and --real-tokens must be at least 2")
        print(f"prefill of {args.tokens} tokens (one-shot scores every position against every other; a chunk "
              f"only its own queries)")
        report = {"embedded": bench_prefill(args.checkpoint, tokens=args.tokens, chunks=chunks, repeats=args.repeats)}
        if args.real_size:
            with tempfile.TemporaryDirectory(prefix="dsv41-bench-prefill-") as folder:
                write_decode_checkpoint(folder)
                print(f"prefill of {args.real_tokens} tokens on real-size synthetic layers (dim {DIM}, experts {INTER})")
                report["real_size"] = bench_prefill(folder, tokens=args.real_tokens, repeats=args.repeats,
                                                    chunks=[c for c in chunks if c < args.real_tokens]
                                                    or [max(1, args.real_tokens // 4)])
    except (LoadError, ValueError) as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _write_report(args.json, report)
    return 0


def _decode_main(args) -> int:
    if args.tokens < 1 or args.prompt < 2:
        print("dsv41 bench: --tokens must be at least 1 and --prompt at least 2", file=sys.stderr)
        return 2
    if args.geometry == "released":
        if args.speculative:
            print("dsv41 bench: --speculative runs on the experts geometry; drop --geometry released", file=sys.stderr)
            return 2
        return _decode_released_main(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dim, inter = (int(v) for v in args.dims.split(","))
    bench = bench_speculative if args.speculative else bench_decode

    def write(path):
        write_decode_checkpoint(path, dim, inter)
        return "the synthetic checkpoint"

    return _on_synthetic_checkpoint(args, "dsv41-bench-decode-", write,
                                    lambda path: bench(path, prompt_tokens=args.prompt, decode_tokens=args.tokens))


def _decode_released_main(args) -> int:
    from dsv41.loader import all_cores

    if args.repeats < 1 or args.copy_mib < 1 or (args.threads is not None and args.threads < 1):
        print("dsv41 bench: --repeats and --threads must be at least 1", file=sys.stderr)
        return 2
    cores = all_cores()
    settings = [args.threads] if args.threads is not None else ([1] if cores == 1 else [1, cores])

    try:  # refused before anything is written
        cfg = released_decode_config(args.layers, args.experts, small=args.small)
        _require_cuda(args.device)
    except ValueError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2

    def write(path):
        write_decode_checkpoint(path, cfg=cfg)
        return f"the released-geometry checkpoint ({_folder_bytes(path) / 2**30:.2f} GiB)"

    def run(path):
        return bench_decode_released(path, prompt_tokens=args.prompt, decode_tokens=args.tokens,
                                     repeats=args.repeats, thread_settings=settings, copy_bytes=args.copy_mib << 20,
                                     device=args.device)

    return _on_synthetic_checkpoint(args, "dsv41-bench-released-", write, run)


def _on_synthetic_checkpoint(args, prefix: str, write: Callable[[str], str], run: Callable[[str], dict]) -> int:
    """Run `run(path)` on --checkpoint, written there by `write(path)` first when the folder is
    empty or missing (a temporary folder, removed after, without --checkpoint); the report to --json."""
    import shutil
    import tempfile

    from dsv41.loader import LoadError

    temporary = None
    path = args.checkpoint
    try:
        if path is None:
            path = temporary = tempfile.mkdtemp(prefix=prefix)
        if not os.path.isfile(os.path.join(path, "config.json")):
            if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
                print(f"dsv41 bench: {path} is neither a checkpoint nor an empty folder to write one into",
                      file=sys.stderr)
                return 2
            began = time.perf_counter()
            what = write(path)
            print(f"wrote {what} to {path} in {time.perf_counter() - began:.1f} s")
        report = run(path)
    except (LoadError, ValueError) as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    if args.json:
        _write_report(args.json, report)
    return 0


def _threads_main(args) -> int:
    from dsv41.cachedir import CacheError
    from dsv41.loader import LoadError

    if args.tokens < 1 or args.repeats < 1:
        print("dsv41 bench: --tokens and --repeats must be at least 1", file=sys.stderr)
        return 2
    try:
        path = args.checkpoint
        if path is None:
            from dsv41.tiny import default_checkpoint

            path = default_checkpoint(progress=False)
        report = bench_threads(path, decode_tokens=args.tokens, repeats=args.repeats)
    except (LoadError, ValueError, CacheError) as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _write_report(args.json, report)
    return 0


# ---------------------------------------------------------------------- bench vision
def bench_vision(width: int, height: int, *, blocks: Optional[int] = None, repeats: int = 1,
                 device: str = "cpu", log: Callable[[str], None] = print) -> dict:
    """One image's vision tower (ViT and aligner, bf16 as the released runtime holds them) at the
    released geometry on synthetic weights: the resize plan of a `width x height` image, the seconds
    of the best of `repeats` runs and the tower's weight bytes. `blocks` overrides the 32 ViT blocks."""
    from dsv41 import vision
    from dsv41.config import RELEASED
    from dsv41.layers import init_random_

    cfg = RELEASED if blocks is None else RELEASED.replace(vision_n_layers=int(blocks))
    plan = vision.plan(width, height, cfg)
    vit, aligner = init_random_(vision.ViT(cfg), 0).to(device), init_random_(vision.Aligner(cfg), 1).to(device)
    g = torch.Generator().manual_seed(2)
    patches = (torch.rand(plan.patches, 3, cfg.vision_patch_size, cfg.vision_patch_size, generator=g) * 2 - 1)
    image = vision.ImageInput(0, plan, patches.to(torch.bfloat16))

    def run():
        with torch.inference_mode():
            out = vision.encode_image(vit, aligner, image)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        return out

    run()  # warm-up: allocator, kernels
    seconds = _best_time(run, repeats, budget_s=600.0)
    weight_bytes = sum(p.numel() * p.element_size() for m in (vit, aligner) for p in m.parameters())
    report = {"width": width, "height": height, "pixel_size": [plan.pixel_width, plan.pixel_height],
              "vit_grid": [plan.vit_rows, plan.vit_cols], "patches": plan.patches,
              "llm_grid": [plan.llm_rows, plan.llm_cols], "span_tokens": plan.span_tokens,
              "vit_blocks": cfg.vision_n_layers, "vision_dim": cfg.vision_dim, "device": str(device),
              "threads": torch.get_num_threads(), "seconds": seconds, "weight_bytes": weight_bytes}
    log(f"vision tower, {cfg.vision_n_layers} blocks of dim {cfg.vision_dim} ({weight_bytes / 2**30:.2f} GiB bf16): "
        f"a {width}x{height} image -> {plan.pixel_width}x{plan.pixel_height} px, {plan.patches:,} patches "
        f"({plan.vit_rows}x{plan.vit_cols}) -> {plan.cells} cells ({plan.llm_rows}x{plan.llm_cols}), "
        f"{plan.span_tokens} span tokens: {seconds:.2f} s on {device} ({torch.get_num_threads()} threads)")
    return report


def _vision_main(args) -> int:
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
        if args.repeats < 1 or (args.blocks is not None and args.blocks < 1):
            raise ValueError("--repeats (and --blocks) must be at least 1")
        if args.device != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is available here")
        report = bench_vision(width, height, blocks=args.blocks, repeats=args.repeats, device=args.device)
    except ValueError as exc:  # a malformed --size, an image size the plan refuses (ImageError)
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _write_report(args.json, report)
    return 0
