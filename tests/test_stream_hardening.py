"""`dsv41 bench stream` refuses in one sentence, before anything is written, what would fail later
(a --dir on a file, a budget too small, a --json it cannot write, too little free space, absurd
counts), never loses its report, and never leaves a folder the next run cannot use: a write
stopped by a full disk or a kill is cleared by the next run, which removes only what it wrote.

Everything runs at the smallest geometry (`--small`, 6 experts: a 0.1 GiB checkpoint); the
refusals stop before any checkpoint is written, and the measured run itself is covered end to end
in test_streaming.py. Read-only folders are simulated (tests run as root): see
test_notebooks_hardening.refuse_writes_under."""

import errno
import json
import os
import shutil
from collections import namedtuple

import pytest
from test_notebooks_hardening import refuse_writes_under

from dsv41.bench import stream
from dsv41.bench.cli import cli_main
from dsv41.core.errors import Dsv41Error

SMALL = [
    "--small",
    "--experts",
    "6",
    "--memory",
    "2GiB",
    "--tokens",
    "2",
    "--prompt",
    "3",
    "--disk-probe-mib",
    "8",
    "--recorded-tokens",
    "2",
    "--io-threads",
    "2",
]
GIB = 1 << 30


def small_config():
    return stream.stream_config(2, 6, True)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Neither the checkpoint writer nor the run may be reached: a refusal comes first."""

    def reached(*args, **kwargs):
        raise AssertionError("the bench went on past a refusal")

    from dsv41.checkpoint import synthetic

    monkeypatch.setattr(synthetic, "write_release_layout", reached)
    monkeypatch.setattr(stream, "recorded_steps", reached)
    monkeypatch.setattr(stream, "measure", reached)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _own_files(folder) -> set[str]:
    return {os.path.relpath(os.path.join(root, f), folder) for root, _, names in os.walk(folder) for f in names}


# ---------------------------------------------------------------------- refused before anything is written
@pytest.mark.parametrize("where", ["file", "under a file"])
def test_a_dir_on_a_file_is_one_sentence(tmp_path, capsys, nothing_runs, where):
    """Reproduces: --dir FILE was a FileExistsError traceback (NotADirectoryError under a file)."""
    file = tmp_path / "a-file"
    file.write_text("mine\n")
    target = file if where == "file" else file / "ck"
    assert cli_main(["stream", "--dir", str(target), *SMALL]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"dsv41 bench: --dir {target}") and "not a folder" in line, line
    assert (f"{target} is a file" if where == "file" else f"{file} is a file") in line
    assert file.read_text() == "mine\n"


def test_the_budget_is_checked_before_the_checkpoint_is_written(tmp_path, capsys, nothing_runs):
    """Reproduces: a budget below the minimum was refused only after the checkpoint (23.5 GiB at the
    default size) had been written."""
    from dsv41.runtime.budget import BudgetError, plan_budget

    cfg, positions = small_config(), stream.run_positions(3, 2)
    minimum = plan_budget(cfg, 1 << 50, max_seq_len=positions).minimum
    below = minimum - (1 << 20)
    with pytest.raises(BudgetError):
        plan_budget(cfg, below, max_seq_len=positions)
    target = tmp_path / "ck"
    argv = ["stream", "--dir", str(target), *SMALL, "--memory", str(below)]
    assert cli_main(argv) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("dsv41 bench: ") and "memory budget" in line, line
    assert not target.exists()


def test_a_budget_above_the_machine_is_refused_before_writing(tmp_path, monkeypatch, capsys, nothing_runs):
    from dsv41.runtime import budget

    machine = 3 * GIB
    monkeypatch.setattr(budget, "machine_memory", lambda: (machine, "this machine has"))
    with pytest.raises(budget.BudgetError):
        budget.check_machine(machine + 1)
    target = tmp_path / "ck"
    assert cli_main(["stream", "--dir", str(target), *SMALL, "--memory", str(machine + 1)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("dsv41 bench: a memory budget of") and "this machine has" in line, line
    assert not target.exists()


def test_more_positions_than_the_config_has_are_refused_before_writing(tmp_path, nothing_runs):
    cfg = small_config()
    with pytest.raises(Dsv41Error, match=f"more than the config's {cfg.max_seq_len:,}"):
        stream.bench_stream(
            str(tmp_path / "ck"),
            layers=2,
            experts=6,
            small=True,
            memory="2GiB",
            prompt_tokens=4,
            decode_tokens=cfg.max_seq_len,
        )
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("how", ["read-only folder", "a folder", "under a file", "missing folder"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, monkeypatch, capsys, nothing_runs, how):
    """Reproduces: --json into a read-only folder failed with a traceback after the whole run, and
    the report was lost."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "a-file").write_text("mine\n")
    json_path = {
        "read-only folder": out / "r.json",
        "a folder": out,
        "under a file": tmp_path / "a-file" / "r.json",
        "missing folder": tmp_path / "nowhere" / "r.json",
    }[how]
    if how == "read-only folder":
        refuse_writes_under(monkeypatch, out)
    target = tmp_path / "ck"
    assert cli_main(["stream", "--dir", str(target), *SMALL, "--json", str(json_path)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"dsv41 bench: --json {json_path}"), line
    if how == "read-only folder":
        assert f"cannot write into {out} ({os.strerror(errno.EROFS)})" in line, line
    assert not target.exists() and os.listdir(out) == []
    assert (tmp_path / "a-file").read_text() == "mine\n"


def test_a_report_that_cannot_be_written_after_the_run_is_printed(tmp_path, monkeypatch, capsys):
    """The --json folder passes the check, then goes away during the run: the report is printed
    on stdout, one line on stderr says so, exit 1."""
    out = tmp_path / "out"
    out.mkdir()
    report = {"command": "bench stream", "runs": [{"seconds_per_token": 1.25}]}

    def the_run(folder, **kwargs):
        shutil.rmtree(out)
        return report

    monkeypatch.setattr(stream, "bench_stream", the_run)
    json_path = out / "r.json"
    assert cli_main(["stream", "--dir", str(tmp_path / "ck"), *SMALL, "--json", str(json_path)]) == 1
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert line == (
        f"dsv41 bench: --json {json_path} could not be written ({os.strerror(errno.ENOENT)}); "
        f"the report is printed on stdout instead"
    )
    assert json.loads(captured.out) == report


def test_the_report_is_written_whole_beside_nothing_else(tmp_path):
    from dsv41.bench.common import write_report

    path = tmp_path / "r.json"
    path.write_text("an older report\n")
    write_report(str(path), {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and os.listdir(tmp_path) == ["r.json"]


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch, capsys, nothing_runs):
    """Reproduces: nothing looked at the free space; a full disk was found half way through."""
    need = stream.checkpoint_bytes(small_config())
    free = need - (1 << 20)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * need, 9 * need, free))
    target = tmp_path / "ck"
    assert cli_main(["stream", "--dir", str(target), *SMALL]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == (
        f"dsv41 bench: --dir {target}: the checkpoint needs {need / GIB:.2f} GiB and the disk of "
        f"{tmp_path} has {free / GIB:.2f} GiB free; free some space or name a folder on another disk"
    )
    assert not target.exists()


def test_a_dir_on_a_read_only_disk_is_refused(tmp_path, monkeypatch, capsys, nothing_runs):
    ro = tmp_path / "ro"
    ro.mkdir()
    refuse_writes_under(monkeypatch, ro)
    target = ro / "ck"
    assert cli_main(["stream", "--dir", str(target), *SMALL]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"dsv41 bench: --dir {target}: cannot write into {ro}")
    assert f"({os.strerror(errno.EROFS)})" in line, line
    assert os.listdir(ro) == []


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--io-threads", "100000"),
        ("--layers", "1" + "0" * 400),
        ("--tokens", "0"),
        ("--prompt", "1"),
        ("--runs", "-1"),
        ("--experts", "5"),
        ("--disk-probe-mib", "1e3"),
    ],
)
def test_counts_out_of_range_are_usage_errors(tmp_path, capsys, nothing_runs, flag, value):
    """Reproduces: --io-threads 100000 went on to allocate 4 MiB per thread (400 GB), --layers 10**400
    was an OverflowError traceback."""
    target = tmp_path / "ck"
    with pytest.raises(SystemExit) as stop:
        cli_main(["stream", "--dir", str(target), *SMALL, flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a whole number" in err and "Traceback" not in err, err
    assert not target.exists()


# ---------------------------------------------------------------------- writing, stopped and resumed
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A checkpoint this bench wrote at the smallest geometry, shared by the tests that only read it."""
    folder = str(tmp_path_factory.mktemp("written") / "ck")
    marker = stream.ensure_checkpoint(folder, small_config(), log=lambda line: None)
    return folder, marker


def test_a_written_checkpoint_lists_its_files_and_fits_the_estimate(written):
    folder, marker = written
    assert marker["complete"] and set(marker["files"]) == _own_files(folder) - {stream.MARKER}
    assert json.loads(open(os.path.join(folder, stream.MARKER)).read()) == json.loads(json.dumps(marker))
    assert marker["bytes"] == sum(os.path.getsize(os.path.join(folder, n)) for n in marker["files"])
    assert marker["bytes"] <= stream.checkpoint_bytes(small_config())  # the free-space check asks enough
    lines = []
    assert stream.ensure_checkpoint(folder, small_config(), log=lines.append) == json.loads(json.dumps(marker))
    assert lines == [f"reusing the checkpoint in {folder} ({marker['bytes'] / GIB:.2f} GiB)"]


def test_the_budget_checked_first_is_the_one_the_load_plans(written):
    import dsv41

    folder, _ = written
    positions = stream.run_positions(3, 2)
    planned = stream.plan_run(small_config(), "2GiB", positions)
    model = dsv41.load(folder, quiet=True, threads=1, memory="2GiB", max_seq_len=positions)
    try:
        assert model.report.budget_plan == planned.as_dict()
    finally:
        model.experts.close()


def _failing_on_shard(monkeypatch, n: int, exc: OSError):
    """The writer fails on its `n`th shard, after writing part of it (as a full disk does)."""
    from dsv41.checkpoint import synthetic

    real, calls = synthetic.write_streamed_shard, []

    def write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == n:
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
            raise exc
        return real(path, *args, **kwargs)

    monkeypatch.setattr(synthetic, "write_streamed_shard", write)
    return calls


def test_a_full_disk_half_way_leaves_nothing_and_the_next_run_writes(tmp_path, monkeypatch):
    """Reproduces: a shard a full disk cut short stayed in --dir with no marker, and the next run
    refused the folder until it was emptied by hand."""
    folder = str(tmp_path / "ck")
    calls = _failing_on_shard(monkeypatch, 2, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(Dsv41Error, match=f"{os.strerror(errno.ENOSPC)}.*its partial files were removed"):
        stream.ensure_checkpoint(folder, small_config(), log=lambda line: None)
    assert len(calls) == 2 and not os.path.exists(folder)  # the folder this run made is gone again
    monkeypatch.undo()
    marker = stream.ensure_checkpoint(folder, small_config(), log=lambda line: None)
    assert marker["complete"] and _own_files(folder) == {*marker["files"], stream.MARKER}


@pytest.mark.parametrize("when", ["writing", "moving"])
def test_a_killed_write_is_cleared_by_the_next_run_and_only_its_own_files(tmp_path, monkeypatch, when):
    """Reproduces: what a killed write left in --dir blocked every later run. The kill is played in
    this process: the write stops at the same point and the writer's own cleanup never runs, so the
    folder is left as a killed process leaves it."""
    from dsv41.checkpoint import synthetic

    class Killed(BaseException):
        pass

    def dies_at(real, dies, partial=False):
        calls = []

        def call(*args, **kwargs):
            calls.append(args)
            if dies(calls):
                if partial:
                    with open(args[0], "wb") as f:
                        f.write(b"\0" * 4096)
                raise Killed
            return real(*args, **kwargs)

        return call

    def no_cleanup(*args):
        raise OSError("killed: no cleanup runs")

    if when == "writing":  # in the third shard, part of it written
        monkeypatch.setattr(
            synthetic,
            "write_streamed_shard",
            dies_at(synthetic.write_streamed_shard, lambda calls: len(calls) == 3, partial=True),
        )
    else:  # moving the second written file in beside the marker
        monkeypatch.setattr(
            os,
            "replace",
            dies_at(os.replace, lambda calls: len([c for c in calls if stream.STAGING in str(c[0])]) == 2),
        )
    monkeypatch.setattr(stream, "_remove_own", no_cleanup)
    folder = tmp_path / "ck"
    with pytest.raises(Killed):
        stream.ensure_checkpoint(str(folder), small_config(), log=lambda line: None)
    monkeypatch.undo()
    debris = _own_files(folder)
    assert stream.MARKER in debris and len(debris) > 1, debris
    if when == "moving":
        assert any(not d.startswith(stream.STAGING) for d in debris - {stream.MARKER}), debris  # one moved in
    (folder / "notes.txt").write_text("the user's\n")
    lines = []
    marker = stream.ensure_checkpoint(str(folder), small_config(), log=lines.append)
    assert lines[0] == f"removing the unfinished checkpoint an earlier run left in {folder}"
    assert marker["complete"] and _own_files(folder) == {*marker["files"], stream.MARKER, "notes.txt"}
    assert (folder / "notes.txt").read_text() == "the user's\n"


def test_debris_without_a_marker_is_recognized_by_its_name(tmp_path):
    """What a write left under this bench's own staging name is its own, marker or none."""
    folder = tmp_path / "ck"
    (folder / stream.STAGING).mkdir(parents=True)
    (folder / stream.STAGING / "model-00001-of-00006.safetensors").write_bytes(b"\0" * 4096)
    lines = []
    marker = stream.ensure_checkpoint(str(folder), small_config(), log=lines.append)
    assert lines[0] == f"removing the unfinished checkpoint an earlier run left in {folder}"
    assert _own_files(folder) == {*marker["files"], stream.MARKER}


def test_a_checkpoint_of_another_geometry_is_replaced_file_by_file(written, tmp_path):
    """Its files (more shards than the new one has) go, the user's stay."""
    folder = str(tmp_path / "ck")
    shutil.copytree(written[0], folder)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("the user's\n")
    cfg = stream.stream_config(3, 6, True)
    old = set(written[1]["files"])
    marker = stream.ensure_checkpoint(folder, cfg, log=lambda line: None)
    assert set(marker["files"]) != old
    assert _own_files(folder) == {*marker["files"], stream.MARKER, "notes.txt"}


def test_a_folder_without_a_marker_is_the_users(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "model-00001-of-00006.safetensors").write_text("the user's\n")
    with pytest.raises(Dsv41Error, match=f"holds files but no {stream.MARKER}"):
        stream.ensure_checkpoint(str(folder), small_config(), log=lambda line: None)
    assert _own_files(folder) == {"model-00001-of-00006.safetensors"}


@pytest.mark.parametrize("files", [["notes.txt"], ["../outside.txt"], ["/etc/hostname"], "config.json", [7]])
def test_a_marker_that_lists_other_files_is_refused_and_nothing_removed(tmp_path, files):
    """A marker is what lets the bench remove files: one it cannot have written is never acted on."""
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's\n")
    (tmp_path / "outside.txt").write_text("the user's\n")
    (folder / stream.MARKER).write_text(json.dumps({"config": {}, "complete": False, "files": files}))
    with pytest.raises(Dsv41Error, match="is not a marker this bench wrote"):
        stream.ensure_checkpoint(str(folder), small_config(), log=lambda line: None)
    assert (folder / "notes.txt").exists() and (tmp_path / "outside.txt").exists()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"config": {}, "complete": true, "files": []}',
        "[" * 100_000 + "]" * 100_000,
        '{"bytes": 1' + "0" * 5000 + "}",
        '{"config": {}, "complete": true, "files": [], "bytes": "many"}',
    ],
)
def test_an_unreadable_or_damaged_marker_is_one_sentence(tmp_path, content):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / stream.MARKER).write_text(content)
    with pytest.raises(Dsv41Error, match=stream.MARKER):
        stream.ensure_checkpoint(str(folder), small_config(), log=lambda line: None)
    assert os.listdir(folder) == [stream.MARKER]
