"""Where dsv41 keeps what it builds once per machine: the embedded default checkpoint and the
native CPU kernels. Each records the sha256 of what it wrote, so a later run can tell its own
output from anything else found there."""

import hashlib
import os
from pathlib import Path

from dsv41.core.errors import Dsv41Error

CACHE_ENV = "DSV41_CACHE"


class CacheError(Dsv41Error, RuntimeError):
    """The cache folder cannot be used; the message is one sentence naming it and the fix."""


def cache_root() -> Path:
    """$DSV41_CACHE, else $XDG_CACHE_HOME/dsv41, else ~/.cache/dsv41."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv41"


def cache_dir(*parts: str) -> Path:
    """cache_root() / parts, created if missing; CacheError where that cannot be done."""
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cache_error(path, exc) from None
    return path


def cache_error(path, exc: OSError) -> CacheError:
    """The CacheError for `exc`, met creating or writing `path` under the cache."""
    root = cache_root()
    where = f"the dsv41 cache {root}" + (f" (${CACHE_ENV})" if os.environ.get(CACHE_ENV) else "")
    path = Path(path)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker == root:
        return CacheError(f"{where} is a file, not a folder; point ${CACHE_ENV} at a folder or remove the file")
    if blocker is not None:
        return CacheError(
            f"{where} is unusable: {blocker} is a file, not a folder; point ${CACHE_ENV} at a folder or remove the file"
        )
    return CacheError(
        f"{where} cannot be written ({path}: {exc.strerror or exc}); point ${CACHE_ENV} at a writable folder with room"
    )


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def current_umask() -> int:
    """The process umask (read by setting it and putting it back), for files that must get the
    mode any other file written here gets."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
