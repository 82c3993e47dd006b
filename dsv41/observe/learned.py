"""What a trained checkpoint learned, as plain data, measured on held-out text (notebook 08).

Each study takes a loaded model and the held-out
split of the training corpus (`train.corpus`: the standard library by file), so the same call on
the trained miniature and on the random tiny checkpoint of the same geometry sets the two side by
side. Everything returned is numbers and lists (JSON-ready); the arithmetic a figure states is in
small pure functions here (`spread`, `mutual_information`, `index_recall`, `frequency_bins`,
`token_class`) so tests hold it on crafted inputs, and so are the chance levels a figure reads a
number against (`shuffled_mutual_information`, `uniform_routing_loads`: fixed seeds). Input a study
cannot measure (no texts, no tokens, an empty count table) is a `LearnedError` in one sentence.
Observation goes through the model's sites and traces; the measurements the package already owns
are called, not redone: the expert-cache replay (`cache_policy.policy_data`), speculative
decoding's acceptance and calibration (`speculative.Speculation`), the prefill / decode comparison
(`generate.compare_prefill_decode`) and the indexer's distillation target
(`attention.attention_target`, read at the `attn.topk` sites of the model's own forward).
"""

from __future__ import annotations

import keyword
import math
import string
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from ..core.errors import Dsv41Error
from ..core.text import brief
from ..generation.generate import as_prompt, compare_prefill_decode, generate
from ..generation.speculative import Speculation
from ..model.attention import attention_target
from ..model.hooks import run_with_hooks
from ..model.trace import ForwardTrace
from .cache_policy import policy_data

if TYPE_CHECKING:  # annotations only
    from ..model.model import Model

# The classes a decoded token falls in, in the order figures and matrices list them.
TOKEN_CLASSES = ("whitespace", "identifier", "keyword", "punctuation", "digits", "other")
_PUNCTUATION = frozenset(string.punctuation)
# n-gram frequency bins: [edge_i, edge_{i+1}) occurrences in the counted text
FREQUENCY_EDGES = (0, 1, 2, 4, 16, 64, 256, 1024)
CACHE_CAPACITIES = (2, 4, 6, 8, 12)
MIN_CLASS_TOKENS = 20
# Chance baselines are averages over random draws with a fixed seed, so a figure is the same every run:
# shuffled class-expert pairings for the mutual information's small-sample bias, and uniform random
# routing for the balance a router would show by luck alone.
MI_SHUFFLES = 32
CHANCE_DRAWS = 2000
CHANCE_SEED = 0


class LearnedError(Dsv41Error, ValueError):
    """A study or its arithmetic was handed input it cannot measure; the message says which and why."""


def _count(value, name: str, low: int) -> int:
    """`value` as a whole number >= low, else one sentence naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise LearnedError(f"{name} must be a whole number >= {low}, got {brief(value)}")
    return int(value)


def _texts(texts: Sequence[str]) -> list[str]:
    texts = list(texts)
    if not texts:
        raise LearnedError("the study got no texts; pass at least one (e.g. learned.held_out_texts(n))")
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise LearnedError(f"text {i} is {brief(text)}; every text must be a non-empty string")
    return texts


# ---------------------------------------------------------------------- held-out text
def held_out_texts(n: int, chars: int = 1600, corpus=None) -> list[str]:
    """`n` excerpts of the held-out split's Python sources, evenly spaced over its sorted file
    names, each `chars` characters from the first line that starts a definition or an import
    (past the module docstring, where the code is)."""
    from ..train.corpus import load_corpus

    n, chars = _count(n, "the number of held-out excerpts", 1), _count(chars, "chars", 1)
    corpus = corpus or load_corpus()
    names = [name for name in sorted(corpus.held_out) if name.endswith(".py") and len(corpus.held_out[name]) > chars]
    if not names:
        raise LearnedError(f"no held-out Python file is longer than {chars:,} characters; ask for shorter excerpts")
    picked = [names[(i * len(names)) // n] for i in range(min(n, len(names)))]
    out = []
    for name in picked:
        text = corpus.held_out[name]
        starts = [text.find(f"\n{word}") for word in ("def ", "class ", "import ", "from ")]
        start = min((s + 1 for s in starts if s >= 0), default=0)
        out.append(text[start : start + chars])
    return out


def shared_axis(studies: dict[str, dict]) -> tuple[list[int], dict[str, list[int]]]:
    """(every layer id the studies measured, sorted; per study the positions of its own layers on
    that axis): two checkpoints of different geometries (the released one against the random tiny
    one) are drawn each at its own layers, and checkpoints of one geometry at 0, 1, 2, ..."""
    ids = sorted({layer for study in studies.values() for layer in study["layers"]})
    at = {layer: i for i, layer in enumerate(ids)}
    return ids, {name: [at[layer] for layer in study["layers"]] for name, study in studies.items()}


def by_common_layer(a: dict, b: dict, key: str) -> list[tuple]:
    """(a's value, b's value) of `key` at each layer both studies measured, in a's order: what a
    comparison layer by layer may pair when the two geometries differ."""
    other = dict(zip(b["layers"], b[key]))
    return [(value, other[layer]) for layer, value in zip(a["layers"], a[key]) if layer in other]


def prompt_ids(model: Model, text: str, tokens: int, at_least: int = 1) -> list[int]:
    """`text` as the model's prompt ids (BOS first where the model adds one), cut to `tokens`; a
    text that gives fewer than `at_least` ids is refused (a study would have nothing to measure)."""
    tokens = _count(tokens, "tokens", at_least)
    if not isinstance(text, str) or not text:
        raise LearnedError(f"the text is {brief(text)}; a study needs a non-empty string")
    ids = as_prompt(model, text).ids[:tokens]
    if len(ids) < at_least:
        raise LearnedError(
            f"the text {brief(text)} gives {len(ids)} token id(s); this study needs at least "
            f"{at_least}: give a longer text"
        )
    return ids


# ---------------------------------------------------------------------- token classes
def token_class(text: str) -> str:
    """The class of one decoded token: whitespace (indentation, newlines), a keyword (soft ones
    too), digits, an identifier (or a piece of one), punctuation / operators, else other. Leading
    and trailing whitespace is ignored ("  def" is a keyword)."""
    s = text.strip()
    if not s:
        return "whitespace"
    if keyword.iskeyword(s) or keyword.issoftkeyword(s):
        return "keyword"
    if s.isdigit():
        return "digits"
    if s.isidentifier():
        return "identifier"
    if all(ch in _PUNCTUATION for ch in s):
        return "punctuation"
    return "other"


def token_classes(model: Model, ids: Sequence[int]) -> list[Optional[int]]:
    """Per position the index of its token's class in TOKEN_CLASSES; None for special tokens (they
    decode to nothing)."""
    out = []
    for i in ids:
        text = model.decode([int(i)])
        out.append(TOKEN_CLASSES.index(token_class(text)) if text else None)
    return out


# ---------------------------------------------------------------------- arithmetic
def spread(p: np.ndarray) -> np.ndarray:
    """Entropy of each row of `p` (non-negative, normalized here) over log(width): 1 is uniform,
    0 one entry. `p` [..., E] -> [...]. A row of zeros has no distribution to spread, so it is
    refused rather than read as 0 (one entry) or 1 (uniform); so are a width below 2 (log 1 = 0),
    negative and non-finite entries."""
    p = np.asarray(p, dtype=np.float64)
    if p.ndim == 0 or p.shape[-1] < 2:
        raise LearnedError(f"spread needs rows of at least 2 entries (entropy over log width), got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        raise LearnedError("spread takes finite non-negative weights; this input has a negative, NaN or infinite entry")
    with np.errstate(over="ignore"):  # an overflowing sum is refused just below, not warned about
        total = p.sum(axis=-1, keepdims=True)
    if not np.isfinite(total).all():
        raise LearnedError("spread's rows sum past the float64 range; scale the weights down")
    empty = int((total == 0).sum())
    if empty:
        raise LearnedError(
            f"{empty} of {total.size} rows given to spread are all zero: an empty row has no "
            "distribution, so its spread is undefined; drop it or count something into it"
        )
    p = p / total
    # 0.0 minus the sum: a one-entry row gives +0.0, not -0.0; the same bits otherwise
    h = 0.0 - np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
    return h / math.log(p.shape[-1])


def mutual_information(counts: np.ndarray) -> float:
    """I(row; column) in bits of a joint count table [classes, experts]. An empty table (no counts)
    is refused: it has no joint distribution, and 0 bits would read as "independent"."""
    joint = np.asarray(counts, dtype=np.float64)
    if joint.ndim != 2:
        raise LearnedError(f"mutual_information takes a 2-D count table [classes, experts], got shape {joint.shape}")
    if not np.isfinite(joint).all() or (joint < 0).any():
        raise LearnedError(
            "mutual_information takes finite non-negative counts; this table has a negative, NaN or infinite entry"
        )
    with np.errstate(over="ignore"):  # an overflowing sum is refused just below, not warned about
        total = joint.sum()
    if total == 0:
        raise LearnedError(
            f"the {joint.shape[0]} x {joint.shape[1]} count table holds no counts: with nothing "
            "counted the mutual information is undefined"
        )
    if not np.isfinite(total):
        raise LearnedError("the count table sums past the float64 range; scale the counts down")
    joint = joint / total
    rows, cols = joint.sum(1, keepdims=True), joint.sum(0, keepdims=True)
    inside = joint > 0
    return float((joint[inside] * np.log2(joint[inside] / (rows @ cols)[inside])).sum())


def class_expert_counts(classes: Sequence[int], chosen: np.ndarray, n_classes: int, n_experts: int) -> np.ndarray:
    """The joint count table [n_classes, n_experts] of tokens' classes and the experts each chose:
    `classes` [n] (class index per token), `chosen` [n, k]; every (token, chosen expert) adds one."""
    classes = np.asarray(classes, dtype=np.int64).reshape(-1)
    chosen = np.asarray(chosen, dtype=np.int64)
    if chosen.ndim != 2 or len(chosen) != len(classes):
        raise LearnedError(
            f"{len(classes)} token classes but chosen experts of shape {chosen.shape}; "
            "give one row of chosen experts per token"
        )
    if len(classes) and not (0 <= classes.min() and classes.max() < n_classes):
        raise LearnedError(f"a token class lies outside 0..{n_classes - 1}")
    if chosen.size and not (0 <= chosen.min() and chosen.max() < n_experts):
        raise LearnedError(f"a chosen expert lies outside 0..{n_experts - 1}")
    table = np.zeros((n_classes, n_experts), dtype=np.int64)
    np.add.at(table, (np.repeat(classes, chosen.shape[1]), chosen.reshape(-1)), 1)  # [n * k] pairs
    return table


def shuffled_mutual_information(
    classes: Sequence[int],
    chosen: np.ndarray,
    n_classes: int,
    n_experts: int,
    shuffles: int = MI_SHUFFLES,
    seed: int = CHANCE_SEED,
) -> float:
    """Mean I(class; expert) in bits over `shuffles` random pairings of the tokens' classes with
    their chosen experts (the classes permuted, fixed seed): what the plug-in estimate shows for a
    router that ignores the class, on this many tokens: its small-sample bias, the level an
    observed value is read against."""
    shuffles = _count(shuffles, "shuffles", 1)
    classes = np.asarray(classes, dtype=np.int64).reshape(-1)
    rng = np.random.default_rng(seed)
    return float(
        np.mean(
            [
                mutual_information(class_expert_counts(rng.permutation(classes), chosen, n_classes, n_experts))
                for _ in range(shuffles)
            ]
        )
    )


def uniform_routing_loads(
    n_tokens: int, n_experts: int, top_k: int, draws: int = CHANCE_DRAWS, seed: int = CHANCE_SEED
) -> np.ndarray:
    """Expert loads [draws, n_experts] of `n_tokens` tokens each sending to `top_k` distinct experts
    picked uniformly at random (fixed seed): the balance a router shows by chance on that many tokens."""
    n_tokens, draws = _count(n_tokens, "n_tokens", 1), _count(draws, "draws", 1)
    n_experts, top_k = _count(n_experts, "n_experts", 1), _count(top_k, "top_k", 1)
    if top_k > n_experts:
        raise LearnedError(f"top_k = {top_k} experts of {n_experts}: a token cannot choose more experts than exist")
    rng = np.random.default_rng(seed)
    loads = np.zeros((draws, n_experts), dtype=np.int64)
    per_chunk = max(1, (1 << 22) // (n_tokens * top_k))  # bounds the picks held at once to ~4M numbers
    for start in range(0, draws, per_chunk):
        m = min(per_chunk, draws - start)
        # each token's k distinct experts by Floyd's sampling (a uniform k-subset in k draws, so the
        # cost follows k, not E): step j draws t in [0, j] and takes j instead if t is taken already
        picks = np.empty((m, n_tokens, top_k), dtype=np.int64)
        for i, j in enumerate(range(n_experts - top_k, n_experts)):
            t = rng.integers(0, j + 1, size=(m, n_tokens))
            picks[..., i] = np.where((picks[..., :i] == t[..., None]).any(-1), j, t)
        flat = (picks.reshape(m, -1) + n_experts * np.arange(m)[:, None]).reshape(-1)  # [m * n_tokens * k] slots
        loads[start : start + m] = np.bincount(flat, minlength=m * n_experts).reshape(m, n_experts)
    return loads


def index_recall(target: torch.Tensor, selected: torch.Tensor, reachable: torch.Tensor, k: int) -> dict:
    """How well a selection of compressed positions covers what full attention attends to.

    target [s, T]: each query's attention over the compressed positions (heads averaged);
    selected [s, k'] the positions the indexer chose (-1: none); reachable [s]. Over the queries
    that reach more than k positions (fewer are taken whole): recall, the fraction of the target's
    top-k the selection holds; mass, the target's probability on the selection; chance, k /
    reachable (a random k of the reachable positions: its expected recall and mass alike)."""
    k = _count(k, "k (positions an indexer keeps)", 1)
    if not (
        target.dim() == 2
        and selected.dim() == 2
        and reachable.dim() == 1
        and target.size(0) == selected.size(0) == reachable.size(0)
    ):
        raise LearnedError(
            f"index_recall takes target [s, T], selected [s, k'] and reachable [s] over the same "
            f"queries, got {tuple(target.shape)}, {tuple(selected.shape)} and {tuple(reachable.shape)}"
        )
    rows = torch.nonzero(reachable > k).flatten()
    recall, mass, chance = [], [], []
    for q in rows.tolist():
        n = int(reachable[q])
        picks = {int(t) for t in selected[q].tolist() if 0 <= t < n}
        top = set(target[q, :n].topk(k).indices.tolist())
        recall.append(len(picks & top) / k)
        mass.append(float(target[q, sorted(picks)].sum()) if picks else 0.0)
        chance.append(k / n)
    return {"queries": len(recall), "recall": recall, "mass": mass, "chance": chance}


def frequency_bins(counts: Sequence[int], values: Sequence[float], edges: Sequence[int] = FREQUENCY_EDGES) -> dict:
    """`values` grouped by the bin of the matching `counts` ([edges[i], edges[i + 1]), the last
    bin open): per bin its label, how many values and their mean (None when empty)."""
    counts, values = np.asarray(counts, dtype=np.int64).reshape(-1), np.asarray(values, dtype=np.float64).reshape(-1)
    if len(counts) != len(values):
        raise LearnedError(f"{len(counts)} counts but {len(values)} values; frequency_bins pairs them one to one")
    if not len(edges) or list(edges) != sorted(set(edges)):
        raise LearnedError(f"bin edges must be one or more strictly increasing counts, got {brief(list(edges))}")
    if len(counts) and counts.min() < edges[0]:
        raise LearnedError(f"a count of {int(counts.min())} lies below the first bin edge {edges[0]}")
    which = np.searchsorted(np.asarray(edges), counts, side="right") - 1
    labels = [_bin_label(lo, edges[i + 1] if i + 1 < len(edges) else None) for i, lo in enumerate(edges)]
    n = [int((which == i).sum()) for i in range(len(edges))]
    mean = [float(values[which == i].mean()) if k else None for i, k in enumerate(n)]
    return {"labels": labels, "edges": list(edges), "n": n, "mean": mean}


def _bin_label(lo: int, hi: Optional[int]) -> str:
    if hi is None:
        return f">={lo}"
    return str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"


# ---------------------------------------------------------------------- a: routing
class _Router:
    """Observer of the MoE sites: per layer and token, the spread of its router affinities and the
    standard deviation of its router logits over the experts."""

    def __init__(self):
        self.spread: dict[int, list[np.ndarray]] = {}
        self.logit_std: dict[int, list[np.ndarray]] = {}

    def __call__(self, name: str, value, context: dict) -> None:
        x = context["x"]
        gate, layer = context["gate"], int(name.split(".")[1])
        logits = gate.logits(x.reshape(-1, x.shape[-1]))  # [n, E]
        scores = gate.affinities(logits)  # [n, E], the unbiased affinities the routing chose from
        self.spread.setdefault(layer, []).append(spread(scores.double().numpy()))
        self.logit_std.setdefault(layer, []).append(logits.double().std(dim=-1).numpy())


def expected_affinity_spread(
    sigmas: Sequence[float], n_experts: int, score_func: str, samples: int = 4096, seed: int = 0
) -> list[float]:
    """The affinity spread a router would show whose logits over the `n_experts` were independent
    normal draws of standard deviation sigma, through the score function `score_func`: a curve to read
    the measured spread against its logit scale (fixed seed, `samples` tokens per sigma)."""
    from ..model.moe import expert_scores

    n_experts, samples = _count(n_experts, "n_experts", 2), _count(samples, "samples", 1)
    if not all(math.isfinite(float(s)) and float(s) >= 0 for s in sigmas):
        raise LearnedError(f"sigmas must be finite standard deviations >= 0, got {brief(list(sigmas))}")
    unit = torch.randn(samples, n_experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return [float(spread(expert_scores(unit * float(s), score_func).numpy()).mean()) for s in sigmas]


def spread_given_token(
    ids: Sequence[int], chosen: np.ndarray, n_experts: int, min_count: int
) -> tuple[Optional[float], int]:
    """Mean over the token ids seen at least `min_count` times of the spread of the experts that id
    chose (its positions pooled), with how many ids counted (None and 0 when none is that frequent).
    `chosen` [positions, k]. A router that sends every occurrence of an id to the same k experts
    gives log k / log E."""
    ids, chosen = np.asarray(ids, dtype=np.int64).reshape(-1), np.asarray(chosen)
    min_count = _count(min_count, "min_count", 1)
    if len(chosen) != len(ids):
        raise LearnedError(f"{len(ids)} token ids but {len(chosen)} rows of chosen experts; give one row per id")
    values, counts = np.unique(ids, return_counts=True)
    frequent = values[counts >= min_count]
    per_id = [float(spread(np.bincount(chosen[ids == i].reshape(-1), minlength=n_experts))) for i in frequent]
    return (float(np.mean(per_id)) if per_id else None), len(per_id)


def routing_study(model: Model, texts: Sequence[str], tokens: int) -> dict:
    """Per MoE layer, over each text's first `tokens` prompt ids run as one prefill:
    affinity_spread (mean over tokens of the entropy of its normalized router affinities / log E:
    how sharply a token prefers some experts), logit_std (mean over tokens of its router logits'
    standard deviation over the experts: the scale the spread follows, `expected_affinity_spread`),
    token_spread (`spread_given_token` with MIN_CLASS_TOKENS, its floor log k / log E as
    token_spread_floor), load_spread (entropy of the experts' load over one
    text / log E, notebook 05's balance measure, averaged over texts) with load_spread_chance (the
    same under uniform random routing of each text's token count, `uniform_routing_loads`),
    class_share [class][expert] (the fraction of a class's tokens that chose the expert; a row sums
    to top-k), mutual_information_bits (between a token's class and each expert it chose) with
    mutual_information_shuffled_bits (`shuffled_mutual_information`: the estimate's level when
    routing ignores the class), max_class_share (the largest entry of class_share among classes of
    at least MIN_CLASS_TOKENS tokens, with its class and expert; top-k / E if routing ignored the
    class) and class_tokens."""
    texts = _texts(texts)
    cfg = model.cfg
    n_experts, top_k = cfg.n_routed_experts, cfg.n_activated_experts
    load_spread: dict[int, list[float]] = {}
    router = _Router()
    chosen_by_layer: dict[int, list[np.ndarray]] = {}
    all_ids: list[int] = []
    all_classes: list[Optional[int]] = []
    lengths: list[int] = []
    for text in texts:
        ids = prompt_ids(model, text, tokens)
        trace = ForwardTrace()
        model.reset()
        with model.sites.hooks({"layers.*.ffn": router}):
            model(torch.tensor([ids]), 0, trace=trace)
        model.reset()
        all_ids += ids
        all_classes += token_classes(model, ids)
        lengths.append(len(ids))
        for layer, rec in trace.routing_by_layer().items():
            chosen = rec["expert_ids"][0].numpy()  # [s, k]
            chosen_by_layer.setdefault(layer, []).append(chosen)
            load = np.bincount(chosen.reshape(-1), minlength=n_experts)
            load_spread.setdefault(layer, []).append(float(spread(load)))
    layers = sorted(chosen_by_layer)
    if not layers:
        raise LearnedError(
            "the model routed no token through an MoE layer; routing_study needs a model with MoE layers"
        )
    chosen = {layer: np.concatenate(chosen_by_layer[layer]) for layer in layers}  # [all positions, k]
    classed = np.array([c is not None for c in all_classes])  # special tokens decode to nothing: no class
    classes = np.array([c for c in all_classes if c is not None], dtype=np.int64)
    class_tokens = np.bincount(classes, minlength=len(TOKEN_CLASSES))
    joint = {
        layer: class_expert_counts(classes, chosen[layer][classed], len(TOKEN_CLASSES), n_experts) for layer in layers
    }
    given = {layer: spread_given_token(all_ids, chosen[layer], n_experts, MIN_CLASS_TOKENS) for layer in layers}
    share = {layer: joint[layer] / np.maximum(class_tokens[:, None], 1) for layer in layers}
    counted = class_tokens >= MIN_CLASS_TOKENS  # a class of a few tokens would show a share of 1 by chance
    best = {
        layer: np.unravel_index(int(np.where(counted[:, None], share[layer], -1).argmax()), share[layer].shape)
        for layer in layers
    }
    # one expected value per distinct text length, averaged over the texts as load_spread is
    chance = {n: float(spread(uniform_routing_loads(n, n_experts, top_k)).mean()) for n in sorted(set(lengths))}
    return {
        "layers": layers,
        "n_experts": n_experts,
        "top_k": top_k,
        "texts": len(texts),
        "tokens": tokens,
        "classes": list(TOKEN_CLASSES),
        "class_tokens": class_tokens.tolist(),
        "affinity_spread": [float(np.concatenate(router.spread[layer]).mean()) for layer in layers],
        "logit_std": [float(np.concatenate(router.logit_std[layer]).mean()) for layer in layers],
        "token_spread": [given[layer][0] for layer in layers],
        "token_spread_ids": [given[layer][1] for layer in layers],
        "token_spread_floor": math.log(top_k) / math.log(n_experts),
        "load_spread": [float(np.mean(load_spread[layer])) for layer in layers],
        "load_spread_chance": float(np.mean([chance[n] for n in lengths])),
        "text_tokens": lengths,
        "class_share": [share[layer].tolist() for layer in layers],
        "mutual_information_bits": [mutual_information(joint[layer]) for layer in layers],
        "mutual_information_shuffled_bits": [
            shuffled_mutual_information(classes, chosen[layer][classed], len(TOKEN_CLASSES), n_experts)
            for layer in layers
        ],
        "max_class_share": [float(share[layer][best[layer]]) for layer in layers],
        "max_class_share_at": [[TOKEN_CLASSES[int(best[layer][0])], int(best[layer][1])] for layer in layers],
        "uniform_class_share": top_k / n_experts,
        "min_class_tokens": MIN_CLASS_TOKENS,
        "chance": {"shuffles": MI_SHUFFLES, "draws": CHANCE_DRAWS, "seed": CHANCE_SEED},
    }


# ---------------------------------------------------------------------- b: Engram gates
def ngram_counts(stream: np.ndarray, base: int, n: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """The distinct n-grams of a token stream (ids below `base`) as keys (int64, sorted: the ids
    read as digits in base `base`) and their counts."""
    n = _count(n, "n (the n-gram length)", 1)
    stream = np.asarray(stream, dtype=np.int64)
    if len(stream) < n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keys = np.zeros(len(stream) - n + 1, dtype=np.int64)
    for i in range(n):
        keys = keys * base + stream[i : len(stream) - n + 1 + i]
    distinct, counts = np.unique(keys, return_counts=True)
    return distinct, counts


def lookup_counts(ids: Sequence[int], table: tuple[np.ndarray, np.ndarray], base: int, n: int = 2) -> np.ndarray:
    """Per position p >= n - 1 of `ids`, how often the n-gram ending there occurs in `table`
    (`ngram_counts` of a stream whose largest id + 1 is `base`) -> [len(ids) - n + 1]; empty when
    fewer than n ids (no n-gram ends in them)."""
    n = _count(n, "n (the n-gram length)", 1)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) < n:
        return np.zeros(0, dtype=np.int64)
    keys = np.zeros(len(ids) - n + 1, dtype=np.int64)
    for i in range(n):
        keys = keys * base + ids[i : len(ids) - n + 1 + i]
    distinct, counts = table
    at = np.searchsorted(distinct, keys).clip(0, max(len(distinct) - 1, 0))
    found = (distinct[at] == keys) if len(distinct) else np.zeros(len(keys), dtype=bool)
    return np.where(found, counts[at] if len(distinct) else 0, 0)


def counting_stream(model: Model, docs: dict[str, str], every: int = 1) -> np.ndarray:
    """Every `every`-th document of `docs` (sorted by name) tokenized by the model's tokenizer,
    an EOS after each: the text n-gram frequencies are counted on."""
    from ..train.data import encode_documents

    names = sorted(docs)[::every]
    return encode_documents(model.tokenizer, {name: docs[name] for name in names}, int(model.cfg.eos_token_id))


def engram_study(model: Model, texts: Sequence[str], tokens: int, stream: np.ndarray) -> dict:
    """Per Engram layer, the gate (mean over the hyper-connection copies) of every token after the
    first of each text, binned by how often its bigram (previous token, token) occurs in `stream`:
    per bin the tokens and mean gate; also the correlation of the gate with log(1 + count). A text
    must give at least 2 ids (`tokens` >= 2): the first has no bigram."""
    texts = _texts(texts)
    stream = np.asarray(stream, dtype=np.int64).reshape(-1)
    if len(stream) < 2:
        raise LearnedError(
            f"the counting stream holds {len(stream)} token(s); bigram counts need at least 2 "
            "(learned.counting_stream of a non-empty corpus)"
        )
    base = max(int(np.max(stream)) + 1, model.cfg.vocab_size)
    table = ngram_counts(stream, base, 2)
    gates: dict[int, list[np.ndarray]] = {}
    counts: list[np.ndarray] = []
    for text in texts:
        ids = prompt_ids(model, text, tokens, at_least=2)
        trace = ForwardTrace()
        model.reset()
        model(torch.tensor([ids]), 0, trace=trace)
        model.reset()
        counts.append(lookup_counts(ids, table, base, 2))
        for layer, rec in trace.engram_by_layer().items():
            gates.setdefault(layer, []).append(rec["gate"][0, 1:].float().mean(-1).numpy())  # [s - 1]
    count = np.concatenate(counts)
    layers = sorted(gates)
    if not layers:
        raise LearnedError("the model has no Engram layer; engram_study needs one")
    out = {
        "layers": layers,
        "ngram": 2,
        "counted_tokens": int(len(stream)),
        "tokens": int(len(count)),
        "bins": {},
        "correlation_with_log_count": [],
        "mean_gate": [],
    }
    for layer in layers:
        g = np.concatenate(gates[layer])
        out["bins"][str(layer)] = frequency_bins(count, g)
        out["mean_gate"].append(float(g.mean()))
        x = np.log1p(count.astype(np.float64))
        corr = float(np.corrcoef(x, g)[0, 1]) if x.std() > 0 and g.std() > 0 else 0.0
        out["correlation_with_log_count"].append(corr)
    return out


# ---------------------------------------------------------------------- c: indexer recall
def indexer_study(model: Model, texts: Sequence[str], tokens: int) -> dict:
    """Per index-source layer (its own indexer: Full and Reindex layers), over each text's first
    `tokens` ids from position 0: the indexer's recall of full attention's top-k compressed
    positions (k = index_topk), the attention mass on its selection, and chance (k / reachable),
    averaged over the queries that reach more than k. Full attention is read where the selection is
    made (each layer's `attn.topk` site: its queries against the compressed rows,
    `attention.attention_target`), in the model's own forward."""
    texts = _texts(texts)
    k = model.cfg.index_topk
    per: dict[int, dict[str, list]] = {}
    sources = [b.layer for b in model.backbone.layers if b.attn.indexer is not None]
    for text in texts:
        ids = torch.tensor([prompt_ids(model, text, tokens)])
        seen: dict[int, tuple] = {}

        def record(name: str, selected: torch.Tensor, context: dict) -> None:
            attention = context["attention"]
            if attention.layer in sources:
                width = ids.size(1) // attention.ratio
                rows = context["compressed_kv"].read(1, width)
                seen[attention.layer] = (attention_target(context["q"], rows, attention.ratio), selected)

        with model.hooks({"layers.*.attn.topk": record}):
            model(ids)
        for layer, (target, selected) in seen.items():
            reachable = (torch.arange(ids.size(1)) + 1) // model.cfg.compress_ratios[layer]
            got = index_recall(target[0], selected[0], reachable, k)
            row = per.setdefault(layer, {"recall": [], "mass": [], "chance": []})
            for name in row:
                row[name] += got[name]
    layers = sorted(per)
    return {
        "layers": layers,
        "k": k,
        "modes": [model.cfg.layer_mode(layer) for layer in layers],
        "compress_ratios": [model.cfg.compress_ratios[layer] for layer in layers],
        "queries": [len(per[layer]["recall"]) for layer in layers],
        **{
            name: [float(np.mean(per[layer][name])) if per[layer][name] else None for layer in layers]
            for name in ("recall", "mass", "chance")
        },
    }


# ---------------------------------------------------------------------- d: DSpark
def speculative_study(model: Model, texts: Sequence[str], prompt_tokens: int, new_tokens: int, bins: int = 5) -> dict:
    """Speculative greedy decoding against plain greedy on each text's first `prompt_tokens` ids
    (`model` loaded with `Numerics.parity()`, where the two must agree token for token), the steps of
    every prompt pooled: acceptance by draft position, calibration of the confidence head, tokens
    per target forward, and per prompt whether the outputs are equal."""
    texts = _texts(texts)
    prompt_tokens = _count(prompt_tokens, "prompt_tokens", 1)
    new_tokens = _count(new_tokens, "new_tokens", 2)  # the first new token comes from the prefill, unspeculated
    steps, equal = [], []
    for text in texts:
        ids = prompt_ids(model, text, prompt_tokens)
        plain = generate(model, ids, max_new_tokens=new_tokens, stop_at_eos=False)
        spec = generate(model, ids, max_new_tokens=new_tokens, stop_at_eos=False, speculative=True)
        equal.append(spec.ids == plain.ids)
        steps += spec.speculation.steps
    pooled = Speculation(steps)
    judged, accepted = pooled.judged_by_position()
    return {
        "prompts": len(texts),
        "new_tokens": new_tokens,
        "equal_to_plain": equal,
        "steps": len(steps),
        "tokens": pooled.tokens,
        "target_forwards": pooled.target_forwards,
        "tokens_per_forward": pooled.tokens_per_forward,
        "mean_accepted": pooled.mean_accepted,
        "judged_by_position": judged,
        "accepted_by_position": accepted,
        "acceptance_by_position": pooled.acceptance_by_position(),
        "calibration": pooled.calibration(bins),
        "block_size": model.cfg.dspark_block_size,
    }


# ---------------------------------------------------------------------- e: expert cache
def cache_study(
    model: Model, text: str, prompt_tokens: int, new_tokens: int, capacities: Sequence[int] = CACHE_CAPACITIES
) -> dict:
    """A greedy generation from `text`'s first `prompt_tokens` ids with a trace, its routing
    replayed through LRU, LFU, static top-N and Belady at `capacities` (`cache_policy.policy_data`):
    the hit rate over all layers per policy and size, and the compulsory limit (every size)."""
    prompt_tokens, new_tokens = _count(prompt_tokens, "prompt_tokens", 1), _count(new_tokens, "new_tokens", 1)
    n_experts = model.cfg.n_routed_experts
    capacities = list(capacities)
    if not capacities or not all(
        isinstance(c, (int, np.integer)) and not isinstance(c, bool) and 0 <= c <= n_experts for c in capacities
    ):
        raise LearnedError(
            f"capacities must be one or more whole cache sizes from 0 to {n_experts} experts, got {brief(capacities)}"
        )
    result = generate(
        model, prompt_ids(model, text, prompt_tokens), max_new_tokens=new_tokens, stop_at_eos=False, trace=True
    )
    data = policy_data(result, capacities=sorted({*capacities, n_experts}), n_experts=n_experts, cfg=model.cfg)
    wanted = [data["capacities"].index(c) for c in capacities]
    return {
        "capacities": list(capacities),
        "policies": data["policies"],
        "policy_names": data["policy_names"],
        "hit_rate": {p: [data["hit_rate"][p][i] for i in wanted] for p in data["policies"]},
        "all_experts_hit_rate": data["hit_rate"]["lru"][data["capacities"].index(n_experts)],
        "lookups": sum(data["lookups"]),
        "distinct": sum(data["distinct"]),
        "tokens": data["tokens"],
        "generated": result.ids,
    }


# ---------------------------------------------------------------------- f: prefill vs decode
def tie_study(model: Model, ids: Sequence[int]) -> dict:
    """`ids` run as one prefill and one token per call (`generate.compare_prefill_decode`) under
    the model's numerics: where logits, greedy tokens, indexer selections and routing first part,
    and at the indexer's top-k cuts of the prefill how many queries were truncated, how many sat on
    an exact tie and the smallest gap between the k-th and (k+1)-th score relative to the k-th."""
    ids = list(ids)
    if not ids:
        raise LearnedError("tie_study got no token ids; give at least one (learned.prompt_ids of a text)")
    cmp = compare_prefill_decode(model, ids)
    truncated = ties = 0
    gaps = []
    for rec in cmp.prefill_trace.attention:
        if rec.kth_score is None:
            continue
        kth, nxt = rec.kth_score.flatten(), rec.next_score.flatten()
        # truncated (not NaN) with both scores finite: spare picks inside a small candidate pool
        # score -inf and are no cut between real positions
        cut = torch.isfinite(kth) & torch.isfinite(nxt)
        truncated += int(cut.sum())
        ties += int((kth[cut] == nxt[cut]).sum())
        gaps += ((kth[cut] - nxt[cut]).abs() / kth[cut].abs().clamp_min(1e-30)).tolist()
    return {
        "positions": cmp.positions,
        "numerics": cmp.numerics,
        "first_logit_divergence": cmp.first_logit_divergence,
        "first_argmax_divergence": cmp.first_argmax_divergence,
        "selection_parting": {str(k): v for k, v in cmp.selections.items()},
        "routing_parting": {str(k): v for k, v in cmp.routing.items()},
        "max_abs_diff": max(cmp.max_abs_diff),
        "max_abs_logit": cmp.max_abs_logit,
        "truncated_queries": truncated,
        "ties_at_cut": ties,
        "min_relative_gap": min(gaps) if gaps else None,
        "median_relative_gap": float(np.median(gaps)) if gaps else None,
    }


def lookahead_study(model: Model, texts: Sequence[str], tokens: int) -> dict:
    """How often layer L+1's experts can be guessed before L+1 runs, so a read-ahead could fetch
    them while earlier work computes: over each text's first `tokens` prompt ids run as one prefill,
    per layer L+1 the mean share of its chosen experts that a guess names (|guess & chosen| / k).

    Two guesses, both L+1's own router (`Gate`, with its selection bias) applied to a state known
    earlier: "early", the input of layer L's router (known when L's experts start: a read issued
    then overlaps L's expert compute and L+1's attention); "late", the stream leaving layer L
    collapsed by L+1's FFN-side mix (known before L+1's attention: a read overlaps that attention
    only). `exact_check` is the same computation for L's own routing from its own input, which must
    be 1.0 (it says the inputs were rebuilt right). Chance is k / E."""
    from ..model.model import hc_pre

    texts = _texts(texts)
    blocks = list(model.backbone.layers)
    cfg = model.cfg
    k = cfg.n_activated_experts
    names = [
        f"layers.{b.layer}.{site}" for b in blocks for site in ("resid_pre", "resid_mid", "resid_post", "ffn.gate")
    ]
    early: dict[int, list[float]] = {}
    late: dict[int, list[float]] = {}
    exact: list[float] = []
    n_tokens = 0

    def overlap(guess: torch.Tensor, chosen: torch.Tensor) -> float:
        hits = (guess.unsqueeze(-1) == chosen.unsqueeze(-2)).any(-1).sum(-1)  # [n]: guessed experts chosen
        return float(hits.double().mean() / k)

    for text in texts:
        ids = prompt_ids(model, text, tokens)
        n_tokens += len(ids)
        model.reset()
        _, cache = run_with_hooks(model, torch.tensor([ids]), 0, names=names, to_cpu=True)
        model.reset()
        with torch.no_grad():
            router_input, chosen = {}, {}
            for b in blocks:
                pre = cache.last(f"layers.{b.layer}.resid_pre")
                mid = cache.last(f"layers.{b.layer}.resid_mid")
                attn_pre = b.mixes(pre, "attn")[0]
                h = b.ffn_norm(hc_pre(mid, attn_pre)).flatten(0, 1)  # [b * s, dim]: what L's router reads
                router_input[b.layer] = h
                chosen[b.layer] = cache.last(f"layers.{b.layer}.ffn.gate")[1].reshape(h.shape[0], k)
                exact.append(overlap(b.ffn.gate(h)[1], chosen[b.layer]))
            for before, after in zip(blocks, blocks[1:]):
                guess = after.ffn.gate(router_input[before.layer])[1]
                early.setdefault(after.layer, []).append(overlap(guess, chosen[after.layer]))
                stream = cache.last(f"layers.{before.layer}.resid_post")  # [b, s, hc, dim]
                ffn_pre = after.mixes(stream, "ffn")[0]
                h_late = after.ffn_norm(hc_pre(stream, ffn_pre)).flatten(0, 1)
                late.setdefault(after.layer, []).append(overlap(after.ffn.gate(h_late)[1], chosen[after.layer]))
    layers = sorted(early)
    return {
        "layers": layers,
        "early": [float(np.mean(early[i])) for i in layers],
        "late": [float(np.mean(late[i])) for i in layers],
        "exact_check": float(np.mean(exact)),
        "chance": k / cfg.n_routed_experts,
        "k": k,
        "n_experts": cfg.n_routed_experts,
        "tokens": n_tokens,
    }


def check_side_by_side(paths: Sequence[str], memory) -> None:
    """Notebook 08 holds every checkpoint of `paths` at once, each loaded once (its parity model is
    a `loader.sibling`, sharing the weights): LearnedError in one sentence when their dense parts
    alone exceed the memory budget `memory` (None: no budget, nothing to check). Two released-size
    checkpoints are two 12.6 GiB dense parts; the released one beside the random tiny one fits a
    budget for one."""
    if memory is None:
        return
    from ..core.argtypes import byte_size
    from ..core.config import load_config
    from ..runtime.report import predict_retained_bytes

    budget = byte_size(memory)
    held = sum(predict_retained_bytes(load_config(p))["bytes"] for p in paths)
    if held > budget:
        raise LearnedError(
            f"notebook 08 holds {len(paths)} checkpoints side by side: {held / 2**30:.2f} GiB of "
            f"dense weights at once, more than the memory budget of {budget / 2**30:.2f} GiB; give "
            "one of them as the comparison only where both fit, or run without a budget"
        )
