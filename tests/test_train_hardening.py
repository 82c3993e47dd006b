"""`dsv41 train` against hostile input: no code runs from a training state (it is safetensors and
JSON, checked as a checkpoint), no file of the user's is lost (it writes only into a new or empty
folder or one it wrote), a resumed run keeps its own settings, every bad flag, folder, cache or
--draft-from source is one sentence, and a copy of the miniature is held to its manifest.

Runs train on a few standard-library files (`small_corpus`) at 2 x 32 tokens a step, 4 backbone
steps and 1 draft step, so a whole run with its final measurements takes seconds; the folders the
tests tamper with are copies of two shared runs (`stopped`, `finished`)."""

import errno
import hashlib
import json
import os
import pickle
import shutil
import struct
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dsv41  # noqa: E402
from dsv41.checkpoint import miniature  # noqa: E402
from dsv41.checkpoint.checkpoint import LoadError  # noqa: E402
from dsv41.train import corpus as corpus_module  # noqa: E402
from dsv41.train.cli import cli_main  # noqa: E402
from dsv41.train.state import (  # noqa: E402
    STATE_NAME,
    STEP_FIXED_BYTES,
    TrainError,
    TrainSettings,
    TrainState,
    TrainStateError,
    check_memory,
    step_bytes,
)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("train-hardening")]

RUN = ["--batch", "2", "--seq-len", "32", "--no-compile", "--threads", "1", "--held-out-windows", "1"]
NEW = ["--steps", "4", "--draft-steps", "1", *RUN]
TRAIN_FILES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "bisect.py", "heapq.py"]
HELD_OUT_FILES = ["colorsys.py", "fnmatch.py"]


def small_corpus(root=None) -> corpus_module.Corpus:
    """A few standard-library files in place of the whole library (the corpus `load_corpus` reads)."""
    lib = sysconfig.get_paths()["stdlib"]
    read = {name: Path(lib, name).read_text(encoding="utf-8") for name in TRAIN_FILES + HELD_OUT_FILES}
    return corpus_module.Corpus(
        train={n: read[n] for n in TRAIN_FILES},
        held_out={n: read[n] for n in HELD_OUT_FILES},
        python="test",
        file_list_sha256="0" * 64,
    )


@pytest.fixture(autouse=True)
def _small_corpus(monkeypatch):
    monkeypatch.setattr(corpus_module, "load_corpus", small_corpus)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two shared runs: `stopped` at step 2 of 5 (--stop-at), and `finished`: a copy of it resumed
    with no settings given, which must go on with its own (4 + 1 steps) and write its checkpoint."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpus_module, "load_corpus", small_corpus)
        root = tmp_path_factory.mktemp("runs")
        stopped, finished = root / "stopped", root / "finished"
        assert cli_main(["--out", str(stopped), "--stop-at", "2", *NEW]) == 0
        shutil.copytree(stopped, finished)
        # old behaviour: the defaults (1,500 + 200 steps) replaced the run's; --stop-at 5 then stopped
        # it short of its end with no checkpoint
        assert cli_main(["--out", str(finished), "--resume", "--stop-at", "5", *RUN]) == 0
    return {"stopped": stopped, "finished": finished}


def copy_of(runs, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs[name], tmp_path / name))


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its bytes' sha256 (folders by name): what "nothing lost" compares."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
    return out


def one_line(capsys, *names: str) -> str:
    """The command's stderr: one line, from dsv41 train, naming each of `names`."""
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("dsv41 train: ") and "Traceback" not in err, err
    for name in names:
        assert name in err, (name, err)
    return err


def rewrite_tensors(folder: Path, change) -> None:
    """Apply `change` to the state's tensors (name -> tensor) and write them back under the name
    state.json gives, with its size and sha256 set to match: the check must then find the change."""
    from safetensors.torch import load, save

    document = json.loads((folder / STATE_NAME).read_text())
    path = folder / document["tensors"]["file"]
    tensors = {k: v.clone() for k, v in load(path.read_bytes()).items()}
    change(tensors)
    data = save(tensors)
    path.write_bytes(data)
    document["tensors"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / STATE_NAME).write_text(json.dumps(document))


def edit_state(folder: Path, change) -> None:
    document = json.loads((folder / STATE_NAME).read_text())
    change(document)
    (folder / STATE_NAME).write_text(json.dumps(document))


# ---------------------------------------------------------------------- no code runs from a state
class _RunsCode:
    """Unpickling this makes the folder `marker` (what a crafted state.pt ran: os.system)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_pickled_state_is_refused_without_running_it(tmp_path, capsys):
    """Reproduces serious 1: `--resume` in a folder holding a crafted state.pt ran its code (torch.load
    with weights_only=False). Now the pickled format is never read, and the folder is refused."""
    marker = tmp_path / "code-ran"
    out = tmp_path / "out"
    out.mkdir()
    (out / "state.pt").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    (out / "tokenizer.json").write_text("{}")
    before = snapshot(out)
    assert cli_main(["--out", str(out), "--resume", *RUN]) == 1
    one_line(capsys, "state.pt", "never loaded")
    assert not marker.exists(), "unpickling the state ran its code"
    assert snapshot(out) == before


def test_a_pickle_in_place_of_the_tensors_file_is_refused_without_running_it(runs, tmp_path, capsys):
    """A run's own folder whose tensors file is swapped for the crafted pickle, state.json's sha256
    set to match: safetensors refuses it unread."""
    folder = copy_of(runs, "stopped", tmp_path)
    marker = tmp_path / "code-ran"
    document = json.loads((folder / STATE_NAME).read_text())
    crafted = pickle.dumps(_RunsCode(str(marker)))
    (folder / document["tensors"]["file"]).write_bytes(crafted)
    edit_state(folder, lambda d: d["tensors"].update(size=len(crafted), sha256=hashlib.sha256(crafted).hexdigest()))
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 1
    one_line(capsys, document["tensors"]["file"], "not a readable safetensors file")
    assert not marker.exists()


def test_no_module_of_the_package_unpickles():
    """No torch.load, pickle or numpy load that allows pickled objects, anywhere in the package."""
    offenders = []
    for path in Path(dsv41.__file__).parent.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for needle in ("torch.load(", "weights_only=False", "pickle.load", "allow_pickle=True", "import pickle"):
            if needle in text:
                offenders.append(f"{path.name}: {needle}")
    assert offenders == []


# ---------------------------------------------------------------------- the state, checked
TAMPERINGS = {
    "truncated": lambda f: (f / STATE_NAME).write_bytes((f / STATE_NAME).read_bytes()[:100]),
    "empty": lambda f: (f / STATE_NAME).write_bytes(b""),
    "random": lambda f: (f / STATE_NAME).write_bytes(os.urandom(4096)),
    "a folder": lambda f: ((f / STATE_NAME).unlink(), (f / STATE_NAME).mkdir()),
    "a FIFO": lambda f: ((f / STATE_NAME).unlink(), os.mkfifo(f / STATE_NAME)),
    "step 10**9": lambda f: edit_state(f, lambda d: d.update(step=10**9)),
    "step -5": lambda f: edit_state(f, lambda d: d.update(step=-5)),
    "step a string": lambda f: edit_state(f, lambda d: d.update(step="2")),
    "unknown setting": lambda f: edit_state(f, lambda d: d["settings"].update(bogus=1)),
    "missing setting": lambda f: edit_state(f, lambda d: d["settings"].pop("batch")),
    "batch a float": lambda f: edit_state(f, lambda d: d["settings"].update(batch=2.0)),
    "missing log": lambda f: edit_state(f, lambda d: d.pop("log")),
    "log of another run": lambda f: edit_state(f, lambda d: d.update(log=d["log"][:1])),
    "unknown field": lambda f: edit_state(f, lambda d: d.update(extra=None)),
    "tensors file elsewhere": lambda f: edit_state(f, lambda d: d["tensors"].update(file="../state.pt")),
    "tensors file cut": lambda f: (lambda p: p.write_bytes(p.read_bytes()[:-1000]))(
        f / json.loads((f / STATE_NAME).read_text())["tensors"]["file"]
    ),
    "tensors file changed": lambda f: (lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\x01"))(
        f / json.loads((f / STATE_NAME).read_text())["tensors"]["file"]
    ),
    "missing tensor": lambda f: rewrite_tensors(f, lambda t: t.pop("param.head.weight")),
    "extra tensor": lambda f: rewrite_tensors(f, lambda t: t.update({"param.surprise": torch.zeros(2)})),
    "wrong shape": lambda f: rewrite_tensors(
        f, lambda t: t.update({"param.head.weight": t["param.head.weight"][:, :-1].contiguous()})
    ),
    "wrong dtype": lambda f: rewrite_tensors(
        f, lambda t: t.update({"param.head.weight": t["param.head.weight"].double()})
    ),
    "NaN weights": lambda f: rewrite_tensors(f, lambda t: t["param.norm.weight"].__setitem__(0, float("nan"))),
    "moment of a frozen tensor": lambda f: rewrite_tensors(
        f, lambda t: t.update({"adam.mtp.0.norm.weight.step": torch.tensor(1.0)})
    ),
    "moment without its step": lambda f: rewrite_tensors(f, lambda t: t.pop(next(k for k in t if k.endswith(".step")))),
}


@pytest.mark.parametrize("how", list(TAMPERINGS))
def test_a_damaged_state_is_one_sentence_and_nothing_is_written(runs, tmp_path, capsys, how):
    folder = copy_of(runs, "stopped", tmp_path)
    TAMPERINGS[how](folder)
    before = snapshot(folder)
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 1
    one_line(capsys, str(folder))
    assert snapshot(folder) == before


def test_a_state_is_refused_without_reading_the_corpus(runs, tmp_path, monkeypatch, capsys):
    """The whole state (its tensors too) is checked before any work: the corpus is not read."""
    folder = copy_of(runs, "stopped", tmp_path)
    TAMPERINGS["NaN weights"](folder)
    monkeypatch.setattr(corpus_module, "load_corpus", lambda root=None: pytest.fail("the corpus was read"))
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 1
    one_line(capsys, "param.norm.weight", "NaN")


# the fuzz runs on a geometry of three tensors, so each example reads a few hundred bytes
SHAPES = {"a.weight": (3, 4), "b.bias": (5,), "mtp.0.c.weight": (2, 2)}
TRAINED = {"backbone": ["a.weight", "b.bias"], "draft": ["mtp.0.c.weight"]}


@pytest.fixture(scope="module")
def small_state(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("small-state")
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    moments = {
        "a.weight": {
            "exp_avg": torch.randn(3, 4, generator=gen),
            "exp_avg_sq": torch.rand(3, 4, generator=gen),
            "step": torch.tensor(3.0),
        }
    }
    settings = TrainSettings(backbone_steps=4, draft_steps=1, batch=2, seq_len=32, eval_every=4)
    log = [{"step": i, "phase": settings.phase(i), "loss": 7.0 - i, "seconds": 0.5, "lr": 1e-3} for i in range(3)]
    evals = [{"step": 2, "bits_per_byte": 6.5, "nats_per_token": 7.1, "tokens": 32, "bytes": 90}]
    TrainState(settings, params, 3, {"phase": "backbone", "moments": moments}, log, evals, 1.5).save(str(folder))
    return folder


def test_the_small_state_round_trips(small_state):
    state = TrainState.load(str(small_state), SHAPES, TRAINED)
    assert state.step == 3 and state.settings.backbone_steps == 4 and len(state.log) == 3
    assert list(state.params) == list(SHAPES) and state.optimizer["phase"] == "backbone"
    assert sorted(state.optimizer["moments"]["a.weight"]) == ["exp_avg", "exp_avg_sq", "step"]


def _json_values():
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=True), st.text(max_size=8)
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
        max_leaves=6,
    )


def _paths(value, prefix=()):
    """Every path to a value inside a JSON document."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _load_or_refuse(folder: Path) -> None:
    """A correct load (every tensor of its shape, finite) or one clean sentence: nothing else."""
    try:
        state = TrainState.load(str(folder), SHAPES, TRAINED)
    except TrainStateError as exc:
        message = str(exc)
        assert "\n" not in message and len(message) < 600 and str(folder) in message, message
        return
    assert {n: tuple(v.shape) for n, v in state.params.items()} == SHAPES
    assert all(torch.isfinite(v).all() for v in state.params.values())
    assert 0 <= state.step <= state.settings.steps and len(state.log) <= state.step


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_the_state_loader(small_state, tmp_path_factory, data):
    """Random bytes, truncations, any field of state.json replaced by any JSON value, tensors
    removed, reshaped or retyped (the sha256 kept matching, so the tensor checks are reached)."""
    from safetensors.torch import load, save

    folder = Path(shutil.copytree(small_state, tmp_path_factory.mktemp("fuzz") / "state"))
    document = json.loads((folder / STATE_NAME).read_text())
    tensors_path = folder / document["tensors"]["file"]
    kind = data.draw(st.sampled_from(["json bytes", "json cut", "field", "tensors cut", "tensor"]))
    if kind == "json bytes":
        (folder / STATE_NAME).write_bytes(data.draw(st.binary(max_size=300)))
    elif kind == "json cut":
        raw = (folder / STATE_NAME).read_bytes()
        (folder / STATE_NAME).write_bytes(raw[: data.draw(st.integers(0, len(raw)))])
    elif kind == "field":
        path = data.draw(st.sampled_from(list(_paths(document))[1:]))
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = data.draw(_json_values())
        (folder / STATE_NAME).write_text(json.dumps(document))
    elif kind == "tensors cut":
        raw = tensors_path.read_bytes()
        tensors_path.write_bytes(raw[: data.draw(st.integers(0, len(raw)))])
    else:
        tensors = load(tensors_path.read_bytes())
        name = data.draw(st.sampled_from(sorted(tensors)))
        how = data.draw(st.sampled_from(["remove", "reshape", "retype", "nan"]))
        value = tensors.pop(name)
        if how == "reshape":
            tensors[name] = value.reshape(-1).contiguous() if value.dim() != 1 else value.reshape(1, -1).contiguous()
        elif how == "retype":
            tensors[name] = value.to(
                data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.int32, torch.float64]))
            )
        elif how == "nan":
            tensors[name] = value.clone().fill_(float("nan"))
        raw = save(tensors)
        tensors_path.write_bytes(raw)
        document["tensors"].update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        (folder / STATE_NAME).write_text(json.dumps(document))
    _load_or_refuse(folder)


# ---------------------------------------------------------------------- no user file is lost
def test_a_folder_train_did_not_write_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """Reproduces serious 2: --out on a folder of the user's removed its checkpoint/ and replaced
    facts.json, the loss curves, tokens.npz, and took its tokenizer.json as the tokenizer."""
    out = tmp_path / "mine"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "notes.txt").write_text("my notes")
    for name in ("facts.json", "loss_curve.png", "tokenizer.json", "tokens.npz"):
        (out / name).write_text(f"the user's {name}")
    before = snapshot(out)
    monkeypatch.setattr(corpus_module, "load_corpus", lambda root=None: pytest.fail("the corpus was read"))
    assert cli_main(["--out", str(out), *NEW]) == 1
    one_line(capsys, str(out), "dsv41-train.json", "give another --out")
    assert snapshot(out) == before


def test_its_own_folder_is_refused_where_it_would_replace_a_users_file(runs, tmp_path, capsys):
    folder = copy_of(runs, "finished", tmp_path)
    (folder / "checkpoint" / "notes.txt").write_text("my notes")
    before = snapshot(folder)
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 1
    one_line(capsys, "notes.txt", "did not write")
    assert snapshot(folder) == before
    (folder / "checkpoint" / "notes.txt").unlink()
    (folder / "facts.json").unlink()
    (folder / "facts.json").mkdir()
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 1
    one_line(capsys, "facts.json", "is a folder")


def test_a_run_writes_only_its_own_files_and_leaves_no_temporary_ones(runs):
    names = sorted(p.name for p in runs["finished"].iterdir())
    document = json.loads((runs["finished"] / STATE_NAME).read_text())
    assert names == sorted(
        [
            "checkpoint",
            "dsv41-train.json",
            "facts.json",
            "loss_curve.json",
            "loss_curve.png",
            "loss_curve.svg",
            STATE_NAME,
            document["tensors"]["file"],
            "tokenizer.json",
            "tokens.npz",
        ]
    )
    marker = json.loads((runs["finished"] / "dsv41-train.json").read_text())
    assert marker["format"] == "dsv41-train-folder"
    assert marker["tokenizer_sha256"] == hashlib.sha256((runs["finished"] / "tokenizer.json").read_bytes()).hexdigest()


def test_a_killed_runs_temporary_files_are_removed_and_the_users_kept(runs, tmp_path, capsys):
    folder = copy_of(runs, "stopped", tmp_path)
    debris = [folder / ".state.json.x1y2.partial", folder / ".state-0000004.safetensors.abc.partial"]
    for path in debris:
        path.write_bytes(b"half")
    (folder / ".checkpoint.q9.partial").mkdir()
    (folder / "notes.txt").write_text("kept")
    assert cli_main(["--out", str(folder), "--resume", "--stop-at", "2", *RUN]) == 0
    assert "stopped at step 2 of 5" in capsys.readouterr().err
    assert not any(p.exists() for p in debris) and not (folder / ".checkpoint.q9.partial").exists()
    assert (folder / "notes.txt").read_text() == "kept"


def test_replace_file_keeps_the_old_file_when_writing_fails(tmp_path):
    from dsv41.core.outdir import replace_file, write_json

    path = tmp_path / "facts.json"
    write_json(path, {"a": 1})

    def half_then_fail(tmp):
        Path(tmp).write_text('{"a": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_file(path, half_then_fail)
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["facts.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_replace_folder_puts_the_new_one_in_place_of_the_old(tmp_path):
    from dsv41.core.outdir import replace_folder

    old, new = tmp_path / "checkpoint", tmp_path / ".checkpoint.x.partial"
    old.mkdir(), new.mkdir()
    (old / "a").write_text("old")
    (new / "a").write_text("new")
    replace_folder(new, old)
    assert (old / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


# ---------------------------------------------------------------------- --out, flags, caches
def refuse_writes_under(monkeypatch, folder: Path) -> None:
    """`folder` behaves as on a read-only mount for the probe that finds it out (tests run as root,
    where mode bits stop no write)."""
    import tempfile

    real = tempfile.mkstemp
    folder = str(folder)

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and (str(dir) == folder or str(dir).startswith(folder + os.sep)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("where", ["a file", "under a file", "a read-only folder", "under a read-only folder"])
def test_out_that_cannot_be_written_is_one_sentence_before_any_work(tmp_path, monkeypatch, capsys, where):
    afile, readonly = tmp_path / "afile", tmp_path / "readonly"
    afile.write_text("the user's")
    readonly.mkdir()
    if os.geteuid() == 0:
        refuse_writes_under(monkeypatch, readonly)
    else:
        readonly.chmod(0o555)
    out = {
        "a file": afile,
        "under a file": afile / "run",
        "a read-only folder": readonly,
        "under a read-only folder": readonly / "run",
    }[where]
    monkeypatch.setattr(corpus_module, "load_corpus", lambda root=None: pytest.fail("the corpus was read"))
    assert cli_main(["--out", str(out), *NEW]) == 1
    err = one_line(capsys, "--out")
    assert (
        ("is a file" in err)
        if "file" in where
        else ("cannot write into" in err and "Read-only" in err or "Permission" in err)
    )
    assert afile.read_text() == "the user's" and list(readonly.iterdir()) == []


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--seed", str(10**30)),
        ("--seed", "-1"),
        ("--threads", "-1"),
        ("--threads", "100000"),
        ("--threads", "0"),
        ("--steps", str(10**400)),
        ("--steps", "1e3"),
        ("--draft-steps", "-1"),
        ("--seq-len", "100000"),
        ("--stop-at", "0"),
        ("--pool-sequences", "0"),
        ("--pool-sequences", "100001"),
    ],
)
def test_a_flag_out_of_range_is_a_usage_error(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as done:
        cli_main(["--out", str(tmp_path / "out"), flag, value])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a whole number" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_batch_past_this_machines_memory_is_one_sentence_naming_the_most_that_fits(tmp_path, capsys):
    from dsv41.runtime.budget import machine_memory

    limit, _ = machine_memory()
    most = (limit - STEP_FIXED_BYTES) // (step_bytes(1, 256) - STEP_FIXED_BYTES)
    check_memory(TrainSettings(batch=most, seq_len=256))  # the most that fits is accepted
    assert cli_main(["--out", str(tmp_path / "out"), "--batch", "100000"]) == 1
    one_line(capsys, "--batch 100,000", f"give at most --batch {most:,}")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TrainError):
        check_memory(TrainSettings(batch=most + 1, seq_len=256))


def test_a_corrupt_tokens_cache_is_said_and_written_again(runs, tmp_path, capsys):
    folder = copy_of(runs, "stopped", tmp_path)
    (folder / "tokens.npz").write_bytes(os.urandom(2000))
    assert cli_main(["--out", str(folder), "--resume", "--stop-at", "2", *RUN]) == 0
    err = capsys.readouterr().err
    assert "tokens.npz is unreadable" in err and "tokenizing the corpus again" in err and "Traceback" not in err
    from tokenizers import Tokenizer

    from dsv41.train.data import cached_streams

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    key = hashlib.sha256((small_corpus().file_list_sha256 + tokenizer.to_str()).encode()).hexdigest()[:16]
    arrays, problem = cached_streams(str(folder / "tokens.npz"), key, small_corpus(), 1024)
    assert problem is None and arrays is not None


@pytest.mark.parametrize("how", ["cut", "pickled", "ids past the vocabulary", "two axes", "other members", "huge"])
def test_a_tokens_cache_that_is_not_token_streams_is_refused_unread(runs, tmp_path, how):
    import io
    import zipfile

    import numpy as np

    from dsv41.train.data import cached_streams

    cache = tmp_path / "tokens.npz"
    raw = (runs["stopped"] / "tokens.npz").read_bytes()
    with np.load(io.BytesIO(raw)) as saved:
        key, train, held = str(saved["key"]), saved["train"], saved["held_out"]
    if how == "cut":
        cache.write_bytes(raw[: len(raw) // 2])
    elif how == "pickled":
        with open(cache, "wb") as f:
            np.savez(f, key=np.array(key), train=np.array([{"a": 1}], dtype=object), held_out=held)
    elif how == "ids past the vocabulary":
        with open(cache, "wb") as f:
            np.savez(f, key=np.array(key), train=train + 5000, held_out=held)
    elif how == "two axes":
        with open(cache, "wb") as f:
            np.savez(f, key=np.array(key), train=train[: len(train) // 2 * 2].reshape(2, -1), held_out=held)
    elif how == "other members":
        with open(cache, "wb") as f:
            np.savez(f, key=np.array(key), train=train, held_out=held, extra=held)
    else:  # a member whose size claims more than the corpus could give: refused before it is read
        with zipfile.ZipFile(cache, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, array in (("key", np.array(key)), ("held_out", held)):
                member = io.BytesIO()
                np.save(member, array)
                archive.writestr(f"{name}.npy", member.getvalue())
            archive.writestr("train.npy", b"\0" * (64 << 20))
    arrays, problem = cached_streams(str(cache), key, small_corpus(), 1024)
    assert arrays is None and problem and "\n" not in problem


# ---------------------------------------------------------------------- --resume keeps the run's settings
def test_a_resumed_run_goes_on_with_its_own_settings_and_its_counts_agree(runs):
    """The `finished` run was resumed with no settings given: it kept 4 + 1 steps (the defaults
    had replaced them), and its manifest counts what ran."""
    folder = runs["finished"]
    facts = json.loads((folder / "facts.json").read_text())
    manifest = json.loads((folder / "checkpoint" / "dsv41-miniature.json").read_text())
    state = json.loads((folder / STATE_NAME).read_text())
    assert facts["settings"]["backbone_steps"] == 4 and facts["settings"]["draft_steps"] == 1
    assert facts["steps"] == manifest["steps"] == state["step"] == len(state["log"]) == 5
    assert [r["step"] for r in state["log"]] == list(range(5))
    assert [r["phase"] for r in state["log"]].count("draft") == 1
    assert facts["tokens_seen"] == 2 * 32 * 4
    assert facts["training_seconds"] == round(sum(r["seconds"] for r in state["log"]), 1)


def test_a_flag_that_conflicts_with_the_run_is_one_sentence(runs, tmp_path, capsys):
    folder = copy_of(runs, "stopped", tmp_path)
    before = snapshot(folder)
    for flag, value in (
        ("--steps", "6"),
        ("--draft-steps", "3"),
        ("--seed", "1"),
        ("--batch", "3"),
        ("--seq-len", "48"),
        ("--pool-sequences", "5"),
    ):
        assert cli_main(["--out", str(folder), "--resume", flag, value, "--no-compile"]) == 1
        one_line(capsys, flag, "leave")
    assert cli_main(["--out", str(folder), "--resume", "--draft-from", str(runs["finished"] / "checkpoint")]) == 1
    one_line(capsys, "did not go on from a checkpoint", "without --draft-from")
    assert snapshot(folder) == before
    # the same values as the run's are no conflict
    assert cli_main(["--out", str(folder), "--resume", "--stop-at", "2", "--steps", "4", *RUN]) == 0
    assert "stopped at step 2 of 5" in capsys.readouterr().err


def test_ctrl_c_before_the_first_checkpoint_says_there_is_none(tmp_path, monkeypatch, capsys):
    from dsv41.train.loop import Trainer

    def interrupted(self, step, opt):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "backbone_step", interrupted)
    assert cli_main(["--out", str(tmp_path / "out"), *NEW]) == 130
    err = one_line(capsys, "before the run's first checkpoint", "nothing to resume")
    assert "--resume" not in err
    assert not (tmp_path / "out" / STATE_NAME).exists()


def test_ctrl_c_after_a_checkpoint_names_its_step(runs, tmp_path, monkeypatch, capsys):
    from dsv41.train.loop import Trainer

    folder = copy_of(runs, "stopped", tmp_path)

    def interrupted(self, step, opt):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "backbone_step", interrupted)
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 130
    one_line(capsys, "--resume` goes on from the checkpoint at step 2")


def test_sigterm_stops_like_ctrl_c_and_leaves_the_handler_as_it_was(runs, tmp_path, monkeypatch, capsys):
    """A run started in the background by a shell without job control ignores SIGINT: `kill` stops it
    the same way, naming the checkpoint to go on from, exit code 128 + SIGTERM."""
    import os
    import signal

    from dsv41.train.loop import Trainer

    folder = copy_of(runs, "stopped", tmp_path)

    def killed(self, step, opt):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the step")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(Trainer, "backbone_step", killed)
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 128 + signal.SIGTERM
    one_line(capsys, "--resume` goes on from the checkpoint at step 2")
    assert signal.getsignal(signal.SIGTERM) is before


# ---------------------------------------------------------------------- --draft-from
def test_draft_from_goes_on_with_the_sources_settings(runs, tmp_path, capsys):
    """No backbone settings given: they are the source's; the draft steps go on from its 5."""
    source = runs["finished"] / "checkpoint"
    out = tmp_path / "more"
    assert cli_main(["--out", str(out), "--draft-from", str(source), "--draft-steps", "1", *RUN[4:]]) == 1
    one_line(capsys, "has had 1 draft steps already")
    assert cli_main(["--out", str(out), "--draft-from", str(source), "--draft-steps", "2", *RUN[4:]]) == 0
    capsys.readouterr()
    facts = json.loads((out / "facts.json").read_text())
    assert facts["steps"] == 6 and facts["draft_continued_from"]["steps"] == 5
    assert "path" not in facts["draft_continued_from"]
    assert facts["settings"]["batch"] == 2 and facts["settings"]["seq_len"] == 32
    state = json.loads((out / STATE_NAME).read_text())
    assert [r["step"] for r in state["log"]] == [5] and state["continued_from"]["path"] == str(source)
    # its resume may name the same source, not another
    assert cli_main(["--out", str(out), "--resume", "--draft-from", str(runs["stopped"]), *RUN]) == 1
    one_line(capsys, "went on from", str(source))


def test_draft_from_keeps_the_sources_learning_rate(runs, tmp_path, capsys):
    """The backbone's peak learning rate is the source's: the new manifest records the recipe of the
    backbone it ships, and a different --lr is refused rather than recorded."""
    source = _source_copy(runs, tmp_path)
    trained_with = json.loads((source / miniature.MANIFEST_NAME).read_text())["settings"]["lr"]
    other = trained_with / 3
    _edit_manifest(source, lambda m: m["settings"].update(lr=other))
    out = tmp_path / "more"
    given = ["--draft-steps", "2", "--lr", str(trained_with), *RUN]
    assert cli_main(["--out", str(out), "--draft-from", str(source), *given]) == 1
    one_line(capsys, f"--lr {other}")
    assert cli_main(["--out", str(out), "--draft-from", str(source), "--draft-steps", "2", *RUN]) == 0
    capsys.readouterr()
    assert json.loads((out / "facts.json").read_text())["settings"]["lr"] == other


def _source_copy(runs, tmp_path) -> Path:
    return Path(shutil.copytree(runs["finished"] / "checkpoint", tmp_path / "source"))


def _edit_manifest(folder: Path, change) -> None:
    path = folder / miniature.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


DRAFT_SOURCES = {
    "a shard changed": (
        lambda f: (lambda p: p.write_bytes(p.read_bytes()[:-1] + b"\x07"))(f / "model-00011-of-00016.safetensors"),
        "model-00011-of-00016.safetensors",
    ),
    "steps a string": (lambda f: _edit_manifest(f, lambda m: m.update(steps="5")), "steps"),
    "settings not an object": (lambda f: _edit_manifest(f, lambda m: m.update(settings=[4, 1])), "settings"),
    "a setting a string": (lambda f: _edit_manifest(f, lambda m: m["settings"].update(batch="2")), "settings"),
    "files a list": (lambda f: _edit_manifest(f, lambda m: m.update(files=list(m["files"]))), "files"),
    "a size negative": (
        lambda f: _edit_manifest(f, lambda m: m["files"]["config.json"].update(size=-1)),
        "config.json",
    ),
    "no steps": (lambda f: _edit_manifest(f, lambda m: m.pop("steps")), "steps"),
    "its source's facts a list": (
        lambda f: _edit_manifest(f, lambda m: m.update(initialized_from=[m["steps"]])),
        "initialized_from",
    ),
    "no tokenizer": (
        lambda f: (_edit_manifest(f, lambda m: m["files"].pop("tokenizer.json")), (f / "tokenizer.json").unlink()),
        "tokenizer.json",
    ),
    "not a miniature": (lambda f: (f / miniature.MANIFEST_NAME).unlink(), "not a miniature checkpoint"),
}


@pytest.mark.parametrize("how", list(DRAFT_SOURCES))
def test_a_draft_from_source_that_is_damaged_or_tampered_is_one_sentence(runs, tmp_path, monkeypatch, capsys, how):
    source = _source_copy(runs, tmp_path)
    change, named = DRAFT_SOURCES[how]
    change(source)
    monkeypatch.setattr(corpus_module, "load_corpus", lambda root=None: pytest.fail("the corpus was read"))
    assert cli_main(["--out", str(tmp_path / "out"), "--draft-from", str(source), "--draft-steps", "9", *RUN]) == 1
    one_line(capsys, "--draft-from", named)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- --init-from
def test_init_from_starts_a_new_run_from_the_sources_released_weights(runs, tmp_path, capsys):
    from dsv41.train.loop import Trainer
    from dsv41.train.masters import checkpoint_params

    source = runs["finished"] / "checkpoint"
    given = {"backbone_steps": 2, "draft_steps": 1, "batch": 2, "seq_len": 32}
    trainer = Trainer(str(tmp_path / "a"), given, compile=False, progress=False, init_from=str(source))
    released = checkpoint_params(str(source))
    assert set(trainer.params) == set(released)
    assert all(torch.equal(trainer.params[n], released[n]) for n in released)  # the draft's too
    source_seed = json.loads((source / miniature.MANIFEST_NAME).read_text())["seed"]
    assert trainer.state.step == 0 and trainer.settings.seed == source_seed + 1
    # the source's seed would draw its batches again
    with pytest.raises(TrainError, match="--seed"):
        Trainer(str(tmp_path / "b"), {**given, "seed": source_seed}, compile=False, init_from=str(source))
    assert not (tmp_path / "b").exists()


def test_an_init_from_run_counts_its_sources_time_and_tokens_and_keeps_its_facts(runs, tmp_path, capsys):
    source = runs["finished"] / "checkpoint"
    out = tmp_path / "further"
    args = ["--out", str(out), "--init-from", str(source), "--steps", "2", "--draft-steps", "1", "--lr", "1e-3"]
    assert cli_main([*args, *RUN]) == 0
    capsys.readouterr()
    before = json.loads((source / miniature.MANIFEST_NAME).read_text())
    after = json.loads((out / "checkpoint" / miniature.MANIFEST_NAME).read_text())
    assert after["steps"] == 3 and after["settings"]["lr"] == 1e-3 and after["settings"]["backbone_steps"] == 2
    total = before["training_seconds"] + after["run_training_seconds"]
    assert after["training_seconds"] == pytest.approx(total, abs=0.1)
    assert after["tokens_seen"] == before["tokens_seen"] + 2 * 2 * 32
    kept = after["initialized_from"]
    assert kept["manifest_sha256"] == hashlib.sha256((source / miniature.MANIFEST_NAME).read_bytes()).hexdigest()
    assert {k: v for k, v in kept.items() if k != "manifest_sha256"} == {
        k: v for k, v in before.items() if k not in ("files", "format")
    }
    assert f"trained {before['steps'] + 3} steps in 2 runs" in miniature.describe(out / "checkpoint")
    state = json.loads((out / STATE_NAME).read_text())
    assert state["initialized_from"]["path"] == str(source) and state["continued_from"] is None
    # resuming it may name the same source, not another, and a run started at random none
    assert cli_main(["--out", str(out), "--resume", "--init-from", str(runs["stopped"]), *RUN]) == 1
    one_line(capsys, "started from", str(source), "without --init-from")
    stopped = copy_of(runs, "stopped", tmp_path)
    assert cli_main(["--out", str(stopped), "--resume", "--init-from", str(source), *RUN]) == 1
    one_line(capsys, "started from random weights")
    assert cli_main(["--out", str(tmp_path / "both"), "--init-from", str(source), "--draft-from", str(source)]) == 1
    one_line(capsys, "--draft-from and --init-from")
    assert not (tmp_path / "both").exists()
    # more draft steps on it (--draft-from) go on with that run: its lineage and its own time stay
    more = tmp_path / "more"
    assert cli_main(["--out", str(more), "--draft-from", str(out / "checkpoint"), "--draft-steps", "2", *RUN[4:]]) == 0
    capsys.readouterr()
    last = json.loads((more / "checkpoint" / miniature.MANIFEST_NAME).read_text())
    assert last["steps"] == 4 and last["initialized_from"] == kept
    assert "initialized_from" not in last["draft_continued_from"]
    assert last["tokens_seen"] == after["tokens_seen"]
    this_phase = last["training_seconds"] - after["training_seconds"]
    assert this_phase > 0 and last["run_training_seconds"] == pytest.approx(
        after["run_training_seconds"] + this_phase, abs=0.1
    )
    assert f"trained {before['steps'] + 4} steps in 2 runs" in miniature.describe(more / "checkpoint")


def test_a_state_written_before_init_from_existed_resumes(runs, tmp_path, capsys):
    folder = copy_of(runs, "stopped", tmp_path)
    path = folder / STATE_NAME
    document = json.loads(path.read_text())
    assert document.pop("initialized_from") is None
    path.write_text(json.dumps(document))
    assert cli_main(["--out", str(folder), "--resume", "--stop-at", "3", *RUN]) == 0
    assert "stopped at step 3 of 5" in capsys.readouterr().err


def test_a_state_written_before_pool_sequences_existed_resumes_with_the_pool_it_had(runs, tmp_path, capsys):
    folder = copy_of(runs, "stopped", tmp_path)
    path = folder / STATE_NAME
    document = json.loads(path.read_text())
    assert document["settings"].pop("pool_sequences") == TrainSettings.pool_sequences
    path.write_text(json.dumps(document))
    code = cli_main(["--out", str(folder), "--resume", "--stop-at", "3", *RUN])
    assert code == 0, capsys.readouterr().err
    assert "stopped at step 3 of 5" in capsys.readouterr().err
    assert json.loads(path.read_text())["settings"]["pool_sequences"] == TrainSettings.pool_sequences


def test_what_a_draft_from_run_carries_is_checked_its_later_keys_optional():
    from dsv41.train.state import CONTINUED_KEYS, continued_problem

    older = {
        "path": "/x",
        "manifest_sha256": "0" * 64,
        "steps": 5,
        "training_seconds": 1.0,
        "final_train_loss": None,
        "tokens_seen": 128,
    }
    assert set(older) == set(CONTINUED_KEYS) and continued_problem(older) is None  # written before the lineage keys
    assert continued_problem({**older, "initialized_from": {"steps": 4}, "run_training_seconds": 2.5}) is None
    for key, value in (("initialized_from", [4]), ("run_training_seconds", -1.0), ("run_training_seconds", "2")):
        assert continued_problem({**older, key: value}).startswith(f"continued_from.{key} must be")
    assert continued_problem({**older, "surprise": 1}).startswith("continued_from must be")
    assert continued_problem({k: v for k, v in older.items() if k != "steps"}).startswith("continued_from must be")


@pytest.mark.parametrize("value", [{"path": "x"}, [1], {"path": 1, "manifest_sha256": "0" * 64, "facts": {}}])
def test_a_damaged_initialized_from_is_one_sentence(runs, tmp_path, capsys, value):
    folder = copy_of(runs, "stopped", tmp_path)
    path = folder / STATE_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "initialized_from": value}))
    before = snapshot(folder)
    assert cli_main(["--out", str(folder), "--resume", *RUN]) == 1
    one_line(capsys, "initialized_from must be")
    assert snapshot(folder) == before


@pytest.mark.parametrize("value", ["0", "-1e-3", "nan", "inf", "11", "fast"])
def test_an_lr_that_is_no_rate_is_a_usage_error(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as done:
        cli_main(["--out", str(tmp_path / "out"), f"--lr={value}"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lr: must be a number above 0" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- copies of the miniature
def _tensor_offset(folder: Path, name: str) -> tuple[Path, int]:
    """(the shard holding `name`, the file offset of its middle byte)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return shard, 8 + n + (begin + end) // 2


@pytest.fixture
def miniature_copy(miniature_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(miniature_checkpoint, tmp_path / "copy"))


@pytest.mark.parametrize("tensor", ["head.weight", "layers.0.attn.wq_a.weight", "layers.3.ffn.experts.5.w2.weight"])
def test_a_copy_of_the_miniature_with_one_byte_changed_is_a_load_error_naming_the_file(miniature_copy, tensor):
    """Reproduces: a copy with one byte changed loaded silently, reported as the embedded miniature."""
    shard, at = _tensor_offset(miniature_copy, tensor)
    raw = bytearray(shard.read_bytes())
    raw[at] ^= 0x10
    shard.write_bytes(bytes(raw))
    with pytest.raises(LoadError) as caught:
        dsv41.load(str(miniature_copy), quiet=True)
    assert shard.name in str(caught.value) and "\n" not in str(caught.value)


MANIFEST_FIELDS = {
    "steps": "many",
    "seed": -1,
    "training_seconds": None,
    "tokens_seen": "3M",
    "final_train_loss": [2.2],
    "corpus": "python",
    "settings": "defaults",
    "held_out": {"release_format": {"bits_per_byte": "1.4"}},
    "files": {"../../etc/passwd": {"size": 1, "sha256": "0" * 64}},
    "format": "something-else",
}


@pytest.mark.parametrize("field", list(MANIFEST_FIELDS))
def test_a_manifest_field_of_the_wrong_kind_is_one_load_error(miniature_copy, field):
    _edit_manifest(miniature_copy, lambda m: m.update({field: MANIFEST_FIELDS[field]}))
    with pytest.raises(LoadError) as caught:
        dsv41.load(str(miniature_copy), quiet=True)
    message = str(caught.value)
    assert miniature.MANIFEST_NAME in message and "\n" not in message and len(message) < 300


def test_a_manifest_that_is_a_fifo_is_one_load_error_not_a_hang(miniature_copy):
    (miniature_copy / miniature.MANIFEST_NAME).unlink()
    os.mkfifo(miniature_copy / miniature.MANIFEST_NAME)
    with pytest.raises(LoadError, match="not a regular file"):
        dsv41.load(str(miniature_copy), quiet=True)


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "1" * 5000, "[" * 100000])
def test_a_manifest_that_is_not_json_of_an_object_is_one_load_error(miniature_copy, text):
    (miniature_copy / miniature.MANIFEST_NAME).write_text(text)
    with pytest.raises(LoadError) as caught:
        dsv41.load(str(miniature_copy), quiet=True)
    assert miniature.MANIFEST_NAME in str(caught.value)


def test_only_the_packaged_folder_is_called_the_embedded_miniature(miniature_checkpoint, miniature_copy, runs):
    packaged = dsv41.load(miniature_checkpoint, quiet=True).report.embedded
    copied = dsv41.load(str(miniature_copy), quiet=True).report.embedded
    trained = dsv41.load(str(runs["finished"] / "checkpoint"), quiet=True).report.embedded
    manifest = json.loads((Path(miniature_checkpoint) / miniature.MANIFEST_NAME).read_text())
    steps, runs_made = miniature.lineage(manifest)  # its own run's steps and those of each run it began from
    assert steps >= manifest["steps"] and runs_made >= 1
    assert packaged.startswith(f"the embedded miniature: trained {steps} steps")
    assert copied.startswith(f"a copy of the embedded miniature at {miniature_copy}")
    assert trained.startswith(f"a miniature written by dsv41 train at {runs['finished'] / 'checkpoint'}")


def test_the_verdict_is_kept_until_a_file_changes(miniature_copy, monkeypatch):
    hashed = []
    real = miniature.file_sha256
    monkeypatch.setattr(miniature, "file_sha256", lambda path: hashed.append(path) or real(path))
    listed = len(json.loads((miniature_copy / miniature.MANIFEST_NAME).read_text())["files"])
    assert miniature.verify(miniature_copy) is not None and len(hashed) == listed
    assert miniature.verify(miniature_copy) is not None and len(hashed) == listed  # nothing hashed again
    config = miniature_copy / "config.json"
    config.write_bytes(config.read_bytes().replace(b"{", b"{ ", 1))  # same JSON, another file
    with pytest.raises(miniature.MiniatureError, match="config.json"):
        miniature.verify(miniature_copy)


def test_the_draft_phase_reads_the_targets_own_greedy_continuations(miniature_checkpoint, tmp_path, monkeypatch):
    """The greedy pool a draft phase trains on beside the text: each row is BOS and a prompt from
    the train stream, then what the target released as a checkpoint decodes greedily after it
    (the loaded miniature's own argmax at each position, read back here by one prefill of the row:
    under the reference arithmetic a prefill and one-token steps part on about 6% of this
    miniature's greedy positions, measured 0.93-0.94 agreement, and under `Numerics.parity()` on
    none; an off-by-one would agree on almost none). Every other draft step reads it, its anchors
    past the prompt."""
    from dsv41.train import draft
    from dsv41.train.loop import Trainer

    monkeypatch.setattr(draft, "POOL_BATCH", 4)
    shipped = json.loads((Path(miniature_checkpoint) / miniature.MANIFEST_NAME).read_text())
    more = {
        "draft_steps": shipped["steps"] - shipped["settings"]["backbone_steps"] + 800,  # past those it has had
        "pool_sequences": 4,
    }
    trainer = Trainer(str(tmp_path / "out"), more, draft_from=miniature_checkpoint, compile=False)
    phase = draft.DraftTrainer(trainer)
    pool = phase.pool
    n, prompt = draft.pool_shape(trainer.settings)
    assert n == 4 and prompt == draft.POOL_PROMPT and pool.shape == (4, trainer.settings.seq_len)
    assert (pool[:, 0] == trainer.cfg.bos_token_id).all()
    stream = torch.from_numpy(trainer.streams.train.astype("int64"))
    for row in pool:  # the prompt is a stretch of the train stream
        first = row[1:prompt].tolist()
        assert any(
            stream[o : o + prompt - 1].tolist() == first for o in (stream == first[0]).nonzero().flatten().tolist()
        )
    model = dsv41.load(miniature_checkpoint, quiet=True, max_batch_size=4, max_seq_len=trainer.settings.seq_len)
    with torch.no_grad():
        logits = model(pool, 0, all_positions=True)  # [4, seq_len, vocab]
    chosen = logits[:, prompt - 1 : -1].argmax(-1)  # what follows each position from the prompt's last on
    agree = (chosen == pool[:, prompt:]).float().mean().item()
    assert agree > 0.9, agree
    assert phase.from_pool(1) and not phase.from_pool(2)
    assert phase.inputs(3).shape == (trainer.settings.batch, trainer.settings.seq_len)
    assert all(any(torch.equal(r, p) for p in pool) for r in phase.inputs(3))
    assert phase.anchors(3, trainer.settings.seq_len, 2).min() >= prompt - 1
