"""Cache view: expert-cache hit rates per layer over the forward calls, and the recorded routing
replayed through an LRU of any size.

The loader's expert cache keeps, per layer, the `capacity` most recently used packed experts. On
each forward call a layer looks up the distinct experts its tokens chose, in ascending id order;
each lookup is a hit or a miss. `cache_policy.lru_replay` is that rule in plain Python over recorded ids, so the
hit rate a different cache size would have had follows from one traced run, without running the
model again. At the configured size, starting cold, the replay reproduces the recorded counts
exactly; above the number of distinct experts it is left with the compulsory misses alone.
"""

from __future__ import annotations

from typing import Sequence

from dsv41.observe.cache_policy import call_lookups, pool_hit_rates, pool_steps, replay_counts

from ._common import View, routing_calls


# ---------------------------------------------------------------------- trace -> plain data
def cache_data(
    result,
    capacity: int | None = None,
    sizes: Sequence[int] | None = None,
    n_experts: int | None = None,
    pool: dict | None = None,
) -> dict:
    """Plain cache data from a traced GenerationResult: the recorded hits / misses per layer and
    forward call, each layer's lookup ids, and the LRU replay's hit rate for every size in `sizes`
    (default 0 .. n_experts; n_experts defaults to the largest routed id + 1). `capacity` is the
    cache size the run used (`model.experts.capacity`), marked on the curve; the replay starts cold.
    `pool`: for a run under a memory budget, whose experts sat in one pool of slots shared by every
    layer (`stores.SlotCache`), {"slots", "policy", "half_life"}: the recorded run is then marked
    at the pool's share per layer, and the pool itself replayed (`cache_policy.pool_hit_rates`,
    the running pool's own bookkeeping), which must give the recorded counts."""
    calls = routing_calls(result)
    layers = list(calls)
    lookups = {layer: [call_lookups(c["expert_ids"]) for c in calls[layer]] for layer in layers}
    steps = result.trace.cache
    hits = [[int(s["layers"].get(layer, [0, 0])[0]) for s in steps] for layer in layers]
    misses = [[int(s["layers"].get(layer, [0, 0])[1]) for s in steps] for layer in layers]
    seen = max((e for per in lookups.values() for call in per for e in call), default=-1)
    n_experts = int(n_experts or seen + 1)
    sizes = [int(s) for s in (sizes if sizes is not None else range(0, n_experts + 1))]
    if capacity is not None and capacity not in sizes:
        sizes = sorted(sizes + [int(capacity)])
    by_layer = []
    for layer in layers:
        rates = []
        for size in sizes:
            counts = replay_counts(lookups[layer], size)
            n = sum(h + m for h, m in counts)
            rates.append(sum(h for h, _ in counts) / n if n else None)
        by_layer.append(rates)
    n_lookups = [sum(len(c) for c in lookups[layer]) for layer in layers]
    total = sum(n_lookups)
    overall = [
        sum(r[i] * n for r, n in zip(by_layer, n_lookups) if r[i] is not None) / total if total else None
        for i in range(len(sizes))
    ]
    recorded_hits = sum(map(sum, hits))
    data = {
        "layers": layers,
        "n_experts": n_experts,
        "capacity": capacity,
        "steps": [{"start_pos": s["start_pos"], "seqlen": s["seqlen"]} for s in steps],
        "hits": hits,
        "misses": misses,
        "recorded_hit_rate": recorded_hits / (recorded_hits + sum(map(sum, misses))) if steps else None,
        "lookups": n_lookups,
        "distinct": [len({e for c in lookups[layer] for e in c}) for layer in layers],
        "lookup_ids": {str(layer): lookups[layer] for layer in layers},
        "replay_sizes": sizes,
        "replay_hit_rate": overall,
        "replay_hit_rate_by_layer": by_layer,
    }
    if pool is not None:
        replayed = pool_hit_rates(pool_steps(result), int(pool["slots"]), (pool["policy"],), pool.get("half_life"))
        data["pool"] = {
            "slots": int(pool["slots"]),
            "policy": pool["policy"],
            "layers_sharing": len(layers),
            "share_per_layer": int(pool["slots"]) / max(1, len(layers)),
            "replay_hits": replayed[pool["policy"]]["hits"],
            "replay_misses": replayed[pool["policy"]]["misses"],
            "replay_hit_rate": replayed[pool["policy"]]["hit_rate"],
            "replay_equals_recorded": replayed[pool["policy"]]["hits"] == recorded_hits
            and replayed[pool["policy"]]["misses"] == sum(map(sum, misses)),
        }
    elif capacity is not None:
        data["replay_at_capacity"] = {str(layer): replay_counts(lookups[layer], capacity) for layer in layers}
    return data


def pool_of(experts) -> dict | None:
    """`cache_data`'s `pool` for a model's expert store: {"slots", "policy", "half_life"} where it is
    one pool of slots for every layer (`stores.SlotCache`, a load under a memory budget), else None."""
    if not hasattr(experts, "slots") or not hasattr(experts, "residency"):
        return None
    return {"slots": int(experts.slots), "policy": experts.policy, "half_life": experts.half_life}


def replay_accounting(data: dict) -> dict[str, dict]:
    """Per layer (str), from `cache_data` made with a capacity: the replay's hits and misses at
    that capacity, whether it reproduces the recorded counts call by call, and the distinct experts."""
    if "replay_at_capacity" not in data:
        raise ValueError(
            "this cache data has no per-layer replay at the run's capacity; make it with cache_data(result, "
            "capacity=...) (a pooled run's replay is data['pool'])"
        )
    out = {}
    for i, layer in enumerate(data["layers"]):
        replay = data["replay_at_capacity"][str(layer)]
        out[str(layer)] = {
            "replay_hits": sum(h for h, _ in replay),
            "replay_misses": sum(m for _, m in replay),
            "replay_per_call_equal": replay == [[h, m] for h, m in zip(data["hits"][i], data["misses"][i])],
            "distinct": data["distinct"][i],
        }
    return out


def render(data: dict, highlight: int | None = None):
    """Figure: hit rate per layer and forward call (left), LRU replay hit rate vs cache size (right)
    with the recorded run marked at its configured size and `highlight` (a size) called out."""
    import numpy as np

    from dsv41.observe import viz

    layers, steps = data["layers"], data["steps"]
    hits, misses = np.asarray(data["hits"], dtype=float), np.asarray(data["misses"], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = hits / (hits + misses)  # [layers, calls]; NaN where a layer looked nothing up
    fig, (ax_map, ax_curve) = viz.new_figure(1, 2, figsize=(8.4, 3.6), width_ratios=(3, 2))
    with viz.style():
        image = ax_map.imshow(
            np.ma.masked_invalid(rate),
            aspect="auto",
            interpolation="nearest",
            vmin=0,
            vmax=1,
            extent=(-0.5, len(steps) - 0.5, len(layers) - 0.5, -0.5),
        )
        ax_map.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        ticks = list(range(0, len(steps), max(1, len(steps) // 8)))
        ax_map.set_xticks(ticks, ["prefill" if steps[t]["start_pos"] == 0 else str(t) for t in ticks])
        pool = data.get("pool")
        ax_map.set(
            xlabel="forward call (decode step)",
            ylabel="layer",
            title=(
                f"expert-pool hit rate ({pool['slots']} slots for {pool['layers_sharing']} layers, {pool['policy']})"
                if pool
                else f"expert-cache hit rate (cache {data['capacity']} per layer)"
            ),
        )
        ax_map.grid(False)
        fig.colorbar(image, ax=ax_map, shrink=0.9, label="hits / lookups")

        sizes = np.asarray(data["replay_sizes"])
        for i, rates in enumerate(data["replay_hit_rate_by_layer"]):
            ax_curve.plot(
                sizes,
                [np.nan if r is None else r for r in rates],
                color="#bbbbbb",
                lw=0.7,
                label="LRU replay, each layer" if i == 0 else None,
            )
        overall = np.array([np.nan if r is None else r for r in data["replay_hit_rate"]], dtype=float)
        ax_curve.plot(sizes, overall, color=viz.PALETTE[0], marker="o", ms=3, label="LRU replay, all layers")
        # the run: at its cache size, or at a pool's share per layer (where its rate compares)
        if pool:
            recorded_at, recorded_label = (
                pool["share_per_layer"],
                f"recorded, a pool of {pool['slots']} ({pool['share_per_layer']:.1f} per layer)",
            )
        else:
            recorded_at, recorded_label = data["capacity"], f"recorded, size {data['capacity']}"
        if recorded_at is not None and data["recorded_hit_rate"] is not None:
            ax_curve.plot(
                [recorded_at],
                [data["recorded_hit_rate"]],
                ls="none",
                marker="*",
                ms=11,
                color=viz.PALETTE[1],
                label=recorded_label,
            )
        if pool:
            replayed = np.nan if pool["replay_hit_rate"] is None else pool["replay_hit_rate"]
            ax_curve.plot(
                [recorded_at],
                [replayed],
                ls="none",
                marker="o",
                mfc="none",
                ms=9,
                color=viz.PALETTE[2],
                label=f"the pool replayed ({pool['policy']})",
            )
        if highlight is not None and highlight in data["replay_sizes"]:
            value = overall[list(data["replay_sizes"]).index(highlight)]
            ax_curve.axvline(highlight, color=viz.PALETTE[3], lw=0.8, ls="--")
            ax_curve.annotate(
                f"size {highlight}: {value:.3f}",
                (highlight, value),
                xytext=(4, -12),
                textcoords="offset points",
                fontsize=8,
                color=viz.PALETTE[3],
            )
        ax_curve.set(xlabel="experts cached per layer", ylabel="hit rate", ylim=(-0.02, 1.02), title="replayed routing")
        # upper left: the curves start low at small sizes, and the size call-out sits by the curve
        ax_curve.legend(loc="upper left", fontsize=8)
    return fig


class CacheView(View):
    """The cache figure with a cache-size slider that reads the replay at that size."""

    render = staticmethod(render)

    def __init__(self, data: dict, highlight: int | None = None):
        if highlight is None and data.get("pool") is None:
            highlight = data.get("capacity")
        super().__init__(data, highlight=highlight)

    def _controls(self) -> list:
        import ipywidgets as w

        sizes = self.data["replay_sizes"]
        slider = w.IntSlider(
            value=self.options["highlight"] or 0, min=min(sizes), max=max(sizes), description="cache size"
        )
        slider.observe(lambda change: self.set(highlight=change["new"]), names="value")
        return [slider]

    def update(self, data: dict) -> None:
        if self.options.get("highlight") not in data["replay_sizes"]:
            self.options["highlight"] = data.get("capacity")
        super().update(data)
