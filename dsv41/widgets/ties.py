"""Tie view: how close each top-k cut came to a tie, where a prefill and a token-by-token run of the
same tokens part, and how decisive each generated token was.

An indexer keeps the k best-scoring compressed positions (k = index_topk); the candidate source
keeps the k best blocks. The gap between the k-th and the (k+1)-th score says how safe that cut
is: 0 is a tie, which the top-k implementation may break differently in a one-call prefill and in
a decode of the same tokens; no gap (grey) means nothing was cut yet, and a top-k that cut nothing
at any position is left out of the panel and named in its title (`never_cut`). `tie_data(result,
comparison)` collects the gaps per index-source layer and position from the generation's trace,
and, from a `compare_prefill_decode` report over the same tokens, the first position at which each
layer's selections and routing part and the logits' max |difference| per position; the top-2
logit margin per generated token comes from the trace's steps.
"""

from __future__ import annotations

import math

from ._common import View, as_float_grid


def _finite_or_none(values) -> list:
    return [float(v) if math.isfinite(v) else None for v in values]


def tie_data(result, comparison=None) -> dict:
    """Plain tie data from a traced GenerationResult and, optionally, the PrefillDecodeComparison
    of the tokens that went through the model (`result.prompt_ids + result.ids[:-1]`)."""
    trace = result.trace
    if trace is None:
        raise ValueError("this GenerationResult has no trace; generate with trace=True")
    att = trace.attention()
    rows, row_layers, gaps = [], [], []
    positions: list[int] = []
    for layer, fields in sorted(att.items()):
        positions = fields["positions"].tolist()
        for kth, nxt, label in (
            ("kth_score", "next_score", "index"),
            ("candidate_kth_score", "candidate_next_score", "blocks"),
        ):
            if kth in fields:
                gap = (fields[kth][0].float() - fields[nxt][0].float()).tolist()  # [n], NaN: nothing cut
                rows.append(f"{layer} {label}")
                row_layers.append(layer)
                gaps.append(_finite_or_none(gap))
    cut = [p for row in gaps for p, g in zip(positions, row) if g is not None]
    data = {
        "positions": positions,
        "prompt_tokens": len(result.prompt_ids),
        "layers": sorted(att),
        "rows": rows,
        "row_layers": row_layers,
        "gap": gaps,
        "never_cut": never_cut(rows, gaps),
        "ties": [sum(1 for g in row if g == 0.0) for row in gaps],
        "first_cut": min(cut) if cut else None,
        "margin_positions": [s.position for s in trace.steps],
        "margins": [s.margin for s in trace.steps],
        "tokens": [s.token for s in trace.steps],
        "comparison": None,
    }
    if comparison is not None:
        data["comparison"] = {
            "positions": comparison.positions,
            "max_abs_diff": list(comparison.max_abs_diff),
            "max_abs_logit": comparison.max_abs_logit,
            "first_logit_divergence": comparison.first_logit_divergence,
            "first_argmax_divergence": comparison.first_argmax_divergence,
            "selection_parting": {str(k): v for k, v in sorted(comparison.selection_partings.items())},
            "routing_parting": {str(k): v for k, v in sorted(comparison.routing_partings.items())},
            "numerics": dict(comparison.numerics),
        }
    return data


def never_cut(rows: list[str], gaps: list[list]) -> list[str]:
    """The top-k rows that cut nothing at any position (every gap None): nothing to read in them."""
    return [row for row, gap in zip(rows, gaps) if all(g is None for g in gap)]


# The Numerics fields in words a reader knows, per value; the title names what the comparison ran under.
_PLAIN_NUMERICS = {
    "window_layout": {
        "reference": "the released window-row layout",
        "uniform": "one window-row layout for both orders",
    },
    "pad_f32_rows": {False: "float32 products at each call's row count", True: "float32 products padded to 8 rows"},
    "tie_break": {"topk": "ties in torch.topk's order", "lowest": "ties to the lower position"},
    "fix_stale_index_keys": {False: "index keys republished as released", True: "index keys current at every call"},
}


def render(data: dict, tol: float = 0.0):
    """Figure, four rows over the position axis: the k-th minus (k+1)-th score per index-source row
    (x: |gap| <= tol), where prefill and decode first part per layer, max |logit difference| per
    position, and the top-2 logit margin of each generated token (red: <= tol)."""
    import numpy as np

    from dsv41.observe import viz

    positions = data["positions"]
    n = len(positions)
    extent_x = (-0.5, n - 0.5)
    fig, axes = viz.new_figure(4, 1, figsize=(8.0, 7.2), sharex=True, height_ratios=(3, 2.2, 1.6, 1.6))
    ax_gap, ax_part, ax_diff, ax_margin = axes
    decode_from = data["prompt_tokens"] - 0.5  # positions from here on were decoded one at a time
    with viz.style():
        import matplotlib.patheffects as effects

        # a row that never cut is all grey: it is named in the title instead of drawn
        skipped = never_cut(data["rows"], data["gap"])
        shown = [i for i, row in enumerate(data["rows"]) if row not in skipped]
        gap = as_float_grid([data["gap"][i] for i in shown]) if shown else np.full((1, n), np.nan)
        ax_gap.set_facecolor("#eeeeee")  # grey: nothing cut at that position
        image = ax_gap.imshow(
            np.ma.masked_invalid(gap),
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            extent=(*extent_x, gap.shape[0] - 0.5, -0.5),
        )
        near = np.argwhere(np.abs(np.nan_to_num(gap, nan=np.inf)) <= tol)
        if len(near):
            # white with a black outline: legible on viridis's dark small gaps and on its yellow alike
            ax_gap.plot(
                near[:, 1],
                near[:, 0],
                ls="none",
                marker="x",
                ms=6,
                mew=1.8,
                color="white",
                path_effects=[effects.Stroke(linewidth=3.2, foreground="black"), effects.Normal()],
                label=f"tie (gap <= {tol:g})",
            )
            ax_gap.legend(loc="upper left", fontsize=7, facecolor="#dddddd")
        ax_gap.set_yticks(range(len(shown)), [data["rows"][i] for i in shown])
        title = "k-th minus (k+1)-th score (grey: nothing cut yet)"
        if skipped:
            title += f"; never cut here, not drawn: {', '.join(f'layer {row}' for row in skipped)}"
        if not shown:
            ax_gap.text(
                0.5,
                0.5,
                "no top-k cut at any position",
                transform=ax_gap.transAxes,
                ha="center",
                va="center",
                color="#777777",
            )
        ax_gap.set(ylabel="layer, top-k", title=title)
        ax_gap.grid(False)
        fig.colorbar(image, ax=list(axes), shrink=0.35, anchor=(0.0, 1.0), label="score gap")

        cmp = data["comparison"]
        ax_part.set_ylim(len(data["layers"]) - 0.5, -0.5)
        ax_part.set_yticks(range(len(data["layers"])), [str(layer) for layer in data["layers"]])
        ax_part.set(ylabel="layer")
        if cmp is None:
            ax_part.text(
                0.5,
                0.5,
                "no prefill / decode comparison given",
                transform=ax_part.transAxes,
                ha="center",
                va="center",
                color="#777777",
            )
        else:
            row = {layer: k for k, layer in enumerate(data["layers"])}
            for key, marker, color, label in (
                ("selection_parting", "v", viz.PALETTE[0], "selections part"),
                ("routing_parting", "o", viz.PALETTE[1], "routing parts"),
            ):
                items = [
                    (pos, row[int(layer)])
                    for layer, positions in cmp[key].items()
                    if int(layer) in row
                    for pos in positions
                ]
                ax_part.plot(
                    [p for p, _ in items],
                    [r for _, r in items],
                    ls="none",
                    marker=marker,
                    ms=6,
                    color=color,
                    label=label,
                )
            if cmp["positions"] < n:  # positions the comparison did not cover
                ax_part.axvspan(cmp["positions"] - 0.5, extent_x[1], color="#f2f2f2", zorder=0)
            ax_part.legend(loc="upper left", fontsize=7, ncol=2)
        ax_part.set_title("prefill vs token-by-token: positions where each layer parts", fontsize=9)

        if cmp is not None:
            diff = np.asarray(cmp["max_abs_diff"], dtype=float)
            ax_diff.step(np.arange(diff.size), diff, where="mid", color=viz.PALETTE[4])
            if cmp["first_logit_divergence"] is not None:
                ax_diff.axvline(cmp["first_logit_divergence"], color=viz.PALETTE[3], lw=0.8, ls=":")
        if data["first_cut"] is not None:
            for ax in (ax_gap, ax_part, ax_diff):
                ax.axvline(data["first_cut"] - 0.5, color="#444444", lw=0.8, ls="--")
        ax_diff.set(ylabel="max |Δ logit|")
        ax_diff.set_title("logits, prefill vs token-by-token (dashed: first top-k cut)", fontsize=9)

        margins = np.asarray(data["margins"], dtype=float)
        where = np.asarray(data["margin_positions"], dtype=float)
        colors = [viz.PALETTE[3] if m <= tol else viz.PALETTE[2] for m in margins]
        ax_margin.bar(where, margins, width=0.8, color=colors)
        ax_margin.set(xlabel="position", ylabel="top-2 margin", xlim=extent_x)
        ax_margin.set_title("top-1 minus top-2 logit of each generated token", fontsize=9)
        for ax in axes:
            ax.axvline(decode_from, color=viz.PALETTE[7], lw=0.8)
        _reference_line_legend(fig, data, viz)
        fig.suptitle(_arithmetic_title(cmp), fontsize=10)
    return fig


def _reference_line_legend(fig, data: dict, viz) -> None:
    """One legend for the vertical lines every panel shares."""
    from matplotlib.lines import Line2D

    lines = [Line2D([], [], color=viz.PALETTE[7], lw=0.8, label="decoding starts (prompt before)")]
    if data["first_cut"] is not None:
        lines.append(Line2D([], [], color="#444444", lw=0.8, ls="--", label="first top-k cut"))
    cmp = data["comparison"]
    if cmp is not None and cmp["first_logit_divergence"] is not None:
        lines.append(Line2D([], [], color=viz.PALETTE[3], lw=0.8, ls=":", label="logits first differ"))
    # "outside": the layout engine makes room below the x labels instead of drawing over them
    fig.legend(handles=lines, loc="outside lower center", ncol=len(lines), fontsize=8, frameon=False)


def _arithmetic_title(cmp) -> str:
    """What the figure compares and under which arithmetic (the model's Numerics), in words."""
    if cmp is None or not cmp.get("numerics"):
        return "How close each top-k cut came to a tie, and how sure each generated token was"
    from dsv41.core.numerics import Numerics

    numerics = cmp["numerics"]
    if numerics == Numerics().as_dict():
        how = "the released model's arithmetic"
    elif numerics == Numerics.parity().as_dict():
        how = "arithmetic made independent of how the tokens are split into calls"
    else:
        reference = Numerics().as_dict()
        how = "; ".join(
            _PLAIN_NUMERICS.get(k, {}).get(v, f"{k} = {v}") for k, v in numerics.items() if reference.get(k) != v
        )
    return f"Does one prefill give what the same tokens fed one at a time give?\nWith {how}"


class TieView(View):
    """The tie figure with a tolerance slider: gaps and margins at or below it count as ties."""

    render = staticmethod(render)

    def __init__(self, data: dict, tol: float = 0.0):
        super().__init__(data, tol=tol)

    def _controls(self) -> list:
        import ipywidgets as w

        slider = w.FloatSlider(
            value=self.options["tol"], min=0.0, max=0.5, step=0.005, readout_format=".3f", description="tie below"
        )
        slider.observe(lambda change: self.set(tol=change["new"]), names="value")
        return [slider]
