"""Prompt probe: a text box and a run button that regenerate and refresh the three views.

Each run clears the expert cache first, so the recorded hit rates and the LRU replay (which starts
cold) describe the same thing, then generates greedily with a trace and, unless `compare=False`,
runs the same tokens as one prefill and token by token (`compare_prefill_decode`) for the tie view.
Nothing here needs a kernel: a test builds the probe and calls `on_run` directly.
"""

from __future__ import annotations

from .cache import CacheView, cache_data
from .routing import RoutingView, routing_data
from .ties import TieView, tie_data


def traced_ids(result, limit: int | None = None) -> list[int]:
    """The ids that went through the model in a generation (the prompt and every generated token
    but the last), optionally only the first `limit`: what a prefill/decode comparison should run."""
    ids = list(result.prompt_ids) + list(result.ids[:-1])
    return ids[:limit] if limit else ids


class PromptProbe:
    """Text box, token count and run button over a loaded model, above the routing, cache and tie
    views. `result` / `comparison` show an existing run instead of generating on construction;
    `compare_limit` caps the positions the prefill/decode comparison runs (it costs one forward
    per position)."""

    def __init__(self, model, prompt: str = "Once upon a time", max_new_tokens: int = 8, *, compare: bool = True,
                 compare_limit: int | None = None, result=None, comparison=None):
        import ipywidgets as w

        self.model, self.compare, self.compare_limit = model, compare, compare_limit
        self.text = w.Text(value=prompt, description="prompt", layout=w.Layout(width="60%"))
        self.tokens = w.BoundedIntText(value=max_new_tokens, min=1, max=4096, description="new tokens")
        self.button = w.Button(description="run", button_style="primary")
        self.status = w.HTML()
        self.button.on_click(self.on_run)
        self.runs = 0
        self.views: dict[str, object] = {}
        if result is None:
            result, comparison = self._generate(prompt, max_new_tokens)
        self._show(result, comparison)
        self._box = None

    # ------------------------------------------------------------------ running
    def _generate(self, prompt: str, max_new_tokens: int):
        self.model.reset_expert_cache()  # start cold: the replay assumes an empty cache
        result = self.model.generate(prompt, max_new_tokens=max_new_tokens, trace=True, stop_at_eos=False)
        comparison = None
        if self.compare and len(result.prompt_ids) + len(result.ids) > 1:
            comparison = self.model.compare_prefill_decode(traced_ids(result, self.compare_limit))
        return result, comparison

    def _show(self, result, comparison) -> None:
        self.result, self.comparison = result, comparison
        n_experts = self.model.cfg.n_routed_experts
        data = {"routing": routing_data(result, n_experts),
                "cache": cache_data(result, capacity=self.model.experts.capacity, n_experts=n_experts),
                "ties": tie_data(result, comparison)}
        for name, cls in (("routing", RoutingView), ("cache", CacheView), ("ties", TieView)):
            if name in self.views:
                self.views[name].update(data[name])
            else:
                self.views[name] = cls(data[name])
        self.status.value = (f"{len(result.prompt_ids)} prompt tokens, {len(result.ids)} generated "
                             f"({result.timings['prefill_s']:.2f} s prefill, {result.timings['decode_s']:.2f} s "
                             f"decode): <code>{_escape(result.text)}</code>")

    def on_run(self, _button=None) -> None:
        """The run button's handler: regenerate from the text box and refresh the views; a bad prompt
        becomes one line in the status, not a traceback."""
        if not self.text.value.strip():
            self.status.value = "<b>not run:</b> the prompt box is empty; type a prompt first"
            return
        self.button.disabled = True
        self.status.value = "running..."
        try:
            result, comparison = self._generate(self.text.value, int(self.tokens.value))
        except ValueError as exc:
            self.status.value = f"<b>not run:</b> {_escape(str(exc))}"
            return
        finally:
            self.button.disabled = False
        self.runs += 1
        self._show(result, comparison)

    # ------------------------------------------------------------------ showing
    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            tabs = w.Tab(children=[v.widget for v in self.views.values()])
            tabs.titles = ("routing", "expert cache", "ties")
            self._box = w.VBox([w.HBox([self.text, self.tokens, self.button]), self.status, tabs])
        return self._box

    def show(self, static: bool = True) -> None:
        """The live probe when a person is looking; headless, the three static figures (or, with
        static=False, one line: for a notebook that has shown this run's figures already)."""
        from dsv41 import viz

        if not viz.is_headless():
            viz.show(widget=self.widget)
        elif static:
            for view in self.views.values():
                viz.show(view.figure)
        else:
            print("the prompt probe is interactive: open this notebook in JupyterLab to use it")


def _escape(text: str) -> str:
    """HTML-safe, with control characters shown as escapes (random-weighted text is full of them)."""
    from html import escape

    return escape(repr(text))
