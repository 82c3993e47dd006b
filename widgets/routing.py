"""Routing view: which experts each MoE layer sent tokens to, with what weight, and how evenly.

`routing_data(result)` turns a traced GenerationResult into plain data; `render(data, phase=...)`
draws a layer x expert heat map of routed load (tokens sent to each expert) and of the mean routing
weight an expert got when chosen, plus two balance measures per layer: max / mean load (1 is
perfectly even; E / k means one expert took every token) and the load's entropy over log E (1 is
perfectly even). `RoutingView` wraps it with a prefill / decode / all toggle.
"""

from __future__ import annotations

import math

from ._common import View, nan_to_none, routing_calls

PHASES = ("all", "prefill", "decode")


def routing_data(result, n_experts: int | None = None) -> dict:
    """Plain routing data from a traced GenerationResult. The prefill is the call at position 0,
    every later call a decode step. `n_experts` defaults to the largest routed id + 1."""
    calls = routing_calls(result)
    layers = list(calls)
    if not layers:
        raise ValueError("the trace holds no routing records")
    top_k = len(calls[layers[0]][0]["expert_ids"][0])
    seen = max(e for per in calls.values() for c in per for row in c["expert_ids"] for e in row)
    n_experts = int(n_experts or seen + 1)
    data = {"layers": layers, "n_experts": n_experts, "top_k": top_k, "n_tokens": {},
            "load": {}, "weight_sum": {}, "weight_mean": {}, "balance": {}}
    for phase in PHASES:
        loads, sums = [], []
        for layer in layers:
            load, wsum = [0] * n_experts, [0.0] * n_experts
            for call in calls[layer]:
                if phase == "prefill" and call["start_pos"] != 0 or phase == "decode" and call["start_pos"] == 0:
                    continue
                for ids, weights in zip(call["expert_ids"], call["weights"]):
                    for e, w in zip(ids, weights):
                        load[e] += 1
                        wsum[e] += w
            loads.append(load)
            sums.append(wsum)
        data["n_tokens"][phase] = sum(loads[0]) // top_k
        data["load"][phase] = loads
        data["weight_sum"][phase] = sums
        data["weight_mean"][phase] = [nan_to_none([s / n if n else math.nan for s, n in zip(ws, ls)])
                                      for ws, ls in zip(sums, loads)]
        data["balance"][phase] = balance(loads)
    return data


def balance(loads: list[list[int]]) -> dict:
    """Per layer: max / mean load, load entropy / log E, and the number of experts never chosen.
    A layer with no tokens gets None for the two ratios."""
    out = {"max_over_mean": [], "entropy": [], "unused": []}
    for load in loads:
        total, n = sum(load), len(load)
        out["unused"].append(sum(1 for x in load if x == 0))
        if total == 0:
            out["max_over_mean"].append(None)
            out["entropy"].append(None)
            continue
        out["max_over_mean"].append(max(load) / (total / n))
        h = -sum(x / total * math.log(x / total) for x in load if x)
        out["entropy"].append(h / math.log(n) if n > 1 else 1.0)
    return out


def render(data: dict, phase: str = "all"):
    """Figure: load and mean-weight heat maps (layer x expert) above the per-layer balance bars."""
    import numpy as np

    from dsv41 import viz

    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    layers, n_experts = data["layers"], data["n_experts"]
    load = np.asarray(data["load"][phase], dtype=float)  # [layers, experts]
    mean_w = np.array([[np.nan if v is None else v for v in row] for row in data["weight_mean"][phase]], dtype=float)
    bal = data["balance"][phase]
    fig, axes = viz.new_figure(2, 2, figsize=(8.0, 5.6), height_ratios=(3, 2))
    (ax_load, ax_w), (ax_max, ax_ent) = axes
    with viz.style():
        for ax, grid, label, unit, cmap in ((ax_load, load, "tokens routed", "tokens", "viridis"),
                                            (ax_w, mean_w, "mean weight when chosen", "routing weight", "magma")):
            image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap,
                              extent=(-0.5, n_experts - 0.5, len(layers) - 0.5, -0.5))
            ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
            ax.set(xlabel="expert", ylabel="layer", title=label)
            ax.grid(False)
            fig.colorbar(image, ax=ax, shrink=0.9, label=unit)
        x = np.arange(len(layers))
        max_over_mean = np.array([np.nan if v is None else v for v in bal["max_over_mean"]], dtype=float)
        entropy = np.array([np.nan if v is None else v for v in bal["entropy"]], dtype=float)
        ax_max.bar(x, max_over_mean, color=viz.PALETTE[1])
        ax_max.axhline(1.0, color="#444444", lw=0.8, ls="--")
        ax_max.set(xticks=x, xticklabels=[str(layer) for layer in layers], xlabel="layer",
                   ylabel="max / mean load", title="peak load (1 is even)")
        ax_ent.bar(x, entropy, color=viz.PALETTE[2])
        ax_ent.set(xticks=x, xticklabels=[str(layer) for layer in layers], xlabel="layer", ylim=(0, 1.05),
                   ylabel="entropy / log E", title="spread over experts (1 is even)")
        fig.suptitle(f"routing, {phase}: {data['n_tokens'][phase]} tokens x top-{data['top_k']} of {n_experts} experts")
    return fig


class RoutingView(View):
    """The routing figure with a prefill / decode / all toggle."""

    render = staticmethod(render)

    def __init__(self, data: dict, phase: str = "all"):
        super().__init__(data, phase=phase)

    def _controls(self) -> list:
        import ipywidgets as w

        toggle = w.ToggleButtons(options=list(PHASES), value=self.options["phase"], description="tokens")
        toggle.observe(lambda change: self.set(phase=change["new"]), names="value")
        return [toggle]
