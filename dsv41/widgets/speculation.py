"""Speculation view: what a speculative run's draft stack proposed and the model accepted.

`speculation_data(result)` reads a speculative `GenerationResult`'s `speculation` (one
`SpeculationStep` per draft-verify step) into plain data; `render` draws three panels: the accepted
length of every step (bars) against what the step kept after the confidence cut (outline),
acceptance by draft position (a proposal is judged only when all before it were accepted, so each
bar is the conditional rate, with how many were judged), and calibration — the judged proposals'
sigmoid(confidence), binned, against the fraction accepted (the diagonal is a calibrated head).
"""

from __future__ import annotations

from ._common import View, nan_to_none


def speculation_data(result, bins: int = 5) -> dict:
    """Plain data from a GenerationResult made with `speculative=True`."""
    spec = getattr(result, "speculation", None)
    if spec is None:
        raise ValueError("this GenerationResult is not a speculative run; generate with speculative=True")
    steps = spec.steps
    judged, _ = spec.judged_by_position()
    return {
        "positions": [s.position for s in steps],
        "drafted": [s.drafted for s in steps],
        "kept": [s.kept for s in steps],
        "accepted": [s.accepted for s in steps],
        "target_forwards": [s.target_forwards for s in steps],
        "acceptance_by_position": nan_to_none(spec.acceptance_by_position()),
        "judged_by_position": judged,
        "calibration": spec.calibration(bins),
        "tokens": spec.tokens,
        "forwards": spec.target_forwards,
        "tokens_per_forward": spec.tokens_per_forward,
        "mean_accepted": spec.mean_accepted,
    }


def render(data: dict):
    import numpy as np

    from dsv41.observe import viz

    fig, (ax_steps, ax_pos, ax_cal) = viz.new_figure(1, 3, figsize=(10.0, 3.2), width_ratios=(1.6, 1, 1))
    with viz.style():
        n = len(data["accepted"])
        x = np.arange(n)
        ax_steps.bar(x, data["kept"], color="none", edgecolor=viz.PALETTE[0], lw=0.8, label="kept (verified)")
        ax_steps.bar(x, data["accepted"], color=viz.PALETTE[0], label="accepted")
        rerun = [i for i, f in enumerate(data["target_forwards"]) if f > 1]
        ax_steps.plot(
            rerun,
            [-0.25] * len(rerun),
            ls="none",
            marker="^",
            ms=3,
            color=viz.PALETTE[3],
            label="rollback had to re-run the kept part",
        )
        per_forward = data["tokens_per_forward"]
        ax_steps.set(
            xlabel="draft-verify step",
            ylabel="proposals",
            title=f"{data['tokens']} tokens in {data['forwards']} target forwards"
            + (f" ({per_forward:.2f} per forward)" if per_forward else ""),
        )
        ax_steps.legend(loc="upper right", fontsize=7)
        ax_steps.set_ylim(-0.6, max(data["drafted"] + [1]) + 0.6)

        rates = [np.nan if r is None else r for r in data["acceptance_by_position"]]
        pos = np.arange(1, len(rates) + 1)
        ax_pos.bar(pos, rates, color=viz.PALETTE[1])
        for p, r, k in zip(pos, rates, data["judged_by_position"]):
            ax_pos.text(p, (0 if np.isnan(r) else r) + 0.02, f"n={k}", ha="center", fontsize=7)
        ax_pos.set(
            xlabel="draft position",
            ylabel="accepted / judged",
            ylim=(0, 1.1),
            xticks=pos,
            title="acceptance by draft position",
        )

        cal = data["calibration"]
        centers = [(b["low"] + b["high"]) / 2 for b in cal]
        fractions = [np.nan if b["accepted_fraction"] is None else b["accepted_fraction"] for b in cal]
        ax_cal.plot([0, 1], [0, 1], color="#999999", lw=0.8, ls="--")
        ax_cal.plot(centers, fractions, marker="o", color=viz.PALETTE[2])
        for c, f, b in zip(centers, fractions, cal):
            if b["count"]:
                ax_cal.text(c, f + 0.04, str(b["count"]), ha="center", fontsize=7)
        ax_cal.set(
            xlabel="sigmoid(confidence), binned",
            ylabel="accepted fraction",
            xlim=(0, 1),
            ylim=(0, 1.1),
            title="calibration (judged proposals)",
        )
    return fig


class SpeculationView(View):
    render = staticmethod(render)
    title = "speculation"
