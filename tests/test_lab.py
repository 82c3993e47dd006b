"""`dsv41 lab`: the copy logic (prepare_lab and --dry-run, no server) and one short real start of
JupyterLab on a free port (polled until it answers with its token URL, then terminated; bounded
to 30 s)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dsv41.app import lab
from dsv41.app.cli import COMMANDS, main
from dsv41.app.notebooks import default_notebooks_dir, find_notebooks


def _notebook(text: str) -> str:
    return (
        json.dumps(
            {
                "cells": [{"cell_type": "markdown", "metadata": {}, "source": text}],
                "metadata": {},
                "nbformat": 4,
                "nbformat_minor": 5,
            },
            indent=1,
        )
        + "\n"
    )


@pytest.fixture
def source(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "01_first.ipynb").write_text(_notebook("one"))
    (src / "02_second.ipynb").write_text(_notebook("two"))
    (src / "notes.ipynb").write_text(_notebook("not numbered"))  # never copied
    return src


def _kinds(actions):
    return {a.name: a.kind for a in actions}


def _manifest(folder: Path) -> dict:
    return json.loads((folder / lab.MANIFEST_NAME).read_text())["notebooks"]


def test_first_run_copies_every_numbered_notebook_and_records_its_digest(tmp_path, source):
    work = tmp_path / "outputs" / "lab"
    actions = lab.prepare_lab(work, source)
    assert _kinds(actions) == {"01_first.ipynb": lab.COPIED, "02_second.ipynb": lab.COPIED}
    assert sorted(p.name for p in work.iterdir()) == [lab.MANIFEST_NAME, "01_first.ipynb", "02_second.ipynb"]
    for name in ("01_first.ipynb", "02_second.ipynb"):
        assert (work / name).read_bytes() == (source / name).read_bytes()
        assert _manifest(work)[name] == lab._sha256((source / name).read_bytes())
    assert _kinds(lab.prepare_lab(work, source)) == {"01_first.ipynb": lab.CURRENT, "02_second.ipynb": lab.CURRENT}


def test_an_edited_copy_is_kept_and_an_unedited_stale_one_is_updated(tmp_path, source):
    work = tmp_path / "lab"
    lab.prepare_lab(work, source)
    edited = _notebook("one, with my outputs")
    (work / "01_first.ipynb").write_text(edited)
    # the repository's notebooks change
    (source / "01_first.ipynb").write_text(_notebook("one, version 2"))
    (source / "02_second.ipynb").write_text(_notebook("two, version 2"))
    actions = {a.name: a for a in lab.prepare_lab(work, source)}
    assert actions["01_first.ipynb"].kind == lab.KEPT and "edited here" in actions["01_first.ipynb"].message
    assert "changed since" in actions["01_first.ipynb"].message
    assert actions["02_second.ipynb"].kind == lab.UPDATED
    assert (work / "01_first.ipynb").read_text() == edited  # never overwritten
    assert (work / "02_second.ipynb").read_text() == _notebook("two, version 2")
    # the manifest still holds what the lab wrote for the kept one, so it stays "edited"
    assert _manifest(work)["01_first.ipynb"] == lab._sha256(_notebook("one").encode())
    again = {a.name: a for a in lab.prepare_lab(work, source)}
    assert again["01_first.ipynb"].kind == lab.KEPT and again["02_second.ipynb"].kind == lab.CURRENT


def test_edited_with_the_source_unchanged_and_foreign_files(tmp_path, source):
    work = tmp_path / "lab"
    lab.prepare_lab(work, source)
    (work / "01_first.ipynb").write_text(_notebook("mine"))
    first = {a.name: a for a in lab.prepare_lab(work, source)}["01_first.ipynb"]
    assert first.kind == lab.KEPT and first.message == "kept 01_first.ipynb: edited here since dsv41 lab copied it"
    # a deleted copy comes back
    (work / "02_second.ipynb").unlink()
    assert _kinds(lab.prepare_lab(work, source))["02_second.ipynb"] == lab.COPIED
    # without a manifest a differing file was not the lab's: kept; an equal one is adopted
    (work / lab.MANIFEST_NAME).unlink()
    actions = {a.name: a for a in lab.prepare_lab(work, source)}
    assert (
        actions["01_first.ipynb"].kind == lab.KEPT and "not written by dsv41 lab" in actions["01_first.ipynb"].message
    )
    assert actions["02_second.ipynb"].kind == lab.CURRENT
    assert set(_manifest(work)) == {"02_second.ipynb"}
    # a damaged manifest counts as none
    (work / lab.MANIFEST_NAME).write_text("{not json")
    assert _kinds(lab.prepare_lab(work, source))["01_first.ipynb"] == lab.KEPT


def test_dry_run_decides_and_writes_nothing(tmp_path, source, capsys):
    work = tmp_path / "lab"
    actions = lab.prepare_lab(work, source, dry_run=True)
    assert _kinds(actions) == {"01_first.ipynb": lab.COPIED, "02_second.ipynb": lab.COPIED}
    assert actions[0].message == "would copy 01_first.ipynb"
    assert not work.exists()
    assert (
        main(["lab", "--dir", str(work), "--notebooks", str(source), "--dry-run", "--port", "9999", "--no-browser"])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["dry run: would copy 01_first.ipynb", "dry run: would copy 02_second.ipynb"]
    assert out[-1].startswith("dry run: nothing written; would start ")
    command = out[-1]
    assert "-m jupyter lab" in command and f"--ServerApp.root_dir={work.resolve()}" in command
    assert "--ServerApp.port=9999" in command and "--no-browser" in command
    assert ("--allow-root" in command) == lab.is_root()
    assert not work.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no folder can be created")
def test_dry_run_on_a_folder_that_cannot_be_created_says_what_the_real_run_says(tmp_path, source, capsys):
    """The dry run said it would copy into a folder that the real run then failed to create."""
    target = "/proc/dsv41-no-such-place/lab"
    said = []
    for dry in (["--dry-run"], []):
        assert main(["lab", "--dir", target, "--notebooks", str(source), "--no-browser", *dry]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        said.append(captured.err)
    assert said[0] == said[1] and f"--dir {target}: cannot create this folder" in said[0]
    # a creatable one: the dry run's probe leaves nothing behind
    before = sorted(tmp_path.iterdir())
    assert main(["lab", "--dir", str(tmp_path / "new" / "lab"), "--notebooks", str(source), "--dry-run"]) == 0
    assert sorted(tmp_path.iterdir()) == before


def test_the_default_source_is_the_repository_notebooks(tmp_path):
    actions = lab.prepare_lab(tmp_path / "lab", dry_run=True)
    assert [a.name for a in actions] == [p.name for p in find_notebooks(default_notebooks_dir())]
    assert len(actions) >= 5 and all(a.kind == lab.COPIED for a in actions)


def test_bad_folders_are_one_sentence(tmp_path, source, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["lab", "--dir", str(blocker / "lab"), "--notebooks", str(source)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs through the file" in err
    assert main(["lab", "--dir", str(tmp_path / "lab"), "--notebooks", str(tmp_path / "none")]) == 2
    assert "no such notebooks folder" in capsys.readouterr().err


def test_lab_is_a_command():
    assert COMMANDS["lab"][:2] == ("dsv41.app.lab", "cli_main")


def test_the_command_starts_the_server_in_place_of_itself(tmp_path, source, monkeypatch, capsys):
    """The exec itself, mocked: the command line, the kernelspec on JUPYTER_PATH, the root line."""
    started = {}
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lab, "start_lab", lambda cmd, env: started.update(cmd=cmd, env=env))
    assert main(["lab", "--dir", str(tmp_path / "lab"), "--notebooks", str(source), "--no-browser"]) == 0
    cmd, env = started["cmd"], started["env"]
    assert cmd[:4] == [sys.executable, "-m", "jupyter", "lab"]
    spec_root = Path(env["JUPYTER_PATH"].split(os.pathsep)[0])
    spec = json.loads((spec_root / "kernels" / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable and spec_root.is_relative_to(tmp_path / "cache")
    err = capsys.readouterr().err
    assert ("running as root, so JupyterLab is started with --allow-root" in err) == lab.is_root()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_real_start_answers_with_a_token_url(tmp_path, source):
    """Start `dsv41 lab` for real, wait (at most 30 s) for the token URL on stderr and an answer
    from the port, ask the server which python3 kernel it would start, then terminate it."""
    port = _free_port()
    env = {
        **os.environ,
        "DSV41_CACHE": str(tmp_path / "cache"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "jcfg"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "jrt"),
        "JUPYTER_DATA_DIR": str(tmp_path / "jdata"),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsv41",
            "lab",
            "--dir",
            str(tmp_path / "lab"),
            "--notebooks",
            str(source),
            "--no-browser",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline, token, status = time.monotonic() + 30, None, None
        while time.monotonic() < deadline and proc.poll() is None:
            token = next(
                (line.split("token=")[1].split()[0] for line in list(lines) if f":{port}/lab?token=" in line), None
            )
            if token:
                try:
                    with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/api/kernelspecs?token={token}", timeout=5
                    ) as r:
                        status, specs = r.status, json.load(r)
                    break
                except OSError:
                    pass
            time.sleep(0.25)
        assert proc.poll() is None, "".join(lines)[-2000:]
        assert token and status == 200, f"no answer within 30 s:\n{''.join(lines)[-2000:]}"
        python3 = specs["kernelspecs"]["python3"]["spec"]
        assert python3["argv"][0] == sys.executable  # the pinned kernel, not whatever python3 is registered
        assert ("running as root" in "".join(lines)) == lab.is_root()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "copied 01_first.ipynb" in out and (tmp_path / "lab" / "01_first.ipynb").is_file()


def test_lab_copies_write_their_figures_beside_themselves(tmp_path):
    from dsv41.app.lab import prepare_lab
    from dsv41.app.notebooks import default_notebooks_dir

    prepare_lab(tmp_path / "lab")
    for copy in sorted((tmp_path / "lab").glob("0*.ipynb")):
        text = copy.read_text()
        original = (Path(default_notebooks_dir()) / copy.name).read_text()
        assert 'output_dir = \\"interactive\\"' in text and "../outputs/interactive" not in text
        assert text == original.replace('output_dir = \\"../outputs/interactive\\"', 'output_dir = \\"interactive\\"')
    n_notebooks = len(list(Path(default_notebooks_dir()).glob("[0-9][0-9]_*.ipynb")))
    assert [a.kind for a in prepare_lab(tmp_path / "lab")] == ["current"] * n_notebooks  # its own copies stay current
