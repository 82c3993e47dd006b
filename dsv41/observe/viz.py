"""House style and the one export every figure goes through.

Regression runs compare numbers, not pixels: `export_figure` writes a PNG, an SVG and a JSON sidecar
of the numbers plotted. Both images are byte-identical when the same figure is exported again (no
dates or version strings in their metadata, a fixed SVG hash salt), so a diff of an `outputs/` run
shows only what changed.

Figures are plain `matplotlib.figure.Figure` objects (not pyplot-managed): nothing is shown or kept
alive behind the caller's back, and `show` decides how a notebook displays one — the static figure
when headless (papermill), the widget when a person is looking.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any, Iterator

from dsv41.checkpoint.audit import format_ranges

# "1-3, 7, 9-10" for layer and shard numbers in a table cell; the audit report uses the same. Bound
# here, not only imported: the notebooks call viz.ranges, and ruff (which skips them) would drop an
# import nothing in this file uses
ranges = format_ranges

# Style: DejaVu ships with matplotlib, so the glyphs (and the SVG paths drawn from them) are the same
# on every machine. Colors: a short qualitative cycle that stays legible in grey.
PALETTE = ("#3b6ea5", "#d9843b", "#4f9a5b", "#b8474a", "#7c65a9", "#8c6d4f", "#c46aa8", "#7f7f7f")

HOUSE_STYLE: dict[str, Any] = {
    "font.family": "DejaVu Sans",
    "font.size": 9.0,
    "axes.titlesize": 10.0,
    "axes.labelsize": 9.0,
    "xtick.labelsize": 8.0,
    "ytick.labelsize": 8.0,
    "legend.fontsize": 8.0,
    "figure.titlesize": 11.0,
    "figure.figsize": (6.4, 3.6),
    "figure.dpi": 100,
    "figure.facecolor": "white",
    "axes.facecolor": "white",
    "axes.edgecolor": "#444444",
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#dddddd",
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": None,  # filled in below (needs cycler, imported lazily)
    "image.cmap": "viridis",
}

# What saving reads; fixed here so the bytes do not depend on the caller's rcParams.
_SAVE_RC: dict[str, Any] = {
    "svg.hashsalt": "dsv41",
    "svg.fonttype": "path",
    "savefig.dpi": 100,
    "savefig.facecolor": "white",
    "savefig.edgecolor": "white",
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.05,
    "path.simplify": True,
}

# No dates, no version strings: the same figure gives the same bytes on any day.
_PNG_METADATA = {"Software": None}
_SVG_METADATA = {"Date": None, "Creator": "dsv41.observe.viz"}


def _style_rc() -> dict[str, Any]:
    from cycler import cycler

    rc = dict(HOUSE_STYLE)
    rc["axes.prop_cycle"] = cycler(color=list(PALETTE))
    return rc


@contextlib.contextmanager
def style() -> Iterator[None]:
    """Context in which figures are built in the house style (fonts, sizes, colors, grid)."""
    import matplotlib

    with matplotlib.rc_context(_style_rc()):
        yield


def use_house_style() -> None:
    """Apply the house style for the rest of the session (a notebook's first cell calls this)."""
    import matplotlib

    matplotlib.rcParams.update(_style_rc())


def new_figure(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] | None = None, **subplot_kw):
    """(figure, axes) in the house style; a plain Figure, so nothing is displayed until `show`."""
    from matplotlib.figure import Figure

    with style():
        fig = Figure(figsize=figsize, layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=True, **subplot_kw)
    return fig, axes


# ---------------------------------------------------------------------- sidecars
def to_jsonable(value: Any) -> Any:
    """Plain JSON data from numpy/torch scalars and arrays, tuples, sets and dataclasses.

    Dict keys become strings (so keys sort); non-finite floats become the strings "NaN",
    "Infinity", "-Infinity" rather than invalid JSON.
    """
    import dataclasses

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return [to_jsonable(v) for v in sorted(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    # numpy scalars and arrays, torch tensors: all have tolist() (item() for 0-d gives a Python scalar)
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return to_jsonable(tolist())
    raise TypeError(f"cannot write a {type(value).__name__} into a figure sidecar; convert it to numbers first")


def write_sidecar(data: dict, path: str) -> str:
    """Write `data` as JSON with sorted keys and a trailing newline (a figure's sidecar, or the facts
    a notebook states that no figure plots); returns the path."""
    if not isinstance(data, dict):
        raise TypeError(f"a figure sidecar takes a dict of the plotted numbers, got {type(data).__name__}")
    text = json.dumps(to_jsonable(data), sort_keys=True, indent=2, allow_nan=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text + "\n")
    return path


def read_sidecar(path: str) -> dict:
    """A sidecar `write_sidecar` or `export_figure` wrote, read back: what a notebook states in its
    text comes from the numbers its figure exported."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------- export
def export_figure(fig, name: str, out_dir: str, data: dict) -> dict[str, str]:
    """Write `<out_dir>/<name>.png`, `.svg` and `.json` (the plotted numbers); returns their paths.

    Exporting the same figure twice gives identical bytes; a figure with a layout engine keeps the
    positions of its first export (see `_freeze_layout`). `name` is a file stem (letters, digits,
    `_`, `-`, `.`); notebooks prefix theirs with their number so one run folder holds them all.

    A figure made under interventions says so: those listed in `data["interventions"]` (a trace's,
    say) and those of any `intervene` block open while it is exported are written under it in red
    and into the sidecar's "interventions".
    """
    import matplotlib

    if not name or any(not (c.isalnum() or c in "_-.") for c in name) or name.startswith("."):
        raise ValueError(f"figure name {name!r}: use letters, digits, '_', '-' and '.' only")
    under = _interventions_under(data)
    if under:
        data = {**data, "interventions": under}
        _stamp(fig, under)
    _freeze_layout(fig)
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"{name}.{ext}") for ext in ("png", "svg", "json")}
    with matplotlib.rc_context(_SAVE_RC):
        fig.savefig(paths["png"], format="png", metadata=_PNG_METADATA)
        fig.savefig(paths["svg"], format="svg", metadata=_SVG_METADATA)
    write_sidecar(data, paths["json"])
    return paths


def _interventions_under(data) -> list[str]:
    """The interventions a figure's numbers were made under: `data`'s own list, then those of the
    blocks open now (`interventions.open_labels`)."""
    listed = list(data.get("interventions") or []) if isinstance(data, dict) else []
    # none can be open unless the module that opens them was imported; a figure made without it
    # does not import torch for the question
    module = sys.modules.get("dsv41.model.interventions")
    if module is not None:
        listed += [entry for entry in module.open_labels() if entry not in listed]
    return [str(entry) for entry in listed]


_STAMP_ID = "dsv41-interventions"


def _stamp(fig, under: list[str]) -> None:
    """A red line under the figure naming the interventions (once, however often it is exported)."""
    if any(text.get_gid() == _STAMP_ID for text in fig.texts):
        return
    shown = "; ".join(under[:3]) + (f"; and {len(under) - 3} more" if len(under) > 3 else "")
    text = fig.text(0.0, -0.01, f"made under interventions: {shown}", ha="left", va="top", fontsize=6, color=PALETTE[3])
    text.set_gid(_STAMP_ID)


# Decimals of a figure fraction kept when a solved layout is frozen: 1e-9 of an 8-inch figure at
# 100 dpi is a millionth of a pixel, and the solver's drift (~1e-16) is far below it.
LAYOUT_DIGITS = 9


def _freeze_layout(fig) -> None:
    """Run the figure's layout engine once more and then keep those positions.

    Constrained/tight layout re-solves on every draw and drifts in the last float digits; the SVG
    clip-path ids hash those floats, so a second export would differ. Freezing makes every later
    export (and display) of this figure draw the same positions. The solver's result itself also
    differs in its last bits from one process to another (the constraint solver's internal order
    follows memory addresses), so the frozen positions are rounded to LAYOUT_DIGITS decimals of the
    figure size, far below a pixel: two runs of a notebook then export the same bytes.
    """
    from matplotlib.layout_engine import PlaceHolderLayoutEngine

    engine = fig.get_layout_engine()
    if engine is not None and not isinstance(engine, PlaceHolderLayoutEngine):
        fig.draw_without_rendering()
        fig.set_layout_engine("none")
        for ax in fig.axes:
            ax.set_position([round(v, LAYOUT_DIGITS) for v in ax.get_position(original=True).bounds], which="both")


# ---------------------------------------------------------------------- tables
class Table:
    """A small table a notebook shows: HTML in Jupyter, aligned text elsewhere (and in the executed
    notebook's text/plain output). Numbers get thousands separators; `title` goes above."""

    def __init__(self, rows, columns=None, title: str | None = None):
        rows = list(rows)
        if rows and isinstance(rows[0], dict):
            columns = list(columns or rows[0].keys())
            rows = [[row.get(c) for c in columns] for row in rows]
        self.columns = [str(c) for c in (columns or [])]
        self.rows = [[_cell(v) for v in row] for row in rows]
        self.title = title

    def __repr__(self) -> str:
        grid = ([self.columns] if self.columns else []) + self.rows
        widths = [max(len(r[i]) for r in grid if i < len(r)) for i in range(max(map(len, grid), default=0))]
        lines = [self.title] if self.title else []
        for k, row in enumerate(grid):
            lines.append("  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(row, widths)).rstrip())
            if k == 0 and self.columns:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from html import escape

        def tr(cells, tag):
            return (
                "<tr>"
                + "".join(
                    f'<{tag} style="text-align:{"right" if _numeric(c) else "left"}">{escape(c)}</{tag}>' for c in cells
                )
                + "</tr>"
            )

        head = tr(self.columns, "th") if self.columns else ""
        caption = f"<caption style='text-align:left'><b>{escape(self.title)}</b></caption>" if self.title else ""
        # a wide table scrolls inside its own box instead of spilling past the notebook's column
        return (
            f"<div style='overflow-x:auto;max-width:100%'><table>{caption}{head}"
            f"{''.join(tr(r, 'td') for r in self.rows)}</table></div>"
        )


def table(rows, columns=None, title: str | None = None) -> Table:
    """A `Table` from a list of dicts (columns from the first) or of lists with `columns`."""
    return Table(rows, columns, title)


def numbers(values, digits: int = 3) -> str:
    """Numbers for a sentence: "0.912, 0.874, -, NaN" (`digits` decimals; None, nothing measured, a
    dash; a non-finite value as a sidecar writes it, "NaN", "Infinity" or "-Infinity")."""

    def one(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, str):
            if v not in NON_FINITE:  # only the strings a sidecar writes for a float
                raise ValueError(f"not a number a sidecar writes: {v!r}")
            return v
        return f"{v:.{digits}f}"

    return ", ".join(one(v) for v in values)


NON_FINITE = ("NaN", "Infinity", "-Infinity")


def _cell(value) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else ("yes" if value else "no")
    if isinstance(value, int) or type(value).__name__.startswith(("int", "uint")):
        return f"{int(value):,}"
    if isinstance(value, float) or type(value).__name__.startswith("float"):
        value = float(value)
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, (list, tuple)):  # ids and multipliers: no thousands separators inside a list
        return "[" + ", ".join(str(v) if isinstance(v, int) else _cell(v) for v in value) + "]"
    return str(value)


def _numeric(text: str) -> bool:
    return (
        bool(text)
        and text.replace(",", "").replace(".", "").replace("-", "").replace("+", "").replace("e", "").isdigit()
    )


# ---------------------------------------------------------------------- notebooks
HEADLESS_ENV = "DSV41_HEADLESS"


def is_headless() -> bool:
    """True under papermill (the runner sets DSV41_HEADLESS=1) or outside a Jupyter kernel."""
    flag = os.environ.get(HEADLESS_ENV)
    if flag is not None:
        return flag.strip().lower() not in ("", "0", "false", "no")
    try:
        from IPython import get_ipython
    except ImportError:
        return True
    shell = get_ipython()
    return shell is None or type(shell).__name__ != "ZMQInteractiveShell"


def show(fig=None, widget=None) -> None:
    """Display a figure in a notebook: the widget when interactive and one is given, else the static
    figure (headless runs keep a rendered image in the executed notebook). Outside IPython: nothing."""
    try:
        from IPython.display import display
    except ImportError:
        return
    if widget is not None and not is_headless():
        display(widget)
    elif fig is not None:
        display(_png_image(fig))


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes, exactly as `export_figure` writes its PNG (the same settings and
    metadata, and the layout frozen the same way, so rendering twice or before an export gives the
    same bytes; no pyplot backend needed): what a notebook or a widget shows is the exported image."""
    import io

    import matplotlib

    _freeze_layout(fig)
    buf = io.BytesIO()
    with matplotlib.rc_context(_SAVE_RC):
        fig.savefig(buf, format="png", metadata=_PNG_METADATA)
    return buf.getvalue()


def _png_image(fig):
    """The figure as an IPython PNG image (`png_bytes`), so the executed notebook holds the bytes
    `export_figure` writes."""
    from IPython.display import Image

    return Image(data=png_bytes(fig), format="png")
