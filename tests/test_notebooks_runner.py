"""`dsv41 notebooks` when a run does not go to its end: a signal (SIGINT, SIGTERM) stops it, a cell
runs past --cell-timeout, or an argument cannot be used. Throwaway notebooks only; each test starts
at most one kernel and is bounded in time."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from conftest import write_throwaway_notebook

from dsv41.app.cli import main as dsv41_main

REPO = Path(__file__).resolve().parent.parent


# source cells: 0 markdown, 1 parameters, 2 "x = 1", 3 writes the kernel's pid, 4 sleeps, 5 never runs
SLEEPY_CELLS = (
    "x = 1",
    "import os, time\nopen(os.path.join(output_dir, 'kernel.pid'), 'w').write(str(os.getpid()))",
    "time.sleep(300)  # the slow cell\nslept = True",
    "after = True",
)
SLOW_CELL = 4
# the executed file has papermill's injected-parameters cell after the parameters cell
SLOW_CELL_EXECUTED = SLOW_CELL + 1


@pytest.fixture(scope="module")
def sleepy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sleepy")
    write_throwaway_notebook(d / "01_sleepy.ipynb", *SLEEPY_CELLS)
    write_throwaway_notebook(d / "02_after.ipynb", "z = 3")
    return d


def _statuses(executed: Path) -> list[str | None]:
    nb = json.loads(executed.read_text(encoding="utf-8"))
    return [c["metadata"].get("papermill", {}).get("status") for c in nb["cells"]]


def _kernel_gone(pid: int) -> bool:
    """The kernel process has exited (a zombie waiting for a reaper counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# ---------------------------------------------------------------------- signals
@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_leaves_a_truthful_run_folder(sleepy_dir, tmp_path, signum, code):
    """Reproduces: SIGINT left no summary.json and an executed notebook whose papermill metadata said
    every cell "completed" although the run stopped in the middle of cell 4."""
    run = tmp_path / "run"
    executed = run / "01_sleepy.ipynb"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv41", "notebooks", "--notebooks", str(sleepy_dir), "--out", str(run)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # wait until the slow cell is running (papermill saves the file at each cell start)
            assert proc.poll() is None, f"the run ended on its own: {proc.communicate()}"
            assert time.monotonic() < deadline, "the slow cell never started"
            try:
                if _statuses(executed)[SLOW_CELL_EXECUTED] == "running" and (run / "kernel.pid").is_file():
                    break
            except (FileNotFoundError, json.JSONDecodeError, IndexError, KeyError):
                pass  # not written yet, or caught mid-write
            time.sleep(0.2)
        kernel_pid = int((run / "kernel.pid").read_text())
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert proc.returncode == code, (out, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("dsv41 notebooks: interrupted by " + signal.Signals(signum).name), err
    assert "01_sleepy" in last and "summary.json" in last

    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["ok"] is False
    stopped = summary["interrupted"]
    assert stopped["signal"] == signal.Signals(signum).name
    assert stopped["notebook"] == "01_sleepy"
    assert stopped["cell"] == SLOW_CELL and stopped["cell_source"] == "time.sleep(300)  # the slow cell"
    first, second = summary["notebooks"]
    assert first["status"] == "interrupted" and first["failed_cell"] == SLOW_CELL
    assert first["failed_cell_executed"] == SLOW_CELL_EXECUTED
    assert second["name"] == "02_after" and second["status"] == "not run"
    assert not (run / "02_after.ipynb").exists()
    assert (summary["n_ok"], summary["n_failed"], summary["n_interrupted"], summary["n_not_run"]) == (0, 0, 1, 1)

    # the saved copy says what ran: the cells before ran, the slow one was stopped, the rest did not run
    statuses = _statuses(executed)
    assert statuses[:SLOW_CELL_EXECUTED] == ["completed"] * SLOW_CELL_EXECUTED
    assert statuses[SLOW_CELL_EXECUTED] == "interrupted"
    assert statuses[SLOW_CELL_EXECUTED + 1 :] == ["pending"]
    nb = nbformat.read(str(executed), as_version=4)
    assert nb.cells[-1].execution_count is None and not nb.cells[-1].outputs

    deadline = time.monotonic() + 15
    while not _kernel_gone(kernel_pid):
        assert time.monotonic() < deadline, f"the kernel {kernel_pid} outlived the run"
        time.sleep(0.2)


# ---------------------------------------------------------------------- cell timeout
@pytest.mark.slow
def test_cell_timeout_names_the_cell(sleepy_dir, tmp_path, capfd):
    """Reproduces: a cell timeout's failed_cell was null (papermill marked every cell completed)."""
    run = tmp_path / "run"
    assert dsv41_main(["notebooks", "--notebooks", str(sleepy_dir), "--out", str(run), "--cell-timeout", "2"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err  # nor the kernel's own, shut down while busy
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed"
    sleepy, after = summary["notebooks"]
    assert sleepy["status"] == "failed" and sleepy["error"].startswith("CellTimeoutError")
    assert sleepy["failed_cell"] == SLOW_CELL and sleepy["failed_cell_executed"] == SLOW_CELL_EXECUTED
    assert sleepy["failed_cell_source"] == "time.sleep(300)  # the slow cell"
    assert f"FAILED at cell {SLOW_CELL} (time.sleep(300)  # the slow cell)" in err
    assert after["status"] == "ok"  # a timeout stops its own notebook only
    statuses = _statuses(run / "01_sleepy.ipynb")
    assert statuses[SLOW_CELL_EXECUTED] == "failed" and statuses[SLOW_CELL_EXECUTED + 1 :] == ["pending"]


# ---------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("value", ["0.5", "nan", "-1", "0", "inf", "1e3", "86401", "ten"])
def test_cell_timeout_must_be_a_whole_number_of_seconds(sleepy_dir, tmp_path, capsys, value):
    """Reproduces: 0.5 failed every notebook with a TraitError, nan and -1 ran with no usable limit."""
    with pytest.raises(SystemExit) as stop:
        dsv41_main(
            ["notebooks", "--notebooks", str(sleepy_dir), "--outputs-root", str(tmp_path), "--cell-timeout", value]
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--cell-timeout" in err and "whole number of seconds from 1 to 86,400" in err, err
    assert not any(tmp_path.iterdir()), "a refused run still created a folder"


def test_cell_timeout_help_states_the_rule(capsys):
    with pytest.raises(SystemExit):
        dsv41_main(["notebooks", "--help"])
    assert "1 to 86400" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "flag, where",
    [("--outputs-root", "file"), ("--out", "file"), ("--outputs-root", "under a file"), ("--out", "under a file")],
)
def test_output_folder_on_a_file_is_one_sentence(sleepy_dir, tmp_path, capsys, flag, where):
    """Reproduces: --outputs-root FILE was a FileExistsError traceback, --out FILE/x a NotADirectoryError."""
    file = tmp_path / "a-file"
    file.write_text("not a folder\n")
    target = file if where == "file" else file / "run"
    assert dsv41_main(["notebooks", "--notebooks", str(sleepy_dir), flag, str(target)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dsv41 notebooks: {flag} {target}"), err
    assert "not a folder" in lines[0] or "is a file" in lines[0], err
    assert file.read_text() == "not a folder\n"
