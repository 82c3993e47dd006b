"""Where dsv41 keeps what it builds once per machine: the embedded default checkpoint and the
native CPU kernels."""

import os
from pathlib import Path

CACHE_ENV = "DSV41_CACHE"


def cache_root() -> Path:
    """$DSV41_CACHE, else $XDG_CACHE_HOME/dsv41, else ~/.cache/dsv41."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv41"


def current_umask() -> int:
    """The process umask (read by setting it and putting it back), for files that must get the
    mode any other file written here gets."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
