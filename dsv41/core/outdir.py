"""Folders a command writes its results into, and the files it replaces there.

A command writes only into a folder that is new, empty, or one it wrote itself: it leaves a marker
file of its own there (`claim_folder`), and anything else is refused in one sentence before any
work starts, as are a path that is a file or lies under one and a folder that refuses new files
(found out by making one: mode bits do not tell, as root every one passes and a read-only mount
refuses whatever they say). What it writes replaces its earlier file whole: written beside it
under a temporary name and renamed over it (`replace_file`, `write_json`, `replace_folder`), so an
interrupted write leaves the earlier file, never half of one. Standard library only."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .cachedir import current_umask
from .errors import Dsv41Error
from .text import bounded_ints


class OutDirError(Dsv41Error, ValueError):
    """An output folder that cannot be used; the message is one sentence naming it and the fix."""


def creation_refused(folder) -> str | None:
    """None when a new file can be made in the existing folder `folder`, else the system's reason
    ("Read-only file system"): a file is created there and removed."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".dsv41-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.remove(probe)
    return None


def listing(names, shown: int = 3) -> str:
    """A few names of a folder's entries for a message: "a, b, c and 4 more"."""
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def usable_folder(path, flag: str) -> Path:
    """`path` resolved (through a link: where it points), checked for a folder a command may create
    or write in: OutDirError when it is a file, lies under a file, or it (else its nearest existing
    parent) refuses new files. Creates nothing."""
    folder = Path(os.path.realpath(os.fspath(path)))
    if folder.exists() and not folder.is_dir():
        raise OutDirError(f"{flag} {path} is a file, not a folder; give a folder")
    blocker = next((p for p in folder.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OutDirError(f"{flag} {path}: {blocker} is a file, not a folder; give a folder elsewhere")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    refused = creation_refused(existing)
    if refused:
        where = "this folder" if existing == folder else f"{existing}, where it would be created"
        raise OutDirError(f"{flag} {path}: cannot write into {where} ({refused}); choose a writable folder")
    return folder


def read_marker(folder: Path, marker: str, fmt: str) -> dict | None:
    """The marker `marker` in `folder` when it is one of format `fmt`, else None."""
    if not (folder / marker).is_file():  # a FIFO would block
        return None
    try:
        with open(folder / marker, encoding="utf-8") as f:
            found = json.loads(f.read(1 << 20), parse_int=bounded_ints(30))
    except (OSError, ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) and found.get("format") == fmt else None


def inspect_folder(
    path, *, marker: str, fmt: str, flag: str, command: str, foreign: Callable[[set[str]], str] | None = None
) -> tuple[Path, dict | None]:
    """(the folder at `path` resolved, its marker's contents or None when it is missing or empty)
    when `command` may write there; OutDirError when `usable_folder` refuses it or it holds
    anything without the marker `marker` of format `fmt` (`foreign(names)` may say better what
    such a folder holds, e.g. an older format of the command's own files). Writes nothing."""
    folder = usable_folder(path, flag)
    found = read_marker(folder, marker, fmt) if folder.is_dir() else None
    if found is not None:
        return folder, found
    names = set(os.listdir(folder)) if folder.is_dir() else set()
    if names:
        what = (foreign(names) if foreign else "") or f"holds {listing(names)} and is not a folder {command} wrote"
        raise OutDirError(
            f"{flag} {path} {what} (no {marker}); {command} writes only into a new or empty folder "
            f"or one it wrote itself: give another {flag}"
        )
    return folder, None


def claim_folder(
    path, *, marker: str, fmt: str, flag: str, command: str, foreign: Callable[[set[str]], str] | None = None
) -> tuple[Path, dict]:
    """The folder at `path` (resolved) made ready for `command` to write in, and its marker's
    contents: as `inspect_folder` allows it, created when missing, and the marker written into it
    when new or empty."""
    folder, found = inspect_folder(path, marker=marker, fmt=fmt, flag=flag, command=command, foreign=foreign)
    if found is not None:
        return folder, found
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutDirError(f"{flag} {path}: cannot create this folder ({exc.strerror or exc}); choose another") from None
    found = {"format": fmt, "note": f"written by {command}, which writes only into folders holding this file"}
    write_json(folder / marker, found)
    return folder, found


def replace_file(path, write: Callable[[str], None]) -> None:
    """`write(temporary path)` in `path`'s folder, then that file renamed over `path`; on any
    failure (Ctrl-C included) the temporary file is removed and `path` is as it was. The file gets
    the mode a new file gets here (mkstemp's own is owner-only)."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=folder or ".")
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


def write_json(path, data) -> None:
    """`data` as indented JSON (keys sorted), replacing `path` whole."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    replace_file(path, write)


def is_temporary(name: str, of: str) -> bool:
    """Whether `name` is one of `replace_file`'s temporary names for a file named `of` (left behind
    only when the process was killed while writing it)."""
    return name.startswith(f".{of}.") and name.endswith(".partial")


def replace_folder(tmp, target) -> None:
    """Rename the complete folder `tmp` to `target`; whatever `target` holds is moved aside first
    and deleted only once `tmp` has its place (should even putting it back fail, it stays beside)."""
    tmp, target = Path(tmp), Path(target)
    try:
        os.rename(tmp, target)  # target missing or an empty folder
        return
    except OSError:
        if not os.path.lexists(target):
            raise
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    try:
        os.rename(target, aside / target.name)
    except OSError:
        shutil.rmtree(aside, ignore_errors=True)
        raise
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(aside / target.name, target)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
