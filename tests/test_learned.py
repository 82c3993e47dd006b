"""The arithmetic of dsv41.observe.learned on crafted inputs: token classes, spread, mutual information,
indexer recall and the n-gram frequency bins."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dsv41.core.errors import Dsv41Error
from dsv41.observe import learned


@pytest.mark.parametrize(
    "text, cls",
    [
        ("    ", "whitespace"),
        ("\n", "whitespace"),
        ("\n        ", "whitespace"),
        (" def", "keyword"),
        ("return", "keyword"),
        ("match", "keyword"),
        (" self", "identifier"),
        ("ction", "identifier"),
        ("_x1", "identifier"),
        ("42", "digits"),
        (" 0", "digits"),
        ("):", "punctuation"),
        (" ==", "punctuation"),
        ("self.", "other"),
        ("é", "identifier"),
        ("1.5", "other"),
    ],
)
def test_token_class(text, cls):
    assert learned.token_class(text) == cls


def test_spread_is_one_for_uniform_and_zero_for_one_expert():
    assert learned.spread(np.ones(16)) == pytest.approx(1.0)
    assert learned.spread(np.eye(4)[1]) == pytest.approx(0.0)
    # two of four equally: log 2 / log 4
    assert learned.spread(np.array([[0, 3, 3, 0], [1, 1, 1, 1]])).tolist() == pytest.approx([0.5, 1.0])


def test_mutual_information():
    assert learned.mutual_information(np.ones((3, 4))) == pytest.approx(0.0)
    # two classes, each on its own expert: one bit
    assert learned.mutual_information(np.array([[5, 0], [0, 5]])) == pytest.approx(1.0)
    # an empty table has no joint distribution: refused, not read as 0 bits ("independent")
    with pytest.raises(learned.LearnedError, match="holds no counts"):
        learned.mutual_information(np.zeros((2, 2)))


def test_index_recall_on_crafted_selections():
    k = 2
    target = torch.tensor([[0.1, 0.2, 0.7, 0.0], [0.4, 0.3, 0.2, 0.1], [1.0, 0.0, 0.0, 0.0]])
    selected = torch.tensor([[2, 1], [0, 3], [0, -1]])
    reachable = torch.tensor([3, 4, 2])  # the last reaches only k: taken whole, not counted
    got = learned.index_recall(target, selected, reachable, k)
    assert got["queries"] == 2
    assert got["recall"] == [1.0, 0.5]  # top-2 of row 0 is {2, 1}; of row 1 {0, 1}
    assert got["mass"] == pytest.approx([0.9, 0.5])
    assert got["chance"] == pytest.approx([2 / 3, 2 / 4])


def test_frequency_bins_and_ngram_counts():
    stream = np.array([1, 2, 1, 2, 1, 3])
    table = learned.ngram_counts(stream, base=4, n=2)
    counts = learned.lookup_counts([0, 1, 2, 1, 3, 3], table, base=4, n=2)
    assert counts.tolist() == [0, 2, 2, 1, 0]  # (0,1) never, (1,2) twice, (2,1) twice, (1,3) once, (3,3) never
    bins = learned.frequency_bins([0, 1, 2, 3, 5, 2000], [0.1, 0.2, 0.3, 0.5, 0.7, 0.9])
    assert bins["labels"][:4] == ["0", "1", "2-3", "4-15"] and bins["labels"][-1] == ">=1024"
    assert bins["n"] == [1, 1, 2, 1, 0, 0, 0, 1]
    assert bins["mean"][2] == pytest.approx(0.4) and bins["mean"][4] is None


def test_held_out_texts_come_from_the_held_out_split():
    from dsv41.train.corpus import load_corpus

    corpus = load_corpus()
    texts = learned.held_out_texts(3, chars=400, corpus=corpus)
    assert len(texts) == 3 and all(len(t) == 400 for t in texts)
    assert all(any(t in doc for doc in corpus.held_out.values()) for t in texts)
    assert learned.held_out_texts(3, chars=400, corpus=corpus) == texts


def test_expected_affinity_spread_falls_from_one_as_the_logits_spread():
    curve = learned.expected_affinity_spread([0.0, 0.5, 1.0, 2.0, 4.0, 8.0], 16, "sqrtsoftplus", samples=2048)
    assert curve[0] == pytest.approx(1.0)  # equal logits: equal affinities
    assert all(a > b for a, b in zip(curve, curve[1:]))
    # the same draws through softmax are sharper than through sqrtsoftplus at every scale past zero
    soft = learned.expected_affinity_spread([1.0, 2.0, 4.0], 16, "softmax", samples=2048)
    assert all(s < q for s, q in zip(soft, curve[2:5]))


def test_spread_given_token():
    ids = [5, 5, 5, 7, 7, 9]
    chosen = np.array([[0, 1], [0, 1], [0, 1], [2, 3], [0, 1], [3, 2]])  # id 5 always (0, 1); id 7 two pairs
    value, counted = learned.spread_given_token(ids, chosen, 4, min_count=2)
    assert counted == 2
    assert value == pytest.approx((0.5 + 1.0) / 2)  # log 2 / log 4 for id 5, uniform over 4 for id 7
    assert learned.spread_given_token(ids, chosen, 4, min_count=4) == (None, 0)


# ---------------------------------------------------------------------- bad input: one sentence, no numpy warnings
def _refused(call, match: str):
    """`call` raises LearnedError (a Dsv41Error and a ValueError) matching `match`."""
    with pytest.raises(learned.LearnedError, match=match) as info:
        call()
    assert isinstance(info.value, Dsv41Error) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


@pytest.mark.filterwarnings("error")
def test_spread_of_nothing_is_refused_not_read_as_one_expert():
    # before: -0.0 (reads as "one expert") with a RuntimeWarning
    _refused(lambda: learned.spread(np.zeros(4)), "all zero")
    _refused(lambda: learned.spread(np.array([[1.0, 2.0], [0.0, 0.0]])), "1 of 2 rows")
    _refused(lambda: learned.spread(np.zeros(0)), "at least 2 entries")
    _refused(lambda: learned.spread(np.ones(1)), "at least 2 entries")  # log 1 = 0
    _refused(lambda: learned.spread(np.float64(3.0)), "at least 2 entries")
    for bad in (-1.0, np.nan, np.inf):
        _refused(lambda: learned.spread(np.array([1.0, bad, 1.0])), "non-negative")
    _refused(lambda: learned.spread(np.array([1e308, 1e308])), "float64 range")
    # one entry is 0 and says so with a plus sign
    one = learned.spread(np.array([0.0, 5.0, 0.0]))
    assert one == 0.0 and math.copysign(1.0, one) == 1.0


@pytest.mark.filterwarnings("error")
def test_arithmetic_refuses_empty_and_bad_arguments():
    _refused(lambda: learned.mutual_information(np.zeros((0, 4))), "holds no counts")
    _refused(lambda: learned.mutual_information(np.array([1, 2])), "2-D count table")
    _refused(lambda: learned.mutual_information(np.array([[1, -1], [1, 1]])), "non-negative")
    target, reachable = torch.rand(3, 4), torch.tensor([3, 4, 2])
    # k = 0 was a ZeroDivisionError
    _refused(lambda: learned.index_recall(target, torch.zeros(3, 2, dtype=torch.long), reachable, 0), "k .* >= 1")
    _refused(lambda: learned.index_recall(target, torch.zeros(2, 2, dtype=torch.long), reachable, 2), "same queries")
    _refused(lambda: learned.frequency_bins([1, 2], [0.1]), "2 counts but 1 values")
    _refused(lambda: learned.frequency_bins([-1], [0.1]), "below the first bin edge")  # was silently dropped
    _refused(lambda: learned.frequency_bins([1], [0.1], edges=(0, 4, 2)), "strictly increasing")
    _refused(lambda: learned.frequency_bins([1], [0.1], edges=()), "strictly increasing")
    _refused(lambda: learned.ngram_counts(np.array([1, 2]), 4, n=0), "n-gram length")
    table = learned.ngram_counts(np.array([1, 2, 1]), 4)
    assert learned.lookup_counts([], table, 4).tolist() == [] == learned.lookup_counts([1], table, 4).tolist()
    _refused(lambda: learned.spread_given_token([1, 2], np.zeros((1, 2), dtype=int), 4, 1), "one row per id")
    _refused(lambda: learned.spread_given_token([1], np.zeros((1, 2), dtype=int), 4, 0), "min_count")
    assert learned.spread_given_token([], np.zeros((0, 2), dtype=int), 4, 1) == (None, 0)
    _refused(lambda: learned.expected_affinity_spread([1.0], 1, "sqrtsoftplus"), "n_experts")
    _refused(lambda: learned.expected_affinity_spread([1.0], 16, "sqrtsoftplus", samples=0), "samples")
    _refused(lambda: learned.expected_affinity_spread([float("nan")], 16, "sqrtsoftplus"), "sigmas")
    _refused(lambda: learned.held_out_texts(0), "held-out excerpts")
    _refused(lambda: learned.held_out_texts(2, chars=10**9), "no held-out Python file")
    _refused(lambda: learned.uniform_routing_loads(0, 16, 4), "n_tokens")
    _refused(lambda: learned.uniform_routing_loads(4, 4, 5), "more experts than exist")
    _refused(lambda: learned.class_expert_counts([0, 1], np.zeros((3, 2), dtype=int), 2, 4), "one row of chosen")
    _refused(lambda: learned.class_expert_counts([0, 5], np.zeros((2, 2), dtype=int), 2, 4), "token class")


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    import dsv41

    return dsv41.load(tiny_checkpoint, quiet=True)


@pytest.mark.filterwarnings("error")
def test_studies_refuse_no_texts_and_no_tokens(tiny_model, tiny_checkpoint):
    m, texts = tiny_model, ["def f(x):\n    return x + 1\n"]
    for study in (
        lambda t, n: learned.routing_study(m, t, n),
        lambda t, n: learned.indexer_study(m, t, n),
        lambda t, n: learned.engram_study(m, t, n, np.array([1, 2, 3])),
        lambda t, n: learned.speculative_study(m, t, n, 4),
    ):
        _refused(lambda: study([], 8), "no texts")  # was a concatenate error or an empty result
        _refused(lambda: study([""], 8), "non-empty string")
        _refused(lambda: study(texts, 0), ">= [12]")  # tokens=0 was "token ids must be whole numbers" (float ids)
        _refused(lambda: study(texts, -1), ">= [12]")  # -1 cut the last id silently
    _refused(lambda: learned.engram_study(m, texts, 1, np.array([1, 2, 3])), "tokens must be a whole number >= 2")
    _refused(lambda: learned.engram_study(m, texts, 8, np.zeros(0, dtype=np.int64)), "counting stream holds 0")
    _refused(lambda: learned.speculative_study(m, texts, 8, 0), "new_tokens")
    _refused(lambda: learned.speculative_study(m, texts, 0, 4), "prompt_tokens")
    _refused(lambda: learned.cache_study(m, texts[0], 0, 4), "prompt_tokens")
    _refused(lambda: learned.cache_study(m, texts[0], 8, 0), "new_tokens")
    _refused(lambda: learned.cache_study(m, texts[0], 8, 2, capacities=()), "capacities")
    _refused(lambda: learned.cache_study(m, texts[0], 8, 2, capacities=(2, 99)), "capacities")
    _refused(lambda: learned.tie_study(m, []), "no token ids")
    _refused(lambda: learned.prompt_ids(m, "x", 50, at_least=30), r"token id\(s\); this study needs at least 30")


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=5),
        elements=st.one_of(st.just(0.0), st.floats(-1.0, 1e3), st.just(np.nan), st.just(np.inf)),
    )
)
def test_spread_answers_any_array_with_a_value_in_range_or_one_sentence(p):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            h = np.asarray(learned.spread(p))
        except learned.LearnedError:
            return
    assert np.isfinite(h).all() and (h >= 0).all() and (h <= 1 + 1e-12).all()
    assert not np.signbit(h).any()


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.int64, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4), elements=st.integers(-2, 50))
)
def test_mutual_information_answers_any_table_with_bits_or_one_sentence(counts):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            bits = learned.mutual_information(counts)
        except learned.LearnedError:
            return
    assert counts.ndim == 2 and counts.min() >= 0 and counts.sum() > 0
    assert -1e-12 <= bits <= math.log2(min(counts.shape)) + 1e-12


# ---------------------------------------------------------------------- chance baselines
def test_class_expert_counts_and_the_shuffled_baseline():
    classes = [0, 0, 1, 1]
    chosen = np.array([[0, 1], [0, 1], [2, 3], [2, 3]])  # each class on its own two experts
    table = learned.class_expert_counts(classes, chosen, 2, 4)
    assert table.tolist() == [[2, 2, 0, 0], [0, 0, 2, 2]]
    assert learned.mutual_information(table) == pytest.approx(1.0)
    shuffled = learned.shuffled_mutual_information(classes, chosen, 2, 4, shuffles=64)
    assert shuffled < 1.0 and shuffled == learned.shuffled_mutual_information(classes, chosen, 2, 4, shuffles=64)
    # one class: every pairing is the same table, 0 bits
    assert learned.shuffled_mutual_information([0, 0, 0], chosen[:3], 1, 4) == pytest.approx(0.0, abs=1e-12)


def miller_madow_bits(n_classes: int, n_experts: int, n_tokens: int, top_k: int) -> float:
    """The plug-in estimate's expected bias when routing ignores the class: (R - 1)(C - 1) / (2 N ln 2)
    bits over N = tokens x k pairs, times (E - k) / (E - 1) since a token's k experts are distinct
    (drawn without replacement, which narrows each class's expert counts by that factor)."""
    return (
        (n_classes - 1) * (n_experts - 1) / (2 * n_tokens * top_k * math.log(2)) * (n_experts - top_k) / (n_experts - 1)
    )


@pytest.mark.parametrize("top_k", [1, 3])
def test_the_shuffled_baseline_is_the_plug_in_estimates_small_sample_bias(top_k):
    # routing that ignores the class: the shuffled baseline measures the estimate's bias
    rng = np.random.default_rng(7)
    n, n_classes, n_experts = 600, 4, 8
    classes = rng.integers(0, n_classes, n)
    chosen = np.argsort(rng.random((n, n_experts)), axis=1)[:, :top_k]  # k distinct experts a token
    assert learned.shuffled_mutual_information(classes, chosen, n_classes, n_experts) == pytest.approx(
        miller_madow_bits(n_classes, n_experts, n, top_k), rel=0.25
    )


def test_uniform_routing_loads_against_exact_values():
    loads = learned.uniform_routing_loads(7, 16, 4, draws=50)
    assert loads.shape == (50, 16) and (loads.sum(1) == 7 * 4).all() and (loads <= 7).all()
    assert (learned.uniform_routing_loads(7, 16, 4, draws=50) == loads).all()  # fixed seed
    one = learned.uniform_routing_loads(1, 16, 4, draws=20)  # one token: k experts with load 1
    assert ((one == 1).sum(1) == 4).all() and ((one == 0).sum(1) == 12).all()
    # two tokens, 2 of 4 experts each: the peak load is 1 only when the two pairs are disjoint;
    # the exact mean over all 36 equally likely pairs of pairs against the simulation
    pairs = list(itertools.combinations(range(4), 2))
    exact = np.mean([max(np.bincount(a + b, minlength=4)) for a, b in itertools.product(pairs, pairs)])
    peak = learned.uniform_routing_loads(2, 4, 2, draws=4000).max(1)
    assert exact == pytest.approx(11 / 6)
    assert abs(peak.mean() - exact) < 4 * peak.std() / math.sqrt(len(peak))


def test_lookahead_rebuilds_each_router_input_exactly_and_beats_chance():
    import dsv41

    model = dsv41.load(quiet=True)  # the trained miniature
    texts = learned.held_out_texts(2)
    r = learned.lookahead_study(model, texts, 48)
    assert r["exact_check"] == 1.0  # a layer's own router on the rebuilt input gives its recorded choice
    assert r["chance"] == model.cfg.n_activated_experts / model.cfg.n_routed_experts
    assert r["layers"] == list(range(1, model.cfg.n_layers))
    assert all(0.0 <= v <= 1.0 for v in r["early"] + r["late"])
    assert sum(r["early"]) / len(r["early"]) > r["chance"]  # a guess from the layer before beats a random one
    with pytest.raises(learned.LearnedError):
        learned.lookahead_study(model, [], 48)


def test_notebook_08_under_a_budget_too_small_for_its_models_is_one_sentence(tmp_path):
    from dsv41.checkpoint.miniature import embedded_checkpoint
    from dsv41.core.config import load_config
    from dsv41.runtime.report import predict_retained_bytes

    mini = embedded_checkpoint()
    dense = predict_retained_bytes(load_config(mini))["bytes"]
    learned.check_side_by_side([mini, mini], 2 * dense)  # two dense parts fit (the parity models share them)
    learned.check_side_by_side([mini, mini], None)  # no budget: nothing to check
    with pytest.raises(
        learned.LearnedError, match=r"^notebook 08 holds 2 checkpoints side by side: .*more than the memory budget"
    ):
        learned.check_side_by_side([mini, mini], 2 * dense - 1)


def test_studies_of_two_geometries_share_an_axis_and_pair_only_common_layers():
    a = {"layers": [0, 1, 2, 3], "x": [10, 11, 12, 13]}
    b = {"layers": [2, 3, 7], "x": [22, 23, 27]}
    ids, at = learned.shared_axis({"a": a, "b": b})
    assert ids == [0, 1, 2, 3, 7] and at == {"a": [0, 1, 2, 3], "b": [2, 3, 4]}
    assert learned.by_common_layer(a, b, "x") == [(12, 22), (13, 23)]
    same = {"layers": [0, 1], "x": [5, 6]}
    assert learned.shared_axis({"a": same, "b": same}) == ([0, 1], {"a": [0, 1], "b": [0, 1]})
    assert learned.by_common_layer(same, same, "x") == list(zip(same["x"], same["x"]))
