"""dsv41.observe.viz: deterministic export (same bytes twice), sidecar content, no dates in metadata."""

import json
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dsv41.observe import viz


def _figure():
    fig, axes = viz.new_figure(1, 2, figsize=(6.0, 3.0))
    axes[0].bar(["routed", "engram", "attention"], [3.0, 2.0, 1.0])
    axes[0].set_title("bytes by category")
    axes[1].plot(np.arange(10), np.arange(10) ** 2, marker="o", label="square")
    axes[1].legend()
    fig.suptitle("a house-style figure")
    return fig


DATA = {
    "counts": np.array([3, 2, 1], dtype=np.int64),
    "total": np.int64(6),
    "mean": np.float32(2.0),
    "labels": ("routed", "engram", "attention"),
    7: "int key",
    "ratio": float("nan"),
}


def _read(paths):
    return {ext: open(path, "rb").read() for ext, path in paths.items()}


def test_same_figure_twice_gives_identical_bytes(tmp_path):
    fig = _figure()
    first = _read(viz.export_figure(fig, "fig", str(tmp_path / "a"), DATA))
    second = _read(viz.export_figure(fig, "fig", str(tmp_path / "b"), DATA))
    assert set(first) == {"png", "svg", "json"}
    for ext in first:
        assert first[ext] == second[ext], f"{ext} differs between two exports of the same figure"
    # a rebuilt figure (what a rerun of a notebook does) gives the same bytes too
    third = _read(viz.export_figure(_figure(), "fig", str(tmp_path / "c"), DATA))
    assert third == first
    assert first["png"].startswith(b"\x89PNG\r\n\x1a\n")
    assert b"<svg" in first["svg"]


def test_png_bytes_are_the_exported_png(tmp_path):
    fig = _figure()
    exported = _read(viz.export_figure(fig, "fig", str(tmp_path), DATA))["png"]
    assert viz.png_bytes(fig) == exported
    assert viz.png_bytes(_figure()) == exported  # a rebuilt figure, never exported: the same bytes
    pytest.importorskip("IPython")
    assert viz._png_image(fig).data == exported  # what viz.show displays headless


def test_a_layout_solved_a_few_ulps_apart_exports_the_same_bytes(tmp_path, monkeypatch):
    # the constraint solver's last bits differ between processes; the frozen layout must not carry
    # them into the SVG's clip-path ids (they hash the clip rectangles at full precision)
    from matplotlib.figure import Figure

    solve = Figure.draw_without_rendering
    exports = []
    for nudge in (0.0, 1e-15, -3e-16):

        def drifted(fig, nudge=nudge):
            solve(fig)
            for ax in fig.axes:
                x, y, w, h = ax.get_position(original=True).bounds
                ax.set_position([x + nudge, y - nudge, w + nudge, h], which="both")

        monkeypatch.setattr(Figure, "draw_without_rendering", drifted)
        exports.append(_read(viz.export_figure(_figure(), "fig", str(tmp_path / str(nudge)), DATA))["svg"])
    assert exports[0] == exports[1] == exports[2]
    assert re.search(rb'clip-path="url\(#p[0-9a-f]+\)"', exports[0])


def test_identical_bytes_across_processes(tmp_path):
    # the SVG ids hash a salt; without a fixed one each process would pick a random salt
    script = textwrap.dedent(f"""
        import hashlib, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from test_viz import _figure, DATA
        from dsv41.observe import viz
        paths = viz.export_figure(_figure(), "fig", sys.argv[1], DATA)
        print(" ".join(hashlib.sha256(open(paths[e], "rb").read()).hexdigest() for e in ("png", "svg", "json")))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "proc")], check=True, capture_output=True, text=True
    ).stdout.split()
    import hashlib

    here = _read(viz.export_figure(_figure(), "fig", str(tmp_path / "here"), DATA))
    assert out == [hashlib.sha256(here[e]).hexdigest() for e in ("png", "svg", "json")]


def _png_text_chunks(data: bytes) -> dict[str, bytes]:
    chunks, pos = {}, 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind in (b"tEXt", b"iTXt", b"zTXt", b"tIME"):
            key = body.split(b"\0", 1)[0].decode("latin-1") if kind != b"tIME" else "tIME"
            chunks[key] = body
        pos += 12 + length
    return chunks


def test_no_date_or_version_in_metadata(tmp_path):
    import matplotlib

    paths = viz.export_figure(_figure(), "fig", str(tmp_path), DATA)
    png = open(paths["png"], "rb").read()
    text_chunks = _png_text_chunks(png)
    assert "tIME" not in text_chunks
    assert "Software" not in text_chunks and "Creation Time" not in text_chunks
    assert matplotlib.__version__.encode() not in png
    svg = open(paths["svg"], encoding="utf-8").read()
    assert "<dc:date>" not in svg
    assert matplotlib.__version__ not in svg
    assert not re.search(r"(19|20)\d\d-\d\d-\d\d", svg), "a date-like string is in the SVG"


def test_sidecar_holds_the_plotted_numbers(tmp_path):
    paths = viz.export_figure(_figure(), "fig", str(tmp_path), DATA)
    text = open(paths["json"], encoding="utf-8").read()
    loaded = json.loads(text)
    assert loaded == {
        "counts": [3, 2, 1],
        "total": 6,
        "mean": 2.0,
        "labels": ["routed", "engram", "attention"],
        "7": "int key",
        "ratio": "NaN",
    }
    assert list(loaded) == sorted(loaded), "sidecar keys are not sorted"
    assert isinstance(loaded["total"], int)
    assert text.endswith("\n")


def test_sidecar_reads_back_and_numbers_read_in_a_sentence(tmp_path):
    paths = viz.export_figure(_figure(), "fig", str(tmp_path), DATA)
    assert viz.read_sidecar(paths["json"]) == json.loads(open(paths["json"], encoding="utf-8").read())
    assert viz.numbers([0.12345, None, 2]) == "0.123, -, 2.000" and viz.numbers([1.25], 1) == "1.2"
    # a non-finite value comes back from a sidecar as its string (a constant gate's correlation is NaN)
    written = viz.read_sidecar(viz.write_sidecar({"r": [0.5, float("nan")]}, str(tmp_path / "nan.json")))
    assert viz.numbers(written["r"]) == "0.500, NaN"
    with pytest.raises(ValueError, match="not a number a sidecar writes"):
        viz.numbers([0.5, "0.5"])


def test_sidecar_rejects_what_it_cannot_write(tmp_path):
    with pytest.raises(TypeError, match="sidecar"):
        viz.export_figure(_figure(), "fig", str(tmp_path), {"x": object()})
    with pytest.raises(ValueError, match="figure name"):
        viz.export_figure(_figure(), "../escape", str(tmp_path), {})


def test_house_style_applies_inside_the_context():
    import matplotlib

    before = matplotlib.rcParams["font.size"]
    with viz.style():
        assert matplotlib.rcParams["font.size"] == viz.HOUSE_STYLE["font.size"]
        assert matplotlib.rcParams["axes.prop_cycle"].by_key()["color"][0] == viz.PALETTE[0]
    assert matplotlib.rcParams["font.size"] == before


def test_headless_flag(monkeypatch):
    monkeypatch.setenv(viz.HEADLESS_ENV, "1")
    assert viz.is_headless()
    monkeypatch.setenv(viz.HEADLESS_ENV, "0")
    assert not viz.is_headless()
    monkeypatch.delenv(viz.HEADLESS_ENV)
    assert viz.is_headless()  # plain pytest is not a Jupyter kernel
