"""Generation over a loaded model: prefill, decode one, decode n, sampling, and what a run recorded.

The prompt is one forward at position 0; its last row gives the first new token, then every new
token is one forward at the next position. Greedy is the default and breaks ties to the lowest id.
With temperature > 0 a token is drawn with the Gumbel-max trick (`sampling.sample`, the one sampler
the speculative verify and the draft stack also draw through) from a seeded `torch.Generator`, so a
seed reproduces a run on the same torch build.

Input is made one `vision.Prompt` on entry (`as_prompt`: text tokenized, images put in their
placeholders, token ids checked as whole numbers), so everything after reads one type; a model call
gets it as a Prompt when it carries images and as plain ids otherwise. The argument checks
(`check_prompt`, `check_sampling`, `check_length`, `check_prefill_chunk`) are public so that
`dsv41 generate` can refuse the same arguments with the same sentences before it loads a model.

`compare_prefill_decode` runs a prompt both ways — one prefill over every position, and the same
tokens fed one at a time — and reports where the logits, the indexer selections and the expert
routing first part, and under which of the model's numerics options. With the reference's
arithmetic (the defaults) the two already differ by float32 rounding at the first position: the
float32 GEMMs take another BLAS kernel for a single row, and past 64 index columns sparse_attn
groups a decode row's sums differently. Loaded with `numerics=Numerics.parity()` they agree
exactly until some top-k (indexer, candidate blocks, routing) has to break a tie or cut
between values that differ by rounding; the report says at which position and layer that happened.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..core.errors import Dsv41Error
from ..core.text import is_whole
from ..model import sequence
from ..model.sampling import sample
from ..model.token_ids import as_token_ids
from ..model.trace import ForwardTrace, GenerationTrace, StepRecord
from ..model.vision import TEXT, Prompt, check_placeholders, image_sources


class NonFiniteLogits(Dsv41Error, RuntimeError):
    """A forward gave NaN or Inf logits: generation stops; the message names where it began."""


# torch.Generator.manual_seed takes any 64-bit pattern; a seed outside that would be cut silently
SEED_LIMIT = 2**64


def check_prompt(prompt) -> None:
    """The errors a bad prompt gets, in Python and from `dsv41 generate` alike."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a surrogate-escaped byte from a non-UTF-8 argv or file
            raise ValueError(f"the prompt is not valid UTF-8 text (character {exc.start}); pass UTF-8") from None
    elif len(prompt) == 0:
        raise ValueError("the prompt is empty")


def check_sampling(max_new_tokens, temperature, seed) -> None:
    """The errors bad sampling arguments get, in Python and from `dsv41 generate` alike."""
    if not is_whole(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if not is_whole(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be a whole number in [0, 2**64), got {seed!r}")


def check_length(
    prompt_tokens: int, max_new_tokens: int, max_seq_len: int, *, model_limit: Optional[int] = None, hint: str = ""
) -> None:
    """The errors a prompt too long for the run gets, in Python and from `dsv41 generate` alike:
    longer than `model_limit` (the config's `max_seq_len`, when given), or with `max_new_tokens`
    more than the `max_seq_len` positions the caches hold (`model.backbone.max_seq_len`). `hint` ends the
    second message (the CLI's " (raise --max-seq-len)")."""
    if model_limit is not None and prompt_tokens > model_limit:
        raise ValueError(f"the prompt is {prompt_tokens} tokens, longer than the model's {model_limit}-token maximum")
    # the last new token is sampled, never fed back: it takes no cache position
    if prompt_tokens + max_new_tokens - 1 > max_seq_len:
        raise ValueError(
            f"{prompt_tokens} prompt tokens + {max_new_tokens} new ones need "
            f"{prompt_tokens + max_new_tokens - 1} positions, more than max_seq_len {max_seq_len}{hint}"
        )


def check_prefill_chunk(chunk) -> None:
    """The error a bad `prefill_chunk` gets (None: no chunking), in Python and from the CLI alike."""
    if chunk is not None and (not is_whole(chunk) or chunk < 1):
        raise ValueError(f"prefill_chunk must be a whole number >= 1, got {chunk!r}")


def as_prompt(model, prompt, images: Sequence = ()) -> Prompt:
    """What generation runs on, made once on entry: text (tokenized, with `images` in its
    placeholders or first, `Model.prepare`), token ids [s] (whole numbers) or a `vision.Prompt`
    -> a checked Prompt (its images' rows not yet computed; `Model.encode_images` does that)."""
    check_prompt(prompt)
    images = image_sources(images)
    if images and not isinstance(prompt, str):
        raise ValueError("images= goes with a text prompt; a Prompt carries its own images")
    if isinstance(prompt, Prompt):
        return prompt
    if images:
        return model.prepare(prompt, images)
    if isinstance(prompt, str):
        ids = model.encode(prompt)
        check_placeholders(model.cfg, ids, 0)  # `prepare`'s refusal: no image for the placeholder
    else:
        ids = as_token_ids(prompt, one_sequence=True)[0].tolist()
    return Prompt(ids, [TEXT] * len(ids))


def _model_input(prompt: Prompt, start: int = 0, stop: Optional[int] = None):
    """Positions [start, stop) of `prompt` as a model call takes them: a prompt with images as a
    Prompt (each part keeps the image spans it overlaps), one without as plain ids [1, n], whose
    calls a rollback can cut short in place."""
    if prompt.images:
        return prompt[start:stop]
    return torch.tensor([prompt.ids[start:stop]])


def locate_non_finite(model, ids) -> str:
    """Where the forward of `ids` (token ids, or a `vision.Prompt` with its images) first goes
    non-finite, as a phrase: runs them once more as a prefill with a finite check per site, after
    the vision tower's rows of each image (leaves the model reset)."""
    trace = ForwardTrace(check_finite=True)
    try:
        prompt = as_prompt(model, ids)
        if prompt.images:
            prompt = model.encode_images(prompt)  # the rows the generation used, when it had them
            broken = [k for k, image in enumerate(prompt.images) if not bool(torch.isfinite(image.features).all())]
            if broken:  # the tower runs before the embedding: its output is the first site
                return (
                    f"the first non-finite output is the vision tower's (the ViT and aligner rows of image "
                    f"{broken[0] + 1} of {len(prompt.images)})"
                )
        model(_model_input(prompt), 0, trace=trace)
    finally:
        model.reset()
    bad = trace.first_non_finite()
    if bad is None:
        return "a rerun of the sequence as one prefill stays finite"
    where = bad.site if bad.layer is None else f"layer {bad.layer}'s {bad.site} site"
    return f"the first non-finite output is {where}"


def _check_finite(model, logits: torch.Tensor, prompt: Optional[Prompt] = None) -> None:
    """Stop with one sentence when the logits of the model's last position are not finite (the
    sequence fed so far, `model.token_ids`, is run again to say where it began; `prompt`, the
    Prompt it started with, lends the rerun its images)."""
    if not bool(torch.isfinite(logits).all()):
        held = model.token_ids[0].tolist()
        sequence = held
        if prompt is not None and prompt.images and held[: len(prompt)] == list(prompt.ids):
            sequence = prompt.extend(held[len(prompt) :])  # without its images the span reruns as text tokens
        raise NonFiniteLogits(
            f"the logits at position {len(held) - 1} are NaN or Inf, so generation stops: "
            f"{locate_non_finite(model, sequence)}; `dsv41 audit --values` finds non-finite weights"
        )


# ---------------------------------------------------------------------- what a run recorded
def top2_margin(logits: torch.Tensor) -> float:
    """Largest minus second-largest logit of the first row (0.0 is an exact tie)."""
    top = logits.reshape(-1, logits.size(-1))[0].float().topk(2).values
    return float(top[0] - top[1])


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int]  # generated ids only
    text: str  # the generated ids decoded
    timings: dict  # prefill_s, decode_s, per_token_s (list), tokens_per_s, vision_s (the tower, 0.0 without images)
    finish_reason: str  # 'length' | 'eos' | 'callback'
    trace: Optional[GenerationTrace] = None
    speculation: Optional[object] = None  # speculative.Speculation of a speculative run: per step and summed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids


# ---------------------------------------------------------------------- the three verbs
def prefill(
    model, prompt_ids, *, trace=None, start_pos: int = 0, chunk: Optional[int] = None, progress: bool = False
) -> torch.Tensor:
    """Run the prompt [b, s] (or [s]) from `start_pos` (0: a new sequence) -> float32 logits
    [b, vocab] of its last position. `chunk`: at most that many tokens per forward (the same
    logits as one call under Numerics.parity()); `progress`: a tqdm bar on stderr (tokens, tokens/s)."""
    if isinstance(prompt_ids, Prompt):  # one sequence: a part keeps the image spans it overlaps
        length = len(prompt_ids)

        def part(at: int, stop: int):
            return _model_input(prompt_ids, at, stop)
    else:
        ids = torch.as_tensor(prompt_ids)  # the model refuses ids that are not whole numbers
        ids = ids.unsqueeze(0) if ids.dim() == 1 else ids  # [b, s]
        length = ids.size(1)

        def part(at: int, stop: int):
            return ids[:, at:stop]

    if chunk is None:
        return model(part(0, length), start_pos, trace=trace)
    check_prefill_chunk(chunk)
    from tqdm import tqdm

    with tqdm(total=length, desc="prefill", unit="tok", file=sys.stderr, disable=not progress, leave=False) as bar:
        for at in range(0, length, chunk):
            logits = model(part(at, at + chunk), start_pos + at, trace=trace)
            bar.update(min(chunk, length - at))
    return logits


def decode_one(model, token_id, *, trace=None) -> torch.Tensor:
    """Feed one token per row at the next position -> float32 logits [b, vocab]."""
    ids = torch.as_tensor(token_id).reshape(-1, 1)  # the model refuses ids that are not whole numbers
    return model(ids, model.position, trace=trace)


def decode_n(
    model,
    token_id,
    n: int,
    *,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    callback: Optional[Callable[[int, int, torch.Tensor], Optional[bool]]] = None,
    stop_ids: Sequence[int] = (),
    trace=None,
    steps: Optional[list] = None,
    check_finite: Optional[Callable] = None,
) -> list[int]:
    """Feed `token_id` (batch 1) and keep going for up to `n` tokens, sampling each from the last
    logits. Returns the produced ids (the fed token excluded). `callback(step, token, logits)` runs
    after each token; returning False stops. A token in `stop_ids` is kept and stops the loop.
    NaN or Inf logits stop it with NonFiniteLogits (`check_finite(model, logits)` in place of the
    plain check: generate's knows the prompt's images)."""
    out: list[int] = []
    token = int(token_id)
    check_finite = check_finite or _check_finite
    for step in range(n):
        began = time.perf_counter()
        logits = decode_one(model, token, trace=trace)
        check_finite(model, logits)
        token = int(sample(logits, temperature, generator)[0])
        out.append(token)
        if steps is not None:
            steps.append(StepRecord(model.position - 1, token, top2_margin(logits), time.perf_counter() - began))
        if callback is not None and callback(step, token, logits) is False:
            break
        if token in stop_ids:
            break
    return out


def generate(
    model,
    prompt,
    *,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
    trace: bool = False,
    callback: Optional[Callable] = None,
    stop_at_eos: bool = True,
    prefill_chunk: Optional[int] = None,
    reuse_prefix: bool = False,
    progress: bool = False,
    speculative: bool = False,
    draft_tokens: Optional[int] = None,
    min_confidence: float = 0.5,
    draft_source=None,
    images: Sequence = (),
) -> GenerationResult:
    """Generate from `prompt` (text, a list of token ids, or a `vision.Prompt`) -> GenerationResult.
    `images` (paths, bytes or PIL images) go with a text prompt: each takes the place of the next
    image placeholder in the text, or without one they go first (`Model.prepare`); the vision tower
    runs once before the prefill and `timings['vision_s']` is its time. Decoding after is text.

    Greedy at temperature 0 (ties to the lowest id); otherwise seeded Gumbel-max. `trace=True`
    records the run (see GenerationTrace). `callback(step, token, logits)` as in decode_n. NaN or
    Inf logits stop the run with NonFiniteLogits, naming the first site that went non-finite.
    `prefill_chunk`: prefill in chunks of that many tokens (`progress`: a bar on stderr);
    `reuse_prefix`: continue the model's current sequence where the prompt starts with it (rolled
    back to the longest shared prefix, as far as `sequence.rollback_limit` allows) instead of
    prefilling it again; `timings['reused_positions']` says how many positions were reused.
    `speculative`: decode with the DSpark draft stack (`dsv41.generation.speculative`), up to
    `draft_tokens` proposals per step (default the draft block), cut after the first whose
    sigmoid(confidence) is below `min_confidence`; `draft_source(model, anchor, n)` stands in for
    the stack; the result's `speculation` says what each step drafted, kept and accepted."""
    check_prompt(prompt)
    check_sampling(max_new_tokens, temperature, seed)
    images = image_sources(images)
    spec_module = None
    if speculative:
        from . import speculative as spec_module  # same layer; imported when used

        draft_tokens = spec_module.check_speculation(model, temperature, draft_tokens, min_confidence, draft_source)
    prompt = as_prompt(model, prompt, images)
    vision_s = 0.0
    if prompt.images:
        began = time.perf_counter()
        prompt = model.encode_images(prompt)
        vision_s = time.perf_counter() - began
    check_length(len(prompt), max_new_tokens, model.backbone.max_seq_len)
    generator = torch.Generator().manual_seed(int(seed)) if temperature > 0 else None
    ftrace = ForwardTrace() if trace else None
    steps: list[StepRecord] = []
    stop_ids = (model.cfg.eos_token_id,) if stop_at_eos and model.cfg.eos_token_id is not None else ()
    steps_before = len(model.experts.counters.steps)

    def check_finite(m, logits):  # a NaN diagnosis reruns the prompt with its images
        _check_finite(m, logits, prompt)

    def shifted(step, token, lg):  # the decoders count from 0; the prefill made token 0
        return callback(step + 1, token, lg)

    began = time.perf_counter()
    reused = _reusable_prefix(model, prompt) if reuse_prefix else 0
    if reused:
        sequence.rollback(model, model.position - reused)
    logits = prefill(model, prompt[reused:], trace=ftrace, start_pos=reused, chunk=prefill_chunk, progress=progress)
    check_finite(model, logits)
    ids, finish = [], "length"
    if max_new_tokens > 0:
        ids = [int(sample(logits, temperature, generator)[0])]
        steps.append(StepRecord(len(prompt) - 1, ids[0], top2_margin(logits), time.perf_counter() - began))
        finish = _finish_after(ids[0], logits, callback, stop_ids)
    prefill_s = time.perf_counter() - began

    began = time.perf_counter()
    speculation = spec_module.Speculation([]) if speculative else None
    if finish == "length" and max_new_tokens > 1:
        decode = dict(
            temperature=temperature,
            generator=generator,
            stop_ids=stop_ids,
            trace=ftrace,
            callback=shifted if callback is not None else None,
            check_finite=check_finite,
        )
        if speculative:
            more, speculation = _decode_speculative(
                spec_module,
                model,
                ids[-1],
                max_new_tokens - 1,
                steps,
                draft_tokens,
                min_confidence,
                draft_source,
                decode,
            )
        else:
            more = decode_n(model, ids[-1], max_new_tokens - 1, steps=steps, **decode)
        ids += more
        if more and more[-1] in stop_ids:
            finish = "eos"
        elif len(ids) < max_new_tokens:
            finish = "callback"
    decode_s = time.perf_counter() - began

    timings = {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "per_token_s": [s.seconds for s in steps],
        "tokens_per_s": (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else None,
        "prompt_tokens": len(prompt),
        "reused_positions": reused,
        "vision_s": vision_s,
    }
    gtrace = None
    if trace:
        gtrace = GenerationTrace(
            ftrace,
            steps,
            [
                dict(s, layers={k: list(v) for k, v in s["layers"].items()})
                for s in model.experts.counters.steps[steps_before:]
            ],
        )
    if speculation is not None:
        timings["target_forwards"] = speculation.target_forwards
    return GenerationResult(list(prompt.ids), ids, model.decode(ids), timings, finish, gtrace, speculation)


def _finish_after(first: int, logits, callback, stop_ids) -> str:
    """How the run stands after the prefill's token: 'callback' when the callback stops it, 'eos'
    at a stop token, else 'length' (decoding goes on)."""
    if callback is not None and callback(0, first, logits) is False:
        return "callback"
    return "eos" if first in stop_ids else "length"


def _decode_speculative(
    spec_module,
    model,
    anchor: int,
    n: int,
    steps: list,
    draft_tokens: int,
    min_confidence: float,
    draft_source,
    decode: dict,
):
    """`decode_n`'s speculative counterpart for `generate` -> (ids, Speculation); every committed
    token is recorded in `steps` as plain decoding records it."""

    def record(position, token, row, seconds):
        steps.append(StepRecord(position, token, top2_margin(row), seconds))

    more, spec_steps = spec_module.decode_speculative(
        model,
        anchor,
        n,
        draft_tokens=draft_tokens,
        min_confidence=min_confidence,
        draft_source=draft_source,
        step_record=record,
        **decode,
    )
    return more, spec_module.Speculation(spec_steps)


def _reusable_prefix(model, prompt: Prompt) -> int:
    """How many leading positions of the model's current (batch 1) sequence the prompt shares and
    a rollback can keep; at least the prompt's last token is always run again (its logits start
    the generation), and equal ids are not equal images: sharing stops at the first image span."""
    held = model.token_ids
    if held.size(0) != 1 or not held.size(1):
        return 0
    first_image = next((i for i, t in enumerate(prompt.token_types) if t != TEXT), len(prompt))
    shared = 0
    for have, want in zip(held[0].tolist(), prompt.ids[: first_image + 1][:-1]):
        if have != want:
            break
        shared += 1
    return shared if shared >= sequence.rollback_limit(model) else 0


# ---------------------------------------------------------------------- prefill vs decode
@dataclass
class PrefillDecodeComparison:
    """Where a one-call prefill and a token-by-token run of the same prompt part.

    max_abs_diff[p]: max |logit difference| at position p; first_logit_divergence: first p with a
    nonzero difference (None: bit-identical); first_argmax_divergence: first p where the greedy
    token differs; selection_partings / routing_partings: per layer, every position whose indexer
    selection / routed expert ids differ (layers that never differ are absent); the two traces are
    kept so a caller can ask whether each parting sits on a top-k tie; numerics: the model's
    options the comparison ran under (`Model.numerics` as a dict)."""

    positions: int
    max_abs_diff: list[float]
    max_abs_logit: float
    first_logit_divergence: Optional[int]
    first_argmax_divergence: Optional[int]
    selection_partings: dict[int, list[int]]
    routing_partings: dict[int, list[int]]
    prefill_logits: torch.Tensor  # [s, vocab]
    decode_logits: torch.Tensor  # [s, vocab]
    prefill_trace: Any = None
    decode_trace: Any = None
    numerics: dict = field(default_factory=dict)

    @property
    def selections(self) -> dict[int, int]:
        """Per layer, the first position whose indexer selection differs."""
        return {layer: positions[0] for layer, positions in self.selection_partings.items()}

    @property
    def routing(self) -> dict[int, int]:
        """Per layer, the first position whose routed expert ids differ."""
        return {layer: positions[0] for layer, positions in self.routing_partings.items()}

    @property
    def identical(self) -> bool:
        return self.first_logit_divergence is None

    def parting(self, cut: Optional[int]) -> dict:
        """Where the two orders part, as plain data, with how far apart their logits are before `cut`
        (the first position where some top-k cuts; None: none does), where only rounding can part them."""
        before = self.max_abs_diff[:cut]
        return {
            "first_logit_divergence": self.first_logit_divergence,
            "first_argmax_divergence": self.first_argmax_divergence,
            "selection_parting": {str(k): v for k, v in self.selections.items()},
            "routing_parting": {str(k): v for k, v in self.routing.items()},
            "numerics": self.numerics,
            "untruncated_positions": len(before),
            "untruncated_max_abs_diff": max(before, default=0.0),
            "identical_until_first_cut": all(d == 0.0 for d in before),
            "max_abs_logit": self.max_abs_logit,
        }

    def summary(self) -> str:
        under = ", ".join(f"{k}={v!r}" for k, v in self.numerics.items())
        under = f" ({under})" if under else ""
        if self.identical:
            return f"prefill and decode agree bit for bit over {self.positions} positions{under}"
        worst = max(self.max_abs_diff)
        parts = [
            f"logits first differ at position {self.first_logit_divergence} (max |diff| {worst:.3g}, "
            f"{100 * worst / max(self.max_abs_logit, 1e-30):.3g}% of max |logit|)"
        ]
        parts.append(
            "greedy tokens agree everywhere"
            if self.first_argmax_divergence is None
            else f"greedy tokens first differ at position {self.first_argmax_divergence}"
        )
        if self.selections:
            parts.append(
                "indexer selections part at "
                + ", ".join(f"layer {k}: position {v}" for k, v in sorted(self.selections.items()))
            )
        if self.routing:
            parts.append(
                "routing parts at " + ", ".join(f"layer {k}: position {v}" for k, v in sorted(self.routing.items()))
            )
        return "; ".join(parts) + under


def compare_prefill_decode(model, prompt) -> PrefillDecodeComparison:
    """Run `prompt` (text, ids or a `vision.Prompt`) as one prefill over all positions and as one
    token per call, and report where logits, indexer selections and routing first differ, under the
    `Numerics` the model was loaded with (kept in the report's `numerics`). Leaves the model reset."""

    prompt = as_prompt(model, prompt)
    if prompt.images:
        prompt = model.encode_images(prompt)  # once: one token per call cuts the spans
    ids = prompt.ids

    def part(start: int, stop: int):
        return _model_input(prompt, start, stop)

    one, step = ForwardTrace(), ForwardTrace()
    full = model(part(0, len(ids)), 0, trace=one, all_positions=True)[0]  # [s, vocab]
    rows = [model(part(0, 1), 0, trace=step)[0]]
    for p in range(1, len(ids)):
        rows.append(model(part(p, p + 1), p, trace=step)[0])
    model.reset()
    stepwise = torch.stack(rows)  # [s, vocab]
    diff = (full - stepwise).abs().amax(dim=-1)
    nonzero = torch.nonzero(diff).flatten()
    argmax_diff = torch.nonzero(full.argmax(-1) != stepwise.argmax(-1)).flatten()
    return PrefillDecodeComparison(
        positions=len(ids),
        max_abs_diff=diff.tolist(),
        max_abs_logit=float(full.abs().max()),
        first_logit_divergence=int(nonzero[0]) if len(nonzero) else None,
        first_argmax_divergence=int(argmax_diff[0]) if len(argmax_diff) else None,
        selection_partings=_partings(one.attention_by_layer(), step.attention_by_layer(), "selected"),
        routing_partings=_partings(one.routing_by_layer(), step.routing_by_layer(), "expert_ids"),
        prefill_logits=full,
        decode_logits=stepwise,
        prefill_trace=one,
        decode_trace=step,
        numerics=model.numerics.as_dict(),
    )


def speculative_parting(model, prompt, max_new_tokens: int) -> dict:
    """Plain greedy decoding and a speculative run of `prompt` on `model` (as loaded), set side by
    side: first_parting (the first generated token where they differ; None: nowhere), tokens, and
    max_abs_diff_before (the largest |difference| between the logit rows the two chose from before
    it). At a parting also the plain row's top-2 gap and the rows' max |difference| there: an argmax
    can swap only when the gap is within twice that (gap_within_twice_the_difference)."""
    rows: dict[str, list[torch.Tensor]] = {"plain": [], "speculative": []}

    def keep(name: str):
        return lambda step, token, logits: rows[name].append(logits[0].clone())

    plain = generate(model, prompt, max_new_tokens=max_new_tokens, stop_at_eos=False, callback=keep("plain"))
    spec = generate(
        model, prompt, max_new_tokens=max_new_tokens, stop_at_eos=False, speculative=True, callback=keep("speculative")
    )
    first = next((i for i, (x, y) in enumerate(zip(plain.ids, spec.ids)) if x != y), None)
    agreed = zip(rows["plain"][: len(plain.ids) if first is None else first], rows["speculative"])
    out = {
        "first_parting": first,
        "max_abs_diff_before": max((float((x - y).abs().max()) for x, y in agreed), default=0.0),
        "tokens": len(plain.ids),
    }
    if first is not None:
        x, y = rows["plain"][first], rows["speculative"][first]
        top2 = x.topk(2).values
        gap, delta = float(top2[0] - top2[1]), float((x - y).abs().max())
        out.update(
            {"plain_top2_gap": gap, "rows_max_abs_diff": delta, "gap_within_twice_the_difference": gap <= 2 * delta}
        )
    return out


def _partings(a: dict, b: dict, name: str) -> dict[int, list[int]]:
    """Per layer, every query position whose `name` rows differ (as sets for selections)."""
    out = {}
    for layer in a:
        if name not in a[layer] or layer not in b or name not in b[layer]:
            continue
        x, y = a[layer][name][0], b[layer][name][0]  # [n, width], batch row 0
        width = max(x.size(-1), y.size(-1))
        x = torch.nn.functional.pad(x, (0, width - x.size(-1)), value=-1).sort(-1).values
        y = torch.nn.functional.pad(y, (0, width - y.size(-1)), value=-1).sort(-1).values
        differ = torch.nonzero((x != y).any(-1)).flatten()
        if len(differ):
            out[layer] = [int(a[layer]["positions"][i]) for i in differ]
    return out


# ---------------------------------------------------------------------- chunked prefill
def chunk_sizes(n: int, *sizes: int) -> list[int]:
    """A chunking of `n` tokens: calls of `sizes` (each clipped to what is left), then the rest as one."""
    out, left = [], n
    for size in sizes:
        if left > 0:
            out.append(min(size, left))
            left -= out[-1]
    return out + ([left] if left else [])


def chunked_logits(model, ids: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The logits of every position of `ids`, fed from position 0 as consecutive calls of `sizes`
    tokens -> [len(ids), vocab]: what a chunked prefill computes, to set beside a one-shot one."""
    rows, at = [], 0
    for size in sizes:
        rows.append(model(torch.tensor([list(ids[at : at + size])]), at, all_positions=True)[0])
        at += size
    return torch.cat(rows)


# ---------------------------------------------------------------------- expert-cache accounting
def cache_accounting(result: GenerationResult, model) -> dict:
    """A traced run's expert-cache counts, reconciled three ways per MoE layer, as plain data.

    per_layer[str(layer)]: hits / misses (the run's per-call steps, `result.trace.cache`),
    record_hits / record_misses (the routing records), counter_hits / counter_misses (the cache's own
    counters, `model.experts.counters`), lookups (per call the distinct experts its tokens chose,
    which is what the cache looks up) and token_choices (tokens x top-k). The counters total every
    call since the model was loaded (or its counters reset): `counters_only_this_run` says whether
    they hold this run's calls and nothing else, the only case where they must equal the run's counts.
    """
    if result.trace is None:
        raise ValueError("this GenerationResult has no trace; generate with trace=True")
    steps = result.trace.cache
    counters = model.experts.counters
    per_layer: dict[str, dict] = {}
    for rec in result.trace.forward.routing:
        row = per_layer.setdefault(
            str(rec.layer),
            {"hits": 0, "misses": 0, "record_hits": 0, "record_misses": 0, "lookups": 0, "token_choices": 0},
        )
        row["record_hits"] += int(rec.cache_hits)
        row["record_misses"] += int(rec.cache_misses)
        row["lookups"] += int(torch.unique(rec.expert_ids).numel())  # one lookup per distinct expert and call
        row["token_choices"] += int(rec.expert_ids.numel())
    for layer, row in per_layer.items():
        row["hits"] = sum(int(s["layers"].get(int(layer), [0, 0])[0]) for s in steps)
        row["misses"] = sum(int(s["layers"].get(int(layer), [0, 0])[1]) for s in steps)
        row["counter_hits"], row["counter_misses"] = counters.totals(int(layer))
    only_this_run = len(counters.steps) == len(steps) and all(
        (a["start_pos"], a["seqlen"], {k: list(v) for k, v in a["layers"].items()})
        == (b["start_pos"], b["seqlen"], {k: list(v) for k, v in b["layers"].items()})
        for a, b in zip(counters.steps, steps)
    )
    return {
        "capacity": model.experts.capacity,
        "calls": len(steps),
        "per_layer": per_layer,
        "counters_only_this_run": only_this_run,
    }
