"""`dsv41 bench stream`: routed experts streamed from disk under a memory budget, measured.

Writes once into `--dir` (reused when its marker says it is complete) a synthetic checkpoint with
the released dimensions and all 384 routed experts on a few layers (`released.released_decode_config`,
random FP4 bytes from `synthetic.random_fill`). Everything that can refuse the run is checked before
a byte is written (the budget, the positions, the folder, the --json file, the free space), and a
write stopped half way (a full disk, Ctrl-C) leaves nothing the next run cannot clear away itself
(`ensure_checkpoint`). Each measured run then empties the page cache for
those files (`posix_fadvise(DONTNEED)` over every shard), measures the disk's read bandwidth right
there (parallel positioned reads of a layer shard's experts, dropped again after), loads the model
under `--memory` (`stores.SlotCache`), decodes, and reports in one run: the disk bandwidth before
and after, bytes read and seconds per token, the in-flight read fraction (bytes read / (seconds
some read was in flight x disk bandwidth); above 100% is a measurement error), the fraction of
the disk floor for the whole token, hit rates by policy on this run's routing ("uniform (random
weights)") and on a recorded trace's ("recorded (miniature routing)": the embedded trained
miniature's routing over a held-out text, replayed at the same fraction of experts held), each
beside Belady's bound, the peak resident memory against the budget, and the 40-layer prediction
for this machine and for a stated workstation.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from dsv41.checkpoint.headers import INDEX_NAME
from dsv41.core.config import RELEASED, Config
from dsv41.core.errors import Dsv41Error
from dsv41.core.outdir import usable_folder
from dsv41.core.text import LongInteger, bounded_ints

from .common import (
    BenchError,
    PhaseClock,
    check_report_path,
    measurement_error,
    read_bandwidth,
    reset_peak_rss,
    rss_bytes,
    save_report,
)

if TYPE_CHECKING:  # annotations only
    from dsv41.model.model import Model

MARKER = "bench-stream.json"
# The folder a checkpoint is written into before its files are moved beside the marker: a name of
# this bench's own, so that what a stopped write left is recognizably its debris.
STAGING = ".bench-stream-partial"
# What the release-layout writer names its files (`synthetic.write_release_layout`): the only
# names a marker may list as this bench's own, and so the only files it ever removes.
LAYOUT_FILES = (INDEX_NAME, "config.json", "inference/config.json", "tokenizer.json", "tokenizer_config.json")
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Beside its tensors a checkpoint holds the shard headers, the index, the two configs and the
# tokenizer (26 MB at the released vocabulary): an allowance that errs on the safe side.
FILES_ALLOWANCE = 64 << 20
GIB = 1 << 30
# A workstation the 40-layer prediction is also made for (stated, not measured).
WORKSTATION = {
    "name": "NVMe workstation",
    "disk_bytes_per_s": 7e9,
    "memory_bytes_per_s": 70e9,
    "memory": "116GiB",
    "ram": "128 GB",
    "note": "PCIe 4 NVMe at 7 GB/s, DDR5-5600 dual channel (~70 GB/s sustained), 128 GB RAM",
}
# The held-out text the recorded routing comes from: not in the miniature's training corpus (the
# standard library's sources and pydoc topics); plain English prose about this project's subject.
HELD_OUT = (
    "A small machine can run a very large mixture of experts when most of the experts stay on "
    "disk. Each token asks for a handful of them in every layer, and the ones it asks for are "
    "read into memory, used once, and kept only while there is room for them. Whether the next "
    "token asks for the same ones decides how much has to be read again."
)


# ---------------------------------------------------------------------- the checkpoint, once
@functools.lru_cache(maxsize=4)  # a frozen Config; building its tokenizer takes seconds
def stream_config(layers: int, experts: int, small: bool):
    from .released import released_decode_config

    return released_decode_config(layers, experts, small=small)


def run_positions(prompt_tokens: int, decode_tokens: int) -> int:
    """The positions a measured run loads the model for: the prompt, the decode and a margin."""
    return prompt_tokens + decode_tokens + 8


def plan_run(cfg: Config, memory, positions: int):
    """The budget `dsv41.load` plans for a run of `positions`, planned before anything is written:
    a budget above the machine's memory or one that cannot hold the dense part and one token's
    experts (`BudgetError`), or more positions than the config has, is refused here and not after
    the checkpoint is on disk."""
    from dsv41.runtime.budget import budget_bytes, check_machine, plan_budget

    if positions > cfg.max_seq_len:
        raise BenchError(
            f"--prompt + --tokens + 8 = {positions:,} positions, more than the config's "
            f"{cfg.max_seq_len:,}; ask for fewer tokens"
        )
    check_machine(budget_bytes(memory))  # as the load checks it
    return plan_budget(cfg, memory, max_seq_len=positions)


def checkpoint_bytes(cfg: Config) -> int:
    """The disk space the checkpoint of `cfg` takes at most: its tensors' bytes and the allowance."""
    from dsv41.checkpoint.inventory import expected_tensors

    return sum(spec.nbytes for spec in expected_tensors(cfg)) + FILES_ALLOWANCE


def _is_own_name(name) -> bool:
    return isinstance(name, str) and (name in LAYOUT_FILES or SHARD_FILE.fullmatch(name) is not None)


def _write_marker(folder: str, marker: dict) -> None:
    """The marker, whole or not at all (a temporary file renamed over it)."""
    tmp = os.path.join(folder, f".{MARKER}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f)
    os.replace(tmp, os.path.join(folder, MARKER))


def read_marker(folder: str) -> dict | None:
    """The marker of `folder` (None without one), its fields checked: this bench removes the files
    it lists, so a marker it cannot have written is refused, never acted on. A marker of an
    earlier version (no `files`) lists the release-layout files the folder holds."""
    path = os.path.join(folder, MARKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:  # a marker is a few KiB: more is not one this bench wrote
            marker = json.loads(f.read(1 << 20), parse_int=bounded_ints(30))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = (
            f"an integer of {exc.digits:,} digits"
            if isinstance(exc, LongInteger)
            else "nested too deeply"
            if isinstance(exc, RecursionError)
            else getattr(exc, "strerror", None) or str(exc)
        )
        raise BenchError(f"{path} cannot be read ({reason}); remove the folder or name another --dir") from None
    if isinstance(marker, dict) and "files" not in marker:  # written before markers listed their files
        marker["files"] = [
            n
            for n in [*LAYOUT_FILES, *sorted(os.listdir(folder))]
            if _is_own_name(n) and os.path.isfile(os.path.join(folder, n))
        ]
    fine = (
        isinstance(marker, dict)
        and isinstance(marker.get("config"), dict)
        and isinstance(marker.get("complete"), bool)
        and isinstance(marker["files"], list)
        and all(_is_own_name(n) for n in marker["files"])
        and (not marker["complete"] or (isinstance(marker.get("bytes"), int) and marker["bytes"] >= 0))
    )
    if not fine:
        raise BenchError(
            f"{path} is not a marker this bench wrote (its fields are not config, complete, files and "
            f"bytes as it writes them); remove the folder or name another --dir"
        )
    return marker


def _remove_own(folder: str, files: list[str]) -> None:
    """Remove what this bench wrote into `folder`: the files its marker lists, the staging folder
    and the subfolders those files emptied. Nothing else is touched."""
    shutil.rmtree(os.path.join(folder, STAGING), ignore_errors=True)
    for name in files:
        path = os.path.join(folder, name)
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
    for sub in {os.path.dirname(n) for n in files if os.path.dirname(n)}:
        try:
            os.rmdir(os.path.join(folder, sub))
        except OSError:
            pass  # not empty: it holds something this bench did not write


def _free_bytes(folder: str) -> tuple[str, int]:
    """(the nearest existing folder, the bytes free on its disk for this user)."""
    existing = next(p for p in (Path(folder).absolute(), *Path(folder).absolute().parents) if p.exists())
    return str(existing), shutil.disk_usage(existing).free


def ensure_checkpoint(folder: str, cfg: Config, log: Callable[[str], None] = print) -> dict:
    """The synthetic all-experts checkpoint in `folder`: reused when its marker names this very
    config and says it is complete, else written. Returns the marker's content.

    A write stopped anywhere never blocks the next run. The marker goes first (incomplete), the
    files are written under STAGING, the marker then lists them, they are moved beside it, and it
    says complete last; the next run removes what an unfinished one left (the files its marker
    lists, STAGING) and writes anew. A folder without a marker that holds anything but STAGING is
    the user's and refused. Before writing, the folder must take new files and its disk must have
    room (`checkpoint_bytes`); a write that fails all the same removes its partial files."""
    from dsv41.checkpoint.inventory import shard_names
    from dsv41.checkpoint.synthetic import random_fill, write_release_layout

    want = {"config": json.loads(json.dumps(cfg.as_nested_dict(), default=str)), "complete": True}
    marker = read_marker(folder)
    if (
        marker is not None
        and marker["complete"]
        and marker["config"] == want["config"]
        and all(os.path.isfile(os.path.join(folder, n)) for n in {*marker["files"], *shard_names(cfg)})
    ):
        log(f"reusing the checkpoint in {folder} ({marker['bytes'] / GIB:.2f} GiB)")
        return marker
    entries = os.listdir(folder) if os.path.isdir(folder) else []
    if marker is None and set(entries) - {STAGING}:
        raise BenchError(
            f"--dir {folder} holds files but no {MARKER}; name an empty or missing folder (or one this bench wrote)"
        )
    own = marker["files"] if marker is not None else []
    usable_folder(folder, "--dir")  # not a file, nor under one, and it (or where it would be made) takes files
    where, free = _free_bytes(folder)
    need = checkpoint_bytes(cfg)
    reclaimed = sum(os.path.getsize(os.path.join(folder, n)) for n in own if os.path.isfile(os.path.join(folder, n)))
    if need > free + reclaimed:
        also = f" besides the {reclaimed / GIB:.2f} GiB of the earlier checkpoint it replaces" if reclaimed else ""
        raise BenchError(
            f"--dir {folder}: the checkpoint needs {need / GIB:.2f} GiB and the disk of {where} has "
            f"{free / GIB:.2f} GiB free{also}; free some space or name a folder on another disk"
        )
    if own or STAGING in entries:
        log(
            f"removing the {'unfinished ' if marker is None or not marker['complete'] else ''}checkpoint "
            f"an earlier run left in {folder}"
        )
        _remove_own(folder, own)
    created = not os.path.isdir(folder)
    began = time.perf_counter()
    staging, files = os.path.join(folder, STAGING), []
    try:
        os.makedirs(folder, exist_ok=True)
        _write_marker(folder, {**want, "complete": False, "files": files})
        write_release_layout(staging, cfg, random_fill(), progress="writing", streamed=True)
        files = sorted(
            os.path.relpath(os.path.join(root, f), staging) for root, _, names in os.walk(staging) for f in names
        )
        _write_marker(folder, {**want, "complete": False, "files": files})
        for name in files:
            os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
            os.replace(os.path.join(staging, name), os.path.join(folder, name))
        shutil.rmtree(staging)
        want.update(
            files=files,
            bytes=sum(os.path.getsize(os.path.join(folder, n)) for n in files),
            write_seconds=time.perf_counter() - began,
        )
        _write_marker(folder, want)
    except BaseException as exc:
        try:  # leave nothing half written: the next run starts from a clean folder either way
            _remove_own(folder, files)
            os.remove(os.path.join(folder, MARKER))
            if created:
                os.rmdir(folder)
        except OSError:
            pass  # what is left is listed by the marker or under STAGING: the next run removes it
        if not isinstance(exc, OSError):
            raise
        _, now = _free_bytes(folder)
        raise BenchError(
            f"--dir {folder}: writing the checkpoint failed at {exc.filename or folder} "
            f"({exc.strerror or exc}); its partial files were removed (it needs {need / GIB:.2f} GiB, "
            f"{now / GIB:.2f} GiB are free now)"
        ) from None
    log(f"wrote {want['bytes'] / GIB:.2f} GiB to {folder} in {want['write_seconds']:.0f} s")
    return want


# ---------------------------------------------------------------------- the disk
def drop_page_cache(paths) -> str:
    """Ask the kernel to drop every cached page of `paths`; says what happened."""
    if not hasattr(os, "posix_fadvise"):
        return "not dropped: this system has no posix_fadvise"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "dropped (posix_fadvise DONTNEED over every shard)"


def disk_bandwidth(path: str, nbytes: int, threads: int, piece: int = 4 << 20, offset: int = 0) -> float:
    """Bytes per second of `threads` threads reading `nbytes` of `path` from `offset` by positioned
    reads of `piece` bytes: the better of buffered reads (the range dropped from the page cache
    before and after) and O_DIRECT reads where the system and file system allow, the two ways the
    expert slots read a miss (`stores.SlotCache`)."""
    rates = [_positioned_read_rate(path, nbytes, threads, piece, offset, direct=False)]
    if hasattr(os, "O_DIRECT"):
        try:
            rates.append(_positioned_read_rate(path, nbytes, threads, piece, offset, direct=True))
        except OSError:  # no direct reads on this file system: the slots read buffered there too
            pass
    return max(rates)


def _positioned_read_rate(path: str, nbytes: int, threads: int, piece: int, offset: int, *, direct: bool) -> float:
    import mmap

    align = 4096  # O_DIRECT's offsets, lengths and buffers on block boundaries (stores.DIRECT_ALIGN)
    size = os.path.getsize(path)
    offset -= offset % align
    nbytes = max(piece, min(nbytes, size - offset))
    nbytes -= nbytes % align
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    bufs = [mmap.mmap(-1, piece) for _ in range(threads)]  # page-aligned memory
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

        def read(i):
            view, total = memoryview(bufs[i % threads]), 0
            for at in range(offset + i * piece, offset + nbytes, threads * piece):
                total += os.preadv(fd, [view[: min(piece, offset + nbytes - at)]], at)
            return total

        began = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, range(threads)))
        seconds = time.perf_counter() - began
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        for buf in bufs:
            buf.close()
    return total / seconds


# ---------------------------------------------------------------------- the recorded routing
def recorded_steps(tokens: int, log: Callable[[str], None] = print):
    """(steps for `cache_policy.pool_hit_rates`, the keys there are): the embedded trained
    miniature's routing over the held-out text and `tokens` generated after it."""
    import dsv41
    from dsv41.generation.generate import generate
    from dsv41.observe.cache_policy import pool_steps

    model = dsv41.load(quiet=True, threads=None)
    result = generate(model, HELD_OUT, max_new_tokens=tokens, trace=True, stop_at_eos=False)
    steps = pool_steps(result)
    log(f"recorded routing: {model.report.embedded or model.report.checkpoint}; {len(steps)} calls")
    return steps, model.cfg.n_layers * model.cfg.n_routed_experts


# ---------------------------------------------------------------------- one run
def measure(
    folder: str,
    cfg: Config,
    *,
    memory,
    policy: str,
    prompt_tokens: int,
    decode_tokens: int,
    io_threads: int,
    disk_probe: int,
    recorded,
    log: Callable[[str], None] = print,
) -> dict:
    """One measured run: page cache emptied, disk bandwidth, load under `memory`, prefill, decode."""
    import dsv41
    from dsv41.checkpoint.inventory import shard_names
    from dsv41.generation.generate import decode_n, prefill
    from dsv41.model.trace import ForwardTrace
    from dsv41.observe.cache_policy import pool_hit_rates, pool_steps

    files = [os.path.join(folder, name) for name in shard_names(cfg)]  # this config's, whatever else lies there
    page_cache = drop_page_cache(files)
    probe = max(files, key=os.path.getsize)  # a layer shard: nearly all of it experts
    disk_before = disk_bandwidth(probe, disk_probe, io_threads, offset=os.path.getsize(probe) // 2)
    peak_reset = reset_peak_rss()
    model = dsv41.load(
        folder,
        quiet=True,
        threads=None,
        memory=memory,
        expert_policy=policy,
        max_seq_len=run_positions(prompt_tokens, decode_tokens),
    )
    cache = model.experts
    cache.set_io_threads(io_threads)
    plan = model.report.budget_plan
    g = torch.Generator().manual_seed(0)
    ids = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (prompt_tokens - 1,), generator=g).tolist()
    trace = ForwardTrace()
    began = time.perf_counter()
    logits = prefill(model, ids, trace=trace)
    prefill_s = time.perf_counter() - began
    prefill_bytes = cache.counters.bytes_read
    before = cache.stats.as_dict()
    hits0, misses0 = sum(cache.counters.hits.values()), sum(cache.counters.misses.values())
    clock = PhaseClock(("attention", "routed experts", "shared expert", "Engram", "head"))
    with clock.timing(model):
        began = time.perf_counter()
        decode_n(model, int(logits[0].argmax()), decode_tokens, trace=trace)
        decode_s = time.perf_counter() - began
    after = cache.stats.as_dict()
    hits = sum(cache.counters.hits.values()) - hits0
    misses = sum(cache.counters.misses.values()) - misses0
    memory_end = rss_bytes()
    disk_after = disk_bandwidth(probe, disk_probe, io_threads, offset=os.path.getsize(probe) // 4)
    # the better of the two probes: a probe slowed by other work on the machine would otherwise
    # make the decode's reads look faster than the disk
    disk = max(disk_before, disk_after)
    read_bytes = after["bytes_read"] - before["bytes_read"]
    read_s = after["read_seconds"] - before["read_seconds"]
    wait_s = after["wait_seconds"] - before["wait_seconds"]
    per_token_bytes, per_token_s = read_bytes / decode_tokens, decode_s / decode_tokens
    in_flight = read_bytes / (read_s * disk) if read_s > 0 else None
    floor = per_token_bytes / disk / per_token_s if per_token_s > 0 else None
    slots = cache.slots
    steps = pool_steps(trace)
    uniform = pool_hit_rates(steps, slots, ("lru", "decay", "belady"))
    rec_steps, rec_keys = recorded
    rec_slots = min(rec_keys, max(1, round(slots * rec_keys / (cfg.n_layers * cfg.n_routed_experts))))
    recorded_rates = pool_hit_rates(rec_steps, rec_slots, ("lru", "decay", "belady"))
    report = {
        "memory": plan["memory"],
        "budget": plan,
        "policy": policy,
        "page_cache": page_cache,
        "slot_cache_page_cache": cache.page_cache,
        "io_threads": io_threads,
        "disk_bytes_per_s_before": disk_before,
        "disk_bytes_per_s_after": disk_after,
        "disk_bytes_per_s": disk,
        "prefill_tokens": prompt_tokens,
        "prefill_s": prefill_s,
        "prefill_bytes_read": prefill_bytes,
        "prefill_distinct_experts": len({k for layer in steps[0] for k in layer}),
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "seconds_per_token": per_token_s,
        "tokens_per_s": 1 / per_token_s,
        "bytes_read_per_token": per_token_bytes,
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "read_ahead": after["read_ahead"] - before["read_ahead"],
        "read_ahead_used": after["read_ahead_used"] - before["read_ahead_used"],
        "read_seconds": read_s,
        "wait_seconds": wait_s,
        "wait_fraction_of_token": wait_s / decode_s,
        "in_flight_read_fraction": in_flight,
        "in_flight_measurement_error": measurement_error(in_flight),
        "fraction_of_disk_floor": floor,
        "floor_measurement_error": measurement_error(floor),
        "policies": {
            "uniform (random weights)": {"slots": slots, **uniform},
            "recorded (miniature routing, same fraction held)": {
                "slots": rec_slots,
                "keys": rec_keys,
                **recorded_rates,
            },
        },
        "peak_rss_bytes": memory_end["peak_rss_bytes"],
        "peak_rss_since_load": peak_reset,
        "peak_rss_over_budget": memory_end["peak_rss_bytes"] / plan["memory"],
        "compute_seconds_per_token": (decode_s - wait_s) / decode_tokens,
        "head_seconds_per_token": clock.seconds["head"] / decode_tokens,
    }
    report["prediction"] = predict_40(report, cfg, model)
    cache.close()
    return report


def predict_40(run: dict, cfg: Config, model: Model) -> dict:
    """Seconds per token of the 40-layer released model from this run: per layer the compute
    measured here (the token's time without waiting on reads, less the head, per layer; the head
    once) and the misses a budget of that size leaves (uniform routing: slots / experts held),
    read at the disk's bandwidth, for this machine (a budget of nine tenths of its RAM) and the
    stated workstation; overlapped (the larger of the two) and serial (their sum). A prediction."""
    from dsv41.core.config import RELEASED
    from dsv41.runtime.budget import plan_budget

    out = {}
    expert = run["budget"]["slot_bytes"]
    head = run["head_seconds_per_token"]
    compute_layer = max(0.0, run["compute_seconds_per_token"] - head) / cfg.n_layers  # the rest, per layer
    read_bw = read_bandwidth(256 << 20)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    here = int(ram * 0.9)  # this machine's RAM less a tenth for the system
    for name, disk, mem_bw, memory in (
        ("this machine", run["disk_bytes_per_s"], read_bw, here),
        (
            WORKSTATION["name"],
            WORKSTATION["disk_bytes_per_s"],
            WORKSTATION["memory_bytes_per_s"],
            WORKSTATION["memory"],
        ),
    ):
        try:
            plan = plan_budget(RELEASED, memory, max_seq_len=4096)
            slots = plan.slots
        except ValueError:
            out[name] = {
                "memory": memory,
                "note": "below the released model's minimum budget "
                f"({plan_budget(RELEASED, 1 << 50, max_seq_len=4096).minimum / GIB:.2f} GiB)",
            }
            continue
        held = min(1.0, slots / (RELEASED.n_layers * RELEASED.n_routed_experts))
        miss_bytes = RELEASED.n_layers * RELEASED.n_activated_experts * expert * (1 - held)
        compute = (head + RELEASED.n_layers * compute_layer) * (read_bw / mem_bw)
        read = miss_bytes / disk
        out[name] = {
            "memory": plan.memory,
            "slots": slots,
            "uniform_hit_rate": held,
            "bytes_read_per_token": miss_bytes,
            "read_seconds": read,
            "compute_seconds": compute,
            "seconds_per_token_overlapped": max(read, compute),
            "seconds_per_token_serial": read + compute,
            "disk_bytes_per_s": disk,
            "memory_bytes_per_s": mem_bw,
        }
    out["note"] = (
        "a prediction from this run's measured compute per layer (scaled by memory bandwidth) and the "
        "uniform-routing miss rate of the released model's budget, not a measurement"
    )
    return out


def _log_run(i: int, r: dict, log: Callable[[str], None]) -> None:
    gb = 1e9
    flag = lambda x, err: "-" if x is None else f"{x:.0%}" + (" (measurement error)" if err else "")
    in_flight = flag(r["in_flight_read_fraction"], r["in_flight_measurement_error"])
    log(
        f"run {i}: disk {r['disk_bytes_per_s_before'] / gb:.2f} GB/s before, "
        f"{r['disk_bytes_per_s_after'] / gb:.2f} after; "
        f"{r['seconds_per_token']:.2f} s/token, {r['bytes_read_per_token'] / 1e6:.1f} MB read/token, hit rate "
        f"{r['hit_rate']:.1%}; reads in flight at {in_flight} "
        f"of the disk; token at {flag(r['fraction_of_disk_floor'], r['floor_measurement_error'])} of its disk floor; "
        f"waited on reads {r['wait_fraction_of_token']:.0%} of the time; peak RSS "
        f"{r['peak_rss_bytes'] / GIB:.2f} GiB of {r['memory'] / GIB:.2f} GiB ({r['peak_rss_over_budget']:.0%})"
    )
    log(
        f"  prefill {r['prefill_tokens']} tokens: {r['prefill_bytes_read'] / gb:.2f} GB read for "
        f"{r['prefill_distinct_experts']} distinct experts in {r['prefill_s']:.1f} s"
    )
    for label, p in r["policies"].items():
        log(
            f"  {label} at {p['slots']} slots: "
            + ", ".join(
                f"{name} {p[name]['hit_rate']:.1%}"
                for name in ("lru", "decay", "belady")
                if p[name]["hit_rate"] is not None
            )
        )
    for name, p in r["prediction"].items():
        if isinstance(p, dict) and "seconds_per_token_overlapped" not in p:
            log(f"  40 layers, {name}: {p['memory'] / GIB:.1f} GiB is {p['note']}")
        elif isinstance(p, dict):
            log(
                f"  40 layers, {name} ({p['memory'] / GIB:.0f} GiB, {p['slots']} slots): "
                f"{p['seconds_per_token_overlapped']:.2f}-{p['seconds_per_token_serial']:.2f} s/token, "
                f"{p['bytes_read_per_token'] / gb:.2f} GB read/token (a prediction)"
            )


def bench_stream(
    folder: str,
    *,
    layers: int = 2,
    experts: int = 384,
    memory="12GiB",
    policy: str = "decay",
    prompt_tokens: int = 4,
    decode_tokens: int = 8,
    runs: int = 1,
    io_threads: int = 8,
    disk_probe: int = 2 * GIB,
    small: bool = False,
    recorded_tokens: int = 96,
    log: Callable[[str], None] = print,
) -> dict:
    cfg = stream_config(layers, experts, small)
    plan_run(cfg, memory, run_positions(prompt_tokens, decode_tokens))  # before 23.5 GiB are written, not after
    marker = ensure_checkpoint(folder, cfg, log)
    recorded = recorded_steps(recorded_tokens, log)
    report = {
        "command": "bench stream",
        "dir": folder,
        "checkpoint_bytes": marker["bytes"],
        "n_layers": cfg.n_layers,
        "n_experts": cfg.n_routed_experts,
        "topk": cfg.n_activated_experts,
        "dim": cfg.dim,
        "threads": torch.get_num_threads(),
        "workstation": WORKSTATION,
        "note": "wall times on a possibly shared machine; each run's ratios are measured within it",
        "runs": [],
    }
    for i in range(runs):
        r = measure(
            folder,
            cfg,
            memory=memory,
            policy=policy,
            prompt_tokens=prompt_tokens,
            decode_tokens=decode_tokens,
            io_threads=io_threads,
            disk_probe=disk_probe,
            recorded=recorded,
            log=log,
        )
        report["runs"].append(r)
        _log_run(i + 1, r, log)
    return report


# ---------------------------------------------------------------------- the subcommand
def add_parser(sub) -> None:
    import argparse

    from dsv41.checkpoint.eviction import DEFAULT_POLICY, EXPERT_POLICIES
    from dsv41.core.argtypes import memory_size, whole_number

    positions = RELEASED.max_seq_len
    st = sub.add_parser(
        "stream",
        help="routed experts streamed from disk under a memory budget: disk bandwidth, "
        "bytes and seconds per token, hit rates by policy, peak memory",
    )
    st.add_argument(
        "--dir",
        required=True,
        metavar="FOLDER",
        help="where the synthetic all-experts checkpoint is "
        "written once and reused (a missing or empty folder, or one this bench wrote)",
    )
    st.add_argument("--memory", type=memory_size, default=12 * GIB, metavar="SIZE", help="the budget (default 12GiB)")
    st.add_argument("--expert-policy", choices=EXPERT_POLICIES, default=DEFAULT_POLICY)
    st.add_argument(
        "--layers",
        type=whole_number(2, RELEASED.n_layers, "layers"),
        default=2,
        help=f"backbone layers, 2 to {RELEASED.n_layers} (default 2; 7.2 GB of experts each)",
    )
    st.add_argument(
        "--experts", type=whole_number(6, RELEASED.n_routed_experts, "experts"), default=384, help=argparse.SUPPRESS
    )
    st.add_argument(
        "--tokens", type=whole_number(1, positions, "tokens"), default=8, help="tokens to decode per run (default 8)"
    )
    st.add_argument("--prompt", type=whole_number(2, positions, "tokens"), default=4, help="prompt length (default 4)")
    st.add_argument(
        "--runs",
        type=whole_number(1, 1000, "runs"),
        default=1,
        help="measured runs, each from an emptied page cache (default 1)",
    )
    # each reader of the disk probe holds a 4 MiB buffer: 256 of them are 1 GiB
    st.add_argument(
        "--io-threads", type=whole_number(1, 256, "threads"), default=8, help="reads in flight, 1 to 256 (default 8)"
    )
    st.add_argument(
        "--disk-probe-mib",
        type=whole_number(1, 1 << 20, "MiB"),
        default=2048,
        help="bytes the disk bandwidth is measured on",
    )
    # the recorded routing runs on the embedded miniature, its caches sized for 4096 positions
    st.add_argument("--recorded-tokens", type=whole_number(1, 2048, "tokens"), default=96, help=argparse.SUPPRESS)
    st.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # tiny dims, for tests
    st.add_argument(
        "--json",
        metavar="OUT",
        help="also write the report as JSON here (checked before the run; "
        "printed on stdout if it cannot be written at the end)",
    )


def main(args) -> int:
    try:
        if args.json:
            check_report_path(args.json)  # before the run, not after it
        report = bench_stream(
            args.dir,
            layers=args.layers,
            experts=args.experts,
            memory=args.memory,
            policy=args.expert_policy,
            prompt_tokens=args.prompt,
            decode_tokens=args.tokens,
            runs=args.runs,
            io_threads=args.io_threads,
            disk_probe=args.disk_probe_mib << 20,
            small=args.small,
            recorded_tokens=args.recorded_tokens,
        )
    except (Dsv41Error, ValueError) as exc:  # BenchError, LoadError (BudgetError among them): one sentence each
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return 1
    return save_report(args.json, report) if args.json else 0
