"""The work folder of `dsv41 train`: what it writes there, and the folders it may write into.

It writes only into a new or empty folder or one it wrote itself (`dsv41-train.json`, its marker,
`outdir.claim_folder`); anything else is refused before any work, as is a folder of its own where
a file it writes is a folder, where `checkpoint/` holds what it did not write, or whose tokenizer
is no longer the one it wrote (the marker keeps its sha256). Temporary files a killed run left
(`outdir.replace_file`'s, the checkpoint built beside) are removed."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..checkpoint.miniature import MANIFEST_NAME, MiniatureError, read_manifest
from ..core.cachedir import file_sha256
from ..core.outdir import claim_folder, inspect_folder, listing, read_marker, write_json
from .state import PICKLED_STATE_NAME, STATE_NAME, TrainError

MARKER_NAME = "dsv41-train.json"
MARKER_FORMAT = "dsv41-train-folder"
TOKENIZER_NAME = "tokenizer.json"
TOKENS_NAME = "tokens.npz"
FACTS_NAME = "facts.json"
LOSS_CURVE_STEM = "loss_curve"
CHECKPOINT_NAME = "checkpoint"
# every file the command writes (the tensors files of the state beside: `state.TENSORS_FILE`)
OWN_FILES = (
    MARKER_NAME,
    STATE_NAME,
    TOKENIZER_NAME,
    TOKENS_NAME,
    FACTS_NAME,
    *(f"{LOSS_CURVE_STEM}.{ext}" for ext in ("png", "svg", "json")),
)
# what a killed run may leave: `replace_file`'s temporary files, the checkpoint built beside
_DEBRIS = re.compile(
    r"\.(%s|state-[0-9]{7}\.safetensors|%s)\.[^/]+\.(partial|old)"
    % ("|".join(re.escape(n) for n in OWN_FILES), CHECKPOINT_NAME)
)


def _earlier_format(names: set[str]) -> str:
    if PICKLED_STATE_NAME in names:
        return (
            f"holds {PICKLED_STATE_NAME}, a training state in the pickled format of earlier versions, which "
            f"is never loaded because unpickling can run code"
        )
    return ""


_CLAIM = dict(marker=MARKER_NAME, fmt=MARKER_FORMAT, flag="--out", command="dsv41 train", foreign=_earlier_format)


def inspect(out) -> Path:
    """The work folder at `out` (resolved) when a run may use it: new, empty, or written by this
    command with nothing in the way of what it writes; TrainError (an OutDirError for the folder
    itself) in one sentence otherwise. Writes nothing."""
    folder, marker = inspect_folder(out, **_CLAIM)
    if marker is None:
        return folder
    for name in OWN_FILES:
        if (folder / name).is_dir():
            raise TrainError(
                f"{folder / name} is a folder where dsv41 train writes a file; move it out, or give another --out"
            )
    check_checkpoint(folder / CHECKPOINT_NAME)
    return folder


def claim(out) -> Path:
    """The work folder at `out`, inspected, then created and marked when new or empty, the
    temporary files of a killed run removed."""
    inspect(out)
    folder, _ = claim_folder(out, **_CLAIM)
    for name in os.listdir(folder):
        if _DEBRIS.fullmatch(name):
            path = folder / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return folder


def check_checkpoint(path: Path) -> None:
    """TrainError unless `path` (the folder the checkpoint is written to) is missing, empty or a
    checkpoint this command wrote holding nothing besides: it is replaced at the end of the run."""
    if not os.path.lexists(path):
        return
    if not path.is_dir() or path.is_symlink():
        raise TrainError(
            f"{path} is not a folder dsv41 train wrote (the checkpoint is written there); move it "
            f"out, or give another --out"
        )
    entries = {p.relative_to(path).as_posix() for p in path.rglob("*")}
    if not entries:
        return
    try:
        manifest = read_manifest(path)
    except MiniatureError as exc:
        raise TrainError(f"{exc}; the run would replace {path}: move it out, or give another --out") from None
    listed = set(manifest["files"]) | {MANIFEST_NAME} if manifest else set()
    listed |= {parent.as_posix() for rel in listed for parent in Path(rel).parents if parent != Path(".")}
    foreign = sorted(entries - listed)
    if foreign:
        raise TrainError(
            f"{path} holds {listing(foreign)}, which dsv41 train did not write, and the run would "
            f"replace that folder; move them out, or give another --out"
        )


def tokenizer_written(folder) -> bool:
    """Whether the folder's tokenizer.json is the one this command wrote there (its sha256 in the
    marker)."""
    folder = Path(folder)
    path = folder / TOKENIZER_NAME
    recorded = (read_marker(folder, MARKER_NAME, MARKER_FORMAT) or {}).get("tokenizer_sha256")
    if not path.is_file() or not isinstance(recorded, str):
        return False
    return file_sha256(path) == recorded


def record_tokenizer(folder) -> None:
    """Keep the sha256 of the tokenizer just written in the marker."""
    folder = Path(folder)
    marker = read_marker(folder, MARKER_NAME, MARKER_FORMAT) or {"format": MARKER_FORMAT}
    marker["tokenizer_sha256"] = file_sha256(folder / TOKENIZER_NAME)
    write_json(folder / MARKER_NAME, marker)


def miniature_tokenizer(path: str):
    """(the tokenizer at `path`, the miniature's config for it); TrainError when it is not one the
    miniature can use (unreadable, or another vocabulary)."""
    from tokenizers import Tokenizer

    from ..checkpoint.tiny import tiny_config

    try:
        tokenizer = Tokenizer.from_file(path)
        cfg = tiny_config(tokenizer)
        problem = None
    except Exception as exc:  # noqa: BLE001 (tokenizers' own error types: a tokenizer it cannot use)
        problem = str(exc)[:80]
    if problem is None and tokenizer.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
        problem = f"{tokenizer.get_vocab_size(with_added_tokens=True):,} ids, not {cfg.vocab_size:,}"
    if problem:
        raise TrainError(
            f"{path} is not a tokenizer the miniature can use ({problem}); give another --draft-from, or another --out"
        )
    return tokenizer, cfg
