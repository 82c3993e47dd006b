"""`dsv41 notebooks`: execute every numbered notebook with papermill into a fresh run folder.

A run folder (`outputs/run-001`, `run-002`, … or `--out DIR`) is never reused: it receives the
executed notebooks, the figures and sidecars they export (each notebook gets the folder as its
`output_dir` parameter) and `summary.json` with each notebook's status, duration and, on failure,
the failing cell and the error line. A failed notebook does not stop the others; the exit code is 1
when any failed, 2 for bad usage.

A run stopped by SIGINT or SIGTERM still leaves a truthful folder: `summary.json` with status
"interrupted", the notebook and the cell that were running, and the notebooks that never started as
"not run"; the interrupted notebook's executed copy marks the stopped cell "interrupted" and the
cells after it papermill's "pending" (not run). The exit code is 128 + the signal (130 for SIGINT,
143 for SIGTERM). A cell past --cell-timeout is "failed" in both files, like any failing cell.

Kernel: the notebooks run in *this* Python. A private `python3` kernelspec pinned to sys.executable
is put first on JUPYTER_PATH for the run, so a fresh machine needs nothing registered and a user's
own `python3` kernel (possibly another interpreter without dsv41) is never picked by accident.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dsv41.app.notebook_signals import (
    FAILED,
    INTERRUPTED,
    RUNNING,
    SIGNALS,
    SUMMARY_NAME,
    RunInterrupted,
    as_interrupt,
    stop_on_signals,
)
from dsv41.core.argtypes import memory_size, whole_number
from dsv41.core.errors import Dsv41Error
from dsv41.core.outdir import creation_refused

NOTEBOOK_PATTERN = re.compile(r"^\d\d_[A-Za-z0-9_\-]+\.ipynb$")
RUN_PATTERN = re.compile(r"^run-(\d+)$")
KERNEL_NAME = "python3"
# The parameters every notebook declares in its one cell tagged `parameters`.
STANDARD_PARAMETERS = ("checkpoint", "prompt", "device", "output_dir", "smoke")
# --cell-timeout: a whole number of seconds (nbclient's timeout is an integer), at most a day
MAX_CELL_TIMEOUT_S = 86_400
# --memory is the whole kernel's: a notebook holds more beside its models than a command does (its
# figures, traces, a sibling model's caches, the allocator's high-water mark of earlier cells).
# Measured at the released geometry: notebook 05 with a 20 GiB model budget peaked at 21.55 GiB
# resident, 1.55 GiB past it; the models get --memory less this.
KERNEL_ALLOWANCE = 2 << 30


def model_budget(memory: int) -> int:
    """The budget the notebooks' models get out of a kernel's `memory` (bytes): `memory` less
    KERNEL_ALLOWANCE; NotebookRunError when nothing is left for them."""
    if memory <= KERNEL_ALLOWANCE:
        raise NotebookRunError(
            f"--memory {memory / 2**30:.2f} GiB leaves nothing for the models: a notebook's kernel keeps "
            f"{KERNEL_ALLOWANCE / 2**30:.2f} GiB for itself; give more"
        )
    return memory - KERNEL_ALLOWANCE


class NotebookRunError(Dsv41Error):
    """Bad usage or an unusable set-up: one sentence for a person, exit 2 (`exit_code` 1 for a
    failure that is not the caller's usage, such as a folder the system refuses to create)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------- finding things
def default_notebooks_dir() -> Path:
    """The repository's notebooks/ (next to the package in an editable install), else ./notebooks."""
    beside_package = Path(__file__).resolve().parents[2] / "notebooks"
    return beside_package if beside_package.is_dir() else Path.cwd() / "notebooks"


def find_notebooks(directory: str | os.PathLike, only: list[str] | None = None) -> list[Path]:
    """The `NN_*.ipynb` files of `directory`, in order; `only` keeps those whose stem equals a name
    or starts with `name_` (so `01` selects `01_audit`). `only=None` keeps all; an empty list is a
    selection of nothing, refused (`--only ",,,"` must not run every notebook)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NotebookRunError(f"{directory}: no such notebooks folder; pass --notebooks DIR")
    found = sorted(p for p in directory.iterdir() if NOTEBOOK_PATTERN.match(p.name) and p.is_file())
    if not found:
        raise NotebookRunError(f"{directory}: no numbered notebooks (NN_name.ipynb) in this folder")
    if only is None:
        return found
    if not only:
        raise NotebookRunError(
            f"--only names no notebook (nothing between its commas); name one or more of "
            f"{', '.join(p.stem for p in found)}, or a number prefix such as 01"
        )
    chosen, unknown = [], []
    for name in only:
        name = name.strip().removesuffix(".ipynb")
        hits = [p for p in found if p.stem == name or p.stem.startswith(name + "_")]
        if not hits:
            unknown.append(name)
        chosen += [p for p in hits if p not in chosen]
    if unknown:
        raise NotebookRunError(
            f"--only {', '.join(unknown)}: no such notebook; there are {', '.join(p.stem for p in found)}"
        )
    return sorted(chosen)


def parameters_cell_problem(path: Path) -> str | None:
    """None when the notebook has exactly one cell tagged `parameters`, else what is wrong."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        return f"{path.name}: {len(tagged)} cells tagged 'parameters' (cells {tagged}); a notebook needs exactly one"
    return None


def declared_parameters(path: Path) -> set[str]:
    """Names assigned in the notebook's `parameters` cell (papermill's own reading of it)."""
    import papermill

    return set(papermill.inspect_notebook(str(path)))


# ---------------------------------------------------------------------- run folders
def _folder_problem(flag: str, path: Path, exc: OSError) -> NotebookRunError:
    """One sentence for a folder that cannot be created; exit 2 when the path runs through a file."""
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
        where = "is a file" if blocker == path else f"runs through the file {blocker}"
        return NotebookRunError(f"{flag} {path}: {where}, not a folder; pass a folder path")
    return NotebookRunError(f"{flag} {path}: cannot create this folder ({exc.strerror or exc})", exit_code=1)


def _unwritable(flag: str, path: Path, reason: str) -> NotebookRunError:
    return NotebookRunError(
        f"{flag} {path}: cannot write into this folder ({reason}); choose a writable folder", exit_code=1
    )


def new_run_dir(root: str | os.PathLike, flag: str = "--outputs-root") -> Path:
    """Create and return `root/run-NNN`, one past the highest existing number (never reused)."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        numbers = [int(m.group(1)) for p in root.iterdir() if (m := RUN_PATTERN.match(p.name))]
    except OSError as exc:
        raise _folder_problem(flag, root, exc) from None
    n = max(numbers, default=0) + 1
    while True:
        candidate = root / f"run-{n:03d}"
        try:
            candidate.mkdir()  # exclusive: a concurrent run takes the next number
        except FileExistsError:
            n += 1
            continue
        except OSError as exc:
            raise _folder_problem(flag, root, exc) from None
        refused = creation_refused(candidate)
        if refused:
            candidate.rmdir()
            raise _unwritable(flag, root, refused)
        return candidate


def claim_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create `path` for a run; refuse one that already holds anything (an earlier run)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotebookRunError(
            f"{flag} {path}: is a file, not a folder; choose a folder path that does "
            f"not exist yet, or leave --out out for run-NNN"
        )
    try:
        if path.is_dir() and any(path.iterdir()):
            raise NotebookRunError(
                f"{flag} {path}: already exists and is not an empty folder; an earlier "
                f"run is never overwritten; choose another --out or leave it out for run-NNN"
            )
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _folder_problem(flag, path, exc) from None
    # an existing empty folder on a read-only mount passes mkdir: found out here, before any
    # notebook runs, not when summary.json cannot be written at the end
    refused = creation_refused(path)
    if refused:
        if created:
            path.rmdir()
        raise _unwritable(flag, path, refused)
    return path


# ---------------------------------------------------------------------- kernel
def check_kernel() -> None:
    """Raise NotebookRunError unless this Python can start a notebook kernel."""
    import importlib.util

    if importlib.util.find_spec("ipykernel") is None:
        raise NotebookRunError(
            f"ipykernel is not installed for {sys.executable}; "
            f"`pip install -e .` installs it (or `pip install ipykernel`)"
        )


@contextlib.contextmanager
def kernel_environment(extra_env: dict[str, str] | None = None) -> Iterator[None]:
    """Run papermill with a `python3` kernelspec pinned to this interpreter and the headless flag."""
    check_kernel()
    with tempfile.TemporaryDirectory(prefix="dsv41-kernel-") as tmp:
        spec_dir = Path(tmp) / "kernels" / KERNEL_NAME
        spec_dir.mkdir(parents=True)
        # log level ERROR: the kernel's start-up warnings would interleave with the progress lines
        spec = {
            "argv": [
                sys.executable,
                "-m",
                "ipykernel_launcher",
                "-f",
                "{connection_file}",
                "--IPKernelApp.log_level=ERROR",
            ],
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
        env = {
            "JUPYTER_PATH": os.pathsep.join([tmp] + [p for p in [os.environ.get("JUPYTER_PATH")] if p]),
            "DSV41_HEADLESS": "1",
            **(extra_env or {}),
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# ---------------------------------------------------------------------- the papermill engine
_ENGINE_REGISTERED: list[str] = []


def _engine() -> str:
    """Register (once) the papermill engine the runner uses (`notebook_engine.py`) and return its name."""
    if not _ENGINE_REGISTERED:
        from .notebook_engine import register

        _ENGINE_REGISTERED.append(register())
    return _ENGINE_REGISTERED[0]


# ---------------------------------------------------------------------- running
@dataclass
class NotebookResult:
    name: str
    source: str
    executed: str | None  # None for a notebook that never started
    status: str = "pending"  # "ok" | "failed" | "interrupted" | "not run"
    duration_s: float = 0.0
    outputs: list[str] = field(default_factory=list)
    # the failing cell, or for "interrupted" the cell a signal stopped
    failed_cell: int | None = None  # index in the source notebook (what a person edits)
    failed_cell_executed: int | None = None  # index in the executed file (papermill adds cells)
    failed_cell_source: str | None = None  # first line of that cell
    error: str | None = None  # one line: "ExceptionName: message", or "interrupted by SIGINT"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _first_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[0].strip() if lines else ""


# Cells papermill adds to the executed notebook: its parameters, and the error banner and anchor.
_PAPERMILL_TAGS = ("injected-parameters", "papermill-error-cell-tag")


def _locate_failure(executed_path: Path, fallback_index: int | None) -> tuple[int | None, int | None, str | None]:
    """(source index, executed-file index, first source line) of the cell that failed or was stopped,
    read back from the executed notebook, where papermill marks each cell's status in its metadata."""
    import nbformat

    try:
        nb = nbformat.read(str(executed_path), as_version=4)
    except Exception:
        return None, fallback_index, None
    statuses = [c.get("metadata", {}).get("papermill", {}).get("status") for c in nb.cells]
    index = next((statuses.index(s) for s in (FAILED, INTERRUPTED, RUNNING) if s in statuses), None)
    if index is None:
        return None, fallback_index, None
    added_before = sum(1 for c in nb.cells[:index] if set(c.get("metadata", {}).get("tags", [])) & set(_PAPERMILL_TAGS))
    return index - added_before, index, _first_line(nb.cells[index].source)


def _files_under(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def run_notebook(
    path: Path, run_dir: Path, parameters: dict[str, Any], cell_timeout: int | None = None
) -> NotebookResult:
    """Execute one notebook into `run_dir`; never raises for a notebook's own failure.

    A signal (KeyboardInterrupt) is re-raised as RunInterrupted carrying `.result`, this notebook's
    entry with status "interrupted" and the cell that was running."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    executed = run_dir / path.name
    result = NotebookResult(name=path.stem, source=str(path), executed=path.name)
    start = time.perf_counter()
    before: set[str] = set()
    try:
        before = _files_under(run_dir)
        problem = parameters_cell_problem(path)
        if problem:
            result.status, result.error = "failed", problem
            return result
        # a parameter goes to the notebooks that declare it (`memory` means nothing to 01 and 02);
        # one that no notebook declares was refused before the run
        declared = declared_parameters(path) | {"output_dir"}
        own = {name: value for name, value in parameters.items() if name in declared}
        try:
            papermill.execute_notebook(
                str(path),
                str(executed),
                parameters=own,
                kernel_name=KERNEL_NAME,
                language="python",
                progress_bar=False,
                log_output=False,
                cwd=str(path.parent),
                start_timeout=120,
                execution_timeout=cell_timeout,
                engine_name=_engine(),
            )
            result.status = "ok"
        except PapermillExecutionError as exc:
            result.status = "failed"
            result.error = f"{exc.ename}: {_first_line(exc.evalue)}" if exc.evalue else exc.ename
            (result.failed_cell, result.failed_cell_executed, result.failed_cell_source) = _locate_failure(
                executed, exc.cell_index
            )
        except Exception as exc:  # timeouts, a dead kernel, an unreadable notebook
            result.status = "failed"
            result.error = f"{type(exc).__name__}: {_first_line(str(exc))}"
            if executed.exists():
                (result.failed_cell, result.failed_cell_executed, result.failed_cell_source) = _locate_failure(
                    executed, None
                )
        result.duration_s = round(time.perf_counter() - start, 2)
        result.outputs = sorted(_files_under(run_dir) - before - {path.name})
        return result
    except KeyboardInterrupt as exc:
        stop = as_interrupt(exc)
        result.status, result.error = "interrupted", f"interrupted by {stop.signal_name}"
        if executed.exists():
            (result.failed_cell, result.failed_cell_executed, result.failed_cell_source) = _locate_failure(
                executed, None
            )
        else:
            result.executed = None
        result.duration_s = round(time.perf_counter() - start, 2)
        result.outputs = sorted(_files_under(run_dir) - before - {path.name})
        stop.result = result
        raise stop from None


def _progress_line(tag: str, result: NotebookResult) -> str:
    if result.status == "ok":
        return f"{tag} ok in {result.duration_s:.1f} s, {len(result.outputs)} files"
    where = f" at cell {result.failed_cell}" if result.failed_cell is not None else ""
    code = f" ({result.failed_cell_source})" if result.failed_cell_source else ""
    verdict = "INTERRUPTED" if result.status == "interrupted" else "FAILED"
    return f"{tag} {verdict}{where}{code} after {result.duration_s:.1f} s: {result.error}"


def _summary(
    run_dir: Path,
    notebooks: list[Path],
    parameters: dict[str, Any],
    results: list[NotebookResult],
    duration_s: float,
    stop: RunInterrupted | None = None,
) -> dict[str, Any]:
    """summary.json's content; after a stop, the notebooks without a result are "not run"."""
    done = {r.source for r in results}
    entries = results + [
        NotebookResult(name=p.stem, source=str(p), executed=None, status="not run")
        for p in notebooks
        if str(p) not in done
    ]
    stopped = next((r for r in results if r.status == "interrupted"), None)
    failed = sum(r.status == "failed" for r in entries)
    return {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "notebooks_dir": str(notebooks[0].parent.resolve()) if notebooks else None,
        "parameters": parameters,
        "status": "interrupted" if stop is not None else "failed" if failed else "ok",
        "interrupted": None
        if stop is None
        else {
            "signal": stop.signal_name,
            "notebook": stopped.name if stopped else None,  # None: it stopped between notebooks
            "cell": stopped.failed_cell if stopped else None,
            "cell_executed": stopped.failed_cell_executed if stopped else None,
            "cell_source": stopped.failed_cell_source if stopped else None,
        },
        "ok": stop is None and all(r.status == "ok" for r in entries),
        "n_ok": sum(r.status == "ok" for r in entries),
        "n_failed": failed,
        "n_interrupted": sum(r.status == "interrupted" for r in entries),
        "n_not_run": sum(r.status == "not run" for r in entries),
        "duration_s": round(duration_s, 2),
        "notebooks": [r.as_dict() for r in entries],
    }


def _write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write summary.json whole (a temporary file renamed over it), so it is never half written.
    Where the folder refuses it (removed, made read-only or full during the run) the summary goes
    to stdout instead, so it is not lost, and a NotebookRunError (exit 1) says so."""
    tmp = run_dir / f".{SUMMARY_NAME}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, run_dir / SUMMARY_NAME)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        print(json.dumps(summary, indent=2), flush=True)
        raise NotebookRunError(
            f"{run_dir / SUMMARY_NAME}: cannot be written ({exc.strerror or exc}); the summary "
            f"is printed on stdout instead",
            exit_code=1,
        ) from None


def run_notebooks(
    notebooks: list[Path], run_dir: Path, parameters: dict[str, Any], cell_timeout: int | None = None, progress=None
) -> dict[str, Any]:
    """Execute `notebooks` in order into `run_dir` and write `summary.json`; returns the summary.
    A progress line per notebook goes to `progress` (default: stderr).

    On SIGINT or SIGTERM (RunInterrupted under `stop_on_signals`, or Python's own KeyboardInterrupt)
    it writes summary.json with status "interrupted", then raises RunInterrupted with `.summary`."""
    progress = sys.stderr if progress is None else progress  # the stderr of the call, not of the import
    run_dir = Path(run_dir).resolve()
    parameters = {**parameters, "output_dir": str(run_dir)}
    results: list[NotebookResult] = []
    started = time.perf_counter()
    stop = None
    try:
        with kernel_environment():
            for i, path in enumerate(notebooks, 1):
                tag = f"[{i}/{len(notebooks)}] {path.stem}"
                print(f"{tag} ...", file=progress, flush=True)
                try:
                    result = run_notebook(path, run_dir, parameters, cell_timeout)
                except RunInterrupted as exc:
                    if getattr(exc, "result", None) is not None:
                        results.append(exc.result)
                        print(_progress_line(tag, exc.result), file=progress, flush=True)
                    raise
                results.append(result)
                print(_progress_line(tag, result), file=progress, flush=True)
    except KeyboardInterrupt as exc:
        stop = as_interrupt(exc)
    summary = _summary(run_dir, notebooks, parameters, results, time.perf_counter() - started, stop)
    _write_summary(run_dir, summary)
    if stop is not None:
        stop.summary = summary
        raise stop from None
    return summary


# ---------------------------------------------------------------------- CLI
# Python's spellings of JSON's three literals: a notebook user writes False as often as false.
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}
# The standard parameters whose values are text whatever they look like (a prompt "42" is text).
_TEXT_PARAMETERS = ("checkpoint", "prompt", "device")


def parse_value(name: str, text: str) -> Any:
    """`-p NAME VALUE` -> the value: text for the text parameters, else JSON when it parses
    (numbers, true/false/null, lists, quoted strings) or one of Python's True/False/None, else the
    text. `smoke` must come out a boolean: the string "False" would turn smoke mode on."""
    if name in _TEXT_PARAMETERS:
        return text
    if text.strip() in _PYTHON_LITERALS:
        value = _PYTHON_LITERALS[text.strip()]
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
    if name == "smoke" and not isinstance(value, bool):
        raise NotebookRunError(f"-p smoke takes true or false, got {text!r}")
    return value


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 notebooks",
        description=(
            "Execute every numbered notebook (NN_*.ipynb) with papermill into a new run folder "
            "(outputs/run-NNN, never overwritten): executed notebooks, figures, JSON sidecars and "
            "summary.json. Defaults run on the embedded miniature. SIGINT or SIGTERM stops the run "
            "and still writes summary.json (status interrupted); the exit code is then 130 or 143."
        ),
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded miniature)")
    parser.add_argument(
        "--out", metavar="DIR", help="run folder to create (must not exist or be empty); default outputs/run-NNN"
    )
    parser.add_argument(
        "--outputs-root", metavar="DIR", default="outputs", help="where run-NNN folders go (default: ./outputs)"
    )
    parser.add_argument("--notebooks", metavar="DIR", help="notebooks folder (default: the repository's notebooks/)")
    parser.add_argument(
        "--only",
        metavar="NAMES",
        action="append",
        default=[],
        help="comma-separated notebook names or number prefixes, e.g. 01,02_engram_hashing",
    )
    parser.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        metavar=("NAME", "VALUE"),
        action="append",
        default=[],
        help="pass a parameter to every notebook; VALUE is read as JSON (or Python's True, False, "
        "None) when it parses, else as text; checkpoint, prompt and device are always text, "
        "smoke must be true or false",
    )
    parser.add_argument(
        "--memory",
        type=memory_size,
        metavar="SIZE",
        help="a memory budget for each notebook's kernel, e.g. 20GiB: its models get the `memory` "
        f"parameter, this less {KERNEL_ALLOWANCE >> 30} GiB for the kernel's figures, traces and caches (routed "
        "experts read from disk into the pool that leaves); the way to run the notebooks on the "
        "released checkpoint on a 24-32 GB machine",
    )
    parser.add_argument(
        "--cell-timeout",
        type=whole_number(1, MAX_CELL_TIMEOUT_S, "seconds"),
        metavar="SECONDS",
        help=f"fail a cell that runs longer than this: a whole number of seconds from 1 to "
        f"{MAX_CELL_TIMEOUT_S} (default: no limit)",
    )
    args = parser.parse_args(argv)

    run_dir: Path | None = None
    notebooks: list[Path] = []
    with stop_on_signals():
        try:
            only = [name.strip() for group in args.only for name in group.split(",") if name.strip()]
            notebooks = find_notebooks(args.notebooks or default_notebooks_dir(), only if args.only else None)
            parameters: dict[str, Any] = {}
            if args.checkpoint:
                if not os.path.isdir(args.checkpoint):
                    raise NotebookRunError(f"--checkpoint {args.checkpoint}: no such directory")
                parameters["checkpoint"] = os.path.abspath(args.checkpoint)
            if args.memory is not None:
                parameters["memory"] = model_budget(args.memory)
                print(
                    f"dsv41 notebooks: --memory {args.memory / 2**30:.2f} GiB per kernel: its models get "
                    f"{parameters['memory'] / 2**30:.2f} GiB, {KERNEL_ALLOWANCE / 2**30:.2f} GiB kept for the "
                    f"kernel's figures, traces and caches",
                    file=sys.stderr,
                )
            for name, value in args.parameter:
                if name == "output_dir":
                    raise NotebookRunError("-p output_dir: the run folder is the output folder; use --out DIR")
                parameters[name] = parse_value(name, value)
            declared = set().union(*(declared_parameters(p) for p in notebooks))
            unknown = sorted(set(parameters) - declared)
            if unknown:
                raise NotebookRunError(
                    f"-p {', '.join(unknown)}: no notebook declares this parameter; "
                    f"they declare {', '.join(sorted(declared))}"
                )
            check_kernel()  # before a run folder exists
            run_dir = claim_out_dir(args.out) if args.out else new_run_dir(args.outputs_root)
            summary = run_notebooks(notebooks, run_dir, parameters, args.cell_timeout)
            SIGNALS.finished = True
        except NotebookRunError as exc:
            print(f"dsv41 notebooks: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt as exc:
            try:
                return _report_interrupt(as_interrupt(exc), run_dir, notebooks)
            except NotebookRunError as problem:  # summary.json could not be written
                print(f"dsv41 notebooks: {problem}", file=sys.stderr)
                return problem.exit_code
        verdict = "all ok" if summary["ok"] else f"{summary['n_failed']} failed"
        print(
            f"{summary['run_dir']}: {summary['n_ok']}/{len(summary['notebooks'])} notebooks ok ({verdict}); "
            f"summary in {SUMMARY_NAME}"
        )
    return 0 if summary["ok"] else 1


def _report_interrupt(stop: RunInterrupted, run_dir: Path | None, notebooks: list[Path]) -> int:
    """The one sentence for a stopped run (writing summary.json if the run stopped before
    run_notebooks could); returns the exit code, 128 + the signal."""
    summary = getattr(stop, "summary", None)
    if summary is None and run_dir is not None:
        written = run_dir / SUMMARY_NAME
        try:  # the run had just finished and written it
            summary = json.loads(written.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            summary = _summary(run_dir.resolve(), notebooks, {}, [], 0.0, stop)
            _write_summary(run_dir, summary)
    if summary is None:
        print(
            f"dsv41 notebooks: interrupted by {stop.signal_name} before any notebook ran; no run folder was created",
            file=sys.stderr,
        )
        return stop.exit_code
    where = summary.get("interrupted")
    if where and where["notebook"]:
        cell = f" at cell {where['cell']} ({where['cell_source']})" if where["cell"] is not None else ""
        at = f" while running {where['notebook']}{cell}"
    else:
        at = " between notebooks" if where else " after the last notebook"
    print(
        f"dsv41 notebooks: interrupted by {stop.signal_name}{at}; {summary['n_ok']} of "
        f"{len(summary['notebooks'])} notebooks finished ok; summary in "
        f"{Path(summary['run_dir']) / SUMMARY_NAME}",
        file=sys.stderr,
    )
    return stop.exit_code
