"""Policy view: a trace's routing replayed through expert-cache policies (LRU, LFU, static top-N,
Belady's optimum) at every cache size, and what each size would read from disk per token.

The numbers come from `dsv41.observe.cache_policy.policy_data`, which
takes a traced GenerationResult, a GenerationTrace or the path of a saved one; `render` plots them
and `PolicyView` adds a policy picker and a cache-size slider. Headless, `show()` displays the
static figure; `export()` writes it with a sidecar of the plotted numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

from dsv41.observe.cache_policy import POLICY_NAMES

from ._common import View

__all__ = ["PolicyView", "render"]

_MARKERS = {"lru": "o", "lfu": "s", "static": "^", "belady": "D"}


def _color(data: dict, policy: str) -> str:
    from dsv41.observe import viz

    order = list(data["policies"])
    return viz.PALETTE[order.index(policy) % len(viz.PALETTE)] if policy in order else viz.PALETTE[-1]


def _size(data: dict, capacity: Optional[int]) -> int:
    sizes = data["capacities"]
    if capacity in sizes:
        return capacity
    if data.get("capacity") in sizes:
        return data["capacity"]
    return sizes[len(sizes) // 4]


def _nan(values) -> list:
    return [float("nan") if v is None else v for v in values]


def render(data: dict, policies: Optional[Sequence[str]] = None, capacity: Optional[int] = None):
    """Figure, three panels over `data` from `policy_data`: hit rate vs experts cached per layer,
    all layers (one line per policy; the run's own cache marked when it was recorded); hit rate
    per layer at one size (`capacity`, default the run's); disk MiB read per decode token vs size
    (per token over every call when the trace has no decode calls). `policies` picks which lines
    to draw (default all in the data)."""
    from dsv41.observe import viz

    shown = [p for p in data["policies"] if policies is None or p in policies]
    size = _size(data, capacity)
    at = data["capacities"].index(size)
    sizes = data["capacities"]
    decode = bool(data.get("decode_tokens"))
    disk = data["disk_mib_per_decode_token" if decode else "disk_mib_per_token"]
    fig, (ax_rate, ax_layer, ax_disk) = viz.new_figure(1, 3, figsize=(11.0, 3.6))
    with viz.style():
        for p in shown:
            style = dict(color=_color(data, p), marker=_MARKERS.get(p, "o"), ms=3, lw=1.2, label=POLICY_NAMES.get(p, p))
            ax_rate.plot(sizes, _nan(data["hit_rate"][p]), **style)
            ax_layer.plot(data["layers"], _nan([row[at] for row in data["hit_rate_by_layer"][p]]), **style)
            ax_disk.plot(sizes, _nan(disk[p]), **style)
        if data.get("capacity") is not None and data.get("recorded_hit_rate") is not None:
            ax_rate.plot(
                [data["capacity"]],
                [data["recorded_hit_rate"]],
                ls="none",
                marker="*",
                ms=11,
                color=viz.PALETTE[-1],
                label=f"recorded run, size {data['capacity']}",
            )
        for ax in (ax_rate, ax_disk):
            ax.axvline(size, color="#999999", lw=0.8, ls="--", label=f"size {size}")
        ax_rate.set(
            xlabel="experts cached per layer",
            ylabel="hit rate (hits / lookups)",
            ylim=(-0.02, 1.02),
            title=f"all {len(data['layers'])} MoE layers",
        )
        ax_layer.set(
            xlabel="MoE layer",
            ylabel="hit rate (hits / lookups)",
            ylim=(-0.02, 1.02),
            title=f"per layer, {size} experts cached",
        )
        ax_disk.set(
            xlabel="experts cached per layer",
            ylabel=f"disk MiB per {'decode ' if decode else ''}token",
            title=f"disk reads, {data['mib_per_miss']:.2f} MiB per miss",
        )
        if not shown:
            for ax in (ax_rate, ax_layer, ax_disk):
                ax.text(0.5, 0.5, "no policy picked", ha="center", va="center", transform=ax.transAxes, color="#777777")
        for ax in (ax_rate, ax_layer, ax_disk):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="best")
        fig.suptitle(
            f"expert-cache policies over {data['calls']} calls, {data['tokens']} tokens "
            f"({data['decode_tokens']} decoded), {data['n_experts']} experts per layer"
        )
    return fig


class PolicyView(View):
    """The policy figure with a policy picker (which lines to draw) and a cache-size slider (the
    per-layer panel's size)."""

    render = staticmethod(render)

    def __init__(self, data: dict, policies: Optional[Sequence[str]] = None, capacity: Optional[int] = None):
        super().__init__(
            data, policies=list(data["policies"] if policies is None else policies), capacity=_size(data, capacity)
        )

    def _controls(self) -> list:
        import ipywidgets as w

        picker = w.SelectMultiple(
            options=[(POLICY_NAMES.get(p, p), p) for p in self.data["policies"]],
            value=tuple(self.options["policies"]),
            description="policies",
            rows=len(self.data["policies"]),
        )
        picker.observe(lambda change: self.set(policies=list(change["new"])), names="value")
        sizes = self.data["capacities"]
        slider = w.IntSlider(value=self.options["capacity"], min=min(sizes), max=max(sizes), description="cache size")
        slider.observe(lambda change: self.set(capacity=change["new"]), names="value")
        return [w.HBox([picker, slider])]

    def update(self, data: dict) -> None:
        self.options["policies"] = [p for p in self.options["policies"] if p in data["policies"]] or list(
            data["policies"]
        )
        self.options["capacity"] = _size(data, self.options.get("capacity"))
        super().update(data)
