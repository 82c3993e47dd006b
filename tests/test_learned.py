"""The arithmetic of dsv41.learned on crafted inputs: token classes, spread, mutual information,
indexer recall and the n-gram frequency bins."""

import math

import numpy as np
import pytest
import torch

from dsv41 import learned


@pytest.mark.parametrize("text, cls", [
    ("    ", "whitespace"), ("\n", "whitespace"), ("\n        ", "whitespace"), (" def", "keyword"),
    ("return", "keyword"), ("match", "keyword"), (" self", "identifier"), ("ction", "identifier"),
    ("_x1", "identifier"), ("42", "digits"), (" 0", "digits"), ("):", "punctuation"), (" ==", "punctuation"),
    ("self.", "other"), ("é", "identifier"), ("1.5", "other")])
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
    assert learned.mutual_information(np.zeros((2, 2))) == 0.0


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
