"""`dsv41 bench experts`: the fused packed-FP4 expert path against expand-to-BF16-then-matmul.

One run builds real-size experts (dim 5120, intermediate 2304: packed FP4 with E8M0 scales for
the routed ones, FP8 with 32x32 E8M0 blocks for the shared one), measures this machine's memory
copy bandwidth, and for each token count times one MoE layer's expert work (6 routed experts per
token plus the shared expert) three ways:

- baseline: every selected expert expanded to BF16 (the op layer's codec times its scales), then
  BF16 matmuls -- what the earlier runtime did on each step;
- fused: `routed_experts` + `expert_ffn` straight from the packed bytes (the CPU default);
- compiled (unless --no-compiled): the same with `compiled=True`; compile time reported apart.

Per shape it reports the best time of a few runs, the speedup over the baseline and the packed
bytes the fused path read per second, as a fraction of the copy bandwidth (bytes of the source
tensor per second of a large tensor copy; the copy's read+write traffic is twice that). Times on a
shared machine move with its load: compare numbers from one run.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# The released expert geometry and routing width.
DIM, INTER, TOPK = 5120, 2304, 6
SWIGLU_LIMIT = 10.0


def _best_time(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best wall time of up to `repeats` calls, stopping early once `budget_s` is spent."""
    best, spent = float("inf"), 0.0
    for _ in range(max(1, repeats)):
        began = time.perf_counter()
        fn()
        took = time.perf_counter() - began
        best, spent = min(best, took), spent + took
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


def fused_moe(x, ids, weights, routed, shared, limit, compiled=False):
    """Routed + shared experts from the packed weights; float32 [n, dim]."""
    from dsv41.kernels.experts import expert_ffn, routed_experts

    y = routed_experts(x, ids, weights, routed, limit, compiled=compiled)
    return y + expert_ffn(x, shared, limit, compiled=compiled).float()


def packed_bytes_read(ids, routed, shared) -> int:
    """Packed weight and scale bytes one MoE call reads: each selected expert once, the shared one."""
    return sum(routed[e].nbytes for e in torch.unique(ids).tolist()) + shared.nbytes


# ---------------------------------------------------------------------- the command
def bench_experts(tokens: list[int], *, n_experts: int, dim: int, inter: int, repeats: int, compiled: bool,
                  copy_bytes: int = 256 << 20, log: Callable[[str], None] = print) -> dict:
    """Run the expert benchmark; returns the report (see the module docstring)."""
    if n_experts < TOPK:
        raise ValueError(f"--experts must be at least {TOPK} (the routing width), got {n_experts}")
    report = {
        "command": "bench experts", "dim": dim, "inter": inter, "n_experts": n_experts, "topk": TOPK,
        "swiglu_limit": SWIGLU_LIMIT, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "note": "wall times on a possibly shared machine; compare within one run",
    }
    copy_bw = copy_bandwidth(copy_bytes)
    report["copy_bandwidth_bytes_per_s"] = copy_bw
    report["copy_bandwidth_definition"] = f"source bytes per second of a {copy_bytes >> 20} MiB uint8 tensor copy"
    log(f"memory copy bandwidth: {copy_bw / 1e9:.2f} GB/s (source bytes / s; {report['threads']} threads)")
    report["peak_rss_reset"] = _reset_peak_rss()  # the copy's 512 MiB is not the experts' footprint

    routed, shared = make_experts(n_experts, dim, inter)
    report["routed_expert_bytes"] = next(iter(routed.values())).nbytes
    report["shared_expert_bytes"] = shared.nbytes
    report["after_build"] = rss_bytes()
    log(f"{n_experts} routed experts of {report['routed_expert_bytes'] / 2**20:.1f} MiB packed, shared expert "
        f"{shared.nbytes / 2**20:.1f} MiB; RSS {report['after_build']['rss_bytes'] / 2**20:.0f} MiB")

    compile_s = None
    if compiled:
        x1 = torch.randn(1, dim, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        ids1, w1 = make_routing(1, n_experts, TOPK)
        began = time.perf_counter()
        fused_moe(x1, ids1, w1, routed, shared, SWIGLU_LIMIT, compiled=True)  # compiles both loops
        compile_s = time.perf_counter() - began
        from dsv41.kernels import experts as _experts

        compiled = all(v is not None for v in _experts._COMPILED.values()) and bool(_experts._COMPILED)
        report["compile_s"] = compile_s
        log(f"compiled decode loop: first call {compile_s:.1f} s" + ("" if compiled else " (compile failed)"))

    shapes = []
    header = f"{'tokens':>6} {'baseline':>10} {'fused':>9} {'speedup':>8} {'GB/s':>6} {'of copy':>8}"
    if compiled:
        header += f" {'compiled':>9} {'speedup':>8} {'of copy':>8}"
    log(header)
    for t in tokens:
        x = torch.randn(t, dim, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        ids, weights = make_routing(t, n_experts, TOPK, seed=t)
        nbytes = packed_bytes_read(ids, routed, shared)
        base_s = _best_time(lambda: baseline_moe(x, ids, weights, routed, shared, SWIGLU_LIMIT), repeats, 20.0)
        fused_s = _best_time(lambda: fused_moe(x, ids, weights, routed, shared, SWIGLU_LIMIT), repeats, 20.0)
        row = {
            "tokens": t, "experts_selected": len(torch.unique(ids)), "packed_bytes": nbytes,
            "baseline_s": base_s, "fused_s": fused_s, "speedup": base_s / fused_s,
            "fused_bytes_per_s": nbytes / fused_s, "fused_fraction_of_copy": nbytes / fused_s / copy_bw,
        }
        line = (f"{t:>6} {base_s:>9.3f}s {fused_s:>8.3f}s {row['speedup']:>7.1f}x "
                f"{row['fused_bytes_per_s'] / 1e9:>6.2f} {row['fused_fraction_of_copy']:>7.1%}")
        if compiled:
            comp_s = _best_time(lambda: fused_moe(x, ids, weights, routed, shared, SWIGLU_LIMIT, compiled=True),
                                repeats, 20.0)
            row.update({"compiled_s": comp_s, "compiled_speedup": base_s / comp_s,
                        "compiled_bytes_per_s": nbytes / comp_s, "compiled_fraction_of_copy": nbytes / comp_s / copy_bw})
            line += f" {comp_s:>8.3f}s {row['compiled_speedup']:>7.1f}x {row['compiled_fraction_of_copy']:>7.1%}"
        log(line)
        shapes.append(row)
    report["shapes"] = shapes
    report["end"] = rss_bytes()
    log(f"resident memory: {report['end']['rss_bytes'] / 2**20:.0f} MiB now, "
        f"{report['end']['peak_rss_bytes'] / 2**20:.0f} MiB peak (the baseline's BF16 copies included)")
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
    ex.add_argument("--no-compiled", dest="compiled", action="store_false",
                    help="skip the torch.compile'd decode loop (its first call compiles for seconds to a minute)")
    # smaller experts and copy for tests: DIM,INTER and MiB
    ex.add_argument("--dims", default=f"{DIM},{INTER}", help=argparse.SUPPRESS)
    ex.add_argument("--copy-mib", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    try:
        tokens = _token_list(args.tokens)
        dim, inter = (int(v) for v in args.dims.split(","))
        if dim % 32 or inter % 32:
            raise ValueError(f"--dims must be multiples of 32, got {args.dims}")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if args.copy_mib < 1:
            raise ValueError(f"--copy-mib must be positive, got {args.copy_mib}")
        report = bench_experts(tokens, n_experts=args.experts, dim=dim, inter=inter, repeats=args.repeats,
                               compiled=args.compiled, copy_bytes=args.copy_mib << 20)
    except ValueError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0
