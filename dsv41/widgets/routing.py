"""Routing view: which experts each MoE layer sent tokens to, with what weight, and how evenly.

`routing_data(result)` turns a traced GenerationResult into plain data; `render(data, phase=...)`
draws a layer x expert heat map of routed load (tokens sent to each expert) and of the mean routing
weight an expert got when chosen, plus two balance measures per layer: max / mean load (1 is
perfectly even; E / k means one expert took every token) and the load's entropy over log E (1 is
perfectly even), drawn as its distance from even (1 - entropy / log E) so that 0.92 and 0.98 read
apart. Both are set against chance: a router that picks its k experts uniformly at random shows a
peak load above 1 and an entropy below 1 on a finite number of tokens (`chance_balance`, per phase
and token type in `data["chance"]`). `RoutingView` wraps it with a prefill / decode / all toggle and a token-type
filter: all tokens, text tokens only, or image-span tokens only (which choose with `bias_vl`);
with images, `data["bias_vl"]` counts per layer how many image-token selections `bias_vl` changed
against what the text bias would have chosen.
"""

from __future__ import annotations

import functools
import math

from ._common import View, nan_to_none, routing_calls

PHASES = ("all", "prefill", "decode")
TOKEN_TYPES = ("all", "text", "image")


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
    flags = _image_flags(result)
    data = {"layers": layers, "n_experts": n_experts, "top_k": top_k}
    data.update(_aggregate(calls, flags, layers, n_experts, top_k, "all"))
    # the same numbers over text tokens only and image-span tokens only
    data["by_tokens"] = {kind: _aggregate(calls, flags, layers, n_experts, top_k, kind) for kind in ("text", "image")}
    data["bias_vl"] = _bias_vl_changes(result, layers)
    return data


def _aggregate(calls, flags, layers, n_experts: int, top_k: int, tokens: str) -> dict:
    out = {"n_tokens": {}, "load": {}, "weight_sum": {}, "weight_mean": {}, "balance": {}, "chance": {}}
    for phase in PHASES:
        loads, sums = [], []
        for layer in layers:
            load, wsum = [0] * n_experts, [0.0] * n_experts
            for call, images in zip(calls[layer], flags[layer]):
                if phase == "prefill" and call["start_pos"] != 0 or phase == "decode" and call["start_pos"] == 0:
                    continue
                for ids, weights, image in zip(call["expert_ids"], call["weights"], images):
                    if tokens == "text" and image or tokens == "image" and not image:
                        continue
                    for e, w in zip(ids, weights):
                        load[e] += 1
                        wsum[e] += w
            loads.append(load)
            sums.append(wsum)
        out["n_tokens"][phase] = sum(loads[0]) // top_k
        out["load"][phase] = loads
        out["weight_sum"][phase] = sums
        out["weight_mean"][phase] = [
            nan_to_none([s / n if n else math.nan for s, n in zip(ws, ls)]) for ws, ls in zip(sums, loads)
        ]
        out["balance"][phase] = balance(loads)
        out["chance"][phase] = chance_balance(out["n_tokens"][phase], n_experts, top_k)
    return out


def _image_flags(result) -> dict[int, list[list[bool]]]:
    """Per layer and call (in the order `routing_calls` lists them), which tokens were image tokens."""
    out: dict[int, list[list[bool]]] = {}
    for rec in result.trace.forward.routing:
        n = rec.expert_ids.size(1)
        mask = rec.image_mask[0].tolist() if getattr(rec, "image_mask", None) is not None else [False] * n
        out.setdefault(int(rec.layer), []).append(mask)
    return out


def _bias_vl_changes(result, layers) -> dict:
    """Per layer: image tokens routed, and of their top-k selections how many bias_vl changed
    against the text bias's choice (an expert chosen that the text bias would not have chosen)."""
    tokens, changed = {layer: 0 for layer in layers}, {layer: 0 for layer in layers}
    for rec in result.trace.forward.routing:
        if getattr(rec, "image_mask", None) is None or rec.text_bias_ids is None:
            continue
        mask = rec.image_mask[0]
        tokens[int(rec.layer)] += int(mask.sum())
        for vl, text in zip(rec.expert_ids[0][mask].tolist(), rec.text_bias_ids[0][mask].tolist()):
            changed[int(rec.layer)] += len(set(vl) - set(text))
    return {
        "image_tokens": [tokens[layer] for layer in layers],
        "changed_selections": [changed[layer] for layer in layers],
    }


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


def chance_balance(n_tokens: int, n_experts: int, top_k: int) -> dict | None:
    """What uniform random routing shows on `n_tokens` tokens (each to `top_k` distinct experts of
    `n_experts`, `dsv41.observe.learned.uniform_routing_loads`: fixed seed): `balance`'s max / mean load and
    entropy / log E, each as the mean and the 5th-95th percentile over the draws. None without tokens."""
    from dsv41.observe.learned import CHANCE_DRAWS, CHANCE_SEED

    if n_tokens == 0:
        return None
    out = {"n_tokens": n_tokens, "draws": CHANCE_DRAWS, "seed": CHANCE_SEED}
    for key, (mean, low, high) in _chance_levels(n_tokens, n_experts, top_k):
        out[key] = {"mean": mean, "low": low, "high": high}
    return out


@functools.lru_cache(maxsize=64)
def _chance_levels(n_tokens: int, n_experts: int, top_k: int) -> tuple:
    """(measure, (mean, 5th, 95th percentile)) per balance measure; cached, since every phase, token
    type and probe run of the same token count draws the same numbers."""
    import numpy as np

    from dsv41.observe.learned import uniform_routing_loads

    drawn = balance(uniform_routing_loads(n_tokens, n_experts, top_k).tolist())
    levels = []
    for key in ("max_over_mean", "entropy"):
        values = np.asarray(drawn[key], dtype=float)
        levels.append((key, (float(values.mean()), float(np.percentile(values, 5)), float(np.percentile(values, 95)))))
    return tuple(levels)


def render(data: dict, phase: str = "all", tokens: str = "all"):
    """Figure: load and mean-weight heat maps (layer x expert) above the per-layer balance bars,
    over all tokens, text tokens or image-span tokens (`tokens`)."""
    import numpy as np

    from dsv41.observe import viz

    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if tokens not in TOKEN_TYPES:
        raise ValueError(f"tokens must be one of {TOKEN_TYPES}, got {tokens!r}")
    layers, n_experts = data["layers"], data["n_experts"]
    if tokens != "all":
        data = {**data, **data["by_tokens"][tokens]}
    load = np.asarray(data["load"][phase], dtype=float)  # [layers, experts]
    mean_w = np.array([[np.nan if v is None else v for v in row] for row in data["weight_mean"][phase]], dtype=float)
    bal = data["balance"][phase]
    fig, axes = viz.new_figure(2, 2, figsize=(8.0, 5.6), height_ratios=(3, 2))
    (ax_load, ax_w), (ax_max, ax_ent) = axes
    # at most about a dozen layer labels per axis (the released model's 40 would overprint)
    step = max(1, -(-len(layers) // 12))
    shown = list(range(0, len(layers), step))
    with viz.style():
        for ax, grid, label, unit, cmap in (
            (ax_load, load, "tokens routed", "tokens", "viridis"),
            (ax_w, mean_w, "mean weight when chosen", "routing weight", "magma"),
        ):
            image = ax.imshow(
                np.ma.masked_invalid(grid),
                aspect="auto",
                interpolation="nearest",
                cmap=cmap,
                extent=(-0.5, n_experts - 0.5, len(layers) - 0.5, -0.5),
            )
            ax.set_yticks(shown, [str(layers[i]) for i in shown])
            ax.set(xlabel="expert", ylabel="layer", title=label)
            ax.grid(False)
            fig.colorbar(image, ax=ax, shrink=0.9, label=unit)
        x = np.arange(len(layers))
        max_over_mean = np.array([np.nan if v is None else v for v in bal["max_over_mean"]], dtype=float)
        entropy = np.array([np.nan if v is None else v for v in bal["entropy"]], dtype=float)
        chance = data["chance"][phase]
        ax_max.bar(x, max_over_mean, color=viz.PALETTE[1])
        ax_max.axhline(1.0, color="#444444", lw=0.8, ls="--", label="perfectly even")
        # distance from even: 1 - entropy / log E on an axis from 0, so small differences near 1 show
        # at their true size; each bar keeps its entropy written above it
        uneven = 1.0 - entropy
        bars = ax_ent.bar(x, uneven, color=viz.PALETTE[2])
        if step == 1:  # with more bars than labels fit, the values stay in the sidecar
            ax_ent.bar_label(bars, labels=["" if np.isnan(v) else f"{v:.2f}" for v in entropy], fontsize=6, padding=1)
        top = np.nanmax(uneven, initial=0.0)
        max_title, ent_title = "peak load (1 is even)", "distance from even (0 is even)"
        if chance is not None:
            for ax, stat, flip in ((ax_max, chance["max_over_mean"], False), (ax_ent, chance["entropy"], True)):
                mean, low, high = (
                    (1 - stat["mean"], 1 - stat["high"], 1 - stat["low"])
                    if flip
                    else (stat["mean"], stat["low"], stat["high"])
                )
                ax.axhspan(low, high, color="#bbbbbb", alpha=0.45, lw=0, zorder=0.5)
                ax.axhline(mean, color="#222222", lw=1.0, ls=":", zorder=3)
            top = max(top, 1.0 - chance["entropy"]["low"])
            max_title += f"; chance {chance['max_over_mean']['mean']:.2f}"
            ent_title += f"; chance {1 - chance['entropy']['mean']:.3f}"
        ax_max.set(
            xticks=shown,
            xticklabels=[str(layers[i]) for i in shown],
            xlabel="layer",
            ylim=(0, None),
            ylabel="max / mean load",
            title=max_title,
        )
        ax_ent.set(
            xticks=shown,
            xticklabels=[str(layers[i]) for i in shown],
            xlabel="layer",
            ylim=(0, 1.25 * top or 1.0),
            ylabel="1 - entropy / log E",
            title=ent_title,
        )
        if not data["n_tokens"][phase]:
            for ax in axes.flat:
                ax.text(
                    0.5,
                    0.5,
                    f"no {tokens if tokens != 'all' else ''} tokens in this phase".replace("  ", " "),
                    transform=ax.transAxes,
                    ha="center",
                    va="center",
                    color="#777777",
                )
        _chance_legend(fig, chance is not None, viz, labelled=step == 1)
        which = "" if tokens == "all" else f"{tokens} "
        fig.suptitle(
            f"routing, {phase}: {data['n_tokens'][phase]} {which}tokens x top-{data['top_k']} of {n_experts} experts"
        )
    return fig


def _chance_legend(fig, with_chance: bool, viz, labelled: bool = True) -> None:
    """One legend under the balance panels for their reference lines (`labelled`: the entropy bars
    carry their values)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Line2D([], [], color="#444444", lw=0.8, ls="--", label="perfectly even load"),
        Patch(color=viz.PALETTE[2], label="bar labels: entropy / log E" if labelled else "bars: 1 - entropy / log E"),
    ]
    if with_chance:
        handles += [
            Line2D([], [], color="#222222", lw=1.0, ls=":", label="chance: uniform random routing, mean"),
            Patch(color="#bbbbbb", alpha=0.45, lw=0, label="its 5-95% range (as many tokens)"),
        ]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=7, frameon=False)


class RoutingView(View):
    """The routing figure with a prefill / decode / all toggle and an all / text / image filter."""

    render = staticmethod(render)

    def __init__(self, data: dict, phase: str = "all", tokens: str = "all"):
        super().__init__(data, phase=phase, tokens=tokens)

    def _controls(self) -> list:
        import ipywidgets as w

        toggle = w.ToggleButtons(options=list(PHASES), value=self.options["phase"], description="tokens")
        toggle.observe(lambda change: self.set(phase=change["new"]), names="value")
        kind = w.ToggleButtons(options=list(TOKEN_TYPES), value=self.options["tokens"], description="type")
        kind.observe(lambda change: self.set(tokens=change["new"]), names="value")
        return [toggle, kind]
