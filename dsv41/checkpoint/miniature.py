"""The embedded default: the trained miniature that ships inside the package (`data/miniature`),
in the release format, with `dsv41-miniature.json` beside it (corpus, seed, steps, losses,
training seconds, each file's size and sha256). `dsv41 train` writes such a folder; copying its
`checkpoint/` here makes it the default.

`embedded_checkpoint()` is what every command uses when no checkpoint is named: the miniature when
the package holds it, else the random tiny checkpoint (`tiny.default_checkpoint`). Wherever a
folder's manifest claims sizes and sha256s (the packaged one, a copy of it, what `dsv41 train`
wrote) `verify` holds the files to them before anything is read, once per folder until one of its
files changes. `describe(path)` says which checkpoint a path is, for the load report: only the
packaged folder is "the embedded miniature".
"""

from __future__ import annotations

import json
import math
import os
import re
from importlib import resources

from ..core.cachedir import file_sha256
from ..core.errors import Dsv41Error
from ..core.text import bounded_ints, brief, json_kind

MANIFEST_NAME = "dsv41-miniature.json"
MANIFEST_FORMAT = "dsv41-miniature-checkpoint"
# A manifest lists a few dozen files and some facts; anything much larger is not one.
MAX_MANIFEST_BYTES = 16 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")

# realpath -> the stat of the manifest and of every file it lists when they last matched it
_VERIFIED: dict[str, tuple] = {}


class MiniatureError(Dsv41Error, RuntimeError):
    pass


def packaged_folder() -> str:
    return str(resources.files("dsv41").joinpath("data", "miniature"))


def read_manifest(folder) -> dict | None:
    """The miniature manifest in `folder` with its fields checked, or None when it holds none.
    MiniatureError naming the file when one is there but is not JSON, not a miniature manifest or
    has a field of the wrong kind."""
    path = os.path.join(folder, MANIFEST_NAME)
    if os.path.lexists(path) and not os.path.isfile(path):  # a FIFO or device would block or never end
        raise MiniatureError(f"{path} is not a regular file, so not a miniature manifest")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise MiniatureError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise MiniatureError(f"{path} is over {MAX_MANIFEST_BYTES >> 20} MiB, which no miniature manifest is")
    try:
        manifest = json.loads(raw.decode("utf-8"), parse_int=bounded_ints(30))
    except (ValueError, RecursionError):
        raise MiniatureError(f"{path} is not readable JSON; restore it from where the checkpoint came from") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = brief(manifest.get("format")) if isinstance(manifest, dict) else json_kind(manifest)
        raise MiniatureError(f"{path} is not a miniature manifest (format {MANIFEST_FORMAT!r} expected, got {found})")
    problem = manifest_problem(manifest)
    if problem:
        raise MiniatureError(f"{path}: {problem}")
    return manifest


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a miniature manifest's fields (None: nothing): the file list must be
    relative paths with a size and a sha256 each, and the facts the report and `dsv41 train
    --draft-from` read must be of their kinds where present."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"files must be an object naming each file, got {brief(files)}"
    for rel, entry in files.items():
        parts = rel.split("/")
        if rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts) or rel == MANIFEST_NAME:
            return f"files names {brief(rel)}, which is not a file inside the checkpoint"
        if not (
            isinstance(entry, dict)
            and _count(entry.get("size"))
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
        ):
            return f"files[{brief(rel)}] must be an object with a size (bytes) and a sha256 (64 hex digits)"
    for key, ok, kind in (
        ("steps", _count, "a whole number"),
        ("seed", _count, "a whole number"),
        ("training_seconds", lambda v: _number(v) and v >= 0, "a number of seconds"),
        ("tokens_seen", lambda v: v is None or _count(v), "a whole number or null"),
        ("final_train_loss", lambda v: v is None or _number(v), "a number or null"),
        (
            "corpus",
            lambda v: isinstance(v, dict) and isinstance(v.get("python", ""), str),
            "an object naming its Python",
        ),
        (
            "settings",
            lambda v: isinstance(v, dict) and all(_count(x) for x in v.values() if not isinstance(x, float)),
            "an object of numbers",
        ),
        (
            "initialized_from",
            lambda v: isinstance(v, dict) and _count(v.get("steps")) and _number(v.get("training_seconds")),
            "an object of the source's facts with its steps and training_seconds",
        ),
        (
            "held_out",
            lambda v: isinstance(v, dict) and _bits_per_byte(v) is not False,
            "an object with release_format.bits_per_byte a number",
        ),
    ):
        if key in manifest and not ok(manifest[key]):
            return f"{key} must be {kind}, got {brief(manifest[key])}"
    return None


def _bits_per_byte(held_out: dict):
    """The release format's held-out bits per byte, None when absent, False when of another kind."""
    release = held_out.get("release_format", {})
    if not isinstance(release, dict):
        return False
    value = release.get("bits_per_byte")
    return value if value is None or _number(value) else False


def _signature(folder: str, manifest_stat: os.stat_result, files: dict) -> tuple:
    """What changes when a listed file does: each one's size, modification time and inode."""
    out = [(MANIFEST_NAME, manifest_stat.st_size, manifest_stat.st_mtime_ns, manifest_stat.st_ino)]
    for rel in sorted(files):
        try:
            st = os.stat(os.path.join(folder, rel))
        except OSError:
            return ()
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _fix(folder: str) -> str:
    return (
        "reinstall dsv41"
        if folder == os.path.realpath(packaged_folder())
        else "copy the checkpoint again from its source"
    )


def check_files(folder, manifest: dict) -> None:
    """Every file the manifest lists is there with its size and sha256 (MiniatureError naming the
    first that is not)."""
    folder = os.path.realpath(folder)
    for rel, entry in sorted(manifest["files"].items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise MiniatureError(f"{path} is missing, which {MANIFEST_NAME} lists; {_fix(folder)}")
        if os.path.getsize(path) != entry["size"] or file_sha256(path) != entry["sha256"]:
            raise MiniatureError(
                f"{path} does not match its size and sha256 in {MANIFEST_NAME}: the file was changed; {_fix(folder)}"
            )


def verify(folder) -> dict | None:
    """The manifest of `folder` once its files match it, or None when the folder holds no
    miniature manifest; MiniatureError (one sentence naming the file) otherwise. The verdict is
    kept per folder until the manifest or a listed file changes (size, time or inode), so
    loading the same checkpoint again hashes nothing."""
    try:
        folder = os.path.realpath(os.fspath(folder))
        manifest_stat = os.stat(os.path.join(folder, MANIFEST_NAME))
    except (OSError, TypeError, ValueError):  # no manifest, or no path at all: the loader says what is wrong
        return None
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    signature = _signature(folder, manifest_stat, manifest["files"])
    if not signature or _VERIFIED.get(folder) != signature:
        check_files(folder, manifest)
        _VERIFIED[folder] = signature
    return manifest


def embedded_checkpoint(progress: bool | None = None) -> str:
    """The packaged miniature's folder, or (none packaged) the random tiny checkpoint's."""
    folder = packaged_folder()
    if verify(folder) is None:
        from .tiny import default_checkpoint

        return default_checkpoint(progress=progress)
    return folder


def describe(path) -> str:
    """One line on what the checkpoint at `path` is, when dsv41 made it ("" otherwise): the
    packaged miniature is "the embedded miniature"; any other folder with a miniature manifest is
    named by its path."""
    try:
        manifest = read_manifest(path)
    except MiniatureError as exc:
        return f"a folder whose miniature manifest is damaged ({exc})"
    if manifest is not None:
        real = os.path.realpath(os.fspath(path))
        if real == os.path.realpath(packaged_folder()):
            what = "the embedded miniature"
        elif _same_manifest(real):
            what = f"a copy of the embedded miniature at {path}"
        else:
            what = f"a miniature written by dsv41 train at {path}"
        bpb = _bits_per_byte(manifest.get("held_out", {}))
        python = manifest.get("corpus", {}).get("python")
        steps, runs = lineage(manifest)
        return (
            f"{what}: trained {steps if steps is not None else '?'} steps"
            + (f" in {runs} runs" if runs > 1 else "")
            + f" ({manifest.get('training_seconds', 0) / 60:.0f} min) on the Python {python or '?'} "
            f"standard library, seed {manifest.get('seed', '?')}" + (f", held-out {bpb:.3f} bits/byte" if bpb else "")
        )
    from .tiny import MANIFEST_NAME as TINY_MANIFEST

    if os.path.isfile(os.path.join(path, TINY_MANIFEST)):
        return "the random tiny checkpoint (dsv41 make-tiny): its generations are noise"
    return ""


def lineage(manifest: dict) -> tuple[int | None, int]:
    """(steps, runs) of the training that made a miniature: its own run's steps plus those of each
    run it was started from (`dsv41 train --init-from`, kept in `initialized_from`); None when a
    run's steps are not recorded."""
    steps, runs = 0, 0
    while isinstance(manifest, dict):
        if not _count(manifest.get("steps")) or steps is None:
            steps = None
        else:
            steps += manifest["steps"]
        runs += 1
        manifest = manifest.get("initialized_from")
    return steps, runs


def _same_manifest(folder: str) -> bool:
    """Whether `folder`'s manifest is the packaged one's, byte for byte (a copy of the miniature)."""
    packaged = os.path.join(packaged_folder(), MANIFEST_NAME)
    try:
        return os.path.isfile(packaged) and file_sha256(packaged) == file_sha256(os.path.join(folder, MANIFEST_NAME))
    except OSError:
        return False
