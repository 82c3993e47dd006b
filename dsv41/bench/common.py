"""What the benchmarks share: the released expert sizes, wall-clock helpers, the copy bandwidth
and resident memory, the one phase clock over a model's parts, and the command-line plumbing
(token lists, a synthetic checkpoint written on demand, the JSON report)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from dsv41.core.errors import Dsv41Error

if TYPE_CHECKING:  # annotations only
    from dsv41.model.model import Model

# The released expert geometry and routing width.
DIM, INTER, TOPK = 5120, 2304, 6
SWIGLU_LIMIT = 10.0


def best_time(fn: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best wall time of up to `repeats` calls, stopping early once `budget_s` is spent."""
    return best_times({"fn": fn}, repeats, budget_s)["fn"]


def best_times(fns: dict, repeats: int, budget_s: float) -> dict:
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
    return nbytes / best_time(lambda: dst.copy_(src), repeats, budget_s=10.0)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second of only reading one buffer far larger than the caches: a float32 sum over
    it on torch's threads, the kernel nearest to what a GEMV does with its weight (a copy also
    writes, so its source rate understates what reading alone reaches)."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    buf.sum()  # fault the pages in first
    return buf.numel() * 4 / best_time(lambda: buf.sum(), repeats, budget_s=10.0)


def measurement_error(fraction) -> bool:
    """A fraction of a bandwidth floor above 100% is a measurement error (the floor's bandwidth
    was measured too low, or the bytes counted too many), not a result."""
    return fraction is not None and fraction > 1.0


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


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------- the phase clock
# site pattern -> the phase its span is counted in ("other" is what no site covers)
PHASE_SITES = {
    "layers.*.attn": "attention",
    "layers.*.ffn.routed": "routed experts",
    "layers.*.ffn.shared": "shared expert",
    "layers.*.engram": "Engram",
    "head": "head",
}


class PhaseClock:
    """Seconds per phase of a forward, and per (layer, phase), accumulated between the enter and
    the exit of the model's sites (`hooks`), for as long as it is subscribed (`timing`)."""

    def __init__(self, phases: Sequence[str]):
        self.phases = tuple(phases)
        self._phase_of = {pattern.rsplit(".", 1)[-1]: phase for pattern, phase in PHASE_SITES.items()}
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.phases, 0.0)
        self.by_layer: dict = {}
        self._began: dict = {}

    def _key(self, name: str):
        parts = name.split(".")
        return (int(parts[1]) if parts[0] == "layers" else None), self._phase_of[parts[-1]]

    def enter(self, name: str) -> None:
        self._began[name] = time.perf_counter()

    def exit(self, name: str, value, context: dict) -> None:
        took = time.perf_counter() - self._began.pop(name)
        layer, phase = self._key(name)
        self.seconds[phase] += took
        if layer is not None:
            self.by_layer[(layer, phase)] = self.by_layer.get((layer, phase), 0.0) + took

    def timing(self, model: Model):
        """`with clock.timing(model):` the clock subscribed to the model's phase sites."""
        return model.sites.hooks(dict.fromkeys(PHASE_SITES, self), strict=False)


# ---------------------------------------------------------------------- command-line plumbing
def token_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tokens takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--tokens needs positive token counts, got {text!r}")
    return values


class BenchError(Dsv41Error, ValueError):
    """A benchmark's argument or folder it cannot use: one sentence naming it and the fix."""


def check_report_path(path: str, flag: str = "--json") -> None:
    """Refuse, before a run, a report path that could not be written after it: a folder, a path
    through a file or a missing folder, or a folder that takes no new file (`write_report` writes a
    file beside it and renames it over `path`)."""
    from dsv41.core.outdir import creation_refused

    target = Path(path).absolute()
    if target.is_dir():
        raise BenchError(f"{flag} {path} is a folder; name a file for the report")
    blocker = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise BenchError(f"{flag} {path} runs through the file {blocker}; name a file in a folder")
    if not target.parent.is_dir():
        raise BenchError(
            f"{flag} {path}: there is no folder {target.parent}; create it or name a file in a folder that exists"
        )
    refused = creation_refused(target.parent)
    if refused:
        raise BenchError(
            f"{flag} {path}: cannot write into {target.parent} ({refused}); name a file in a writable folder"
        )


def write_report(path: str, report: dict) -> None:
    """The report as JSON at `path`, whole or not at all (`outdir.replace_file`)."""
    from dsv41.core.outdir import replace_file

    text = json.dumps(report, indent=2) + "\n"

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    replace_file(path, write)


def save_report(path: str, report: dict, flag: str = "--json") -> int:
    """`write_report`, and the exit code: 0, or 1 where the file cannot be written after all (the
    folder removed or made read-only during the run, a full disk); then the report goes to stdout
    so that the run is not lost, and one line on stderr says so."""
    try:
        write_report(path, report)
    except OSError as exc:
        print(json.dumps(report, indent=2), flush=True)
        print(
            f"dsv41 bench: {flag} {path} could not be written ({exc.strerror or exc}); the report is printed "
            f"on stdout instead",
            file=sys.stderr,
        )
        return 1
    return 0


def require_cuda(device: str) -> None:
    """Refuse a device other than the CPU where the Triton expert kernels cannot run."""
    if device == "cpu":
        return
    from dsv41.kernels.triton_experts import available

    if not available():
        raise ValueError(
            f"--device {device} needs a CUDA device and Triton; this machine has "
            f"{'no CUDA device' if not torch.cuda.is_available() else 'no Triton'}"
        )
    if not device.startswith("cuda"):
        raise ValueError(f"--device takes cpu, cuda or cuda:N, got {device!r}")


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def on_synthetic_checkpoint(args, prefix: str, write: Callable[[str], str], run: Callable[[str], dict]) -> int:
    """Run `run(path)` on --checkpoint, written there by `write(path)` first when the folder is
    empty or missing (a temporary folder, removed after, without --checkpoint); the report to --json."""
    import shutil
    import tempfile

    from dsv41.checkpoint.checkpoint import LoadError

    temporary = None
    path = args.checkpoint
    try:
        if path is None:
            path = temporary = tempfile.mkdtemp(prefix=prefix)
        if not os.path.isfile(os.path.join(path, "config.json")):
            if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
                print(
                    f"dsv41 bench: {path} is neither a checkpoint nor an empty folder to write one into",
                    file=sys.stderr,
                )
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
        write_report(args.json, report)
    return 0
