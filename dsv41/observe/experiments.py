"""What each V4.1 mechanism is worth, measured by taking it away on held-out text (notebook 09 and
`dsv41 ablate`).

The text is the held-out split of the training corpus (`train.corpus`), tokenized by the model's
tokenizer into one stream (an EOS after each document) and cut into windows of `tokens` targets,
`n` of them evenly spaced over the stream; each window's input is BOS and its targets but the last,
as the training's held-out evaluation has them (`train.data.held_out_windows`). A run's loss is
bits per target token (`bits`); bits per byte divides the bits by the UTF-8 bytes the targets
stand for (`train.data.token_byte_lengths`: 0 for special tokens), as the training reports it.

Every study compares a run under a named ablation (`ablations`) with the unablated run on the same
windows (`compare`): the difference in bits per byte, overall and per token class of the target
(`learned.TOKEN_CLASSES`), with a paired bootstrap interval over the windows (`paired_bootstrap`:
the windows resampled with replacement, the same resampling for both runs, fixed seed). An
interval that holds zero is said to (`spans_zero`, `verdict`): the windows cannot tell that
ablation from none. The studies: Engram off (all layers, then each), the indexer's selection dense
(every reachable compressed position) and random (as many positions, drawn at random) against its
sparse top-k, each routed expert removed in turn (a layer x expert map, by token class too), the
hyper-connections collapsed to a plain residual, and activation patching on code: a method whose
argument is renamed, patched from the clean run into the renamed one layer by layer and position
by position (`patching_study`). The figures each study's numbers make are here too, so the notebook
and the command draw the same ones.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import numpy as np
import torch

from ..core.errors import Dsv41Error
from ..core.text import brief
from ..model import ablations
from .learned import TOKEN_CLASSES, token_class

if TYPE_CHECKING:  # annotations only
    from ..model.model import Model

BOOTSTRAP_DRAWS = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
# The patching study's code: a method stores its renamed argument, and the next attribute it
# touches is, most likely, the same name again. Its names are drawn, in this order, from those that
# give prompts of one length in the model's tokenizer (`patch_names`), so the positions align.
PATCH_TEMPLATE = "def f(self, {name}):\n    self.{name} = {name}\n    self."
PATCH_NAMES = (
    *("value", "name", "path", "line", "key", "data", "text", "file", "time", "type"),
    *("size", "count", "index", "item", "node", "mode", "args", "state", "result", "items", "parts", "lines"),
    *("words", "obj", "func", "msg", "source", "target", "parent", "child", "buffer", "config", "options"),
)
PATCH_PAIRS = 10
# Which positions the patching study patches: every one, or only those where the pairs' prompts differ
# and the last (where the metric is read): the rest of a row is left unmeasured, a forward per
# position being minutes at the released size.
PATCH_POSITIONS = ("all", "renamed")
STUDIES = ("engram", "indexer", "experts", "hyper_connections", "patching")


class ExperimentError(Dsv41Error, ValueError):
    """A study was asked for something it cannot measure; the message says what and why."""


# ---------------------------------------------------------------------- held-out windows
@dataclass
class HeldOut:
    """Windows of held-out text as a run reads them."""

    inputs: torch.Tensor  # [n, tokens] int64: BOS, then the targets but the last
    targets: torch.Tensor  # [n, tokens] int64
    nbytes: np.ndarray  # [n, tokens] int64: UTF-8 bytes each target stands for (0: a special token)
    classes: np.ndarray  # [n, tokens] int64: the target's TOKEN_CLASSES index, -1 for a special token
    starts: list[int]  # each window's first target in the held-out stream
    stream_tokens: int  # tokens in the whole held-out stream

    @property
    def n(self) -> int:
        return self.targets.size(0)


def held_out(model: Model, n: int, tokens: int, corpus=None) -> HeldOut:
    """`n` windows of `tokens` targets evenly spaced over the held-out stream (see the module)."""
    from ..train.corpus import load_corpus
    from ..train.data import encode_documents, held_out_windows, token_byte_lengths

    for value, what in ((n, "the number of windows"), (tokens, "tokens per window")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExperimentError(f"{what} must be a whole number >= 1, got {brief(value)}")
    if model.tokenizer is None or model.cfg.bos_token_id is None or model.cfg.eos_token_id is None:
        raise ExperimentError("the held-out windows need the model's tokenizer and its BOS and EOS ids")
    corpus = corpus or load_corpus()
    stream = encode_documents(model.tokenizer, corpus.held_out, int(model.cfg.eos_token_id))
    available = len(stream) // tokens
    if available < n:
        raise ExperimentError(
            f"the held-out stream holds {available} windows of {tokens} tokens, fewer than the {n} asked for; "
            "ask for fewer or shorter windows"
        )
    wanted = {(i * available) // n for i in range(n)}
    picked = [
        (w, pair) for w, pair in enumerate(held_out_windows(stream, tokens, int(model.cfg.bos_token_id))) if w in wanted
    ]
    inputs = torch.cat([pair[0] for _, pair in picked])
    targets = torch.cat([pair[1] for _, pair in picked])
    table = token_byte_lengths(model.tokenizer)
    classes = _class_table(model, targets.unique().tolist())
    return HeldOut(
        inputs=inputs,
        targets=targets,
        nbytes=table[targets.numpy()],
        classes=np.vectorize(classes.__getitem__, otypes=[np.int64])(targets.numpy()),
        starts=[w * tokens for w, _ in picked],
        stream_tokens=len(stream),
    )


def _class_table(model: Model, ids: Iterable[int]) -> dict[int, int]:
    out = {}
    for i in ids:
        text = model.decode([int(i)])
        out[int(i)] = TOKEN_CLASSES.index(token_class(text)) if text else -1
    return out


# ---------------------------------------------------------------------- runs and their comparison
def bits(model: Model, windows: HeldOut, interventions: Optional[dict] = None, progress=None) -> np.ndarray:
    """Bits each target costs [n, tokens] (float64), every window a prefill from position 0, as
    many windows a call as the model's caches hold; under `interventions` ({pattern: fn}) if given.
    `progress`: a tqdm-like bar advanced by one per window."""
    batch = model.backbone.max_batch_size
    out = np.zeros(tuple(windows.targets.shape), dtype=np.float64)
    for start in range(0, windows.n, batch):
        rows = slice(start, start + batch)
        if interventions:
            with model.intervene(interventions):
                logits = model(windows.inputs[rows], 0, all_positions=True)
        else:
            logits = model(windows.inputs[rows], 0, all_positions=True)
        logp = torch.log_softmax(logits.double(), dim=-1)  # [b, tokens, vocab]
        picked = logp.gather(-1, windows.targets[rows].unsqueeze(-1)).squeeze(-1)
        out[rows] = (-picked / math.log(2)).numpy()
        if progress is not None:
            progress.update(logits.size(0))
    return out


def paired_bootstrap(
    base: np.ndarray, other: np.ndarray, nbytes: np.ndarray, draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float, float]:
    """(difference, low, high) in bits per byte of `other` minus `base`, each [n] the bits of one
    window (of the tokens counted) with `nbytes` [n] their bytes: the difference over all windows
    and its CONFIDENCE interval over `draws` resamplings of the windows (the same windows for both
    runs, percentile interval, fixed seed)."""
    base, other, nbytes = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (base, other, nbytes))
    if not (len(base) == len(other) == len(nbytes)) or not len(base):
        raise ExperimentError(
            f"a paired bootstrap needs the same windows on both sides, got {len(base)}, {len(other)} and {len(nbytes)}"
        )
    if nbytes.sum() <= 0:
        raise ExperimentError("the windows compared hold no bytes of text: no bits per byte to compare")
    diff = float((other.sum() - base.sum()) / nbytes.sum())
    picks = np.random.default_rng(seed).integers(0, len(base), size=(draws, len(base)))
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample with no bytes of the class
        resampled = (other[picks].sum(1) - base[picks].sum(1)) / nbytes[picks].sum(1)
    resampled = resampled[np.isfinite(resampled)]
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return diff, float(low), float(high)


def compare(windows: HeldOut, base: np.ndarray, other: np.ndarray, label: str = "") -> dict:
    """`other` against `base` (both [n, tokens] bits): bits per byte of each, the difference with
    its interval and whether the interval holds zero, overall and per token class of the target."""

    def part(mask: np.ndarray) -> dict:
        b, o, y = ((a * mask).sum(1) for a in (base, other, windows.nbytes))
        diff, low, high = paired_bootstrap(b, o, y)
        total = y.sum()
        return {
            "base_bits_per_byte": float(b.sum() / total),
            "bits_per_byte": float(o.sum() / total),
            "difference": diff,
            "interval": [low, high],
            "spans_zero": bool(low <= 0 <= high),
            "tokens": int(mask.sum()),
            "bytes": int(total),
        }

    overall = part(np.ones_like(windows.nbytes))
    by_class = {
        name: part(windows.classes == c)
        for c, name in enumerate(TOKEN_CLASSES)
        if windows.nbytes[windows.classes == c].sum() > 0
    }
    return {"label": label, **overall, "by_class": by_class}


def verdict(result: dict, digits: int = 3) -> str:
    """A result of `compare` as a sentence part: "+0.123 bits/byte [0.100, 0.150]", and where its
    interval holds zero, that it cannot be told from no effect on these windows."""
    low, high = result["interval"]
    said = f"{result['difference']:+.{digits}f} bits/byte [{low:+.{digits}f}, {high:+.{digits}f}]"
    if result["spans_zero"]:
        said += ": the interval spans zero, so these windows cannot tell it from no effect"
    return said


# ---------------------------------------------------------------------- the studies
def _bar(total: int, desc: str, shown: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="window", file=sys.stderr, disable=not shown, leave=False)


def baseline(model: Model, windows: HeldOut, progress=None) -> dict:
    """The unablated run: bits [n, tokens] and its bits per byte."""
    base = bits(model, windows, progress=progress)
    return {"bits": base, "bits_per_byte": float(base.sum() / windows.nbytes.sum())}


def engram_study(model: Model, windows: HeldOut, base: np.ndarray, progress=None) -> dict:
    """Engram off on every Engram layer, then on each alone."""
    layers = list(model.cfg.engram_layer_ids)
    if not layers:
        raise ExperimentError("this model has no Engram layer to turn off")
    every = compare(windows, base, bits(model, windows, ablations.engram_off(), progress), "Engram off")
    each = [
        compare(
            windows, base, bits(model, windows, ablations.engram_off([layer]), progress), f"Engram off, layer {layer}"
        )
        for layer in layers
    ]
    return {"layers": layers, "all": every, "each": each}


def indexer_study(model: Model, windows: HeldOut, base: np.ndarray, seed: int = 0, progress=None) -> dict:
    """The indexer's sparse top-k against every reachable compressed position (dense) and against
    as many positions drawn at random, on every layer that reads compressed positions."""
    layers = [i for i, r in enumerate(model.cfg.compress_ratios[: model.cfg.n_layers]) if r]
    if not layers:
        raise ExperimentError("this model has no attention layer reading compressed positions")
    dense = bits(model, windows, ablations.dense_selection(), progress)
    drawn = bits(model, windows, ablations.random_selection(seed), progress)
    return {
        "layers": layers,
        "index_topk": model.cfg.index_topk,
        "seed": seed,
        "dense": compare(windows, base, dense, "dense: every reachable position"),
        "random": compare(windows, base, drawn, "random: as many positions at random"),
        # the cost of sparsity itself: the sparse top-k against reading everything
        "sparse_vs_dense": compare(windows, dense, base, "sparse top-k against dense"),
    }


def spaced(items: Sequence, most: int) -> list:
    """At most `most` of `items`, evenly spaced from the first to the last (all of them when they are
    few; the first alone when `most` is 1): a patched stack's last layer is where most is carried."""
    items = list(items)
    if len(items) <= most:
        return items
    if most <= 1:
        return items[:1]
    gaps = most - 1
    return [items[(i * (len(items) - 1) + gaps // 2) // gaps] for i in range(most)]


def expert_grid(model: Model, max_runs: Optional[int] = None, layers: Optional[Sequence[int]] = None):
    """(layers, experts) the expert map covers: `layers` (default every MoE layer) and every routed
    expert, cut to at most `max_runs` cells by keeping evenly spaced layers and the lowest expert
    ids (a released-size model has 40 x 384)."""
    cfg = model.cfg
    layers = list(range(cfg.n_layers)) if layers is None else sorted({int(i) for i in layers})
    if any(not 0 <= i < cfg.n_layers for i in layers) or not layers:
        raise ExperimentError(f"the expert map's layers must lie in 0 to {cfg.n_layers - 1}, got {brief(layers)}")
    experts = list(range(cfg.n_routed_experts))
    if max_runs is not None and len(layers) * len(experts) > max_runs:
        layers = spaced(layers, max(1, max_runs // len(experts)))
        experts = experts[: max(1, max_runs // len(layers))]
    return layers, experts


def expert_study(
    model: Model,
    windows: HeldOut,
    base: np.ndarray,
    layers: Optional[Sequence[int]] = None,
    experts: Optional[Sequence[int]] = None,
    progress=None,
) -> dict:
    """Each routed expert of `layers` removed in turn (the router's next choices in its place):
    the difference in bits per byte with its interval per (layer, expert), and per token class."""
    grid_layers, grid_experts = expert_grid(model, layers=layers)
    experts = grid_experts if experts is None else sorted({int(e) for e in experts})
    cells = [[None] * len(experts) for _ in grid_layers]
    for i, layer in enumerate(grid_layers):
        for j, expert in enumerate(experts):
            run = bits(model, windows, ablations.remove_experts({layer: [expert]}), progress)
            cells[i][j] = compare(windows, base, run, f"layer {layer}, expert {expert} removed")
    classes = [c for c in TOKEN_CLASSES if all(c in cell["by_class"] for row in cells for cell in row)]
    return {
        "layers": grid_layers,
        "experts": experts,
        "difference": [[cell["difference"] for cell in row] for row in cells],
        "interval": [[cell["interval"] for cell in row] for row in cells],
        "spans_zero": [[cell["spans_zero"] for cell in row] for row in cells],
        "classes": classes,
        "by_class": [[[cell["by_class"][c]["difference"] for c in classes] for cell in row] for row in cells],
        "by_class_spans_zero": [
            [[cell["by_class"][c]["spans_zero"] for c in classes] for cell in row] for row in cells
        ],
    }


def hyper_connection_study(model: Model, windows: HeldOut, base: np.ndarray, progress=None) -> dict:
    """The hyper-connections collapsed to a plain residual on every block."""
    run = bits(model, windows, ablations.plain_residual(), progress)
    return {"hc_mult": model.cfg.hc_mult, "plain_residual": compare(windows, base, run, "plain residual")}


def patch_names(model: Model, template: str = PATCH_TEMPLATE, pairs: int = PATCH_PAIRS) -> list[str]:
    """Up to `pairs` names of PATCH_NAMES, in its order, whose prompts in `template` have one length
    (the shortest that gives `pairs` of them, else the one that gives most), each continuing the
    prompt without merging into its last token and starting with a token of its own."""
    by_length: dict[int, list[str]] = {}
    firsts: dict[int, set] = {}
    for name in PATCH_NAMES:
        prompt = model.encode(template.format(name=name))
        whole = model.encode(template.format(name=name) + name)
        if whole[: len(prompt)] == prompt and whole[len(prompt)] not in firsts.setdefault(len(prompt), set()):
            by_length.setdefault(len(prompt), []).append(name)
            firsts[len(prompt)].add(whole[len(prompt)])
    if not by_length:
        raise ExperimentError("no candidate name continues the patching template without merging into its last token")
    enough = [n for n in sorted(by_length) if len(by_length[n]) >= pairs]
    length = enough[0] if enough else max(sorted(by_length), key=lambda n: len(by_length[n]))
    return by_length[length][:pairs]


def patch_prompts(model: Model, template: str = PATCH_TEMPLATE, names: Optional[Sequence[str]] = None):
    """(prompt ids [names, T], the first token of each name where the prompt continues with it [names]):
    every name must give a prompt of the same length and a first token of its own. `names`: default
    `patch_names`."""
    names = patch_names(model, template) if names is None else list(names)
    if len(names) < 2:
        raise ExperimentError(f"the patching study pairs names, so it needs at least 2, got {brief(names)}")
    prompts = [model.encode(template.format(name=name)) for name in names]
    if len({len(p) for p in prompts}) != 1:
        lengths = ", ".join(f"{n}: {len(p)}" for n, p in zip(names, prompts))
        raise ExperimentError(
            f"the names give prompts of different lengths ({lengths}); choose names that are one token each in "
            "the template, so every position lines up"
        )
    firsts = []
    for name, prompt in zip(names, prompts):
        whole = model.encode(template.format(name=name) + name)
        if whole[: len(prompt)] != prompt:
            raise ExperimentError(f"{name!r} right after the template merges with its last token; choose another name")
        firsts.append(whole[len(prompt)])
    if len(set(firsts)) != len(firsts):
        raise ExperimentError(f"two of the names {names} start with the same token; each needs its own first token")
    return torch.tensor(prompts), torch.tensor(firsts)


def patching_study(
    model: Model,
    template: str = PATCH_TEMPLATE,
    names: Optional[Sequence[str]] = None,
    max_layers: Optional[int] = None,
    positions: str = "all",
    draws: int = BOOTSTRAP_DRAWS,
    seed: int = BOOTSTRAP_SEED,
    progress=None,
) -> dict:
    """Activation patching on code: pair i is `names[i]` (clean) against `names[i + 1]` (corrupted,
    the last paired with the first), the metric at the prompt's end the logit of the clean name's
    first token minus the corrupted one's. For each layer L and position p, every pair's corrupted
    run gets the clean run's `layers.L.resid_pre` at p: recovered = (mean patched metric - mean
    corrupted) / (mean clean - mean corrupted), 1 where that one stream carries the whole
    difference, with a bootstrap interval over the pairs. `names`: default `patch_names`;
    `max_layers`: patch at most that many layers, evenly spaced (a released-size model's 40 layers
    times every position is many forwards); `positions` (PATCH_POSITIONS): "renamed" patches only the
    positions where the prompts differ and the last, the cells of the others where the two runs' streams
    differ None (not measured; where they are equal a patch changes nothing, so 0 without a forward)."""
    if positions not in PATCH_POSITIONS:
        raise ExperimentError(f"positions must be one of {', '.join(PATCH_POSITIONS)}, got {brief(positions)}")
    names = patch_names(model, template) if names is None else list(names)
    prompts, firsts = patch_prompts(model, template, names)
    n, length = prompts.shape
    renamed = renamed_positions(prompts)
    patched_positions = positions_to_patch(renamed, length, positions)
    patching = set(patched_positions)
    clean_ids, corrupt_ids = prompts, prompts.roll(-1, dims=0)
    good, bad = firsts, firsts.roll(-1, dims=0)
    layers = spaced(range(model.cfg.n_layers), max_layers or model.cfg.n_layers)
    sites = [f"layers.{layer}.resid_pre" for layer in layers]
    batch = model.backbone.max_batch_size

    def metric(ids: torch.Tensor, patch_of=None) -> torch.Tensor:
        out = []
        for start in range(0, n, batch):
            rows = slice(start, start + batch)
            if patch_of is None:
                logits = model(ids[rows], 0)
            else:
                with model.intervene(patch_of(rows)):
                    logits = model(ids[rows], 0)
            out.append(logits.gather(-1, good[rows, None]) - logits.gather(-1, bad[rows, None]))
        return torch.cat(out).squeeze(-1).double()  # [pairs]

    def activations(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = [ablations.clean_activations(model, ids[s : s + batch], sites) for s in range(0, n, batch)]
        return {site: torch.cat([part[site] for part in parts]) for site in sites}

    clean, corrupt = activations(clean_ids), activations(corrupt_ids)
    clean_metric, corrupt_metric = metric(clean_ids), metric(corrupt_ids)
    patched = corrupt_metric.expand(len(layers), length, n).clone()
    unmeasured = np.zeros((len(layers), length), dtype=bool)
    for i, site in enumerate(sites):
        for p in range(length):
            if progress is not None and p in patching:
                progress.update(n)
            if torch.equal(clean[site][:, p], corrupt[site][:, p]):
                continue  # both runs already hold the same stream (before the rename, say): a patch changes nothing
            if p in patching:
                patched[i, p] = metric(
                    corrupt_ids, lambda rows: ablations.patch({site: clean[site][rows]}, positions=[p])
                )
            else:
                unmeasured[i, p] = True
    gap = clean_metric - corrupt_metric  # [pairs]
    picks = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    shift = (patched - corrupt_metric).numpy()  # [L, T, pairs]
    with np.errstate(invalid="ignore", divide="ignore"):
        resampled = shift[..., picks].mean(-1) / gap.numpy()[picks].mean(-1)  # [L, T, draws]
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.nanpercentile(resampled, [tail, 100 - tail], axis=-1)
    recovered = shift.mean(-1) / float(gap.mean())
    recovered, low, high = (np.where(unmeasured, np.nan, a) for a in (recovered, low, high))  # [L, T]

    def cells(a: np.ndarray) -> list:  # None where not measured (JSON null)
        return [[None if math.isnan(v) else float(v) for v in row] for row in a]

    gap_draws = gap.numpy()[picks].mean(-1)
    gap_low, gap_high = np.percentile(gap_draws, [tail, 100 - tail])
    return {
        "template": template,
        "names": list(names),
        "pairs": [[names[i], names[(i + 1) % n]] for i in range(n)],
        "layers": layers,
        "site": "resid_pre",
        "tokens": [model.decode([int(t)]) for t in prompts[0]],
        "renamed_positions": renamed,
        "positions": positions,
        "patched_positions": patched_positions,
        "clean_metric": float(clean_metric.mean()),
        "corrupted_metric": float(corrupt_metric.mean()),
        "gap": float(gap.mean()),
        "gap_interval": [float(gap_low), float(gap_high)],
        "gap_spans_zero": bool(gap_low <= 0 <= gap_high),
        "recovered": cells(recovered),
        "interval_low": cells(low),
        "interval_high": cells(high),
        "spans_zero": ((low <= 0) & (high >= 0)).tolist(),  # False where not measured
    }


def renamed_positions(prompts: torch.Tensor) -> list[int]:
    """The positions where the pairs' prompts [names, T] differ: every place the name is written."""
    return [int(p) for p in (prompts != prompts[:1]).any(0).nonzero().flatten()]


def positions_to_patch(renamed: Sequence[int], length: int, positions: str = "all") -> list[int]:
    """The positions `patching_study` may patch in prompts of `length` tokens that differ at `renamed`
    (a patch runs only where the two runs' streams differ)."""
    if positions == "all":
        return list(range(length))
    return sorted({*renamed, length - 1})


def run_studies(
    model: Model,
    windows: HeldOut,
    studies: Sequence[str] = STUDIES,
    *,
    expert_layers: Optional[Sequence[int]] = None,
    max_expert_runs: Optional[int] = None,
    max_patch_layers: Optional[int] = None,
    patch_positions: str = "all",
    patch_pairs: int = PATCH_PAIRS,
    progress: bool = False,
) -> dict:
    """The unablated run and each study of `studies` (STUDIES' names) on `windows`, with a progress
    bar on stderr over every window a run reads: {"baseline": ..., study: its result}."""
    unknown = [s for s in studies if s not in STUDIES]
    if unknown or not studies:
        raise ExperimentError(f"the studies are {', '.join(STUDIES)}; got {brief(list(studies))}")
    layers, experts = expert_grid(model, max_expert_runs, expert_layers)
    runs = {
        "engram": 1 + len(model.cfg.engram_layer_ids),
        "indexer": 2,
        "experts": len(layers) * len(experts),
        "hyper_connections": 1,
    }
    total = windows.n * (1 + sum(runs.get(s, 0) for s in studies))
    names = patch_names(model, pairs=patch_pairs) if "patching" in studies else []
    if names:
        prompts, _ = patch_prompts(model, names=names)
        n, length = prompts.shape
        patched = len(positions_to_patch(renamed_positions(prompts), length, patch_positions))
        total += n * patched * len(spaced(range(model.cfg.n_layers), max_patch_layers or model.cfg.n_layers))
    out: dict = {}
    with _bar(total, "ablate", progress) as bar:
        base = baseline(model, windows, bar)
        out["baseline"] = {"bits_per_byte": base["bits_per_byte"]}
        for study in studies:
            if study == "engram":
                out[study] = engram_study(model, windows, base["bits"], bar)
            elif study == "indexer":
                out[study] = indexer_study(model, windows, base["bits"], progress=bar)
            elif study == "experts":
                out[study] = expert_study(model, windows, base["bits"], layers, experts, bar)
            elif study == "hyper_connections":
                out[study] = hyper_connection_study(model, windows, base["bits"], bar)
            else:
                out[study] = patching_study(
                    model, names=names, max_layers=max_patch_layers, positions=patch_positions, progress=bar
                )
    return out


# ---------------------------------------------------------------------- figures
SPANS_ZERO_HATCH = "////"
UNMEASURED_GREY = "0.85"


def _bars(ax, labels: list[str], results: list[dict], color, *, shift: float = 0.0, width: float = 0.6, label=None):
    """One bar a result: its difference, the interval as an error bar; hatched where it spans zero."""
    x = np.arange(len(results))
    diff = np.array([r["difference"] for r in results])
    low = np.array([r["interval"][0] for r in results])
    high = np.array([r["interval"][1] for r in results])
    bars = ax.bar(
        x + shift, diff, width, color=color, yerr=[diff - low, high - diff], capsize=3, ecolor="#333333", label=label
    )
    for bar, r in zip(bars, results):
        if r["spans_zero"]:
            bar.set_hatch(SPANS_ZERO_HATCH)
            bar.set_facecolor("white")
            bar.set_edgecolor(color)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)


def _spans_zero_note(ax) -> None:
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(facecolor="white", edgecolor="#555555", hatch=SPANS_ZERO_HATCH, label="interval spans zero")],
        fontsize=7,
        loc="best",
    )


def _by_class(result: dict) -> tuple[list[str], list[dict]]:
    names = [c for c in TOKEN_CLASSES if c in result["by_class"]]
    return [f"{c} ({result['by_class'][c]['tokens']})" for c in names], [result["by_class"][c] for c in names]


def engram_figure(study: dict):
    """Engram off: on every layer and on each alone (left), by token class (right)."""
    from . import viz

    fig, (ax, ax2) = viz.new_figure(1, 2, figsize=(9.0, 3.4))
    _bars(ax, ["all layers"] + [f"layer {i}" for i in study["layers"]], [study["all"], *study["each"]], viz.PALETTE[0])
    ax.set(ylabel="bits per byte, off minus on", title="Engram off")
    _bars(ax2, *_by_class(study["all"]), viz.PALETTE[0])
    ax2.set(ylabel="bits per byte of the class's tokens", title="Engram off on every layer, by target class")
    _spans_zero_note(ax)
    return fig


def indexer_figure(study: dict):
    """The indexer's selection replaced: dense and random against its sparse top-k, by class."""
    from . import viz

    fig, (ax, ax2) = viz.new_figure(1, 2, figsize=(9.0, 3.4))
    _bars(ax, ["dense (every reachable)", "random (same count)"], [study["dense"], study["random"]], viz.PALETTE[1])
    ax.set(ylabel="bits per byte, against the top-k", title=f"the indexer's top-{study['index_topk']} replaced")
    labels, dense = _by_class(study["dense"])
    _, drawn = _by_class(study["random"])
    for shift, results, color, name in ((-0.2, dense, viz.PALETTE[1], "dense"), (0.2, drawn, viz.PALETTE[3], "random")):
        _bars(ax2, labels, results, color, shift=shift, width=0.4, label=name)
    ax2.set(ylabel="bits per byte of the class's tokens", title="by target class (hatched: spans zero)")
    ax2.legend(fontsize=7)
    _spans_zero_note(ax)
    return fig


def experts_figure(study: dict):
    """Each routed expert removed in turn: the cost per (layer, expert), a dot where the interval
    spans zero (left); the token classes it costs, on the layer of the costliest expert (right)."""
    from matplotlib.colors import TwoSlopeNorm

    from . import viz

    diff = np.array(study["difference"])  # [L, E]
    fig, (ax, ax2) = viz.new_figure(1, 2, figsize=(12.0, 3.8), width_ratios=(1.3, 1))
    bound = max(float(np.abs(diff).max()), 1e-9)
    norm = TwoSlopeNorm(vmin=-bound, vcenter=0.0, vmax=bound)
    image = ax.imshow(diff, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
    flat = np.array(study["spans_zero"])
    rows, cols = np.nonzero(flat)
    ax.plot(cols, rows, "k.", ms=2.5, label="interval spans zero")
    ax.set(xlabel="expert removed", ylabel="layer", title="bits per byte each removed expert costs")
    ax.set_yticks(range(len(study["layers"])))
    ax.set_yticklabels(study["layers"])
    ax.set_xticks(range(len(study["experts"])))
    ax.set_xticklabels(study["experts"], fontsize=6)
    ax.grid(False)
    ax.legend(fontsize=7, loc="upper right")
    fig.colorbar(image, ax=ax, label="bits per byte, removed minus all")
    at = int(np.unravel_index(int(diff.argmax()), diff.shape)[0])
    by_class = np.array(study["by_class"][at]).T  # [classes, experts]
    bound = max(float(np.abs(by_class).max()), 1e-9)
    image2 = ax2.imshow(
        by_class,
        aspect="auto",
        cmap="RdBu_r",
        norm=TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound),
        interpolation="nearest",
    )
    quiet = np.array(study["by_class_spans_zero"][at]).T
    rows, cols = np.nonzero(quiet)
    ax2.plot(cols, rows, "k.", ms=2.5)
    ax2.set(xlabel="expert removed", title=f"layer {study['layers'][at]}: what each expert is for")
    ax2.set_yticks(range(len(study["classes"])))
    ax2.set_yticklabels(study["classes"], fontsize=7)
    ax2.set_xticks(range(len(study["experts"])))
    ax2.set_xticklabels(study["experts"], fontsize=6)
    ax2.grid(False)
    fig.colorbar(image2, ax=ax2, label="bits per byte of the class's tokens")
    return fig


def hyper_connections_figure(study: dict):
    """The hyper-connections collapsed to a plain residual: overall and by token class."""
    from . import viz

    fig, ax = viz.new_figure(figsize=(6.4, 3.4))
    labels, results = _by_class(study["plain_residual"])
    _bars(ax, ["all tokens", *labels], [study["plain_residual"], *results], viz.PALETTE[2])
    ax.set(
        ylabel="bits per byte, plain minus hyper-connected",
        title=f"{study['hc_mult']} copies collapsed to one residual",
    )
    _spans_zero_note(ax)
    return fig


def patching_figure(study: dict):
    """Activation patching: the share of the clean-minus-corrupted difference one layer's input at
    one position carries, a dot where its interval over the pairs spans zero."""
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm

    from . import viz

    recovered = np.array(study["recovered"], dtype=float)  # [L, T], NaN where not measured
    fig, ax = viz.new_figure(figsize=(10.0, 3.8))
    bound = max(1.0, float(np.nanmax(np.abs(recovered))))
    if np.isnan(recovered).any():
        ax.plot([], [], "s", color=UNMEASURED_GREY, label="not patched")
    image = ax.imshow(
        recovered,
        aspect="auto",
        cmap=colormaps["RdBu_r"].with_extremes(bad=UNMEASURED_GREY),
        norm=TwoSlopeNorm(vcenter=0.0, vmin=-bound, vmax=bound),
        interpolation="nearest",
    )
    rows, cols = np.nonzero(np.array(study["spans_zero"]))
    ax.plot(cols, rows, "k.", ms=2.5, label="interval spans zero")
    ax.set_xticks(range(len(study["tokens"])))
    ax.set_xticklabels([repr(t)[1:-1] for t in study["tokens"]], rotation=90, fontsize=7)
    for tick, position in zip(ax.get_xticklabels(), range(len(study["tokens"]))):
        if position in study["renamed_positions"]:
            tick.set_color(viz.PALETTE[3])
    ax.set_yticks(range(len(study["layers"])))
    ax.set_yticklabels(study["layers"])
    ax.set(
        ylabel="layer (its input stream)", title="share of the renamed name's logit difference restored by one patch"
    )
    ax.grid(False)
    ax.legend(fontsize=7, loc="upper left")
    fig.colorbar(image, ax=ax, label="recovered (1: all of it)")
    return fig


def summary_figure(results: dict):
    """Every study's headline difference with its interval, in one chart."""
    from . import viz

    rows = headlines(results)
    fig, ax = viz.new_figure(figsize=(7.0, 3.4))
    _bars(ax, [label for label, _ in rows], [r for _, r in rows], viz.PALETTE[4])
    ax.set(
        ylabel="bits per byte, ablated minus unablated",
        title=f"what each mechanism is worth (unablated: {results['baseline']['bits_per_byte']:.3f} bits/byte)",
    )
    _spans_zero_note(ax)
    return fig


def headlines(results: dict) -> list[tuple[str, dict]]:
    """(label, compare result) of each study's headline number: Engram off, the selection dense and
    random, the costliest routed expert removed (picked as the largest of the map, so its interval
    flatters it), the plain residual."""
    rows = []
    if "engram" in results:
        rows.append(("Engram off", results["engram"]["all"]))
    if "indexer" in results:
        rows += [("indexer dense", results["indexer"]["dense"]), ("indexer random", results["indexer"]["random"])]
    if "experts" in results:
        e = results["experts"]
        diff = np.array(e["difference"])
        i, j = np.unravel_index(int(diff.argmax()), diff.shape)
        low, high = e["interval"][i][j]
        rows.append(
            (
                f"costliest expert removed (layer {e['layers'][i]}, expert {e['experts'][j]})",
                {"difference": float(diff[i, j]), "interval": [low, high], "spans_zero": e["spans_zero"][i][j]},
            )
        )
    if "hyper_connections" in results:
        rows.append(("plain residual", results["hyper_connections"]["plain_residual"]))
    return rows


FIGURES = {
    "engram": engram_figure,
    "indexer": indexer_figure,
    "experts": experts_figure,
    "hyper_connections": hyper_connections_figure,
    "patching": patching_figure,
}


# ---------------------------------------------------------------------- dsv41 ablate
MARKER = "dsv41-ablate.json"
MARKER_FORMAT = "dsv41-ablate"
RESULTS_NAME = "ablate.json"


def _whole_numbers(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"takes whole numbers >= 0 separated by commas, got {text!r}")
    return values


def _studies(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in STUDIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"takes some of {','.join(STUDIES)}, got {text!r}")
    return names


def cli_main(argv: list[str]) -> int:
    from ..core.argtypes import memory_size, whole_number

    parser = argparse.ArgumentParser(
        prog="dsv41 ablate",
        description=(
            "What each V4.1 mechanism is worth on held-out text: bits per byte with each taken away (Engram off, "
            "the indexer's selection dense or random, each routed expert removed in turn, the hyper-connections "
            "collapsed to a plain residual) against the unablated model, with paired bootstrap intervals over "
            "the windows, and one activation-patching study on code. Writes OUT/ablate.json and a PNG, SVG and "
            "JSON sidecar per figure."
        ),
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded miniature)")
    parser.add_argument(
        "--out", default="outputs/ablate", metavar="DIR", help="results folder (default outputs/ablate)"
    )
    parser.add_argument(
        "--windows",
        type=whole_number(1, 100_000, "windows"),
        default=32,
        metavar="N",
        help="held-out windows (default 32)",
    )
    parser.add_argument(
        "--tokens",
        type=whole_number(2, 1 << 20, "tokens"),
        default=256,
        metavar="N",
        help="targets per window (default 256)",
    )
    parser.add_argument(
        "--batch",
        type=whole_number(1, 4096, "windows"),
        default=8,
        metavar="N",
        help="windows per forward (default 8; the caches hold them)",
    )
    parser.add_argument(
        "--studies",
        type=_studies,
        default=list(STUDIES),
        metavar="A,B",
        help=f"some of {','.join(STUDIES)} (default all)",
    )
    parser.add_argument(
        "--expert-layers",
        type=_whole_numbers,
        default=None,
        metavar="L,M",
        help="the expert map's layers (default every one)",
    )
    parser.add_argument(
        "--max-expert-runs",
        type=whole_number(1, 1 << 30, "runs"),
        default=None,
        metavar="N",
        help="at most N expert removals: evenly spaced layers and the lowest expert ids (a released-size model has "
        "40 x 384)",
    )
    parser.add_argument(
        "--max-patch-layers",
        type=whole_number(1, 1 << 20, "layers"),
        default=None,
        metavar="N",
        help="patch at most N layers, evenly spaced from the first to the last (default every layer)",
    )
    parser.add_argument(
        "--patch-positions",
        choices=PATCH_POSITIONS,
        default="all",
        help="patch every position (default) or only the renamed ones and the last (a forward each: minutes at the "
        "released size)",
    )
    parser.add_argument(
        "--patch-pairs",
        type=whole_number(2, len(PATCH_NAMES), "pairs"),
        default=PATCH_PAIRS,
        metavar="N",
        help=f"renamed-argument pairs in the patching study (default {PATCH_PAIRS}; each pair is a forward per "
        "patched cell)",
    )
    parser.add_argument("--memory", type=memory_size, default=None, metavar="SIZE", help="a memory budget, e.g. 20GiB")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary on stderr")
    args = parser.parse_args(argv)
    try:
        return _ablate(args)
    except Dsv41Error as exc:
        print(f"dsv41 ablate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dsv41 ablate: interrupted; the results folder holds what was written before", file=sys.stderr)
        return 130


def _ablate(args) -> int:
    import os

    from ..core.outdir import claim_folder, write_json
    from ..runtime.loader import checkpoint_path, load
    from . import viz

    folder, _ = claim_folder(args.out, marker=MARKER, fmt=MARKER_FORMAT, flag="--out", command="dsv41 ablate")
    path = checkpoint_path(args.checkpoint, progress=not args.quiet)
    model = load(
        path, quiet=args.quiet, max_batch_size=args.batch, max_seq_len=max(args.tokens, 64), memory=args.memory
    )
    windows = held_out(model, args.windows, args.tokens)
    results = run_studies(
        model,
        windows,
        args.studies,
        expert_layers=args.expert_layers,
        max_expert_runs=args.max_expert_runs,
        max_patch_layers=args.max_patch_layers,
        patch_positions=args.patch_positions,
        patch_pairs=args.patch_pairs,
        progress=not args.quiet,
    )
    facts = {
        "checkpoint": path,
        "windows": windows.n,
        "tokens": args.tokens,
        "window_starts": windows.starts,
        "held_out_tokens": windows.stream_tokens,
        "bootstrap": {"draws": BOOTSTRAP_DRAWS, "seed": BOOTSTRAP_SEED, "confidence": CONFIDENCE},
        **results,
    }
    write_json(folder / RESULTS_NAME, viz.to_jsonable(facts))
    for study in args.studies:
        viz.export_figure(FIGURES[study](results[study]), f"ablate_{study}", os.fspath(folder), results[study])
    if len([s for s in args.studies if s != "patching"]) > 0:
        viz.export_figure(
            summary_figure(results), "ablate_summary", os.fspath(folder), {"headlines": headlines(results)}
        )
    if not args.quiet:
        say = lambda line: print(line, file=sys.stderr)  # noqa: E731
        say(
            f"unablated: {results['baseline']['bits_per_byte']:.4f} bits/byte over {windows.n} windows of {args.tokens}"
        )
        for label, result in headlines(results):
            say(f"{label}: {verdict(result)}")
        if "patching" in results:
            p = results["patching"]
            low, high = p["gap_interval"]
            say(f"patching: clean minus corrupted logit difference {p['gap']:+.3f} [{low:+.3f}, {high:+.3f}]")
        say(f"wrote {folder / RESULTS_NAME} and the figures beside it")
    return 0
