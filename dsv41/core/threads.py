"""torch's intra-op threads: how many a model gets, and setting them for the process.

`load(threads=...)` sets them once the checkpoint checks out (the native expert kernel runs on
`torch.get_num_threads()` too): "auto" gives a model whose expert matrices are small
(`auto_threads`: under AUTO_THREADS_MIN_WEIGHTS weights each, as the embedded checkpoint's) one
thread, since their threads only hand tiny pieces of work back and forth, and anything larger
(the released geometry) every core; an int sets that many; None leaves torch alone.
Standard library only at import (torch is imported by `apply_threads`).
"""

from __future__ import annotations

import os

from .config import Config

# threads="auto": one intra-op thread below this many weights per expert matrix (dim x
# moe_inter_dim), every core at or above it. For the embedded checkpoint's 128 x 64 = 8,192,
# `dsv41 bench threads` on a shared two-core machine measured two threads at 0.14x-1.21x the
# tokens/s of one (a little faster with the second core idle, 7x slower with it busy): little to
# win, much to lose. The released 5,120 x 2,304 = 11,796,480 is far past it: a decode step's expert
# GEMVs are megabytes each, and the native kernel splits their rows over the threads (two threads
# measured up to 1.57x one there).
AUTO_THREADS_MIN_WEIGHTS = 1 << 22


def all_cores() -> int:
    """The cores this process may run on ($OMP_NUM_THREADS when it is set to a positive number,
    as a cap the user chose; else `machine_cores()`)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return machine_cores()


def machine_cores() -> int:
    """The logical CPUs this process may be scheduled on: its affinity set, else os.cpu_count()."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def auto_threads(cfg: Config) -> tuple[int, str]:
    """(threads, why) for threads="auto": 1 when an expert matrix (dim x moe_inter_dim weights)
    is under AUTO_THREADS_MIN_WEIGHTS, else `all_cores()`."""
    weights = cfg.dim * cfg.moe_inter_dim
    shape = f"expert matrices {cfg.dim} x {cfg.moe_inter_dim} = {weights:,} weights"
    if weights < AUTO_THREADS_MIN_WEIGHTS:
        return (
            1,
            f"auto: {shape}, under {AUTO_THREADS_MIN_WEIGHTS:,}: one thread; "
            "more would only hand tiny work back and forth",
        )
    cores = all_cores()
    return cores, f"auto: {shape}, at least {AUTO_THREADS_MIN_WEIGHTS:,}: all {cores} cores"


def check_threads(threads) -> None:
    """ValueError unless `threads` is "auto", None or a whole number from 1 to `machine_cores()`
    (torch starts every thread asked for, and thousands of them crash it)."""
    if threads is None or threads == "auto":
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f'threads must be "auto", None (leave torch alone) or a whole number >= 1, got {threads!r}')
    if threads > machine_cores():
        raise ValueError(
            f"threads={threads} is more than the {machine_cores()} CPUs this process may run on; "
            f'ask for at most {machine_cores()} (or "auto")'
        )


def apply_threads(threads, cfg: Config) -> tuple[int, str]:
    """Set torch's intra-op threads as `load(threads=...)` does; returns (threads now, why)."""
    import torch  # here, so that checking a --threads value needs no torch

    check_threads(threads)
    if threads is None:
        return torch.get_num_threads(), "left alone (threads=None)"
    if threads == "auto":
        count, why = auto_threads(cfg)
    else:
        count, why = threads, f"threads={threads}"
    torch.set_num_threads(count)
    return torch.get_num_threads(), why
