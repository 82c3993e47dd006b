"""`dsv41 notebooks`: execute every numbered notebook with papermill into a fresh run folder.

A run folder (`outputs/run-001`, `run-002`, … or `--out DIR`) is never reused: it receives the
executed notebooks, the figures and sidecars they export (each notebook gets the folder as its
`output_dir` parameter) and `summary.json` with each notebook's status, duration and, on failure,
the failing cell and the error line. A failed notebook does not stop the others; the exit code is 1
when any failed, 2 for bad usage.

Kernel: the notebooks run in *this* Python. A private `python3` kernelspec pinned to sys.executable
is put first on JUPYTER_PATH for the run, so a fresh machine needs nothing registered and a user's
own `python3` kernel (possibly another interpreter without dsv41) is never picked by accident.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

NOTEBOOK_PATTERN = re.compile(r"^\d\d_[A-Za-z0-9_\-]+\.ipynb$")
RUN_PATTERN = re.compile(r"^run-(\d+)$")
KERNEL_NAME = "python3"
# The parameters every notebook declares in its one cell tagged `parameters`.
STANDARD_PARAMETERS = ("checkpoint", "prompt", "device", "output_dir", "smoke")
SUMMARY_NAME = "summary.json"


class NotebookRunError(Exception):
    """Bad usage or an unusable set-up: one sentence for a person, exit 2."""


# ---------------------------------------------------------------------- finding things
def default_notebooks_dir() -> Path:
    """The repository's notebooks/ (next to the package in an editable install), else ./notebooks."""
    beside_package = Path(__file__).resolve().parent.parent / "notebooks"
    return beside_package if beside_package.is_dir() else Path.cwd() / "notebooks"


def find_notebooks(directory: str | os.PathLike, only: list[str] | None = None) -> list[Path]:
    """The `NN_*.ipynb` files of `directory`, in order; `only` keeps those whose stem equals a name
    or starts with `name_` (so `01` selects `01_audit`)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NotebookRunError(f"{directory}: no such notebooks folder; pass --notebooks DIR")
    found = sorted(p for p in directory.iterdir() if NOTEBOOK_PATTERN.match(p.name) and p.is_file())
    if not found:
        raise NotebookRunError(f"{directory}: no numbered notebooks (NN_name.ipynb) in this folder")
    if not only:
        return found
    chosen, unknown = [], []
    for name in only:
        name = name.removesuffix(".ipynb")
        hits = [p for p in found if p.stem == name or p.stem.startswith(name + "_")]
        if not hits:
            unknown.append(name)
        chosen += [p for p in hits if p not in chosen]
    if unknown:
        raise NotebookRunError(f"--only {', '.join(unknown)}: no such notebook; there are "
                               f"{', '.join(p.stem for p in found)}")
    return sorted(chosen)


def parameters_cell_problem(path: Path) -> str | None:
    """None when the notebook has exactly one cell tagged `parameters`, else what is wrong."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        return (f"{path.name}: {len(tagged)} cells tagged 'parameters' (cells {tagged}); "
                f"a notebook needs exactly one")
    return None


def declared_parameters(path: Path) -> set[str]:
    """Names assigned in the notebook's `parameters` cell (papermill's own reading of it)."""
    import papermill

    return set(papermill.inspect_notebook(str(path)))


# ---------------------------------------------------------------------- run folders
def new_run_dir(root: str | os.PathLike) -> Path:
    """Create and return `root/run-NNN`, one past the highest existing number (never reused)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    numbers = [int(m.group(1)) for p in root.iterdir() if (m := RUN_PATTERN.match(p.name))]
    n = max(numbers, default=0) + 1
    while True:
        candidate = root / f"run-{n:03d}"
        try:
            candidate.mkdir()  # exclusive: a concurrent run takes the next number
            return candidate
        except FileExistsError:
            n += 1


def claim_out_dir(path: str | os.PathLike) -> Path:
    """Create `path` for a run; refuse one that already holds anything (an earlier run)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise NotebookRunError(f"{path}: already exists and is not an empty folder; an earlier run is "
                               f"never overwritten; choose another --out or leave it out for run-NNN")
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------- kernel
def check_kernel() -> None:
    """Raise NotebookRunError unless this Python can start a notebook kernel."""
    import importlib.util

    if importlib.util.find_spec("ipykernel") is None:
        raise NotebookRunError(f"ipykernel is not installed for {sys.executable}; "
                               f"`pip install -e .` installs it (or `pip install ipykernel`)")


@contextlib.contextmanager
def kernel_environment(extra_env: dict[str, str] | None = None) -> Iterator[None]:
    """Run papermill with a `python3` kernelspec pinned to this interpreter and the headless flag."""
    check_kernel()
    with tempfile.TemporaryDirectory(prefix="dsv41-kernel-") as tmp:
        spec_dir = Path(tmp) / "kernels" / KERNEL_NAME
        spec_dir.mkdir(parents=True)
        # log level ERROR: the kernel's start-up warnings would interleave with the progress lines
        spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                         "--IPKernelApp.log_level=ERROR"],
                "display_name": "Python 3 (ipykernel)", "language": "python"}
        (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
        env = {"JUPYTER_PATH": os.pathsep.join([tmp] + [p for p in [os.environ.get("JUPYTER_PATH")] if p]),
               "DSV41_HEADLESS": "1", **(extra_env or {})}
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


# ---------------------------------------------------------------------- running
@dataclass
class NotebookResult:
    name: str
    source: str
    executed: str
    status: str = "pending"  # "ok" | "failed"
    duration_s: float = 0.0
    outputs: list[str] = field(default_factory=list)
    failed_cell: int | None = None  # index in the source notebook (what a person edits)
    failed_cell_executed: int | None = None  # index in the executed file (papermill adds cells)
    failed_cell_source: str | None = None  # first line of that cell
    error: str | None = None  # one line: "ExceptionName: message"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _first_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[0].strip() if lines else ""


# Cells papermill adds to the executed notebook: its parameters, and the error banner and anchor.
_PAPERMILL_TAGS = ("injected-parameters", "papermill-error-cell-tag")


def _locate_failure(executed_path: Path, fallback_index: int | None) -> tuple[int | None, int | None, str | None]:
    """(source index, executed-file index, first source line) of the failing cell, read back from
    the executed notebook, where papermill marks each cell's status in its metadata."""
    import nbformat

    try:
        nb = nbformat.read(str(executed_path), as_version=4)
    except Exception:
        return None, fallback_index, None
    statuses = [c.get("metadata", {}).get("papermill", {}).get("status") for c in nb.cells]
    index = next((statuses.index(s) for s in ("failed", "running") if s in statuses), None)
    if index is None:
        return None, fallback_index, None
    added_before = sum(1 for c in nb.cells[:index]
                       if set(c.get("metadata", {}).get("tags", [])) & set(_PAPERMILL_TAGS))
    return index - added_before, index, _first_line(nb.cells[index].source)


def _files_under(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def run_notebook(path: Path, run_dir: Path, parameters: dict[str, Any],
                 cell_timeout: float | None = None) -> NotebookResult:
    """Execute one notebook into `run_dir`; never raises for a notebook's own failure."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    executed = run_dir / path.name
    result = NotebookResult(name=path.stem, source=str(path), executed=path.name)
    before = _files_under(run_dir)
    start = time.perf_counter()
    problem = parameters_cell_problem(path)
    if problem:
        result.status, result.error = "failed", problem
        return result
    try:
        papermill.execute_notebook(
            str(path), str(executed), parameters=parameters, kernel_name=KERNEL_NAME, language="python",
            progress_bar=False, log_output=False, cwd=str(path.parent), start_timeout=120,
            execution_timeout=cell_timeout)
        result.status = "ok"
    except PapermillExecutionError as exc:
        result.status = "failed"
        result.error = f"{exc.ename}: {_first_line(exc.evalue)}" if exc.evalue else exc.ename
        (result.failed_cell, result.failed_cell_executed,
         result.failed_cell_source) = _locate_failure(executed, exc.cell_index)
    except Exception as exc:  # timeouts, a dead kernel, an unreadable notebook
        result.status = "failed"
        result.error = f"{type(exc).__name__}: {_first_line(str(exc))}"
        if executed.exists():
            (result.failed_cell, result.failed_cell_executed,
             result.failed_cell_source) = _locate_failure(executed, None)
    result.duration_s = round(time.perf_counter() - start, 2)
    result.outputs = sorted(_files_under(run_dir) - before - {path.name})
    return result


def run_notebooks(notebooks: list[Path], run_dir: Path, parameters: dict[str, Any],
                  cell_timeout: float | None = None, progress=sys.stderr) -> dict[str, Any]:
    """Execute `notebooks` in order into `run_dir` and write `summary.json`; returns the summary."""
    run_dir = Path(run_dir).resolve()
    parameters = {**parameters, "output_dir": str(run_dir)}
    results = []
    started = time.perf_counter()
    with kernel_environment():
        for i, path in enumerate(notebooks, 1):
            tag = f"[{i}/{len(notebooks)}] {path.stem}"
            print(f"{tag} ...", file=progress, flush=True)
            result = run_notebook(path, run_dir, parameters, cell_timeout)
            if result.status == "ok":
                line = f"{tag} ok in {result.duration_s:.1f} s, {len(result.outputs)} files"
            else:
                where = f" at cell {result.failed_cell}" if result.failed_cell is not None else ""
                code = f" ({result.failed_cell_source})" if result.failed_cell_source else ""
                line = f"{tag} FAILED{where}{code} after {result.duration_s:.1f} s: {result.error}"
            print(line, file=progress, flush=True)
            results.append(result)
    summary = {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "notebooks_dir": str(notebooks[0].parent.resolve()) if notebooks else None,
        "parameters": parameters,
        "ok": all(r.status == "ok" for r in results),
        "n_ok": sum(r.status == "ok" for r in results),
        "n_failed": sum(r.status != "ok" for r in results),
        "duration_s": round(time.perf_counter() - started, 2),
        "notebooks": [r.as_dict() for r in results],
    }
    with open(run_dir / SUMMARY_NAME, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=False)
        f.write("\n")
    return summary


# ---------------------------------------------------------------------- CLI
def parse_value(text: str) -> Any:
    """A -p VALUE: JSON when it parses (numbers, true/false/null, lists, quoted strings), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 notebooks", description=(
        "Execute every numbered notebook (NN_*.ipynb) with papermill into a new run folder "
        "(outputs/run-NNN, never overwritten): executed notebooks, figures, JSON sidecars and "
        "summary.json. Defaults run on the embedded tiny checkpoint."))
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny checkpoint)")
    parser.add_argument("--out", metavar="DIR", help="run folder to create (must not exist or be empty); default outputs/run-NNN")
    parser.add_argument("--outputs-root", metavar="DIR", default="outputs", help="where run-NNN folders go (default: ./outputs)")
    parser.add_argument("--notebooks", metavar="DIR", help="notebooks folder (default: the repository's notebooks/)")
    parser.add_argument("--only", metavar="NAMES", action="append", default=[],
                        help="comma-separated notebook names or number prefixes, e.g. 01,02_engram_hashing")
    parser.add_argument("-p", "--parameter", nargs=2, metavar=("NAME", "VALUE"), action="append", default=[],
                        help="pass a parameter to every notebook; VALUE is read as JSON when it parses, else as text")
    parser.add_argument("--cell-timeout", type=float, metavar="SECONDS", help="fail a cell that runs longer than this")
    args = parser.parse_args(argv)

    try:
        only = [name for group in args.only for name in group.split(",") if name.strip()]
        notebooks = find_notebooks(args.notebooks or default_notebooks_dir(), only)
        parameters: dict[str, Any] = {}
        if args.checkpoint:
            if not os.path.isdir(args.checkpoint):
                raise NotebookRunError(f"--checkpoint {args.checkpoint}: no such directory")
            parameters["checkpoint"] = os.path.abspath(args.checkpoint)
        for name, value in args.parameter:
            if name == "output_dir":
                raise NotebookRunError("-p output_dir: the run folder is the output folder; use --out DIR")
            parameters[name] = parse_value(value)
        declared = set().union(*(declared_parameters(p) for p in notebooks))
        unknown = sorted(set(parameters) - declared)
        if unknown:
            raise NotebookRunError(f"-p {', '.join(unknown)}: no notebook declares this parameter; "
                                   f"they declare {', '.join(sorted(declared))}")
        check_kernel()  # before a run folder exists
        run_dir = claim_out_dir(args.out) if args.out else new_run_dir(args.outputs_root)
        summary = run_notebooks(notebooks, run_dir, parameters, args.cell_timeout)
    except NotebookRunError as exc:
        print(f"dsv41 notebooks: {exc}", file=sys.stderr)
        return 2
    verdict = "all ok" if summary["ok"] else f"{summary['n_failed']} failed"
    print(f"{summary['run_dir']}: {summary['n_ok']}/{len(summary['notebooks'])} notebooks ok ({verdict}); "
          f"summary in {SUMMARY_NAME}")
    return 0 if summary["ok"] else 1
