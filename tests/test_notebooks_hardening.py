"""`dsv41 notebooks` on output folders it cannot write and on selections that name nothing: one
sentence each, nothing run, nothing lost. Throwaway notebooks; no kernel starts.

Tests run as root, where mode bits stop no write, so a read-only mount is simulated
(`refuse_writes_under`): every way the runner and papermill create, open for writing, make or
rename something under the folder fails with EROFS, as the kernel answers on a read-only mount."""

import builtins
import errno
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from conftest import write_throwaway_notebook

from dsv41.app import notebooks as runner
from dsv41.app.cli import main as dsv41_main
from dsv41.app.notebook_signals import SUMMARY_NAME, RunInterrupted


def refuse_writes_under(monkeypatch, folder) -> None:
    """From now on (this test), `folder` and everything under it behave as on a read-only mount."""
    folder = os.path.abspath(folder)

    def under(path) -> bool:
        if isinstance(path, int):  # a file descriptor: opened before, not a new name
            return False
        path = os.path.abspath(os.fsdecode(os.fspath(path)))
        return path == folder or path.startswith(folder + os.sep)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open
    real_mkdir, real_replace, real_rename = os.mkdir, os.replace, os.rename

    def checked_open(real):
        def fake(file, mode="r", *args, **kwargs):
            if under(file) and any(c in mode for c in "wax+"):
                refuse(file)
            return real(file, mode, *args, **kwargs)

        return fake

    def fake_os_open(path, flags, *args, **kwargs):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if under(path):
            if os.path.lexists(path):  # the kernel answers EEXIST before EROFS
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def moving(real):
        def fake(src, dst, *args, **kwargs):
            if under(src) or under(dst):
                refuse(dst)
            return real(src, dst, *args, **kwargs)

        return fake

    monkeypatch.setattr(builtins, "open", checked_open(real_open))
    monkeypatch.setattr(io, "open", checked_open(real_io_open))
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "replace", moving(real_replace))
    monkeypatch.setattr(os, "rename", moving(real_rename))


def test_the_simulated_mount_refuses_what_a_read_only_mount_refuses(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "kept.txt").write_text("here before\n")
    refuse_writes_under(monkeypatch, ro)
    for attempt in (
        lambda: (ro / "new.txt").write_text("x"),
        lambda: open(ro / "kept.txt", "a"),
        lambda: (ro / "sub").mkdir(),
        lambda: os.replace(ro / "kept.txt", ro / "moved.txt"),
        lambda: tempfile.mkstemp(dir=ro),
    ):
        with pytest.raises(OSError) as refused:
            attempt()
        assert refused.value.errno == errno.EROFS
    with pytest.raises(FileExistsError):
        ro.mkdir()
    assert (ro / "kept.txt").read_text() == "here before\n" and os.listdir(ro) == ["kept.txt"]
    (tmp_path / "beside.txt").write_text("x")  # outside the folder nothing changes


@pytest.fixture(scope="module")
def two_notebooks(tmp_path_factory):
    d = tmp_path_factory.mktemp("two")
    write_throwaway_notebook(d / "01_first.ipynb", "x = 1")
    write_throwaway_notebook(d / "02_second.ipynb", "y = 2")
    return d


@pytest.fixture
def no_run(monkeypatch):
    """The run itself must not be reached: a refusal comes before any notebook starts."""

    def reached(*args, **kwargs):
        raise AssertionError("a notebook run started")

    monkeypatch.setattr(runner, "run_notebooks", reached)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------- read-only output folders
@pytest.mark.parametrize("flag, target", [("--out", "ro"), ("--out", "ro/new"), ("--outputs-root", "ro")])
def test_an_output_folder_on_a_read_only_mount_is_one_sentence(
    two_notebooks, tmp_path, monkeypatch, capsys, no_run, flag, target
):
    """Reproduces: `--out` on an existing empty folder of a read-only mount ran every notebook and
    ended in an OSError traceback from summary.json, with no summary anywhere."""
    ro = tmp_path / "ro"
    ro.mkdir()
    refuse_writes_under(monkeypatch, ro)
    target = tmp_path / target
    code = dsv41_main(["notebooks", "--notebooks", str(two_notebooks), flag, str(target)])
    line = _one_line(capsys.readouterr().err)
    assert code == 1
    assert line.startswith(f"dsv41 notebooks: {flag} ") and os.strerror(errno.EROFS) in line, line
    assert os.listdir(ro) == []


def test_a_folder_that_refuses_files_is_found_before_the_run(two_notebooks, tmp_path, monkeypatch, capsys, no_run):
    """A folder that takes a new folder but no file in it (some file systems do) is refused too, and
    the run folder made for it is removed again."""
    root = tmp_path / "outputs"
    root.mkdir()
    real = tempfile.mkstemp

    def refusing(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).parent == root:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refusing)
    assert dsv41_main(["notebooks", "--notebooks", str(two_notebooks), "--outputs-root", str(root)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"--outputs-root {root}: cannot write into this folder ({os.strerror(errno.EACCES)})" in line, line
    assert os.listdir(root) == []


def test_a_summary_that_cannot_be_written_is_printed(two_notebooks, tmp_path, monkeypatch, capsys):
    """Reproduces: a run folder that became unwritable during the run lost the summary in an
    OSError traceback; now it is printed on stdout and stderr says so in one line."""
    run = tmp_path / "run"

    def run_one(path, run_dir, parameters, cell_timeout=None):
        refuse_writes_under(monkeypatch, run_dir)  # the mount turns read-only during the run
        return runner.NotebookResult(name=path.stem, source=str(path), executed=path.name, status="ok", duration_s=0.5)

    monkeypatch.setattr(runner, "run_notebook", run_one)
    assert dsv41_main(["notebooks", "--notebooks", str(two_notebooks), "--out", str(run)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "[2/2] 02_second ok" in err, err
    line = err.strip().splitlines()[-1]
    assert line == (
        f"dsv41 notebooks: {run.resolve() / SUMMARY_NAME}: cannot be written "
        f"({os.strerror(errno.EROFS)}); the summary is printed on stdout instead"
    )
    summary = json.loads(out)
    assert summary["ok"] is True and [n["name"] for n in summary["notebooks"]] == ["01_first", "02_second"]
    assert os.listdir(run) == []  # no temporary file left behind


# ---------------------------------------------------------------------- selections
@pytest.mark.parametrize("only", [[",,,"], [""], [" , "], [",", ",,"]])
def test_a_selection_of_nothing_is_refused(two_notebooks, tmp_path, capsys, no_run, only):
    """Reproduces: `--only ",,,"` ran every notebook."""
    argv = ["notebooks", "--notebooks", str(two_notebooks), "--outputs-root", str(tmp_path)]
    code = dsv41_main(argv + [arg for value in only for arg in ("--only", value)])
    line = _one_line(capsys.readouterr().err)
    names = [p.stem for p in runner.find_notebooks(two_notebooks)]
    assert code == 2 and line.startswith("dsv41 notebooks: --only names no notebook"), line
    assert ", ".join(names) in line
    assert not any(tmp_path.iterdir())
    with pytest.raises(runner.NotebookRunError, match="names no notebook"):
        runner.find_notebooks(two_notebooks, [])


def test_unknown_names_are_refused_naming_the_valid_ones(two_notebooks, tmp_path, capsys, no_run):
    argv = ["notebooks", "--notebooks", str(two_notebooks), "--outputs-root", str(tmp_path)]
    assert dsv41_main(argv + ["--only", "01,nine,*"]) == 2
    line = _one_line(capsys.readouterr().err)
    names = [p.stem for p in runner.find_notebooks(two_notebooks)]
    assert line == f"dsv41 notebooks: --only nine, *: no such notebook; there are {', '.join(names)}"
    assert not any(tmp_path.iterdir())


def test_names_around_commas_may_carry_spaces(two_notebooks):
    """Reproduces: `--only "01, 02"` refused " 02" as no such notebook."""
    chosen = runner.find_notebooks(two_notebooks, [" 02 ", "01_first.ipynb"])
    assert [p.stem for p in chosen] == ["01_first", "02_second"]


def test_a_parameter_goes_only_to_the_notebooks_that_declare_it(tmp_path, monkeypatch):
    """`--memory` sets `memory`, which 01 (header-only) does not declare: papermill would warn of
    an unknown parameter there, so 01 is not handed it and 03 is."""
    import papermill

    from dsv41.app import notebooks as nbmod

    handed = {}

    def record(path, executed, parameters=None, **kw):
        handed[os.path.basename(path)] = dict(parameters)
        raise KeyboardInterrupt  # stop right after the hand-over; nothing runs

    monkeypatch.setattr(papermill, "execute_notebook", record)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("01_audit.ipynb", "03_csa2_modes.ipynb"):
        path = nbmod.default_notebooks_dir() / name
        with pytest.raises(RunInterrupted):  # the stub's KeyboardInterrupt, as run_notebook re-raises it
            nbmod.run_notebook(path, run_dir, {"memory": 1 << 34, "smoke": True, "output_dir": str(run_dir)})
    assert "memory" not in handed["01_audit.ipynb"] and handed["01_audit.ipynb"]["smoke"] is True
    assert handed["03_csa2_modes.ipynb"]["memory"] == 1 << 34


def test_memory_is_the_kernels_budget_and_the_models_get_it_less_the_kernel_allowance(tmp_path, monkeypatch, capsys):
    """A notebook kernel at the released geometry went 1.55 GiB past the budget its model was given
    (figures, traces, a sibling's caches): `--memory` is the kernel's, and the models get it less
    KERNEL_ALLOWANCE; a budget the allowance eats whole is one sentence, before a run folder exists."""
    handed = {}

    def record(notebooks, run_dir, parameters, cell_timeout=None):
        handed.update(parameters)
        return {"ok": True, "n_ok": len(notebooks), "notebooks": [], "run_dir": str(run_dir), "n_failed": 0}

    monkeypatch.setattr(runner, "run_notebooks", record)
    monkeypatch.setattr(runner, "check_kernel", lambda: None)
    assert runner.cli_main(["--only", "03", "--memory", "20GiB", "--out", str(tmp_path / "run")]) == 0
    assert handed["memory"] == (20 << 30) - runner.KERNEL_ALLOWANCE
    assert "its models get 18.00 GiB" in capsys.readouterr().err

    out = tmp_path / "never"
    assert runner.cli_main(["--only", "03", "--memory", "2GiB", "--out", str(out)]) == 2
    assert "leaves nothing for the models" in capsys.readouterr().err
    assert not out.exists()
