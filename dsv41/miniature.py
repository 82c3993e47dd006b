"""The embedded default: the trained miniature that ships inside the package (`data/miniature`),
in the release format, with `dsv41-miniature.json` beside it (corpus, seed, steps, losses,
training seconds, each file's size and sha256). `dsv41 train` writes such a folder; copying its
`checkpoint/` here makes it the default.

`embedded_checkpoint()` is what every command uses when no checkpoint is named: the miniature when
the package holds it (checked against its manifest once per process), else the random tiny
checkpoint (`tiny.default_checkpoint`). `describe(path)` says which, for the load report.
"""

from __future__ import annotations

import json
import os
from importlib import resources

from .cachedir import file_sha256
from .errors import Dsv41Error

MANIFEST_NAME = "dsv41-miniature.json"
MANIFEST_FORMAT = "dsv41-miniature-checkpoint"

_VERIFIED: set[str] = set()


class MiniatureError(Dsv41Error, RuntimeError):
    pass


def packaged_folder() -> str:
    return str(resources.files("dsv41").joinpath("data", "miniature"))


def read_manifest(folder: str) -> dict | None:
    """The miniature manifest in `folder`, or None when it holds none."""
    try:
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else None


def check_files(folder: str, manifest: dict) -> None:
    """Every file the manifest lists is there with its size and sha256 (MiniatureError if not)."""
    for rel, entry in sorted(manifest.get("files", {}).items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise MiniatureError(f"{folder}: {rel} is missing; reinstall dsv41")
        if os.path.getsize(path) != entry["size"] or file_sha256(path) != entry["sha256"]:
            raise MiniatureError(f"{folder}: {rel} does not match its manifest; reinstall dsv41")


def embedded_checkpoint(progress: bool | None = None) -> str:
    """The packaged miniature's folder, or (none packaged) the random tiny checkpoint's."""
    folder = packaged_folder()
    manifest = read_manifest(folder)
    if manifest is None:
        from .tiny import default_checkpoint

        return default_checkpoint(progress=progress)
    if folder not in _VERIFIED:
        check_files(folder, manifest)
        _VERIFIED.add(folder)
    return folder


def describe(path: str) -> str:
    """One line on what the checkpoint at `path` is, when it is an embedded one ("" otherwise)."""
    manifest = read_manifest(path)
    if manifest is not None:
        held = manifest.get("held_out", {}).get("release_format", {})
        bpb = held.get("bits_per_byte")
        return (f"the embedded miniature: trained {manifest.get('steps')} steps "
                f"({manifest.get('training_seconds', 0) / 60:.0f} min) on the Python {manifest.get('corpus', {}).get('python')} "
                f"standard library, seed {manifest.get('seed')}"
                + (f", held-out {bpb:.3f} bits/byte" if bpb is not None else ""))
    from .tiny import MANIFEST_NAME as TINY_MANIFEST

    if os.path.isfile(os.path.join(path, TINY_MANIFEST)):
        return "the random tiny checkpoint (dsv41 make-tiny): its generations are noise"
    return ""
