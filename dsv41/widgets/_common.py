"""What the views share: the trace's routing records as plain per-call data, and the thin widget shell.

A view is `render(data, **options) -> Figure` over plain data plus a `View` that holds the data,
shows the figure as a PNG inside an ipywidgets box with a control or two, and re-renders when the
data or a control changes. Headless (papermill) `View.show()` displays the static figure instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from dsv41.observe import viz


# ---------------------------------------------------------------------- trace -> plain data
def routing_calls(result) -> dict[int, list[dict]]:
    """Per MoE layer, one entry per forward call in call order: {'start_pos', 'expert_ids' [s][k],
    'weights' [s][k], 'hits', 'misses'} (batch row 0; the expert-cache counts are the call's own).

    Read from the trace's routing records rather than the per-layer concatenation, because the
    expert cache looks experts up once per call and layer (the call's distinct ids, ascending)."""
    trace = _trace(result)
    out: dict[int, list[dict]] = {}
    for rec in trace.forward.routing:
        out.setdefault(int(rec.layer), []).append(
            {
                "start_pos": int(rec.start_pos),
                "expert_ids": rec.expert_ids[0].tolist(),
                "weights": rec.weights[0].float().tolist(),
                "hits": int(rec.cache_hits),
                "misses": int(rec.cache_misses),
            }
        )
    return dict(sorted(out.items()))


def _trace(result):
    trace = getattr(result, "trace", None)
    if trace is None:
        raise ValueError("this GenerationResult has no trace; generate with trace=True")
    return trace


def nan_to_none(values) -> list:
    """Floats with NaN as None: the JSON-safe spelling a sidecar and `np.asarray(..., float)` both read."""
    return [None if (v is None or (isinstance(v, float) and math.isnan(v))) else v for v in values]


def as_float_grid(rows) -> "Any":
    """A list of rows (None for missing) -> float ndarray with NaN for None."""
    import numpy as np

    return np.array([[np.nan if v is None else float(v) for v in row] for row in rows], dtype=float).reshape(
        len(rows), -1
    )


# ---------------------------------------------------------------------- the widget shell
class View:
    """A render function, its data and its options, shown as a PNG with controls.

    Subclasses set `render` (a module-level pure function) and may add controls in `_controls()`
    that call `self.set(option=value)`. Build in a test without a kernel: nothing here needs one."""

    render: Callable = staticmethod(lambda data, **options: None)
    title = ""

    def __init__(self, data: dict, **options):
        self.data = data
        self.options = dict(options)
        self._figure = None
        self._box = None
        self._image = None

    # the figure is rendered on first use and after every change
    @property
    def figure(self):
        if self._figure is None:
            self._figure = type(self).render(self.data, **self.options)
        return self._figure

    def update(self, data: dict) -> None:
        """New data (a new generation): re-render and refresh the widget if it exists."""
        self.data = data
        self._changed()

    def set(self, **options) -> None:
        """Change a render option (a control moved): re-render and refresh."""
        self.options.update(options)
        self._changed()

    def _changed(self) -> None:
        self._figure = None
        if self._image is not None:
            self._image.value = viz.png_bytes(self.figure)

    @property
    def widget(self):
        """The ipywidgets box: controls above the rendered figure."""
        if self._box is None:
            import ipywidgets as w

            self._image = w.Image(value=viz.png_bytes(self.figure), format="png")
            self._box = w.VBox([*self._controls(), self._image])
        return self._box

    def _controls(self) -> list:
        return []

    def show(self) -> None:
        """Display in a notebook: the live widget when a person is looking, the static figure headless."""
        viz.show(self.figure, widget=None if viz.is_headless() else self.widget)

    def export(self, name: str, out_dir: str) -> dict[str, str]:
        """PNG, SVG and the plotted data as a JSON sidecar, through `dsv41.observe.viz.export_figure`."""
        return viz.export_figure(self.figure, name, out_dir, {**self.data, "options": self.options})
