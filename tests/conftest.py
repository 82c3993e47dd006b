"""Shared fixtures."""

import os
import shutil

import pytest

HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None


def native_levels() -> tuple[str, ...]:
    """Every instruction-set level this CPU can hold the native kernels to (lowest first): the
    kernel tests run each, so a machine with AVX-512 also runs the AVX2 CPU's and plain C's paths."""
    from dsv41.kernels.native import runnable_isa_levels

    return runnable_isa_levels()


@pytest.fixture(params=native_levels())
def native_level(request):
    """The test runs with the native kernels held to one level (`native.forced_isa`); yields the
    level. Without a C compiler the native kernels cannot be built, and its runs skip."""
    from dsv41.kernels import native

    if not HAVE_CC:
        pytest.skip("no C compiler on PATH: the native kernels cannot be built here")
    with native.forced_isa(request.param):
        yield request.param


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one intra-op thread: its tensors are tiny, and on a shared two-core machine
    extra threads only wait for each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The parity and reference fixtures run their tests on both checkpoints in the release format
# that the package knows: the random tiny one and the trained miniature (its routing, indexer
# selections and draft proposals are not noise, so ties and acceptances fall elsewhere).
CHECKPOINTS = ("tiny", "miniature")


@pytest.fixture(scope="module", params=CHECKPOINTS)
def parity(request):
    """A checkpoint under Numerics.parity(), one per test module and checkpoint."""
    import dsv41
    from dsv41.core.numerics import Numerics

    return dsv41.load(request.getfixturevalue(f"{request.param}_checkpoint"), quiet=True, numerics=Numerics.parity())


@pytest.fixture(scope="module", params=CHECKPOINTS)
def reference(request):
    """A checkpoint under the reference's arithmetic (the default), one per test module and checkpoint."""
    import dsv41

    return dsv41.load(request.getfixturevalue(f"{request.param}_checkpoint"), quiet=True)


@pytest.fixture(scope="session")
def miniature_checkpoint() -> str:
    """The trained miniature the package ships (`dsv41/data/miniature`), checked against its manifest."""
    from dsv41.checkpoint.miniature import check_files, packaged_folder, read_manifest

    folder = packaged_folder()
    manifest = read_manifest(folder)
    if manifest is None:
        pytest.skip("this checkout's package holds no trained miniature (dsv41/data/miniature)")
    check_files(folder, manifest)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The embedded default checkpoint (seed 0), written once per test session into a pytest temp
    folder (never the user cache). Treat it as read-only: other tests share it."""
    from dsv41.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "checkpoint", seed=0, progress=False)


# The numbered notebooks in the groups the tests run them in: one smoke run per group, shared by
# that group's tests on one test worker. Every kernel runs on one torch thread, as in the browser
# test's JupyterLab: two threads on two shared cores run the tiny model several times slower.
NOTEBOOK_GROUPS = ("01,02", "03,04", "05", "06", "07", "08", "09")
SMOKE_THREADS = 1


def group_of(notebook: str) -> str:
    """The group of notebook `notebook` ("04_candidate_blocks" or "04")."""
    number = notebook[:2]
    return next(group for group in NOTEBOOK_GROUPS if number in group.split(","))


def notebook_group(only: str):
    """The mark that keeps the tests of one notebook group on one test worker under
    `pytest -n N --dist loadgroup` (the README's test command), so they share its smoke run."""
    return pytest.mark.xdist_group(f"notebooks-{only}")


# (notebooks, threads) -> (run folder, summary) of the session's first smoke run of them
_SMOKE_RUNS: dict = {}
# notebook number ("04") -> a copy of what the browser test's run of it exported, on this worker
BROWSER_EXPORTS: dict = {}


def run_notebooks_smoke(
    tmp_path_factory,
    checkpoint,
    only: str,
    threads: int | None = SMOKE_THREADS,
    *,
    fresh: bool = False,
    parameters: dict | None = None,
):
    """Execute notebooks `only` ("01,02") in smoke mode on `checkpoint` into a fresh run folder and
    fail the calling fixture, naming the failing cells, unless all of them ran clean. Returns the
    run folder and its summary. `threads` pins the kernels' torch threads (OMP_NUM_THREADS);
    `parameters` {name: text} go in as `-p NAME VALUE` beside smoke. The session's first run of
    the same notebooks is reused unless `fresh` (a second, independent run)."""
    key = (only, threads, str(checkpoint), tuple(sorted((parameters or {}).items())))
    if not fresh and key in _SMOKE_RUNS:
        return _SMOKE_RUNS[key]
    run_and_summary = _run_smoke(tmp_path_factory, checkpoint, only, threads, parameters or {})
    _SMOKE_RUNS.setdefault(key, run_and_summary)
    return run_and_summary


def second_run_exports(tmp_path_factory, checkpoint, only: str) -> dict:
    """A second run of notebooks `only`, independent of the first (other kernel processes): for
    each notebook number, the folder holding what it exported. The browser test's run of a
    notebook is used where it ran on this worker (JupyterLab's kernel, with the smoke run's
    parameters); the others run again under papermill."""
    numbers = only.split(",")
    exports = {n: BROWSER_EXPORTS[n] for n in numbers if n in BROWSER_EXPORTS}
    rest = [n for n in numbers if n not in exports]
    if rest:
        run, _ = run_notebooks_smoke(tmp_path_factory, checkpoint, ",".join(rest), fresh=True)
        exports.update({n: run for n in rest})
    return exports


def _run_smoke(tmp_path_factory, checkpoint, only: str, threads, parameters: dict):
    import json

    from dsv41.app.cli import main as dsv41_main

    run = tmp_path_factory.mktemp(f"smoke-{only.replace(',', '-')}") / "run"
    with pytest.MonkeyPatch.context() as mp:
        if threads is not None:
            mp.setenv("OMP_NUM_THREADS", str(threads))
        code = dsv41_main(
            [
                "notebooks",
                "--only",
                only,
                "--out",
                str(run),
                "--checkpoint",
                str(checkpoint),
                "-p",
                "smoke",
                "true",
                *[v for kv in parameters.items() for v in ("-p", *kv)],
            ]
        )
    summary = json.loads((run / "summary.json").read_text())
    failures = [
        f"{n['name']} cell {n['failed_cell']}: {n['error']}" for n in summary["notebooks"] if n["status"] != "ok"
    ]
    assert code == 0 and not failures, failures
    return run, summary


def sidecar(run, name: str) -> dict:
    """A figure's or a notebook's JSON sidecar from a run folder."""
    import json

    return json.loads((run / f"{name}.json").read_text())


# The standard parameters cell of a throwaway test notebook
THROWAWAY_PARAMETERS = """checkpoint = None
prompt = "default prompt"
device = "cpu"
output_dir = "."
smoke = False"""


def write_throwaway_notebook(path, *cells, n_parameter_cells: int = 1) -> None:
    """A numbered-notebook-shaped file at `path`: a markdown title, the parameters cell(s), then
    one code cell per source in `cells`, with a python3 kernelspec."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    nb = new_notebook(cells=[new_markdown_cell("# a throwaway notebook")])
    for _ in range(n_parameter_cells):
        nb.cells.append(new_code_cell(THROWAWAY_PARAMETERS, metadata={"tags": ["parameters"]}))
    nb.cells += [new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
