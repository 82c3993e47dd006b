"""`dsv41 bench decode --geometry released`: every released dimension (attention, vocabulary, FP32
head, experts) on a few layers of a synthetic checkpoint; at one thread and at every core, each
phase's seconds per token against the bytes it must read and the read bandwidth floor, and the
40-layer prediction (`bench_decode_released`)."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from dsv41.checkpoint.released_synthetic import SMALL_WIDTHS

from .common import (
    TOPK,
    PhaseClock,
    copy_bandwidth,
    folder_bytes,
    measurement_error,
    on_synthetic_checkpoint,
    read_bandwidth,
    require_cuda,
    rss_bytes,
)

if TYPE_CHECKING:  # annotations only
    from dsv41.model.model import Model


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
# A released-shaped checkpoint shrunk for tests (`--small`): same layer plan, the tiny widths
# make-synthetic's small variant has (its vision tower aside: this bench runs text only).
_SMALL_DIMS = {"vocab_size": 129280, **{k: v for k, v in SMALL_WIDTHS.items() if k != "vision_n_layers"}}


def released_decode_config(layers: int = 2, experts: int = 8, *, small: bool = False):
    """The released geometry (dim 5120, 64 heads of 512, q LoRA 1280, 8 output groups of 1024,
    indexer 32 x 128, window 128, index_topk 512, routed experts of 2304 with 6 active, the shared
    expert, vocab 129,280) with `layers` backbone layers and `experts` routed experts: layer 0 is a
    Full layer (ratio-2 compressor, indexer, candidate blocks), the others Reuse layers reading
    it, Engram (small tables) on layer 1, one MTP layer. `small`: the same plan at tiny dims."""
    from dsv41.checkpoint.engram import build_compressed_token_map
    from dsv41.checkpoint.inventory import derived_engram_rows
    from dsv41.checkpoint.tokenizer import build_tiny_tokenizer
    from dsv41.core.config import RELEASED

    if layers < 2:
        raise ValueError(f"--layers must be at least 2 (one Full and one Reuse layer), got {layers}")
    if experts < TOPK:
        raise ValueError(f"--experts must be at least {TOPK} (the routing width), got {experts}")
    cfg = RELEASED.replace(
        n_layers=layers,
        n_mtp_layers=1,
        compress_ratios=(2,) * layers + (0,),
        kv_source_layers=(0,),
        index_source_layers=(0,),
        candidate_source_layer=0,
        engram_layer_ids=(1,),
        engram_vocab_size=_SMALL_ENGRAM_VOCAB,
        engram_num_embeddings=None,
        dspark_target_layer_ids=(layers - 1,),
        n_routed_experts=experts,
        dspark_n_routed_experts=experts,
        dspark_n_activated_experts=3,
        vision_n_layers=0,
        **(_SMALL_DIMS if small else {}),
    )
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


def decode_token_bytes(model: Model) -> dict:
    """Bytes one decode token must read, per phase and per layer, from the tensors as the model
    holds them (wo_a in BF16, the head in FP32): every dense weight once, one embedding row, the
    Engram table rows the hash picks, `n_activated_experts` packed routed experts per layer.
    Returns {"phases": {phase: bytes}, "layers": {layer: {phase: bytes}}}; KV-cache reads (under
    a megabyte at a benchmark's context) are left out."""
    cfg = model.cfg
    phases = dict.fromkeys(RELEASED_PHASES, 0)
    layers = {i: dict.fromkeys(RELEASED_PHASES, 0) for i in range(cfg.n_layers)}
    for name, p in model.backbone.named_parameters():
        if name.startswith(("vision.", "aligner.", "image_")):
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


def _floor_cells(seconds: float, nbytes: int, bandwidth: float) -> dict:
    """A phase against its floor at `bandwidth` (the read bandwidth); above 100% of the floor is
    flagged as a measurement error, not a result."""
    floor = nbytes / bandwidth
    fraction = floor / seconds if seconds > 0 else None
    return {
        "seconds": seconds,
        "bytes": nbytes,
        "floor_seconds": floor,
        "fraction_of_floor": fraction,
        "measurement_error": measurement_error(fraction),
    }


def _released_counts():
    """How many layers of each kind the released model has: Full / Reindex (own indexer queries)
    and Reuse layers, and its Engram layers."""
    from dsv41.core.config import RELEASED

    modes = RELEASED.layer_modes
    return {
        "full": sum(m != "reuse" for m in modes),
        "reuse": sum(m == "reuse" for m in modes),
        "engram": len(RELEASED.engram_layer_ids),
        "layers": RELEASED.n_layers,
    }


def predict_released(
    per_layer_s: dict,
    per_layer_bytes: dict,
    head_s: float,
    head_bytes: int,
    other_s: float,
    other_bytes: int,
    n_layers: int,
    bandwidth: float,
) -> dict:
    """Seconds and bytes of a decode token of the 40-layer released model from one run's
    measurements (experts resident in memory): per layer kind the measured layer's attention
    (`per_layer_*["full"|"reuse"]["attention"]`), the mean routed and shared expert time, Engram
    per Engram layer, the head once, and `other` per layer. A prediction, not a measurement."""
    counts = _released_counts()
    seconds, nbytes = head_s, head_bytes
    per_layer_other_s, per_layer_other_b = other_s / n_layers, other_bytes / n_layers
    for kind in ("full", "reuse"):
        cell_s, cell_b = per_layer_s[kind], per_layer_bytes[kind]
        seconds += counts[kind] * (
            cell_s["attention"] + cell_s["routed experts"] + cell_s["shared expert"] + per_layer_other_s
        )
        nbytes += counts[kind] * (
            cell_b["attention"] + cell_b["routed experts"] + cell_b["shared expert"] + per_layer_other_b
        )
    seconds += counts["engram"] * per_layer_s["engram"]
    nbytes += counts["engram"] * per_layer_bytes["engram"]
    return {
        "layers": counts["layers"],
        "layer_kinds": counts,
        "seconds_per_token": seconds,
        "tokens_per_s": 1.0 / seconds,
        "bytes": int(nbytes),
        "floor_seconds": nbytes / bandwidth,
        "fraction_of_floor": nbytes / bandwidth / seconds,
        "note": "a prediction from the measured layers, not a measurement of the released model",
    }


def bench_decode_released(
    checkpoint: str,
    *,
    prompt_tokens: int,
    decode_tokens: int,
    repeats: int,
    thread_settings: Sequence[int],
    copy_bytes: int = 256 << 20,
    read_bytes: int = 1 << 30,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> dict:
    """Decode on a released-geometry checkpoint at each thread count (taking turns, `repeats`
    rounds, the fastest round kept per setting): per phase seconds per token, the bytes it reads
    (`decode_token_bytes`), its floor at the read bandwidth measured at that thread count, the
    fraction of the floor, the whole token likewise, and the 40-layer prediction. The floor is
    taken at the read bandwidth measured at that thread count (`common.read_bandwidth`, the copy
    bandwidth reported beside it); a fraction above 100% is reported as a measurement error. `device` "cuda"
    (or "cuda:N") holds and runs the routed experts there, the dense layers staying on the host;
    their floor is then still counted at the host's read bandwidth."""
    import dsv41
    from dsv41.generation.generate import decode_n, prefill
    from dsv41.kernels import native

    before = torch.get_num_threads()
    require_cuda(device)
    model = dsv41.load(
        checkpoint, quiet=True, max_seq_len=prompt_tokens + decode_tokens + 8, threads=None, expert_device=device
    )
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    nbytes = decode_token_bytes(model)
    modes = cfg.layer_modes
    report = {
        "command": "bench decode",
        "geometry": "released",
        "checkpoint": checkpoint,
        "checkpoint_bytes": folder_bytes(checkpoint),
        "dim": cfg.dim,
        "n_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "n_layers": cfg.n_layers,
        "layer_modes": list(modes),
        "engram_layers": list(cfg.engram_layer_ids),
        "n_experts": cfg.n_routed_experts,
        "topk": cfg.n_activated_experts,
        "inter": cfg.moe_inter_dim,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "cpu_count": os.cpu_count(),
        "fused_cpu_kernel": "native" if native.available() else "torch",
        "dense_kernel": "native" if native.available() else "reference",
        "expert_device": device,
        "bytes_definition": "weights as held at run time read once per token (wo_a BF16, head FP32), one "
        "embedding row, the Engram rows hashed, 6 packed routed experts per layer",
        "note": "wall times on a possibly shared machine; compare within one run",
        "settings": {},
    }
    bandwidth, copies, runs = {}, {}, {n: [] for n in thread_settings}
    try:
        for n in thread_settings:
            torch.set_num_threads(n)
            copies[n] = copy_bandwidth(copy_bytes)
            bandwidth[n] = read_bandwidth(read_bytes)  # the floor: a GEMV reads its weight, it writes nothing
        for _ in range(max(1, repeats)):
            for n in thread_settings:
                torch.set_num_threads(n)
                clock = PhaseClock(RELEASED_PHASES)
                with clock.timing(model):
                    logits = prefill(model, prompt)  # also warms the expert cache: experts resident
                    clock.reset()
                    began = time.perf_counter()
                    tokens = decode_n(model, int(logits[0].argmax()), decode_tokens)
                    decode_s = time.perf_counter() - began
                runs[n].append((decode_s, dict(clock.seconds), dict(clock.by_layer), tokens))
    finally:
        torch.set_num_threads(before)

    for n in thread_settings:
        report["settings"][str(n)] = _setting_cell(n, runs[n], bandwidth[n], nbytes, cfg, decode_tokens)
        report["settings"][str(n)]["copy_bandwidth_bytes_per_s"] = copies[n]
    # the top-level phases and token are those of the last setting (every core)
    last = report["settings"][str(thread_settings[-1])]
    report.update(
        threads=thread_settings[-1],
        copy_bandwidth_bytes_per_s=last["copy_bandwidth_bytes_per_s"],
        read_bandwidth_bytes_per_s=last["read_bandwidth_bytes_per_s"],
        phases=last["phases"],
        token=last["token"],
        prediction_released=last["prediction_released"],
    )
    report["same_tokens"] = len({tuple(s["tokens"]) for s in report["settings"].values()}) == 1
    from dsv41.core.config import RELEASED

    if all(getattr(cfg, f) == getattr(RELEASED, f) for f in ("dim", "n_heads", "head_dim", "moe_inter_dim")):
        for cell in report["settings"].values():
            cell["targets"] = _released_targets(cell)
    _log_released(report, thread_settings, log)
    report["end"] = rss_bytes()
    log(
        f"resident memory: {report['end']['rss_bytes'] / 2**30:.2f} GiB now, "
        f"{report['end']['peak_rss_bytes'] / 2**30:.2f} GiB peak"
    )
    return report


def _setting_cell(n: int, rounds: list, bw: float, nbytes: dict, cfg, decode_tokens: int) -> dict:
    """One thread setting's report from its fastest round: per phase, per layer and the token
    against the bandwidth floor, and the 40-layer prediction."""
    decode_s, phase_s, layer_s, tokens = min(rounds, key=lambda r: r[0])
    per_token = {phase: t / decode_tokens for phase, t in phase_s.items()}
    per_token["other"] = decode_s / decode_tokens - sum(v for k, v in per_token.items() if k != "other")
    modes = cfg.layer_modes
    phases = {phase: _floor_cells(per_token[phase], nbytes["phases"][phase], bw) for phase in RELEASED_PHASES}
    token = _floor_cells(decode_s / decode_tokens, sum(nbytes["phases"].values()), bw)
    layer_cells = {}
    for i in range(cfg.n_layers):
        layer_cells[str(i)] = {
            "mode": modes[i],
            **{
                phase: _floor_cells(layer_s.get((i, phase), 0.0) / decode_tokens, nbytes["layers"][i][phase], bw)
                for phase in ("attention", "routed experts", "shared expert", "Engram")
            },
        }
    full = [i for i in range(cfg.n_layers) if modes[i] != "reuse"]
    reuse = [i for i in range(cfg.n_layers) if modes[i] == "reuse"]
    engram = list(cfg.engram_layer_ids)

    def mean(layers, phase, key):
        return sum(layer_cells[str(i)][phase][key] for i in layers) / len(layers)

    per_layer_s = {
        kind: {ph: mean(ls, ph, "seconds") for ph in ("attention", "routed experts", "shared expert")}
        for kind, ls in (("full", full), ("reuse", reuse))
    }
    per_layer_b = {
        kind: {ph: mean(ls, ph, "bytes") for ph in ("attention", "routed experts", "shared expert")}
        for kind, ls in (("full", full), ("reuse", reuse))
    }
    per_layer_s["engram"], per_layer_b["engram"] = mean(engram, "Engram", "seconds"), mean(engram, "Engram", "bytes")
    prediction = predict_released(
        per_layer_s,
        per_layer_b,
        phases["head"]["seconds"],
        phases["head"]["bytes"],
        phases["other"]["seconds"],
        phases["other"]["bytes"],
        cfg.n_layers,
        bw,
    )
    return {
        "threads": n,
        "read_bandwidth_bytes_per_s": bw,
        "decode_s": decode_s,
        "tokens_per_s": decode_tokens / decode_s,
        "phases": phases,
        "token": token,
        "layers": layer_cells,
        "prediction_released": prediction,
        "tokens": tokens,
        "round_seconds": [r[0] for r in rounds],
    }


def _log_released(report: dict, thread_settings: Sequence[int], log: Callable[[str], None]) -> None:
    modes = ", ".join(f"{i} {m}" for i, m in enumerate(report["layer_modes"]))
    log(
        f"released geometry: dim {report['dim']}, {report['n_heads']} heads of {report['head_dim']}, vocab "
        f"{report['vocab_size']:,}; {report['n_layers']} layers ({modes}; Engram on {report['engram_layers']}), "
        f"{report['n_experts']} routed experts ({report['topk']} active) of {report['inter']}; checkpoint "
        f"{report['checkpoint_bytes'] / 2**30:.2f} GiB; prompt {report['prompt_tokens']}, "
        f"{report['decode_tokens']} decoded; dense and expert products on the {report['dense_kernel']} kernel"
    )
    for n in thread_settings:
        cell = report["settings"][str(n)]
        log(
            f"{n} thread{'s' if n > 1 else ''}: read bandwidth {cell['read_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s "
            f"(the floors'), copy {cell['copy_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
        )
        log(f"  {'phase':<16} {'s/token':>9} {'MB read':>9} {'floor s':>9} {'of floor':>9}")
        for name, c in [*cell["phases"].items(), ("token", cell["token"])]:
            frac = "" if c["fraction_of_floor"] is None else f"{c['fraction_of_floor']:.0%}"
            frac += " (measurement error)" if c.get("measurement_error") else ""
            log(f"  {name:<16} {c['seconds']:>9.4f} {c['bytes'] / 1e6:>9.1f} {c['floor_seconds']:>9.4f} {frac:>9}")
        p = cell["prediction_released"]
        log(
            f"  {cell['tokens_per_s']:.2f} tokens/s; predicted for the {p['layers']} released layers (experts "
            f"resident): {p['seconds_per_token']:.2f} s/token, {p['tokens_per_s']:.2f} tokens/s, "
            f"{p['bytes'] / 1e9:.2f} GB/token, {p['fraction_of_floor']:.0%} of its floor (a prediction)"
        )
        if "targets" not in cell:  # judged at the released dimensions only
            continue
        t = cell["targets"]
        lowest = t["lowest_phase"]
        log(
            f"  target: the token >= {TOKEN_TARGET:.0%} of its floor, every phase >= {PHASE_TARGET:.0%} but the "
            f"latency-bound {', '.join(LATENCY_BOUND_PHASES)}: measured {t['token_fraction']:.0%}, lowest "
            f"{lowest} {t['lowest_phase_fraction']:.0%}: "
            + (
                "not judged: measurement error in " + ", ".join(t["measurement_errors"])
                if t["measurement_errors"]
                else "met"
                if t["met"]
                else "NOT met"
            )
        )
    if len(thread_settings) > 1:
        one, every = (report["settings"][str(n)]["tokens_per_s"] for n in (thread_settings[0], thread_settings[-1]))
        report["ratio_all_over_one"] = every / one
        log(f"{thread_settings[-1]} threads / {thread_settings[0]}: {every / one:.2f}x tokens/s")


def _released_targets(cell: dict) -> dict:
    """One thread setting's cells against TOKEN_TARGET and PHASE_TARGET."""
    token = cell["token"]["fraction_of_floor"]
    bounded = {
        name: c["fraction_of_floor"]
        for name, c in cell["phases"].items()
        if name not in LATENCY_BOUND_PHASES and c["fraction_of_floor"] is not None
    }
    lowest = min(bounded, key=bounded.get)
    errors = [name for name, c in [*cell["phases"].items(), ("token", cell["token"])] if c.get("measurement_error")]
    return {
        "token_target": TOKEN_TARGET,
        "phase_target": PHASE_TARGET,
        "measurement_errors": errors,
        "latency_bound_phases": list(LATENCY_BOUND_PHASES),
        "token_fraction": token,
        "lowest_phase": lowest,
        "lowest_phase_fraction": bounded[lowest],
        "met": (not errors and token is not None and token >= TOKEN_TARGET and bounded[lowest] >= PHASE_TARGET),
    }


def main(args) -> int:
    from dsv41.checkpoint.synthetic import random_fill, write_release_layout
    from dsv41.core.threads import all_cores

    if args.repeats < 1 or args.copy_mib < 1 or (args.threads is not None and args.threads < 1):
        print("dsv41 bench: --repeats and --threads must be at least 1", file=sys.stderr)
        return 2
    cores = all_cores()
    settings = [args.threads] if args.threads is not None else ([1] if cores == 1 else [1, cores])

    try:  # refused before anything is written
        cfg = released_decode_config(args.layers, args.experts, small=args.small)
        require_cuda(args.device)
    except ValueError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 2

    def write(path):
        write_release_layout(path, cfg, random_fill())
        return f"the released-geometry checkpoint ({folder_bytes(path) / 2**30:.2f} GiB)"

    def run(path):
        return bench_decode_released(
            path,
            prompt_tokens=args.prompt,
            decode_tokens=args.tokens,
            repeats=args.repeats,
            thread_settings=settings,
            copy_bytes=args.copy_mib << 20,
            device=args.device,
        )

    return on_synthetic_checkpoint(args, "dsv41-bench-released-", write, run)
