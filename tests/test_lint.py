"""The tree stays as `ruff check` and `ruff format` want it (the configuration is pyproject.toml's
[tool.ruff]). scripts/gpu-check is named on its own: without a .py suffix ruff would pass it by
when it walks `scripts`. A machine without ruff fails here rather than skipping: a skip would let
an unlinted tree count as passing."""

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("dsv41", "tests", "scripts", "scripts/gpu-check")


def _pinned_ruff() -> str:
    """The ruff requirement of the test extra, as pyproject.toml writes it."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return next(req for req in extra if req.startswith("ruff"))


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail(f"ruff is not installed: pip install -e '.[test]' (the test extra pins {_pinned_ruff()})")
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *TARGETS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _said(done: subprocess.CompletedProcess) -> str:
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True).stdout
    return f"{done.stdout}{done.stderr}\n({version.strip()}; the test extra pins {_pinned_ruff()})"


def test_ruff_check_passes():
    done = _ruff("check", "--output-format", "concise")
    assert done.returncode == 0, "ruff check found problems:\n" + _said(done)


def test_ruff_format_leaves_the_tree_unchanged():
    done = _ruff("format", "--check")
    assert done.returncode == 0, "ruff format would change files (run `ruff format` on them):\n" + _said(done)


def test_a_missing_ruff_fails_with_the_install_command(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ruff" else found(name, *a))
    with pytest.raises(pytest.fail.Exception) as failed:
        _ruff("check")
    said = str(failed.value)
    assert "pip install -e '.[test]'" in said and "\n" not in said, said
