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
`--device cuda` times the Triton kernels instead (`bench_experts_gpu`): the decode GEMVs' kernel
time against the device's memory bandwidth (target 60%) and one expert's 512-token GEMMs against
torch's BF16 matmul on the same shapes (target 50%), both measured in the same run;
`--expert-parallel`, under torchrun, splits the experts over the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dsv41.core.errors import Dsv41Error

from .common import (
    DIM,
    INTER,
    SWIGLU_LIMIT,
    TOPK,
    best_time,
    best_times,
    copy_bandwidth,
    reset_peak_rss,
    rss_bytes,
    token_list,
    write_report,
)


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
    ids = (
        torch.stack([torch.randperm(n_experts, generator=g)[:topk] for _ in range(tokens)])
        if tokens
        else torch.empty(0, topk, dtype=torch.long)
    )
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

    return {
        e: PackedExpert(
            _expand_bf16(p.w1, p.w1_scale),
            None,
            _expand_bf16(p.w2, p.w2_scale),
            None,
            _expand_bf16(p.w3, p.w3_scale),
            None,
        )
        for e, p in experts.items()
    }


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
        isa = (
            "avx512"
            if tokens == 1 and lib is not None and lib.avx512
            else "avx2"
            if lib is not None and lib.simd
            else "plain"
        )
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


def bench_experts(
    tokens: list[int],
    *,
    n_experts: int,
    dim: int,
    inter: int,
    repeats: int,
    kernels: tuple[str, ...] = ("native", "torch"),
    copy_bytes: int = 256 << 20,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the expert benchmark; returns the report (see the module docstring)."""
    from dsv41.kernels import native

    if n_experts < TOPK:
        raise ValueError(f"--experts must be at least {TOPK} (the routing width), got {n_experts}")
    report = {
        "command": "bench experts",
        "dim": dim,
        "inter": inter,
        "n_experts": n_experts,
        "topk": TOPK,
        "swiglu_limit": SWIGLU_LIMIT,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "note": "wall times on a possibly shared machine; compare within one run",
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
    report["peak_rss_reset"] = reset_peak_rss()  # the copy's 512 MiB is not the experts' footprint

    routed, shared = make_experts(n_experts, dim, inter)
    routed_bf16, shared_bf16 = expand_experts(routed), expand_experts({0: shared})[0]
    report["routed_expert_bytes"] = next(iter(routed.values())).nbytes
    report["shared_expert_bytes"] = shared.nbytes
    report["after_build"] = rss_bytes()
    log(
        f"{n_experts} routed experts of {report['routed_expert_bytes'] / 2**20:.1f} MiB packed, shared expert "
        f"{shared.nbytes / 2**20:.1f} MiB; RSS {report['after_build']['rss_bytes'] / 2**20:.0f} MiB"
    )

    shapes = []
    log(
        f"prefill path of this CPU: {native.prefill_path()} (products of more than "
        f"{native.BLOCK_ORDER_MAX_TOKENS} tokens)"
    )
    report["prefill_path"] = native.prefill_path()
    log(
        f"{'tokens':>6} {'baseline':>10} {'bf16 GEMM':>10}"
        + "".join(f" {k:>9} {'speedup':>8} {'GB/s':>6} {'of copy':>8} {'of GEMM':>8}" for k in kernels)
    )
    for t in tokens:
        x = torch.randn(t, dim, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        ids, weights = make_routing(t, n_experts, TOPK, seed=t)
        nbytes = packed_bytes_read(ids, routed, shared)
        fns = {
            "baseline": lambda: baseline_moe(x, ids, weights, routed, shared, SWIGLU_LIMIT),
            "bf16 GEMM": lambda: expanded_moe(x, ids, weights, routed_bf16, shared_bf16, SWIGLU_LIMIT),
        }
        for k in kernels:
            fns[k] = lambda k=k: fused_moe(x, ids, weights, routed, shared, SWIGLU_LIMIT, cpu_kernel=k)
        times = best_times(fns, repeats, 60.0)
        base_s, gemm_s = times["baseline"], times["bf16 GEMM"]
        row = {
            "tokens": t,
            "experts_selected": len(torch.unique(ids)),
            "packed_bytes": nbytes,
            "baseline_s": base_s,
            "bf16_gemm_s": gemm_s,
            "kernels": {},
        }
        line = f"{t:>6} {base_s:>9.3f}s {gemm_s:>9.3f}s"
        paths = []
        for k in kernels:
            k_s = times[k]
            row["kernels"][k] = cell = {
                "s": k_s,
                "speedup": base_s / k_s,
                "bytes_per_s": nbytes / k_s,
                "fraction_of_copy": nbytes / k_s / copy_bw,
                "fraction_of_bf16_gemm": gemm_s / k_s,
                "path": kernel_path(k, t),
            }
            line += (
                f" {k_s:>8.3f}s {cell['speedup']:>7.1f}x {cell['bytes_per_s'] / 1e9:>6.2f} "
                f"{cell['fraction_of_copy']:>7.1%} {cell['fraction_of_bf16_gemm']:>7.0%}"
            )
            paths.append(f"{k}: {cell['path']}")
        log(line + "   (" + "; ".join(paths) + ")")
        shapes.append(row)
    report["shapes"] = shapes
    if (dim, inter) == (DIM, INTER) and kernels:
        report["targets"] = _check_targets(shapes, kernels[0], log)
    report["end"] = rss_bytes()
    log(
        f"resident memory: {report['end']['rss_bytes'] / 2**20:.0f} MiB now, "
        f"{report['end']['peak_rss_bytes'] / 2**20:.0f} MiB peak (the baseline's BF16 copies included)"
    )
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
        met = (
            cell["speedup"] >= speedup
            and (fraction is None or cell["fraction_of_copy"] >= fraction)
            and (gemm is None or gemm >= of_gemm)
        )
        want = (
            f">= {speedup:g}x"
            + (f" and >= {fraction:.0%} of copy" if fraction is not None else "")
            + (f" and >= {of_gemm:.0%} of the BF16 GEMM" if gemm is not None else "")
        )
        got = (
            f"{cell['speedup']:.1f}x"
            + (f", {cell['fraction_of_copy']:.0%}" if fraction is not None else "")
            + (f", {gemm:.0%}" if gemm is not None else "")
        )
        log(f"target {t} token{'s' if t > 1 else ''} ({kernel}): {want}: measured {got}: {'met' if met else 'NOT met'}")
        results.append(
            {
                "tokens": t,
                "kernel": kernel,
                "speedup_target": speedup,
                "fraction_target": fraction,
                "bf16_gemm_fraction_target": of_gemm if gemm is not None else None,
                "speedup": cell["speedup"],
                "fraction_of_copy": cell["fraction_of_copy"],
                "fraction_of_bf16_gemm": gemm,
                "met": met,
            }
        )
    return results


# ---------------------------------------------------------------------- on a GPU
# The GPU targets, judged at the released sizes: the decode GEMVs' packed bytes per second of
# kernel time at GPU_GEMV_TARGET of the device's memory bandwidth (the bytes a device-to-device
# copy reads and writes per second), and one expert's three GEMMs at GPU_GEMM_TOKENS tokens at
# GPU_GEMM_TARGET of the FLOP/s of torch's BF16 matmul on the same shapes, both in the same run.
GPU_GEMV_TARGET, GPU_GEMM_TARGET, GPU_GEMM_TOKENS = 0.60, 0.50, 512
# triton_experts' two kernels as the profiler names them (tests hold these to the module's names)
GEMV_KERNEL, GEMM_KERNEL = "_fp4_gemv_kernel", "_fp4_gemm_kernel"


class DeviceError(Dsv41Error, ValueError):
    """`--device` (or `--interpret`) asks for a device the Triton kernels cannot run on here."""


def triton_device(device: str, interpret: bool = False) -> torch.device:
    """The device `--device` runs the Triton kernels on: a CUDA device, or with `interpret` the CPU
    through Triton's interpreter (checks the bench itself; its times mean nothing)."""
    from dsv41.kernels import triton_experts

    if interpret:
        if device != "cpu":
            raise DeviceError(f"--interpret runs the Triton kernels on CPU tensors; drop --device {device}")
        if triton_experts.triton is None:
            raise DeviceError("--interpret needs Triton installed (pip install triton)")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise DeviceError("--interpret needs TRITON_INTERPRET=1 in the environment the command starts with")
        return torch.device("cpu")
    if not triton_experts.available():
        raise DeviceError(
            f"--device {device} needs a CUDA device and Triton; this machine has "
            f"{'no CUDA device' if not torch.cuda.is_available() else 'no Triton'}"
        )
    dev = torch.device(device)
    if dev.type != "cuda" or (dev.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"--device {device} is not one of this machine's {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", dev.index or 0)


def device_seconds(fn: Callable[[], object], dev: torch.device, repeats: int) -> float:
    """Best time of `fn` over `repeats` calls: on CUDA between two events recorded on the device's
    stream around the call (its clock, launches included), on the CPU the wall clock."""
    if dev.type != "cuda":
        return best_time(fn, repeats, budget_s=60.0)
    best = float("inf")
    for _ in range(max(1, repeats)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return best


def profiled_seconds(
    fn: Callable[[], object], activities: list, device_type, name: Optional[str], sync: Callable[[], object]
) -> float:
    """Seconds of the profiler's events of `device_type` during one call of `fn` whose name holds
    `name` (None: every one), summed; LookupError where it recorded none."""
    from torch.profiler import profile

    with profile(activities=activities) as prof:
        fn()
        sync()
    events = [e for e in prof.events() if e.device_type == device_type]
    spans = [e.time_range.elapsed_us() for e in events if name is None or name in e.name]
    if not spans:  # name what it did see, for the rerun
        seen = sorted({e.name for e in events})[:5]
        raise LookupError(f"the profiler recorded no {device_type} event named {name or 'anything'} (it saw {seen})")
    return sum(spans) / 1e6


def kernel_seconds(
    fn: Callable[[], object], dev: torch.device, repeats: int, name: Optional[str] = None
) -> tuple[float, str]:
    """(best over `repeats` calls of the device time of the kernels `fn` launches whose name holds
    `name` (None: all), summed from the profiler's CUDA activity, so what the host spends launching
    them is not counted; the method). Where the profiler fails, the events' time of the whole call,
    and the method says why; on the CPU the wall clock."""
    if dev.type != "cuda":
        return best_time(fn, repeats, budget_s=60.0), "wall clock (CPU)"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    try:
        seconds = min(
            profiled_seconds(
                fn,
                [ProfilerActivity.CPU, ProfilerActivity.CUDA],
                DeviceType.CUDA,
                name,
                lambda: torch.cuda.synchronize(dev),
            )
            for _ in range(max(1, repeats))
        )
        return seconds, f"kernel time ({name or 'every kernel'}, profiler)"
    except Exception as exc:  # noqa: BLE001 -- any profiler failure: the fallback is measured and says why
        return device_seconds(fn, dev, repeats), f"CUDA events around the calls (the profiler failed: {exc})"


def triton_product(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype):
    """`routed_experts`' `product` hook that sends every (FP4) product to `fp4_gemm_triton` wherever
    the tensors are: under TRITON_INTERPRET=1 CPU tensors take the path CUDA weights take."""
    from dsv41.kernels.triton_experts import fp4_gemm_triton

    return fp4_gemm_triton(a, a_s, w, s, out_dtype=dtype)


def expert_gemm_vs_bf16(expert, tokens: int, dev: torch.device, repeats: int) -> dict:
    """One expert's three products (gate and up at K=dim, down at K=inter) on `tokens` tokens
    through `fp4_gemm_triton`, kernel time, against torch's BF16 matmul on the same shapes in the
    same run; the same FLOPs, so the fraction is the matmul's time over the kernels'."""
    from dsv41.kernels import act_quant
    from dsv41.kernels.triton_experts import GEMV_MAX_TOKENS, fp4_gemm_triton

    inter, dim = expert.w1.size(0), expert.w1.size(1) * 2  # w1 packed [inter, dim/2]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).to(dev)
    h = torch.randn(tokens, inter, generator=g).to(torch.bfloat16).to(dev)
    a, a_s = act_quant(x)
    h_q, h_s = act_quant(h)
    shapes = ((inter, dim), (inter, dim), (dim, inter))  # gate, up, down: [out, in] as the FP4 weights
    bf16 = [torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev) for shape in shapes]

    def fp4():
        fp4_gemm_triton(a, a_s, expert.w1, expert.w1_scale, out_dtype=torch.bfloat16)
        fp4_gemm_triton(a, a_s, expert.w3, expert.w3_scale, out_dtype=torch.bfloat16)
        fp4_gemm_triton(h_q, h_s, expert.w2, expert.w2_scale, out_dtype=torch.bfloat16)

    def matmul():
        torch.matmul(x, bf16[0].t())
        torch.matmul(x, bf16[1].t())
        torch.matmul(h, bf16[2].t())

    fp4()  # compiles the kernel for these shapes
    matmul()
    kernel = GEMM_KERNEL if tokens > GEMV_MAX_TOKENS else GEMV_KERNEL
    fp4_s, fp4_method = kernel_seconds(fp4, dev, repeats, kernel)
    mm_s, mm_method = kernel_seconds(matmul, dev, repeats)
    calls_s = device_seconds(fp4, dev, repeats) if dev.type == "cuda" else fp4_s  # CPU: one wall time
    flops = 2 * tokens * 3 * dim * inter
    return {
        "tokens": tokens,
        "flops": flops,
        "kernel": kernel,
        "fp4_s": fp4_s,
        "fp4_method": fp4_method,
        "fp4_flops_per_s": flops / fp4_s,
        "fp4_calls_s": calls_s,
        "bf16_matmul_s": mm_s,
        "bf16_method": mm_method,
        "bf16_flops_per_s": flops / mm_s,
        "fraction_of_bf16_matmul": mm_s / fp4_s,
        "note": "per 32-value K block the kernel decodes E2M1 in registers, takes two fp16 dots of K 16 and "
        "scales the float32 tile by the activation, then the weight scale before adding it, as the "
        "reference fp4_gemm orders it",
    }


def bench_experts_gpu(
    tokens: list[int],
    *,
    n_experts: int,
    dim: int,
    inter: int,
    repeats: int,
    device: str,
    copy_bytes: int = 1 << 30,
    gemm_tokens: int = GPU_GEMM_TOKENS,
    interpret: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """The routed experts through the Triton kernels on a CUDA device (or, with `interpret`, on CPU
    tensors through Triton's interpreter: a check of the bench, not a measurement).

    In one run: the device's memory bandwidth (a device-to-device copy, CUDA events); per token
    count the MoE layer's routed work (`routed_experts`, launches included); for one token the bare
    decode GEMVs of the selected experts (each one's three matrices through `fp4_gemm_triton`),
    their packed bytes per second of kernel time against the memory bandwidth; and one expert's
    GEMMs at `gemm_tokens` tokens against torch's BF16 matmul of the same shapes
    (`expert_gemm_vs_bf16`). Targets at the released sizes only."""
    from dsv41.kernels import act_quant
    from dsv41.kernels.experts import routed_experts
    from dsv41.kernels.triton_experts import fp4_gemm_triton

    dev = triton_device(device, interpret)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (Triton interpreter)"
    report = {
        "command": "bench experts",
        "device": str(dev),
        "device_name": name,
        "interpret": interpret,
        "dim": dim,
        "inter": inter,
        "n_experts": n_experts,
        "topk": TOPK,
        "torch": torch.__version__,
        "note": "device times from CUDA events and the profiler's kernel times; compare within one run"
        if dev.type == "cuda"
        else "Triton's interpreter on CPU tensors: a check of the bench, its times mean nothing",
    }

    def copy_seconds() -> float:
        # the copy's two buffers (a GiB each by default) live only in here: freed before the kernels run
        src = torch.ones(copy_bytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch
        return device_seconds(lambda: dst.copy_(src), dev, max(3, repeats))

    copy_s = copy_seconds()
    copy_bw, memory_bw = copy_bytes / copy_s, 2 * copy_bytes / copy_s
    report.update(
        copy_bandwidth_bytes_per_s=copy_bw,
        memory_bandwidth_bytes_per_s=memory_bw,
        copy_bandwidth_definition=f"source bytes per second of a {copy_bytes >> 20} MiB uint8 copy on the device",
        memory_bandwidth_definition="bytes read plus bytes written per second by that copy",
    )
    log(
        f"{name}: device memory bandwidth {memory_bw / 1e9:.1f} GB/s (a {copy_bytes >> 20} MiB copy's bytes read "
        f"and written per second; {copy_bw / 1e9:.1f} GB/s of source bytes)"
    )

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

        def layer():  # interpreted, the weights are CPU tensors: the hook keeps them off the CPU kernels
            return routed_experts(x, ids, weights, routed, SWIGLU_LIMIT, product=triton_product if interpret else None)

        layer()  # compiles the kernels for this shape
        sec = device_seconds(layer, dev, repeats)
        row = {
            "tokens": t,
            "experts_selected": len(selected),
            "packed_bytes": nbytes,
            "routed_s": sec,
            "bytes_per_s": nbytes / sec,
            "fraction_of_copy": nbytes / sec / copy_bw,
            "fraction_of_memory_bandwidth": nbytes / sec / memory_bw,
        }
        line = f"{t:>6} {sec:>9.5f}s {row['bytes_per_s'] / 1e9:>8.1f} {row['fraction_of_copy']:>7.1%}"
        if t == 1:  # the bare decode GEMVs: every selected expert's three matrices, one token
            a, a_s = act_quant(x)
            mats = [
                (m, s)
                for e in selected
                for m, s in ((routed[e].w1, routed[e].w1_scale), (routed[e].w3, routed[e].w3_scale))
            ]
            h_q, h_s = act_quant(
                torch.randn(1, inter, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(dev)
            )
            down = [(routed[e].w2, routed[e].w2_scale) for e in selected]

            def gemvs():
                for m, s in mats:
                    fp4_gemm_triton(a, a_s, m, s, out_dtype=torch.bfloat16)
                for m, s in down:
                    fp4_gemm_triton(h_q, h_s, m, s, out_dtype=torch.bfloat16)

            gemvs()
            gemv_s, method = kernel_seconds(gemvs, dev, repeats, GEMV_KERNEL)
            calls_s = device_seconds(gemvs, dev, repeats) if dev.type == "cuda" else gemv_s  # CPU: one wall time
            row.update(
                {
                    "gemv_s": gemv_s,
                    "gemv_method": method,
                    "gemv_bytes_per_s": nbytes / gemv_s,
                    "gemv_fraction_of_copy": nbytes / gemv_s / copy_bw,
                    "gemv_fraction_of_memory_bandwidth": nbytes / gemv_s / memory_bw,
                    "gemv_calls_s": calls_s,
                    "gemv_calls_fraction_of_memory_bandwidth": nbytes / calls_s / memory_bw,
                }
            )
            line += (
                f"   GEMVs alone {gemv_s * 1e6:.1f} us, {row['gemv_fraction_of_memory_bandwidth']:.1%} of memory "
                f"bandwidth ({method}); with their launches {calls_s * 1e6:.1f} us"
            )
        log(line)
        shapes.append(row)
    report["shapes"] = shapes
    if gemm_tokens:
        gemm = report["gemm"] = expert_gemm_vs_bf16(routed[0], gemm_tokens, dev, repeats)
        log(
            f"one expert's GEMMs at {gemm_tokens} tokens: {gemm['fp4_flops_per_s'] / 1e12:.2f} TFLOP/s "
            f"({gemm['fp4_method']}), torch's BF16 matmul on the same shapes {gemm['bf16_flops_per_s'] / 1e12:.2f} "
            f"TFLOP/s: {gemm['fraction_of_bf16_matmul']:.1%}"
        )
    if (dim, inter) == (DIM, INTER):
        report["targets"] = _gpu_targets(report, log)
    return report


def _gpu_targets(report: dict, log: Callable[[str], None]) -> list[dict]:
    """The measured GEMVs and GEMMs against GPU_GEMV_TARGET and GPU_GEMM_TARGET, where measured."""
    results = []
    decode = next((r for r in report["shapes"] if r["tokens"] == 1), None)
    if decode is not None:
        got = decode["gemv_fraction_of_memory_bandwidth"]
        results.append(
            {
                "what": "decode GEMVs",
                "tokens": 1,
                "target": GPU_GEMV_TARGET,
                "measured": got,
                "measure": "packed bytes per second of kernel time / device memory bandwidth",
                "method": decode["gemv_method"],
                "met": got >= GPU_GEMV_TARGET,
            }
        )
    gemm = report.get("gemm")
    if gemm is not None and gemm["tokens"] == GPU_GEMM_TOKENS:
        got = gemm["fraction_of_bf16_matmul"]
        results.append(
            {
                "what": "expert GEMMs",
                "tokens": gemm["tokens"],
                "target": GPU_GEMM_TARGET,
                "measured": got,
                "measure": "FLOP/s of kernel time / torch's BF16 matmul's on the same shapes",
                "method": gemm["fp4_method"],
                "met": got >= GPU_GEMM_TARGET,
            }
        )
    for r in results:
        log(
            f"target {r['what']} ({r['tokens']} token{'s' if r['tokens'] > 1 else ''}): >= {r['target']:.0%} "
            f"({r['measure']}): measured {r['measured']:.0%}: {'met' if r['met'] else 'NOT met'}"
        )
    return results


# ---------------------------------------------------------------------- expert parallel
def bench_experts_parallel(
    tokens: list[int], *, n_experts: int, dim: int, inter: int, repeats: int, log: Callable[[str], None] = print
) -> dict:
    """One MoE layer's expert work across the ranks of a torchrun group (`dsv41.runtime.distributed`):
    each rank computes the routed experts it owns (e % world_size == rank) and the shared expert,
    then the pairs are exchanged and added in the single process's order. Per token count: the
    layer's wall time (the slowest rank's), each rank's compute and exchange seconds and the bytes
    it sent and received, against one process computing every expert itself; the sums are checked
    bit for bit against that single process. Only rank 0 logs; every rank returns the report."""
    import torch.distributed as dist

    from dsv41.checkpoint.stores import DictExpertStore
    from dsv41.kernels.experts import expert_ffn, routed_experts
    from dsv41.runtime import distributed

    if n_experts < TOPK:
        raise ValueError(f"--experts must be at least {TOPK} (the routing width), got {n_experts}")
    ranks = distributed.init()
    say = log if ranks.is_main else (lambda line: None)
    routed, shared = make_experts(n_experts, dim, inter)  # the same bytes on every rank (one seed)
    owned = {e: p for e, p in routed.items() if ranks.owns(e)}
    counters = distributed.ExchangeCounters()
    layer = distributed.ExpertParallelExperts(
        0, DictExpertStore({(0, e): p for e, p in owned.items()}), SWIGLU_LIMIT, ranks=ranks, counters=counters
    )
    report = {
        "command": "bench experts --expert-parallel",
        "rank": ranks.rank,
        "world_size": ranks.world_size,
        "backend": ranks.backend,
        "dim": dim,
        "inter": inter,
        "n_experts": n_experts,
        "topk": TOPK,
        "threads": torch.get_num_threads(),
        "experts_held": sorted(owned),
        "bytes_held": sum(p.nbytes for p in owned.values()) + shared.nbytes,
        "note": "bytes: each rank's share of pair outputs (and one status value) sent to every peer, "
        "the peers' shares received; times are the best of the repeats",
    }
    say(
        f"{ranks.world_size} ranks ({ranks.backend}); rank 0 holds {len(owned)} of {n_experts} routed experts "
        f"and the shared one, {report['bytes_held'] / 2**20:.1f} MiB"
    )
    say(
        f"{'tokens':>6} {'one process':>12} {'parallel':>9} {'compute':>9} {'exchange':>9} "
        f"{'sent/token':>11} {'recv/token':>11}  equal"
    )
    shapes = []
    for t in tokens:
        x = torch.randn(t, dim, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        ids, weights = make_routing(t, n_experts, TOPK, seed=t)

        def parallel():
            dist.barrier()
            return layer(x, ids, weights) + expert_ffn(x, shared, SWIGLU_LIMIT).float()

        def single():
            return routed_experts(x, ids, weights, routed, SWIGLU_LIMIT) + expert_ffn(x, shared, SWIGLU_LIMIT).float()

        single_s = best_time(single, repeats, 60.0)
        equal = bool(torch.equal(parallel(), single()))
        counters.reset()
        parallel_s = best_time(parallel, repeats, 60.0)
        totals = counters.totals()
        calls = max(totals["calls"], 1)
        mine = {
            "rank": ranks.rank,
            "pairs": totals["pairs"] / calls,
            "compute_s": totals["compute_s"] / calls,
            "exchange_s": totals["exchange_s"] / calls,
            "bytes_sent": totals["bytes_sent"] / calls,
            "bytes_received": totals["bytes_received"] / calls,
            "parallel_s": parallel_s,
            "single_s": single_s,
            "equal": equal,
        }
        per_rank = [None] * ranks.world_size
        dist.all_gather_object(per_rank, mine)
        row = {
            "tokens": t,
            "single_process_s": max(r["single_s"] for r in per_rank),
            "parallel_s": max(r["parallel_s"] for r in per_rank),
            "ranks": per_rank,
            "bit_identical": all(r["equal"] for r in per_rank),
        }
        sent = max(r["bytes_sent"] for r in per_rank) / t
        received = max(r["bytes_received"] for r in per_rank) / t
        say(
            f"{t:>6} {row['single_process_s']:>11.4f}s {row['parallel_s']:>8.4f}s "
            f"{max(r['compute_s'] for r in per_rank):>8.4f}s {max(r['exchange_s'] for r in per_rank):>8.4f}s "
            f"{sent / 1024:>8.1f} KiB {received / 1024:>8.1f} KiB  {row['bit_identical']}"
        )
        shapes.append(row)
    report["shapes"] = shapes
    return report


# ---------------------------------------------------------------------- the subcommand
def add_parser(sub) -> None:
    ex = sub.add_parser("experts", help="fused packed-FP4 experts vs expand-to-BF16 baseline")
    ex.add_argument("--tokens", default="1,16,512", help="comma-separated token counts (default 1,16,512)")
    ex.add_argument("--json", metavar="OUT", help="also write the report as JSON here")
    ex.add_argument("--experts", type=int, default=16, help="distinct routed experts built (default 16)")
    ex.add_argument("--repeats", type=int, default=3, help="runs per measurement, best kept (default 3)")
    ex.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ex.add_argument(
        "--device",
        default="cpu",
        help="cpu (default), or cuda / cuda:N for the Triton kernels: the decode GEMVs against the "
        "device's memory bandwidth and one expert's GEMMs against torch's BF16 matmul, both "
        "measured in the same run",
    )
    ex.add_argument(
        "--gemm-tokens",
        type=int,
        default=GPU_GEMM_TOKENS,
        help=f"with --device cuda: tokens of the expert GEMMs timed against the BF16 matmul "
        f"(default {GPU_GEMM_TOKENS}; 0 skips them)",
    )
    ex.add_argument(
        "--kernels",
        default="native,torch",
        help="fused CPU kernels to time: native, torch or both (default native,torch)",
    )
    ex.add_argument(
        "--expert-parallel",
        action="store_true",
        help="under torchrun: the layer's experts split over the ranks (e %% world_size == rank), "
        "time and bytes each rank sends and receives, against one process",
    )
    # smaller experts and copy for tests: DIM,INTER and MiB
    ex.add_argument("--dims", default=f"{DIM},{INTER}", help=argparse.SUPPRESS)
    ex.add_argument("--copy-mib", type=int, default=None, help=argparse.SUPPRESS)  # default 256, on a GPU 1024
    # the --device cuda measurements on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1):
    # checks the bench itself (scripts/gpu-check --cpu); its times mean nothing
    ex.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)


def main(args) -> int:
    try:
        tokens = token_list(args.tokens)
        dim, inter = (int(v) for v in args.dims.split(","))
        if dim % 32 or inter % 32:
            raise ValueError(f"--dims must be multiples of 32, got {args.dims}")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        on_triton = args.device != "cpu" or args.interpret
        copy_mib = args.copy_mib if args.copy_mib is not None else (1024 if on_triton else 256)
        if copy_mib < 1:
            raise ValueError(f"--copy-mib must be positive, got {args.copy_mib}")
        kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
        if not kernels or set(kernels) - {"native", "torch"}:
            raise ValueError(f"--kernels takes native, torch or native,torch, got {args.kernels!r}")
        if args.expert_parallel:
            from dsv41.runtime import distributed

            try:
                report = bench_experts_parallel(
                    tokens, n_experts=args.experts, dim=dim, inter=inter, repeats=args.repeats
                )
            finally:  # leave the group before exit: a group torn down at interpreter exit can abort
                distributed.shutdown()
        elif on_triton:
            if args.gemm_tokens < 0:
                raise ValueError(f"--gemm-tokens must be 0 or more, got {args.gemm_tokens}")
            report = bench_experts_gpu(
                tokens,
                n_experts=args.experts,
                dim=dim,
                inter=inter,
                repeats=args.repeats,
                device=args.device,
                copy_bytes=copy_mib << 20,
                gemm_tokens=args.gemm_tokens,
                interpret=args.interpret,
            )
        else:
            report = bench_experts(
                tokens,
                n_experts=args.experts,
                dim=dim,
                inter=inter,
                repeats=args.repeats,
                kernels=kernels,
                copy_bytes=copy_mib << 20,
            )
    except ValueError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # ExpertParallelError: no group, or a rank that failed
        if not args.expert_parallel:
            raise
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 1
    if args.json and report.get("rank", 0) == 0:  # under --expert-parallel rank 0 writes it
        write_report(args.json, report)
    return 0
