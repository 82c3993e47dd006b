"""ipywidgets views over dsv41 results (each also renders a static figure headless).

Each view is a pure `render(data) -> matplotlib Figure` over plain data, an adapter that makes that
data from a traced `GenerationResult`, and a thin `View` wrapper (controls above the figure):

- routing: `routing_data(result)`, `render_routing`, `RoutingView` — layer x expert load and weight,
  per-layer balance against what uniform random routing of as many tokens gives (`chance_balance`),
  all tokens or the text or image tokens alone.
- cache: `cache_data(result, capacity)`, `render_cache`, `CacheView`, `lru_replay`,
  `replay_accounting` — hit rates per layer and call, the recorded routing replayed through an LRU of
  any size.
- ties: `tie_data(result, comparison)`, `render_ties`, `TieView` — top-k score gaps, where prefill
  and decode part, top-2 logit margins.
- policy: `policy_data(result)` (from `dsv41.observe.cache_policy`), `render_policy`, `PolicyView` — the
  recorded routing replayed through LRU, LFU, a static top-N and Belady's optimum at every cache
  size, per layer and overall, with the disk bytes per token each size would read.
- speculation: `speculation_data(result)`, `render_speculation`, `SpeculationView` — a speculative
  run's accepted length per step, acceptance by draft position and confidence calibration.
- `PromptProbe(model)` — a text box and run button that regenerate and refresh all three.

Widgets import dsv41, never the reverse; `View.show()` shows the live widget in JupyterLab and the
static figure under papermill (`dsv41.observe.viz.show`).
"""

from .cache import CacheView, cache_data, lru_replay, replay_accounting, replay_counts
from .cache import render as render_cache
from .policy import PolicyView, policy_data
from .policy import render as render_policy
from .probe import PromptProbe, traced_ids
from .routing import RoutingView, balance, chance_balance, routing_data
from .routing import render as render_routing
from .speculation import SpeculationView, speculation_data
from .speculation import render as render_speculation
from .ties import TieView, tie_data
from .ties import render as render_ties

__all__ = [
    "CacheView",
    "PolicyView",
    "PromptProbe",
    "RoutingView",
    "SpeculationView",
    "TieView",
    "balance",
    "cache_data",
    "chance_balance",
    "lru_replay",
    "policy_data",
    "render_cache",
    "render_policy",
    "render_routing",
    "render_speculation",
    "render_ties",
    "replay_accounting",
    "replay_counts",
    "routing_data",
    "speculation_data",
    "tie_data",
    "traced_ids",
]
