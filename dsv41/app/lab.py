"""`dsv41 lab`: the numbered notebooks in a working folder of their own, opened in JupyterLab.

Opening `notebooks/` itself in JupyterLab autosaves outputs into the tracked notebooks (and the test
command then fails on committed outputs), so the lab works on copies: `prepare_lab(folder)` copies
every `NN_*.ipynb` (from the repository's notebooks/, found as `dsv41 notebooks` finds them) into
the folder (default `outputs/lab` under the current directory) and records the sha256 of each copy
it wrote in a small manifest (`.dsv41-lab.json`). On a later start a copy whose bytes still match
the manifest is unedited: it is updated when the repository's notebook changed. A copy that no
longer matches was edited in the lab (a run's outputs count) and is kept, with one line saying so.

Then JupyterLab starts on the folder (`python -m jupyter lab --ServerApp.root_dir=FOLDER`), in
this Python: a `python3` kernelspec pinned to sys.executable (kept in the dsv41 cache) is put
first on JUPYTER_PATH, so the notebooks' kernel is the interpreter that has dsv41 installed.
`--allow-root` is passed only when running as root, with a line on stderr. This module never
imports torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsv41.core.argtypes import whole_number
from dsv41.core.errors import Dsv41Error

MANIFEST_NAME = ".dsv41-lab.json"
MANIFEST_FORMAT = 1
DEFAULT_DIR = os.path.join("outputs", "lab")

# what prepare_lab did with one notebook (and, for a dry run, the words for what it would do)
COPIED, UPDATED, CURRENT, KEPT = "copied", "updated", "current", "kept"
_WOULD = {COPIED: "would copy", UPDATED: "would update", KEPT: "would keep"}


class LabError(Dsv41Error):
    """A lab folder or notebooks folder that cannot be used: one sentence, exit 2."""


@dataclass(frozen=True)
class Action:
    """What `prepare_lab` did with one notebook: `kind` is COPIED (it was not there), UPDATED (an
    unedited copy of an older version, replaced), CURRENT (already the repository's version) or
    KEPT (edited in the lab, left as it is); `message` is the line printed for it."""

    kind: str
    name: str
    message: str


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_manifest(folder: Path) -> dict[str, str]:
    """name -> sha256 of the copy the lab last wrote; {} when there is none (or it is unreadable:
    then every copy that differs from the repository counts as edited and is kept)."""
    try:
        doc = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    written = doc.get("notebooks") if isinstance(doc, dict) else None
    if not isinstance(written, dict):
        return {}
    return {k: v for k, v in written.items() if isinstance(k, str) and isinstance(v, str)}


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# The parameters cell's default output folder is relative to the notebook: the repository's
# `../outputs/interactive` would land in outputs/outputs/ from outputs/lab, so a copy writes beside itself.
_REPO_OUTPUT_DIR = rb"output_dir = \"../outputs/interactive\""
_LAB_OUTPUT_DIR = rb"output_dir = \"interactive\""


def _as_lab_copy(data: bytes) -> bytes:
    """A notebook's bytes as the lab folder holds them: figures go to outputs/lab/interactive."""
    return data.replace(_REPO_OUTPUT_DIR, _LAB_OUTPUT_DIR)


def _probe_creatable(folder: Path) -> None:
    """OSError unless `folder` could be created: a dry run creates and removes a temporary folder
    in its nearest existing parent (permissions and read-only mounts alone do not tell: as root
    every mode bit passes, and some file systems refuse new entries whatever they say)."""
    parent = next(p for p in folder.absolute().parents if p.exists())
    os.rmdir(tempfile.mkdtemp(prefix=".dsv41-lab-probe-", dir=parent))


def prepare_lab(
    folder: str | os.PathLike = DEFAULT_DIR, notebooks_dir: str | os.PathLike | None = None, dry_run: bool = False
) -> list[Action]:
    """Bring the lab folder's copies of the numbered notebooks up to date (see the module
    docstring) and return one Action per notebook, in order. `dry_run`: decide, write nothing."""
    from .notebooks import NotebookRunError, default_notebooks_dir, find_notebooks

    folder = Path(folder)
    try:
        sources = find_notebooks(notebooks_dir or default_notebooks_dir())
    except NotebookRunError as exc:
        raise LabError(str(exc)) from None
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == folder else f"runs through the file {blocker}"
        raise LabError(f"--dir {folder}: {where}, not a folder; pass a folder path")
    try:
        if not dry_run:
            folder.mkdir(parents=True, exist_ok=True)
        elif not folder.is_dir():
            _probe_creatable(folder)
    except OSError as exc:
        raise LabError(f"--dir {folder}: cannot create this folder ({exc.strerror or exc})") from None

    manifest = _read_manifest(folder)
    written = dict(manifest)
    actions = []
    for source in sources:
        name, data = source.name, _as_lab_copy(source.read_bytes())
        new = _sha256(data)
        target = folder / name
        try:
            here = _sha256(target.read_bytes()) if target.exists() else None
        except OSError as exc:
            raise LabError(f"{target}: cannot be read ({exc.strerror or exc})") from None
        if here is None:
            action = Action(COPIED, name, f"copied {name}")
        elif here == new:
            action = Action(CURRENT, name, f"{name} is current")
        elif manifest.get(name) == here:
            action = Action(
                UPDATED, name, f"updated {name}: the repository's notebook changed and this copy was not edited"
            )
        elif manifest.get(name) == new:
            action = Action(KEPT, name, f"kept {name}: edited here since dsv41 lab copied it")
        elif name in manifest:
            action = Action(
                KEPT,
                name,
                f"kept {name}: edited here since dsv41 lab copied it, and the repository's "
                f"notebook has changed since (move this copy aside to get the new one)",
            )
        else:
            action = Action(
                KEPT,
                name,
                f"kept {name}: differs from the repository's notebook and was not written "
                f"by dsv41 lab (move it aside to get the repository's)",
            )
        if dry_run and action.kind in _WOULD:
            action = Action(action.kind, name, _WOULD[action.kind] + action.message[len(action.kind) :])
        if action.kind in (COPIED, UPDATED) and not dry_run:
            try:
                _write_atomically(target, data)
            except OSError as exc:
                raise LabError(f"{target}: cannot be written ({exc.strerror or exc})") from None
        if action.kind != KEPT:
            written[name] = new
        actions.append(action)
    if not dry_run and written != manifest:
        doc = {
            "format": MANIFEST_FORMAT,
            "source": str(sources[0].parent.resolve()),
            "note": "sha256 of each notebook as dsv41 lab last wrote it; a copy that differs was edited here",
            "notebooks": dict(sorted(written.items())),
        }
        try:
            _write_atomically(folder / MANIFEST_NAME, (json.dumps(doc, indent=1) + "\n").encode())
        except OSError as exc:
            raise LabError(f"{folder / MANIFEST_NAME}: cannot be written ({exc.strerror or exc})") from None
    return actions


# ---------------------------------------------------------------------- the server
def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def kernel_path() -> Path:
    """A folder for JUPYTER_PATH holding `kernels/python3/kernel.json` pinned to this interpreter
    (one per interpreter, under the dsv41 cache; rewritten when it differs)."""
    from ..core.cachedir import cache_dir

    tag = _sha256(sys.executable.encode())[:12]
    root = cache_dir("lab-kernel", tag)
    spec_dir = root / "kernels" / "python3"
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "metadata": {"dsv41": "pinned by dsv41 lab to the interpreter dsv41 runs in"},
    }
    text = json.dumps(spec, indent=1) + "\n"
    file = spec_dir / "kernel.json"
    if not file.is_file() or file.read_text(encoding="utf-8") != text:
        spec_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(file, text.encode())
    return root


def lab_command(folder: str | os.PathLike, port: int | None = None, browser: bool = True) -> list[str]:
    """The JupyterLab command line for `folder` (with --allow-root when running as root)."""
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={Path(folder).resolve()}"]
    if port is not None:
        cmd.append(f"--ServerApp.port={port}")
    if not browser:
        cmd.append("--no-browser")
    if is_root():
        cmd.append("--allow-root")
    return cmd


def start_lab(cmd: list[str], env: dict[str, str]) -> None:
    """Replace this process with JupyterLab (Ctrl-C and SIGTERM then reach the server itself)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 lab",
        description=(
            "Copy the numbered notebooks into a working folder (default outputs/lab under the current directory) "
            "and start JupyterLab there. A copy edited in the folder is never overwritten (one line says it is "
            "kept); an unedited copy of an older version is updated. The tracked notebooks/ stay untouched, so "
            "their outputs never land in the repository."
        ),
    )
    parser.add_argument("--dir", metavar="DIR", default=DEFAULT_DIR, help="the working folder (default outputs/lab)")
    parser.add_argument(
        "--port",
        type=whole_number(1, 65535, "the port"),
        metavar="N",
        help="the server's port (default: JupyterLab's, 8888 or the next free one)",
    )
    parser.add_argument(
        "--no-browser", action="store_true", help="do not open a browser (the URL with its token is printed)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would be copied and the command that would start, and stop there",
    )
    parser.add_argument("--notebooks", metavar="DIR", help=argparse.SUPPRESS)  # another source folder (tests)
    args = parser.parse_args(argv)

    try:
        actions = prepare_lab(args.dir, args.notebooks, dry_run=args.dry_run)
    except LabError as exc:
        print(f"dsv41 lab: {exc}", file=sys.stderr)
        return 2
    prefix = "dry run: " if args.dry_run else ""
    current = [a for a in actions if a.kind == CURRENT]
    for a in actions:
        if a.kind != CURRENT:
            print(prefix + a.message)
    if current:
        print(f"{prefix}{len(current)} of {len(actions)} notebooks already current in {args.dir}")
    cmd = lab_command(args.dir, args.port, browser=not args.no_browser)
    if args.dry_run:
        print("dry run: nothing written; would start " + shlex.join(cmd))
        return 0
    if "--allow-root" in cmd:
        print("dsv41 lab: running as root, so JupyterLab is started with --allow-root", file=sys.stderr)
    from ..core.cachedir import CacheError

    try:
        jupyter_path = kernel_path()
    except (CacheError, OSError) as exc:
        print(f"dsv41 lab: {exc}", file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["JUPYTER_PATH"] = os.pathsep.join([str(jupyter_path)] + [p for p in [env.get("JUPYTER_PATH")] if p])
    print(f"starting JupyterLab on {Path(args.dir).resolve()} (Ctrl-C twice stops it)", file=sys.stderr)
    try:
        start_lab(cmd, env)
    except OSError as exc:
        print(
            f"dsv41 lab: cannot start JupyterLab ({exc.strerror or exc}); `pip install -e .` installs it",
            file=sys.stderr,
        )
        return 1
    return 0  # not reached: start_lab replaces this process
