"""ipywidgets views over dsv41 results (each also renders a static figure headless).

Each view is a pure `render(data) -> matplotlib Figure` over plain data, an adapter that makes that
data from a traced `GenerationResult`, and a thin `View` wrapper (controls above the figure):

- routing: `routing_data(result)`, `render_routing`, `RoutingView` — layer x expert load and weight,
  per-layer balance.
- cache: `cache_data(result, capacity)`, `render_cache`, `CacheView`, `lru_replay`,
  `replay_accounting` — hit rates per layer and call, the recorded routing replayed through an LRU of
  any size.
- ties: `tie_data(result, comparison)`, `render_ties`, `TieView` — top-k score gaps, where prefill
  and decode part, top-2 logit margins.
- `PromptProbe(model)` — a text box and run button that regenerate and refresh all three.

Widgets import dsv41, never the reverse; `View.show()` shows the live widget in JupyterLab and the
static figure under papermill (`dsv41.viz.show`).
"""

from .cache import CacheView, cache_data, lru_replay, replay_accounting, replay_counts
from .cache import render as render_cache
from .probe import PromptProbe, traced_ids
from .routing import RoutingView, balance, routing_data
from .routing import render as render_routing
from .ties import TieView, tie_data
from .ties import render as render_ties

__all__ = ["CacheView", "PromptProbe", "RoutingView", "TieView", "balance", "cache_data", "lru_replay",
           "render_cache", "render_routing", "render_ties", "replay_accounting", "replay_counts", "routing_data",
           "tie_data", "traced_ids"]
