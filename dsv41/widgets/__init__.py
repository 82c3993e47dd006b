"""ipywidgets views over dsv41 results (each also renders a static figure headless).

Each view is a pure `render(data) -> matplotlib Figure` over plain data (its module's `render`), an
adapter that makes that data from a traced `GenerationResult`, and a thin `View` wrapper (controls
above the figure):

- routing: `routing_data(result)`, `routing.render`, `RoutingView` — layer x expert load and
  weight, per-layer balance against what uniform random routing of as many tokens gives
  (`chance_balance`), all tokens or the text or image tokens alone.
- cache: `cache_data(result, capacity, pool=pool_of(model.experts))`, `cache.render`, `CacheView`,
  `replay_accounting` — hit rates per layer and call, the recorded routing replayed through an
  LRU of any size (`cache_policy.lru_replay`); under a memory budget, through the one pool of
  slots every layer shares, as the running pool keeps it (`cache_policy.pool_hit_rates`).
- ties: `tie_data(result, comparison)`, `ties.render`, `TieView` — top-k score gaps, where prefill
  and decode part, top-2 logit margins.
- policy: `PolicyView` over `cache_policy.policy_data(result)`, `policy.render` — the recorded
  routing replayed through LRU, LFU, a static top-N and Belady's optimum at every cache size, per
  layer and overall, with the disk bytes per token each size would read.
- speculation: `speculation_data(result)`, `speculation.render`, `SpeculationView` — a speculative
  run's accepted length per step, acceptance by draft position and confidence calibration.
- `PromptProbe(model)` — a text box and run button that regenerate and refresh all three.

Widgets import dsv41, never the reverse; `View.show()` shows the live widget in JupyterLab and the
static figure under papermill (`dsv41.observe.viz.show`).
"""

from . import cache, policy, routing, speculation, ties
from .cache import CacheView, cache_data, pool_of, replay_accounting
from .policy import PolicyView
from .probe import PromptProbe, traced_ids
from .routing import RoutingView, balance, chance_balance, routing_data
from .speculation import SpeculationView, speculation_data
from .ties import TieView, tie_data

__all__ = [
    "CacheView",
    "PolicyView",
    "PromptProbe",
    "RoutingView",
    "SpeculationView",
    "TieView",
    "balance",
    "cache",
    "cache_data",
    "pool_of",
    "chance_balance",
    "policy",
    "replay_accounting",
    "routing",
    "routing_data",
    "speculation",
    "speculation_data",
    "tie_data",
    "ties",
    "traced_ids",
]
