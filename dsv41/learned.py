"""What a trained checkpoint learned, as plain data, measured on held-out text (notebook 08).

Each study takes a loaded model (and, for the indexer, its checkpoint folder) and the held-out
split of the training corpus (`train.corpus`: the standard library by file), so the same call on
the trained miniature and on the random tiny checkpoint of the same geometry sets the two side by
side. Everything returned is numbers and lists (JSON-ready); the arithmetic a figure states is in
small pure functions here (`spread`, `mutual_information`, `index_recall`, `frequency_bins`,
`token_class`) so tests hold it on crafted inputs. Observation goes through the model's sites and
traces; the measurements the package already owns are called, not redone: the expert-cache replay
(`cache_policy.policy_data`), speculative decoding's acceptance and calibration
(`speculative.Speculation`), the prefill / decode comparison (`generate.compare_prefill_decode`)
and the indexer's distillation target (`train.twin`, the differentiable twin's exact forward).
"""

from __future__ import annotations

import keyword
import math
import string
from typing import Optional, Sequence

import numpy as np
import torch

from .cache_policy import policy_data
from .generate import as_prompt
from .speculative import Speculation
from .trace import ForwardTrace

# The classes a decoded token falls in, in the order figures and matrices list them.
TOKEN_CLASSES = ("whitespace", "identifier", "keyword", "punctuation", "digits", "other")
_PUNCTUATION = frozenset(string.punctuation)
# n-gram frequency bins: [edge_i, edge_{i+1}) occurrences in the counted text
FREQUENCY_EDGES = (0, 1, 2, 4, 16, 64, 256, 1024)
CACHE_CAPACITIES = (2, 4, 6, 8, 12)
MIN_CLASS_TOKENS = 20


# ---------------------------------------------------------------------- held-out text
def held_out_texts(n: int, chars: int = 1600, corpus=None) -> list[str]:
    """`n` excerpts of the held-out split's Python sources, evenly spaced over its sorted file
    names, each `chars` characters from the first line that starts a definition or an import
    (past the module docstring, where the code is)."""
    from .train.corpus import load_corpus

    corpus = corpus or load_corpus()
    names = [name for name in sorted(corpus.held_out) if name.endswith(".py") and len(corpus.held_out[name]) > chars]
    if n < 1 or not names:
        raise ValueError(f"asked for {n} held-out excerpts; the held-out split has {len(names)} long enough")
    picked = [names[(i * len(names)) // n] for i in range(min(n, len(names)))]
    out = []
    for name in picked:
        text = corpus.held_out[name]
        starts = [text.find(f"\n{word}") for word in ("def ", "class ", "import ", "from ")]
        start = min((s + 1 for s in starts if s >= 0), default=0)
        out.append(text[start : start + chars])
    return out


def prompt_ids(model, text: str, tokens: int) -> list[int]:
    """`text` as the model's prompt ids (BOS first where the model adds one), cut to `tokens`."""
    return as_prompt(model, text).ids[:tokens]


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


def token_classes(model, ids: Sequence[int]) -> list[Optional[int]]:
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
    0 one entry. `p` [..., E] -> [...]."""
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)
    return h / math.log(p.shape[-1])


def mutual_information(counts: np.ndarray) -> float:
    """I(row; column) in bits of a joint count table [classes, experts]."""
    joint = np.asarray(counts, dtype=np.float64)
    total = joint.sum()
    if total == 0:
        return 0.0
    joint = joint / total
    rows, cols = joint.sum(1, keepdims=True), joint.sum(0, keepdims=True)
    inside = joint > 0
    return float((joint[inside] * np.log2(joint[inside] / (rows @ cols)[inside])).sum())


def index_recall(target: torch.Tensor, selected: torch.Tensor, reachable: torch.Tensor, k: int) -> dict:
    """How well a selection of compressed positions covers what full attention attends to.

    target [s, T]: each query's attention over the compressed positions (heads averaged);
    selected [s, k'] the positions the indexer chose (-1: none); reachable [s]. Over the queries
    that reach more than k positions (fewer are taken whole): recall, the fraction of the target's
    top-k the selection holds; mass, the target's probability on the selection; chance, k /
    reachable (a random k of the reachable positions: its expected recall and mass alike)."""
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
    counts, values = np.asarray(counts), np.asarray(values, dtype=np.float64)
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


def expected_affinity_spread(sigmas: Sequence[float], n_experts: int, score_func: str, samples: int = 4096,
                             seed: int = 0) -> list[float]:
    """The affinity spread a router would show whose logits over the `n_experts` were independent
    normal draws of standard deviation sigma, through the score function `score_func`: a curve to read
    the measured spread against its logit scale (fixed seed, `samples` tokens per sigma)."""
    from .moe import expert_scores

    unit = torch.randn(samples, n_experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return [float(spread(expert_scores(unit * float(s), score_func).numpy()).mean()) for s in sigmas]


def spread_given_token(ids: Sequence[int], chosen: np.ndarray, n_experts: int, min_count: int) -> tuple[Optional[float], int]:
    """Mean over the token ids seen at least `min_count` times of the spread of the experts that id
    chose (its positions pooled), with how many ids counted (None and 0 when none is that frequent).
    `chosen` [positions, k]. A router that sends every occurrence of an id to the same k experts
    gives log k / log E."""
    ids = np.asarray(ids)
    values, counts = np.unique(ids, return_counts=True)
    frequent = values[counts >= min_count]
    per_id = [float(spread(np.bincount(chosen[ids == i].reshape(-1), minlength=n_experts))) for i in frequent]
    return (float(np.mean(per_id)) if per_id else None), len(per_id)


def routing_study(model, texts: Sequence[str], tokens: int) -> dict:
    """Per MoE layer, over each text's first `tokens` prompt ids run as one prefill:
    affinity_spread (mean over tokens of the entropy of its normalized router affinities / log E:
    how sharply a token prefers some experts), logit_std (mean over tokens of its router logits'
    standard deviation over the experts: the scale the spread follows, `expected_affinity_spread`),
    token_spread (`spread_given_token` with MIN_CLASS_TOKENS, its floor log k / log E as
    token_spread_floor), load_spread (entropy of the experts' load over one
    text / log E, notebook 05's balance measure, averaged over texts), class_share [class][expert]
    (the fraction of a class's tokens that chose the expert; a row sums to top-k),
    mutual_information_bits (between a token's class and each expert it chose), max_class_share
    (the largest entry of class_share among classes of at least MIN_CLASS_TOKENS tokens, with its
    class and expert; top-k / E if routing ignored the class) and class_tokens."""
    cfg = model.cfg
    n_experts, top_k = cfg.n_routed_experts, cfg.n_activated_experts
    joint: dict[int, np.ndarray] = {}
    load_spread: dict[int, list[float]] = {}
    router = _Router()
    chosen_by_layer: dict[int, list[np.ndarray]] = {}
    all_ids: list[int] = []
    class_tokens = np.zeros(len(TOKEN_CLASSES), dtype=np.int64)
    for text in texts:
        ids = prompt_ids(model, text, tokens)
        classes = token_classes(model, ids)
        trace = ForwardTrace()
        model.reset()
        with model.sites.hooks({"layers.*.ffn": router}):
            model(torch.tensor([ids]), 0, trace=trace)
        model.reset()
        all_ids += ids
        for c in classes:
            if c is not None:
                class_tokens[c] += 1
        for layer, rec in trace.routing_by_layer().items():
            chosen = rec["expert_ids"][0].numpy()  # [s, k]
            chosen_by_layer.setdefault(layer, []).append(chosen)
            table = joint.setdefault(layer, np.zeros((len(TOKEN_CLASSES), n_experts), dtype=np.int64))
            for c, row in zip(classes, chosen):
                if c is not None:
                    np.add.at(table[c], row, 1)
            load = np.bincount(chosen.reshape(-1), minlength=n_experts)
            load_spread.setdefault(layer, []).append(float(spread(load)))
    layers = sorted(joint)
    given = {layer: spread_given_token(all_ids, np.concatenate(chosen_by_layer[layer]), n_experts, MIN_CLASS_TOKENS)
             for layer in layers}
    share = {layer: joint[layer] / np.maximum(class_tokens[:, None], 1) for layer in layers}
    counted = class_tokens >= MIN_CLASS_TOKENS  # a class of a few tokens would show a share of 1 by chance
    best = {layer: np.unravel_index(int(np.where(counted[:, None], share[layer], -1).argmax()), share[layer].shape)
            for layer in layers}
    return {
        "layers": layers, "n_experts": n_experts, "top_k": top_k, "texts": len(texts), "tokens": tokens,
        "classes": list(TOKEN_CLASSES), "class_tokens": class_tokens.tolist(),
        "affinity_spread": [float(np.concatenate(router.spread[layer]).mean()) for layer in layers],
        "logit_std": [float(np.concatenate(router.logit_std[layer]).mean()) for layer in layers],
        "token_spread": [given[layer][0] for layer in layers], "token_spread_ids": [given[layer][1] for layer in layers],
        "token_spread_floor": math.log(top_k) / math.log(n_experts),
        "load_spread": [float(np.mean(load_spread[layer])) for layer in layers],
        "class_share": [share[layer].tolist() for layer in layers],
        "mutual_information_bits": [mutual_information(joint[layer]) for layer in layers],
        "max_class_share": [float(share[layer][best[layer]]) for layer in layers],
        "max_class_share_at": [[TOKEN_CLASSES[int(best[layer][0])], int(best[layer][1])] for layer in layers],
        "uniform_class_share": top_k / n_experts, "min_class_tokens": MIN_CLASS_TOKENS}


# ---------------------------------------------------------------------- b: Engram gates
def ngram_counts(stream: np.ndarray, base: int, n: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """The distinct n-grams of a token stream (ids below `base`) as keys (int64, sorted: the ids
    read as digits in base `base`) and their counts."""
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
    (`ngram_counts` of a stream whose largest id + 1 is `base`) -> [len(ids) - n + 1]."""
    ids = np.asarray(ids, dtype=np.int64)
    keys = np.zeros(len(ids) - n + 1, dtype=np.int64)
    for i in range(n):
        keys = keys * base + ids[i : len(ids) - n + 1 + i]
    distinct, counts = table
    at = np.searchsorted(distinct, keys).clip(0, max(len(distinct) - 1, 0))
    found = (distinct[at] == keys) if len(distinct) else np.zeros(len(keys), dtype=bool)
    return np.where(found, counts[at] if len(distinct) else 0, 0)


def counting_stream(model, docs: dict[str, str], every: int = 1) -> np.ndarray:
    """Every `every`-th document of `docs` (sorted by name) tokenized by the model's tokenizer,
    an EOS after each: the text n-gram frequencies are counted on."""
    from .train.data import encode_documents

    names = sorted(docs)[::every]
    return encode_documents(model.tokenizer, {name: docs[name] for name in names}, int(model.cfg.eos_token_id))


def engram_study(model, texts: Sequence[str], tokens: int, stream: np.ndarray) -> dict:
    """Per Engram layer, the gate (mean over the hyper-connection copies) of every token after the
    first of each text, binned by how often its bigram (previous token, token) occurs in `stream`:
    per bin the tokens and mean gate; also the correlation of the gate with log(1 + count)."""
    base = max(int(np.max(stream)) + 1, model.cfg.vocab_size)
    table = ngram_counts(stream, base, 2)
    gates: dict[int, list[np.ndarray]] = {}
    counts: list[np.ndarray] = []
    for text in texts:
        ids = prompt_ids(model, text, tokens)
        trace = ForwardTrace()
        model.reset()
        model(torch.tensor([ids]), 0, trace=trace)
        model.reset()
        counts.append(lookup_counts(ids, table, base, 2))
        for layer, rec in trace.engram_by_layer().items():
            gates.setdefault(layer, []).append(rec["gate"][0, 1:].float().mean(-1).numpy())  # [s - 1]
    count = np.concatenate(counts)
    layers = sorted(gates)
    out = {"layers": layers, "ngram": 2, "counted_tokens": int(len(stream)), "tokens": int(len(count)),
           "bins": {}, "correlation_with_log_count": [], "mean_gate": []}
    for layer in layers:
        g = np.concatenate(gates[layer])
        out["bins"][str(layer)] = frequency_bins(count, g)
        out["mean_gate"].append(float(g.mean()))
        x = np.log1p(count.astype(np.float64))
        corr = float(np.corrcoef(x, g)[0, 1]) if x.std() > 0 and g.std() > 0 else 0.0
        out["correlation_with_log_count"].append(corr)
    return out


# ---------------------------------------------------------------------- c: indexer recall
def indexer_study(model, checkpoint: str, texts: Sequence[str], tokens: int) -> dict:
    """Per index-source layer (its own indexer: Full and Reindex layers), over each text's first
    `tokens` ids from position 0: the indexer's recall of full attention's top-k compressed
    positions (k = index_topk), the attention mass on its selection, and chance (k / reachable),
    averaged over the queries that reach more than k. Full attention is the twin's exact forward
    of `checkpoint` (`train.twin`), the same arithmetic as the loaded model's."""
    from .train.twin import Twin

    twin = Twin.from_checkpoint(checkpoint)
    k = model.cfg.index_topk
    per: dict[int, dict[str, list]] = {}
    for text in texts:
        ids = torch.tensor([prompt_ids(model, text, tokens)])
        model.hasher.reset()
        hashes = torch.as_tensor(model.hasher(ids))
        model.hasher.reset()
        with torch.no_grad():
            out = twin.forward(ids, hashes, index_loss=False, keep_targets=True)
        for layer, target in out.attention_target.items():
            ratio = model.cfg.compress_ratios[layer]
            reachable = (torch.arange(ids.size(1)) + 1) // ratio
            got = index_recall(target[0], out.selected[layer][0], reachable, k)
            row = per.setdefault(layer, {"recall": [], "mass": [], "chance": []})
            for name in row:
                row[name] += got[name]
    layers = sorted(per)
    return {"layers": layers, "k": k, "modes": [model.cfg.layer_mode(layer) for layer in layers],
            "compress_ratios": [model.cfg.compress_ratios[layer] for layer in layers],
            "queries": [len(per[layer]["recall"]) for layer in layers],
            **{name: [float(np.mean(per[layer][name])) if per[layer][name] else None for layer in layers]
               for name in ("recall", "mass", "chance")}}


# ---------------------------------------------------------------------- d: DSpark
def speculative_study(model, texts: Sequence[str], prompt_tokens: int, new_tokens: int, bins: int = 5) -> dict:
    """Speculative greedy decoding against plain greedy on each text's first `prompt_tokens` ids
    (`model` loaded with `Numerics.parity()`, where the two must agree token for token), the steps of
    every prompt pooled: acceptance by draft position, calibration of the confidence head, tokens
    per target forward, and per prompt whether the outputs are equal."""
    steps, equal = [], []
    for text in texts:
        ids = prompt_ids(model, text, prompt_tokens)
        plain = model.generate(ids, max_new_tokens=new_tokens, stop_at_eos=False)
        spec = model.generate(ids, max_new_tokens=new_tokens, stop_at_eos=False, speculative=True)
        equal.append(spec.ids == plain.ids)
        steps += spec.speculation.steps
    pooled = Speculation(steps)
    judged, accepted = pooled.judged_by_position()
    return {"prompts": len(texts), "new_tokens": new_tokens, "equal_to_plain": equal, "steps": len(steps),
            "tokens": pooled.tokens, "target_forwards": pooled.target_forwards,
            "tokens_per_forward": pooled.tokens_per_forward, "mean_accepted": pooled.mean_accepted,
            "judged_by_position": judged, "accepted_by_position": accepted,
            "acceptance_by_position": pooled.acceptance_by_position(), "calibration": pooled.calibration(bins),
            "block_size": model.cfg.dspark_block_size}


# ---------------------------------------------------------------------- e: expert cache
def cache_study(model, text: str, prompt_tokens: int, new_tokens: int,
                capacities: Sequence[int] = CACHE_CAPACITIES) -> dict:
    """A greedy generation from `text`'s first `prompt_tokens` ids with a trace, its routing
    replayed through LRU, LFU, static top-N and Belady at `capacities` (`cache_policy.policy_data`):
    the hit rate over all layers per policy and size, and the compulsory limit (every size)."""
    result = model.generate(prompt_ids(model, text, prompt_tokens), max_new_tokens=new_tokens,
                            stop_at_eos=False, trace=True)
    n_experts = model.cfg.n_routed_experts
    data = policy_data(result, capacities=sorted({*capacities, n_experts}), n_experts=n_experts, cfg=model.cfg)
    wanted = [data["capacities"].index(c) for c in capacities]
    return {"capacities": list(capacities), "policies": data["policies"], "policy_names": data["policy_names"],
            "hit_rate": {p: [data["hit_rate"][p][i] for i in wanted] for p in data["policies"]},
            "all_experts_hit_rate": data["hit_rate"]["lru"][data["capacities"].index(n_experts)],
            "lookups": sum(data["lookups"]), "distinct": sum(data["distinct"]), "tokens": data["tokens"],
            "generated": result.ids}


# ---------------------------------------------------------------------- f: prefill vs decode
def tie_study(model, ids: Sequence[int]) -> dict:
    """`ids` run as one prefill and one token per call (`generate.compare_prefill_decode`) under
    the model's numerics: where logits, greedy tokens, indexer selections and routing first part,
    and at the indexer's top-k cuts of the prefill how many queries were truncated, how many sat on
    an exact tie and the smallest gap between the k-th and (k+1)-th score relative to the k-th."""
    cmp = model.compare_prefill_decode(list(ids))
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
    return {"positions": cmp.positions, "numerics": cmp.numerics,
            "first_logit_divergence": cmp.first_logit_divergence,
            "first_argmax_divergence": cmp.first_argmax_divergence,
            "selection_parting": {str(k): v for k, v in cmp.selections.items()},
            "routing_parting": {str(k): v for k, v in cmp.routing.items()},
            "max_abs_diff": max(cmp.max_abs_diff), "max_abs_logit": cmp.max_abs_logit,
            "truncated_queries": truncated, "ties_at_cut": ties,
            "min_relative_gap": min(gaps) if gaps else None,
            "median_relative_gap": float(np.median(gaps)) if gaps else None}
