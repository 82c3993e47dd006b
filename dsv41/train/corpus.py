"""The training text every machine has: the running Python's standard-library sources and its
pydoc topics (English prose), split into train and held-out by file, deterministically.

A file's split follows from the sha256 of its name alone (relative to the library root), so the
split does not move when a file's contents change between Python releases; the manifest records
the Python version and a hash of the file list with each file's size, so two corpora compare.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field

# One file in HELD_OUT_EVERY goes to the held-out split.
HELD_OUT_EVERY = 20
# Folders left out: the test suites (much of them generated data) and installed packages.
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
TOPICS_PREFIX = "pydoc_data/topics/"


@dataclass
class Corpus:
    """Documents by name (`lib/...py` relative to the library root, `pydoc_data/topics/NAME`)."""

    train: dict[str, str] = field(default_factory=dict)
    held_out: dict[str, str] = field(default_factory=dict)
    python: str = ""
    file_list_sha256: str = ""

    def manifest(self) -> dict:
        def stats(docs):
            return {"files": len(docs), "bytes": sum(len(t.encode("utf-8")) for t in docs.values())}

        return {
            "source": "the Python standard library's .py sources and pydoc topics",
            "python": self.python,
            "file_list_sha256": self.file_list_sha256,
            "held_out_every": HELD_OUT_EVERY,
            "train": stats(self.train),
            "held_out": stats(self.held_out),
        }


def is_held_out(name: str) -> bool:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELD_OUT_EVERY == 0


def stdlib_sources(root: str | None = None) -> dict[str, str]:
    """name -> text of every .py file under the standard library (sorted by name); files that are
    not UTF-8 are left out."""
    root = root or sysconfig.get_paths()["stdlib"]
    docs = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS and not d.startswith("__pycache__"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            docs[os.path.relpath(path, root).replace(os.sep, "/")] = text
    return dict(sorted(docs.items()))


def pydoc_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without pydoc_data: the sources alone
        return {}
    return {TOPICS_PREFIX + key: topics[key] for key in sorted(topics)}


def load_corpus(root: str | None = None) -> Corpus:
    docs = {**stdlib_sources(root), **pydoc_topics()}
    listing = hashlib.sha256()
    corpus = Corpus(python=platform.python_version())
    for name, text in docs.items():
        listing.update(f"{name}\0{len(text.encode('utf-8'))}\n".encode("utf-8"))
        (corpus.held_out if is_held_out(name) else corpus.train)[name] = text
    corpus.file_list_sha256 = listing.hexdigest()
    if not corpus.train or not corpus.held_out:
        raise RuntimeError(
            "the standard library sources could not be found to train on "
            f"(looked under {root or sysconfig.get_paths()['stdlib']})"
        )
    return corpus
