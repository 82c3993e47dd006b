"""Prompt probe: a text box and a run button that regenerate and refresh the three views.

Each run clears the expert cache first, so the recorded hit rates and the LRU replay (which starts
cold) describe the same thing, then generates greedily with a trace and, unless `compare=False`,
runs the same tokens as one prefill and token by token (`compare_prefill_decode`) for the tie view.
A progress bar counts the generated tokens (with tokens/s so far) and the comparison's positions;
the stop button ends the generation after the current token. In a live kernel the run goes on a
background thread, so the stop button's click is handled while it runs; elsewhere (a test, a
script) `on_run` runs to the end before it returns. Views handed in as `refresh=` (a notebook's
own views above the probe) are refreshed with its tabs. Nothing here needs a kernel: a test
builds the probe and calls `on_run` directly.

Chat mode (`chat=True`): the text box holds a user message (or a JSON list of OpenAI-style messages)
that goes through `dsv41.generation.conversation.chat` in the V4.1 chat format after the probe's `messages`; the status
shows the parsed reply (reasoning, content, tool calls) and the views the routing of the whole
rendered conversation, which each run prefills afresh so the cold expert cache sees all of it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from .cache import CacheView, cache_data, pool_of
from .routing import RoutingView, routing_data
from .speculation import SpeculationView, speculation_data
from .ties import TieView, tie_data

if TYPE_CHECKING:  # annotations only
    from ..model.model import Model

TAB_TITLES = {"routing": "routing", "cache": "expert cache", "ties": "ties", "speculation": "speculation"}


def traced_ids(result, limit: int | None = None) -> list[int]:
    """The ids that went through the model in a generation (the prompt and every generated token
    but the last), optionally only the first `limit`: what a prefill/decode comparison should run."""
    ids = list(result.prompt_ids) + list(result.ids[:-1])
    return ids[:limit] if limit else ids


class PromptProbe:
    """Text box, token count and run button over a loaded model, above the routing, cache and tie
    views. `result` / `comparison` show an existing run instead of generating on construction;
    `compare_limit` caps the positions the prefill/decode comparison runs (it costs one forward
    per position). `refresh`: RoutingView / CacheView / TieView / SpeculationView objects shown
    elsewhere that each run refreshes too; `speculative`: the checkbox's first state (decode with the
    DSpark draft stack; its runs add a speculation tab); `background`: run on a thread (default: when
    a person is looking)."""

    def __init__(
        self,
        model: Model,
        prompt: str = "Once upon a time",
        max_new_tokens: int = 8,
        *,
        compare: bool = True,
        compare_limit: int | None = None,
        result=None,
        comparison=None,
        refresh=(),
        background: bool | None = None,
        chat: bool = False,
        messages=(),
        thinking: bool = False,
        speculative: bool = False,
    ):
        import ipywidgets as w

        from dsv41.observe import viz

        self.model, self.compare, self.compare_limit = model, compare, compare_limit
        self.chat, self.messages, self.thinking = chat, list(messages), thinking
        self.chat_result = None  # chat mode: the last run's ChatResult (parsed reply, raw text, prompt)
        self.refresh = list(refresh)
        self.background = not viz.is_headless() if background is None else background
        self.text = w.Text(value=prompt, description="prompt", layout=w.Layout(width="60%"))
        self.tokens = w.BoundedIntText(value=max_new_tokens, min=1, max=4096, description="new tokens")
        self.button = w.Button(description="run", button_style="primary")
        self.stop_button = w.Button(description="stop", button_style="warning", disabled=True)
        # speculative decoding with the DSpark draft stack: adds the speculation tab
        self.speculate = w.Checkbox(
            value=speculative, description="speculative", indent=False, layout=w.Layout(width="auto")
        )
        self.progress = w.IntProgress(value=0, min=0, max=max(1, max_new_tokens), description="tokens")
        self.status = w.HTML()
        self.button.on_click(self.on_run)
        self.stop_button.on_click(self.stop)
        self.runs = 0
        self.views: dict[str, object] = {}
        self._stop_asked = False
        self._thread: threading.Thread | None = None
        if result is None:
            result, comparison = self._generate(prompt, max_new_tokens)
        self._tabs = None
        self._show(result, comparison)
        self._box = None

    # ------------------------------------------------------------------ running
    def _generate(self, prompt: str, max_new_tokens: int):
        from dsv41.generation.conversation import chat
        from dsv41.generation.generate import compare_prefill_decode, generate

        self.model.experts.clear()  # start cold: the replay assumes an empty cache
        self.progress.max, self.progress.value, self.progress.description = max(1, max_new_tokens), 0, "tokens"
        began = time.perf_counter()

        def counted(step, _token, _logits):
            self.progress.value = step + 1
            rate = (step + 1) / max(time.perf_counter() - began, 1e-9)
            self.status.value = f"generating: {step + 1} / {max_new_tokens} tokens, {rate:.1f} tokens/s"
            return not self._stop_asked  # False ends the generation after this token

        if self.chat:
            self.chat_result = chat(
                self.model,
                self.conversation(prompt),
                thinking=self.thinking,
                max_new_tokens=max_new_tokens,
                trace=True,
                callback=counted,
                reuse_prefix=False,
                keep_resume=False,
            )
            result = self.chat_result.generation
        else:
            result = generate(
                self.model,
                prompt,
                max_new_tokens=max_new_tokens,
                trace=True,
                stop_at_eos=False,
                callback=counted,
                speculative=self.speculate.value,
            )
        comparison = None
        if self.compare and len(result.prompt_ids) + len(result.ids) > 1:
            ids = traced_ids(result, self.compare_limit)
            self.progress.description, self.progress.max, self.progress.value = "comparing", len(ids), 0
            self.status.value = f"comparing a prefill with token-by-token decoding over {len(ids)} positions"
            comparison = compare_prefill_decode(self.model, ids)
        self.progress.description, self.progress.max = "done", max(1, len(result.ids))
        self.progress.value = len(result.ids)  # a finished run shows its tokens, not the last phase
        return result, comparison

    def conversation(self, text: str) -> list:
        """Chat mode: the messages a run sends, the text box's JSON list of messages, or the probe's
        `messages` followed by the text as a user message."""
        import json

        try:
            given = json.loads(text)
        except ValueError:
            given = None
        if isinstance(given, list) and given and all(isinstance(m, dict) for m in given):
            return given
        return self.messages + [{"role": "user", "content": text}]

    def stop(self, _button=None) -> None:
        """The stop button's handler: the generation ends after the token being computed."""
        self._stop_asked = True
        self.status.value = "stopping after this token..."

    def _show(self, result, comparison) -> None:
        self.result, self.comparison = result, comparison
        n_experts = self.model.cfg.n_routed_experts
        data = {
            "routing": routing_data(result, n_experts),
            "cache": cache_data(
                result, capacity=self.model.experts.capacity, n_experts=n_experts, pool=pool_of(self.model.experts)
            ),
            "ties": tie_data(result, comparison),
        }
        kinds = {"routing": RoutingView, "cache": CacheView, "ties": TieView, "speculation": SpeculationView}
        if getattr(result, "speculation", None) is not None:
            data["speculation"] = speculation_data(result)
        for name, cls in kinds.items():
            if name not in data:
                continue  # a plain run: no speculation to show
            if name in self.views:
                self.views[name].update(data[name])
            else:
                self.views[name] = cls(data[name])
        for view in self.refresh:  # the notebook's own views, by kind
            name = next((n for n, cls in kinds.items() if isinstance(view, cls)), None)
            if name is None:
                raise TypeError(
                    f"the probe refreshes routing, cache, tie and speculation views, not {type(view).__name__}"
                )
            if name in data:
                view.update(data[name])
        if self._tabs is not None and len(self._tabs.children) != len(self.views):  # the speculation tab appeared
            self._tabs.children = [v.widget for v in self.views.values()]
            self._tabs.titles = tuple(TAB_TITLES[name] for name in self.views)
        rate = result.timings.get("tokens_per_s")
        self.status.value = (
            f"{len(result.prompt_ids)} prompt tokens, {len(result.ids)} generated "
            f"({result.timings['prefill_s']:.2f} s prefill, {result.timings['decode_s']:.2f} s "
            f"decode{f', {rate:.1f} tokens/s' if rate else ''}"
            f"{', stopped' if result.finish_reason == 'callback' else ''}): "
            f"<code>{_escape(result.text)}</code>"
        )
        if self.chat and self.chat_result is not None and self.chat_result.generation is result:
            self.status.value += "<br>" + reply_html(self.chat_result.reply)

    def on_run(self, _button=None) -> None:
        """The run button's handler: regenerate from the text box and refresh the views; a bad prompt
        becomes one line in the status, not a traceback. On a background thread when `background`."""
        if not self.text.value.strip():
            self.status.value = "<b>not run:</b> the prompt box is empty; type a prompt first"
            return
        if self._thread is not None and self._thread.is_alive():
            return  # one run at a time: the button is disabled meanwhile anyway
        self.button.disabled, self.stop_button.disabled, self._stop_asked = True, False, False
        self.status.value = "running..."
        prompt, n = self.text.value, int(self.tokens.value)
        if self.background:
            self._thread = threading.Thread(target=self._run, args=(prompt, n), daemon=True)
            self._thread.start()
        else:
            self._run(prompt, n)

    def wait(self, timeout: float | None = None) -> None:
        """Block until a background run has finished."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, prompt: str, n: int) -> None:
        try:
            result, comparison = self._generate(prompt, n)
        except (ValueError, RuntimeError) as exc:  # bad input, or NaN logits: one line, the views stay
            self.status.value = f"<b>not run:</b> {_escape(str(exc))}"
            return
        finally:
            self.button.disabled, self.stop_button.disabled = False, True
        self.runs += 1
        self._show(result, comparison)

    # ------------------------------------------------------------------ showing
    @property
    def widget(self):
        if self._box is None:
            import ipywidgets as w

            tabs = self._tabs = w.Tab(children=[v.widget for v in self.views.values()])
            tabs.titles = tuple(TAB_TITLES[name] for name in self.views)
            controls = w.HBox([self.text, self.tokens, self.speculate, self.button, self.stop_button])
            self._box = w.VBox([controls, w.HBox([self.progress]), self.status, tabs])
        return self._box

    def show(self, static: bool = True) -> None:
        """The live probe when a person is looking; headless, the three static figures (or, with
        static=False, one line: for a notebook that has shown this run's figures already)."""
        from dsv41.observe import viz

        if not viz.is_headless():
            viz.show(widget=self.widget)
        elif static:
            for view in self.views.values():
                viz.show(view.figure)
        else:
            print("the prompt probe is interactive: open this notebook in JupyterLab to use it")


def reply_html(reply) -> str:
    """A parsed chat reply as status lines: reasoning, content, each tool call, what was cut off."""
    import json

    lines = []
    if reply.reasoning:
        lines.append(f"<i>reasoning:</i> <code>{_escape(reply.reasoning)}</code>")
    lines.append(f"<i>reply:</i> <code>{_escape(reply.content)}</code>")
    for call in reply.tool_calls:
        shown = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        lines.append(f"<i>tool call:</i> <code>{_escape(shown)}</code>")
    if reply.incomplete:
        lines.append(f"<i>cut off in the {reply.incomplete.replace('_', ' ')}</i>")
    lines += [f"<i>malformed:</i> {_escape(problem)}" for problem in reply.problems]
    return "<br>".join(lines)


def _escape(text: str) -> str:
    """HTML-safe, with control characters shown as escapes (random-weighted text is full of them)."""
    from html import escape

    return escape(repr(text))
