"""What dsv41 builds once and keeps (the default checkpoint, the native kernels) and make-tiny's
output folder, when they find something they did not write or something that changed since."""

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv41.checkpoint import formats, tiny
from dsv41.checkpoint.headers import INDEX_NAME

HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on PATH: the native kernels cannot be built here")


def _files(directory):
    root = Path(directory)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


# ---------------------------------------------------------------------- make-tiny's folder
def test_make_tiny_refuses_a_folder_holding_another_checkpoint(tmp_path, capsys):
    other = tmp_path / "other"
    (other / "inference").mkdir(parents=True)
    theirs = {
        "config.json": b'{"model_type": "someone-else"}\n',
        "inference/config.json": b"{}\n",
        INDEX_NAME: b'{"weight_map": {}}\n',
        "notes.txt": b"mine",
    }
    for name, data in theirs.items():
        (other / name).write_bytes(data)
    assert tiny.cli_main([str(other)]) == 1
    line = _one_line(capsys)
    assert str(other) in line and "--force" in line
    assert _files(other) == theirs
    assert [p.name for p in tmp_path.iterdir()] == ["other"], "nothing left beside it"


def test_make_tiny_force_replaces_the_folder_whole(tiny_checkpoint, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "notes.txt").write_text("mine")
    assert tiny.cli_main([str(other), "--force"]) == 0
    assert _files(other) == _files(tiny_checkpoint)
    assert [p.name for p in tmp_path.iterdir()] == ["other"]


def test_make_tiny_rewrites_its_own_checkpoint_of_the_same_seed_only(tmp_path, capsys):
    out = tmp_path / "ck"
    assert tiny.cli_main([str(out), "--seed", "1"]) == 0
    first = _files(out)
    assert tiny.MANIFEST_NAME in first
    assert tiny.cli_main([str(out), "--seed", "1"]) == 0
    assert _files(out) == first
    capsys.readouterr()
    assert tiny.cli_main([str(out), "--seed", "2"]) == 1
    line = _one_line(capsys)
    assert str(out) in line and "seed 1" in line and "--force" in line
    assert _files(out) == first


def test_make_tiny_refuses_its_own_checkpoint_with_foreign_files_added(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, out)
    (out / "notes.txt").write_text("mine")
    assert tiny.cli_main([str(out)]) == 1
    line = _one_line(capsys)
    assert "notes.txt" in line and "--force" in line
    assert (out / "notes.txt").read_text() == "mine"


def test_a_failed_rewrite_leaves_the_old_checkpoint_and_nothing_beside(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, out)
    before = _files(out)
    real, calls = formats.save_safetensors, []

    def dies_on_the_third_shard(tensors, path):
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"half")
            raise OSError(28, "No space left on device", str(path))
        real(tensors, path)

    monkeypatch.setattr(formats, "save_safetensors", dies_on_the_third_shard)
    assert tiny.cli_main([str(out)]) == 1
    assert "No space left on device" in _one_line(capsys)
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


# ---------------------------------------------------------------------- the default checkpoint's cache
@pytest.fixture
def cached(tiny_checkpoint, tmp_path, monkeypatch):
    """A private cache holding a good seed-0 checkpoint, as a first run leaves it, in a process that
    has checked nothing yet."""
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny, "_VERIFIED", set(), raising=False)
    # the version the session's checkpoint was written under, whatever is edited in the tree since
    version = json.loads((Path(tiny_checkpoint) / tiny.MANIFEST_NAME).read_text())["content_version"]
    monkeypatch.setattr(tiny, "content_version", lambda: version)
    folder = tmp_path / "cache" / f"tiny-0-{version}"
    shutil.copytree(tiny_checkpoint, folder)
    return folder


def _assert_rebuilt(folder, tiny_checkpoint, capsys, *words):
    assert tiny.default_checkpoint(progress=False) == str(folder)
    assert _files(folder) == _files(tiny_checkpoint)
    line = _one_line(capsys)
    assert str(folder) in line and "rebuild" in line and all(w in line for w in words), line
    assert [p.name for p in folder.parent.iterdir()] == [folder.name], "nothing left beside it"


def test_cache_overwritten_payload_bytes_are_noticed_and_rebuilt(cached, tiny_checkpoint, capsys):
    shard = cached / "model-00003-of-00016.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100:] = bytes(100)  # the same size: only the digest tells
    shard.write_bytes(bytes(data))
    _assert_rebuilt(cached, tiny_checkpoint, capsys, shard.name)


def test_cache_truncated_shard_is_rebuilt(cached, tiny_checkpoint, capsys):
    shard = cached / "model-00005-of-00016.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    _assert_rebuilt(cached, tiny_checkpoint, capsys, shard.name)


def test_cache_without_its_index_is_rebuilt(cached, tiny_checkpoint, capsys):
    (cached / INDEX_NAME).unlink()
    _assert_rebuilt(cached, tiny_checkpoint, capsys, INDEX_NAME)


def test_cache_is_checked_once_per_process(cached, tiny_checkpoint, capsys):
    assert tiny.default_checkpoint(progress=False) == str(cached)
    assert capsys.readouterr().err == ""
    (cached / "tokenizer.json").write_text("{}")  # a later change: this process trusts its first verdict
    assert tiny.default_checkpoint(progress=False) == str(cached)
    assert (cached / "tokenizer.json").read_text() == "{}"


@pytest.mark.parametrize("where", ["file", "file/below"])
def test_cache_env_naming_a_file_is_one_sentence(tmp_path, monkeypatch, where):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / where))
    monkeypatch.setattr(tiny, "_VERIFIED", set(), raising=False)
    with pytest.raises(Exception) as caught:
        tiny.default_checkpoint(progress=False)
    assert type(caught.value).__name__ == "CacheError", repr(caught.value)  # the callers' one type to catch
    message = str(caught.value)
    assert str(tmp_path / "file") in message and "DSV41_CACHE" in message and "\n" not in message
    assert (tmp_path / "file").read_text() == "x"


# ---------------------------------------------------------------------- the native kernel cache
@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """A process that has loaded no native library yet, with its own cache and held to the plain
    level (one portable flag set), so the library's name is known before it is built."""
    import dsv41.kernels.experts as ex
    from dsv41.kernels import native

    monkeypatch.setenv("DSV41_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setenv(native.ISA_ENV, "plain")
    monkeypatch.setattr(ex, "_SAID", set())
    return native


def _library(native, tmp_path) -> Path:
    key = native._build_key(os.environ.get("CC", "cc"), ["-O3"], native.SOURCE.read_bytes())
    path = tmp_path / "native" / f"dsv41_native-{key}.so"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _assert_rebuilt_library(native, path, capsys):
    kernels = native.load()
    assert kernels is not None and kernels.path == path, native.unavailable_reason()
    line = _one_line(capsys)
    assert path.name in line and "rebuild" in line, line
    assert Path(f"{path}.sha256").read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest()


@needs_cc
def test_native_garbage_library_is_rebuilt(fresh_native, tmp_path, capsys):
    path = _library(fresh_native, tmp_path)
    path.write_bytes(b"\x7fELF this is not a library" * 40)
    _assert_rebuilt_library(fresh_native, path, capsys)


@needs_cc
def test_native_loadable_foreign_library_is_rebuilt(fresh_native, tmp_path, capsys):
    path = _library(fresh_native, tmp_path)
    source = tmp_path / "other.c"
    source.write_text("int other_function(void) { return 1; }\n")
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    _assert_rebuilt_library(fresh_native, path, capsys)


@needs_cc
def test_native_library_is_trusted_by_its_record_and_built_once(fresh_native, tmp_path, monkeypatch, capsys):
    kernels = fresh_native.load()
    assert kernels is not None, fresh_native.unavailable_reason()
    record = Path(f"{kernels.path}.sha256")
    assert record.is_file() and capsys.readouterr().err == ""
    monkeypatch.setattr(fresh_native, "_STATE", {})
    monkeypatch.setattr(fresh_native, "_compile", lambda *args: pytest.fail("compiled again"))
    assert fresh_native.load().path == kernels.path and capsys.readouterr().err == ""


@needs_cc
def test_native_cache_env_naming_a_file_falls_back_with_one_sentence(fresh_native, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "file"))
    assert fresh_native.load() is None
    reason = fresh_native.unavailable_reason()
    assert str(tmp_path / "file") in reason and "DSV41_CACHE" in reason
