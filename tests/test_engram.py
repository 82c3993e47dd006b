"""Engram front end: layout, multipliers, compressed token map, hasher, CLI.

The released numbers are pinned as literals: a change that moves any of them would make every
Engram lookup read a different row of the 189 GiB of tables while nothing else fails.
"""

import dataclasses
import json

import numpy as np
import pytest

from dsv41.checkpoint.engram import (
    EngramError,
    EngramLayout,
    NgramHasher,
    bucket_load,
    build_compressed_token_map,
    cli_main,
    compute_hash_multipliers,
    engram_report,
    is_prime,
    normalize_token_text,
    poisson_rows,
    split_equality,
)
from dsv41.core.config import RELEASED, TINY, write_config_pair

RELEASED_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


# ---------------------------------------------------------------------- fixtures
def _fold_tokenizer():
    """A word-level tokenizer whose tokens fold under the Engram normalizer in known ways."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = [
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",  # 0..3; engram_pad_id is 2
        "Hello",
        "hello",
        "HELLO",  # 4..6  -> one key
        "café",
        "cafe",
        "CAFÉ",  # 7..9  -> one key
        "  x",
        " x",
        "x",  # 10..12 -> one key ("x")
        " ",
        "\t",
        "\n\n",  # 13..15 -> the lone space " "
        "\u0301",  # 16: a lone combining accent normalizes to nothing
        "<0xE2>",
        "<0xE3>",  # 17, 18: partial UTF-8 bytes, decode to U+FFFD
        "ﬁ",
        "fi",  # 19, 20: NFKC folds the ligature
        "world",
        "World",  # 21, 22
    ]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteFallback()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    return tok


@pytest.fixture(scope="module")
def fold_tokenizer():
    return _fold_tokenizer()


def _small_cfg(n_compressed, **changes):
    """The tiny geometry with its derived Engram fields filled in."""
    base = dataclasses.replace(TINY, engram_compressed_vocab_size=n_compressed)
    base = dataclasses.replace(base, engram_num_embeddings=EngramLayout.from_config(base).derived_num_embeddings)
    return dataclasses.replace(base, **changes)


def _identity_hasher(n=64, **changes):
    cfg = _small_cfg(n, **changes)
    return NgramHasher(cfg, np.arange(n), n)


def _slow_hash(hasher, rows):
    """Per-token scalar evaluation of the hash formula, in Python ints (the test's oracle).
    rows: lists of compressed ids, None for a dead token."""
    lay = hasher.layout
    out = np.zeros((len(rows), len(rows[0]), lay.n_layers, lay.n_hash_cols), dtype=np.int64)
    for b, row in enumerate(rows):
        for t in range(len(row)):
            for k in range(lay.n_layers):
                mult = [int(m) for m in hasher.multipliers[k]]
                value, blocked = 0, False
                for shift in range(lay.max_ngram_size):
                    blocked = blocked or t - shift < 0 or row[t - shift] is None
                    token = hasher.pad_id if blocked else row[t - shift]
                    value ^= token * mult[shift]
                    if shift:
                        for h in range(lay.n_heads):
                            c = (shift - 1) * lay.n_heads + h
                            out[b, t, k, c] = value % lay.flat_primes[k][c] + lay.offsets[k][c]
    return out


# ---------------------------------------------------------------------- primality
def test_is_prime_matches_a_sieve():
    limit = 30000
    sieve = np.ones(limit, dtype=bool)
    sieve[:2] = False
    for i in range(2, int(limit**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = False
    assert [is_prime(n) for n in range(limit)] == sieve.tolist()


@pytest.mark.parametrize(
    "n, expected",
    [
        (561, False),  # Carmichael number
        (3215031751, False),  # strong pseudoprime to bases 2, 3, 5, 7
        (3825123056546413051, False),  # strong pseudoprime to bases 2..23
        (2**61 - 1, True),
        (2**61 + 1, False),
        (16000057, True),
        (16000889, True),
        (16000000, False),
    ],
)
def test_is_prime_edge_cases(n, expected):
    assert is_prime(n) is expected


# ---------------------------------------------------------------------- layout
def test_released_layout_rows_and_primes():
    layout = EngramLayout.from_config(RELEASED)
    assert layout.derived_num_embeddings == (384006168, 384016682)
    assert layout.prime_range(0) == (16000057, 16000463)
    assert layout.prime_range(1) == (16000477, 16000889)
    assert layout.n_hash_cols == RELEASED.n_hash_cols == 24
    flat = [p for row in layout.flat_primes for p in row]
    assert len(flat) == len(set(flat)) == 48
    assert flat == sorted(flat)  # handed out in ascending order across both layers
    # no prime between engram_vocab_size and the first one, and none skipped inside the run
    assert not any(is_prime(n) for n in range(RELEASED.engram_vocab_size, flat[0]))
    assert [n for n in range(flat[0], flat[-1] + 1) if is_prime(n)] == flat
    assert layout.verify() == []


def test_layout_offsets_tile_each_table():
    layout = EngramLayout.from_config(RELEASED)
    for row, starts, rows in zip(layout.flat_primes, layout.offsets, layout.derived_num_embeddings):
        assert starts[0] == 0
        assert all(starts[c + 1] == starts[c] + row[c] for c in range(len(row) - 1))
        assert starts[-1] + row[-1] == rows


def test_tampered_row_count_is_reported():
    tampered = dataclasses.replace(RELEASED, engram_num_embeddings=(384006169, 384016682))
    problems = EngramLayout.from_config(tampered).verify()
    assert len(problems) == 1
    assert "384,006,169" in problems[0] and "384,006,168" in problems[0] and "layer 1" in problems[0]


def test_changed_head_count_changes_the_derivation():
    problems = EngramLayout.from_config(dataclasses.replace(RELEASED, engram_n_heads=7)).verify()
    assert EngramLayout.from_config(dataclasses.replace(RELEASED, engram_n_heads=7)).derived_num_embeddings == (
        336004849,
        336012883,
    )
    assert len(problems) == 2


def test_verify_catches_a_gap_and_a_reused_prime():
    layout = EngramLayout.from_config(RELEASED)
    starts = list(layout.offsets[0])
    starts[5] += 1
    gap = dataclasses.replace(layout, offsets=(tuple(starts), layout.offsets[1]))
    assert any("gap of 1" in p for p in gap.verify())
    primes = [list(map(list, layer)) for layer in layout.primes]
    primes[1][0][0] = primes[0][0][0]
    reused = dataclasses.replace(layout, primes=tuple(tuple(map(tuple, layer)) for layer in primes))
    assert any("used twice" in p for p in reused.verify())


def test_layout_without_declared_rows_is_derived():
    layout = EngramLayout.from_config(TINY)  # the tiny preset leaves engram_num_embeddings unset
    assert layout.declared_num_embeddings is None
    assert layout.flat_primes[0] == (1009, 1013, 1019, 1021, 1031, 1033)
    assert layout.derived_num_embeddings == (6126, 6332)
    assert layout.num_embeddings == layout.derived_num_embeddings
    assert [p for p in layout.verify() if "not set" in p]


def test_primes_start_at_the_vocabulary_size_inclusive():
    # the search for each bucket starts at engram_vocab_size itself, so a prime vocabulary size is
    # the first bucket; none of the released sizes is prime, so only a made-up one shows this
    layout = EngramLayout.from_config(dataclasses.replace(TINY, engram_vocab_size=1009))
    assert layout.flat_primes[0][:3] == (1009, 1013, 1019)


# ---------------------------------------------------------------------- multipliers
def test_released_multipliers():
    got = compute_hash_multipliers(RELEASED.engram_layer_ids, 4, RELEASED.engram_compressed_vocab_size)
    assert got.dtype == np.int64 and got.shape == (2, 4)
    assert got.tolist() == [RELEASED_MULTIPLIERS[1], RELEASED_MULTIPLIERS[14]]
    assert (got % 2 == 1).all()
    # bounded so that compressed_id * multiplier stays inside int64
    assert int(got.max()) * (RELEASED.engram_compressed_vocab_size - 1) < 2**63
    # the bound depends on the compressed vocabulary: one id more and every multiplier moves
    other = compute_hash_multipliers(RELEASED.engram_layer_ids, 4, RELEASED.engram_compressed_vocab_size + 1)
    assert (other != got).all()


# ---------------------------------------------------------------------- compressed token map
def test_normalizer_folding(fold_tokenizer):
    token_map, n = build_compressed_token_map(fold_tokenizer)
    assert token_map.shape == (fold_tokenizer.get_vocab_size(with_added_tokens=True),)
    assert token_map[4] == token_map[5] == token_map[6]  # case
    assert token_map[7] == token_map[8] == token_map[9]  # accents
    assert token_map[10] == token_map[11] == token_map[12]  # whitespace collapsed and stripped
    assert token_map[13] == token_map[14] == token_map[15]  # every whitespace run -> the lone space
    assert token_map[13] != token_map[12]
    assert token_map[19] == token_map[20]  # NFKC ligature
    assert token_map[21] == token_map[22]
    # a token that normalizes to nothing keeps its own text as key, apart from the lone space
    assert token_map[16] not in (token_map[13], token_map[12])
    # partial UTF-8 bytes both decode to U+FFFD; keyed by their raw strings they stay apart
    assert fold_tokenizer.decode([17]) == "\ufffd" == fold_tokenizer.decode([18])
    assert token_map[17] != token_map[18]
    assert n == 13
    # first-seen interning: ids appear in ascending order of first use and fill [0, n)
    first_use = [int(v) for i, v in enumerate(token_map) if v not in token_map[:i]]
    assert first_use == list(range(n))


def test_normalize_token_text():
    assert normalize_token_text("  Café\t\nAU  ") == "cafe au"
    assert normalize_token_text(" ") == " "
    assert normalize_token_text("\t\t") == " "
    assert normalize_token_text("") == ""


def test_tiny_tokenizer_folding():
    from dsv41.checkpoint.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    token_map, n = build_compressed_token_map(tok)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    assert token_map.shape == (vocab_size,) == (TINY.vocab_size,)
    assert sorted(set(token_map.tolist())) == list(range(n))
    assert n < vocab_size  # the learned tokens fold: case, accents, a leading space
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(vocab_size)]

    def ids_where(predicate):
        return [i for i, t in enumerate(texts) if predicate(t)]

    the = ids_where(lambda t: t.strip().lower() == "the")
    assert len(the) >= 2 and len({int(token_map[i]) for i in the}) == 1
    spaces = ids_where(lambda t: t != "" and t.strip(" \t\r\n") == "")
    assert len(spaces) >= 3 and len({int(token_map[i]) for i in spaces}) == 1
    assert normalize_token_text(texts[spaces[0]]) == " "
    # partial UTF-8 byte tokens all decode to U+FFFD but keep one compressed id each
    partial = ids_where(lambda t: "\ufffd" in t)
    assert len(partial) > 0 and len({int(token_map[i]) for i in partial}) == len(partial)
    # the special tokens (bos, eos, pad, noise, image) fold with nothing
    specials = [
        TINY.bos_token_id,
        TINY.eos_token_id,
        TINY.pad_token_id,
        TINY.dspark_noise_token_id,
        TINY.image_token_id,
    ]
    for i in specials:
        assert (token_map == token_map[i]).sum() == 1, texts[i]
    hasher = NgramHasher.from_tokenizer(_small_cfg(n), tok)
    assert hasher.pad_id == int(token_map[TINY.engram_pad_id])


# ---------------------------------------------------------------------- hasher
def test_hasher_refuses_a_compressed_size_mismatch(fold_tokenizer):
    cfg = _small_cfg(12)  # the tokenizer folds to 13
    with pytest.raises(EngramError, match=r"13 .* 12|12 .* 13"):
        NgramHasher.from_tokenizer(cfg, fold_tokenizer)
    with pytest.raises(EngramError, match="13"):
        NgramHasher.from_tokenizer(TINY, fold_tokenizer)  # compressed size not set at all
    hasher = NgramHasher.from_tokenizer(_small_cfg(13), fold_tokenizer)
    assert hasher.pad_id == 2


def test_released_hash_ids_pinned():
    n = RELEASED.engram_compressed_vocab_size
    hasher = NgramHasher(RELEASED, np.arange(n), n)
    got = hasher.hash_ids([[0, 1, 2, 3, n - 1]])
    assert got.shape == (1, 5, 2, 24) and got.dtype == np.int64
    assert got[0, :, :, ::8].tolist() == [
        [[5702652, 131476717, 257520185], [14361964, 132225184, 261362261]],
        [[15045429, 128992384, 261145562], [7992263, 128857751, 270522411]],
        [[1537838, 128329175, 259846505], [7088792, 132892422, 266298694]],
        [[7010988, 129446738, 262357271], [13250800, 138740953, 264875203]],
        [[14043735, 137685179, 257977333], [10359234, 129631616, 268140275]],
    ]
    np.testing.assert_array_equal(got, _slow_hash(hasher, [[0, 1, 2, 3, n - 1]]))


def test_hasher_matches_the_scalar_formula_with_dead_tokens():
    hasher = _identity_hasher()
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 64, size=(2, 40))
    mask = rng.random((2, 40)) > 0.2
    got = hasher.hash_ids(ids, mask)
    rows = [[int(t) if m else None for t, m in zip(r, mr)] for r, mr in zip(ids, mask)]
    np.testing.assert_array_equal(got, _slow_hash(hasher, rows))


def test_hash_ids_fall_inside_their_buckets():
    n = RELEASED.engram_compressed_vocab_size
    hasher = NgramHasher(RELEASED, np.arange(n), n)
    ids = np.random.default_rng(0).integers(0, n, size=(2, 2000))
    got = hasher.hash_ids(ids, np.random.default_rng(1).random((2, 2000)) > 0.05)
    starts = np.array(hasher.layout.offsets)
    ends = starts + np.array(hasher.layout.flat_primes)
    assert (got >= starts).all() and (got < ends).all()
    assert (got.max(axis=(0, 1, 3)) < np.array(RELEASED.engram_num_embeddings)).all()


def test_prefill_then_decode_equals_one_call():
    hasher = _identity_hasher()
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 64, size=(3, 37))
    mask = rng.random((3, 37)) > 0.15
    whole = hasher.hash_ids(ids, mask)
    hasher.reset()
    cuts = [0, 1, 2, 9, 10, 25, 37]
    chunks = [hasher.hash_ids(ids[:, a:b], mask[:, a:b]) for a, b in zip(cuts, cuts[1:])]
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), whole)
    hasher.reset()
    steps = [hasher.hash_ids(ids[:, t : t + 1], mask[:, t : t + 1]) for t in range(37)]
    np.testing.assert_array_equal(np.concatenate(steps, axis=1), whole)
    assert hasher.n_positions == 37
    # without reset the look-back continues; with it, the sequence starts over
    hasher.reset()
    first = hasher.hash_ids(ids[:, :4])
    again = hasher.hash_ids(ids[:, :4])
    assert not np.array_equal(first, again)
    hasher.reset()
    np.testing.assert_array_equal(hasher.hash_ids(ids[:, :4]), first)


def test_dead_tokens_are_sticky():
    hasher = _identity_hasher()
    seq = [11, 12, 13, 14, 15, 16, 17]
    mask = [True, True, True, False, True, True, True]
    got = hasher.hash_ids([seq], [mask])[0]
    hasher.reset()
    fresh = hasher.hash_ids([[15, 16, 17]])[0]  # the tokens after the dead one, as a new sequence
    # after the dead token, every n-gram that would reach it sees pad instead, including the longer
    # n-grams whose own oldest token (before the dead one) is alive
    np.testing.assert_array_equal(got[4:], fresh)
    hasher.reset()
    all_pad = hasher.hash_ids([[2, 2, 2, 2]])[0, 3]  # a window of nothing but the pad id
    np.testing.assert_array_equal(got[3], all_pad)  # a dead token's own n-grams are all pad
    hasher.reset()
    alive = hasher.hash_ids([seq])[0]
    np.testing.assert_array_equal(got[:3], alive[:3])  # nothing before the dead token changes
    assert not np.array_equal(got[4:], alive[4:])


def test_dead_token_at_a_chunk_boundary_stays_dead():
    hasher = _identity_hasher()
    seq, mask = [[5, 6, 7, 8, 9, 10]], [[True, True, False, True, True, True]]
    whole = hasher.hash_ids(seq, mask)
    hasher.reset()
    split = np.concatenate(
        [
            hasher.hash_ids([s[:3] for s in seq], [m[:3] for m in mask]),
            hasher.hash_ids([s[3:] for s in seq], [m[3:] for m in mask]),
        ],
        axis=1,
    )
    np.testing.assert_array_equal(split, whole)


def test_missing_history_is_the_pad_id():
    hasher = _identity_hasher()
    x = 33
    at_start = hasher.hash_ids([[x]])[0, 0]
    hasher.reset()
    after_pads = hasher.hash_ids([[2, 2, 2, x]])[0, 3]  # engram_pad_id 2 maps to compressed 2
    np.testing.assert_array_equal(at_start, after_pads)
    hasher.reset()
    after_other = hasher.hash_ids([[3, 3, 3, x]])[0, 3]
    assert (after_other != at_start).any()


def test_batch_rows_are_independent():
    hasher = _identity_hasher()
    ids = np.random.default_rng(5).integers(0, 64, size=(4, 20))
    mask = np.ones_like(ids, dtype=bool)
    mask[2, 7] = False
    batched = hasher.hash_ids(ids, mask)
    for b in range(4):
        hasher.reset()
        np.testing.assert_array_equal(hasher.hash_ids(ids[b : b + 1], mask[b : b + 1]), batched[b : b + 1])
    hasher.reset()
    np.testing.assert_array_equal(hasher.hash_ids(ids[0]), batched[0])  # 1-D input is one sequence


def test_batch_size_change_needs_reset():
    hasher = _identity_hasher()
    hasher.hash_ids(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(EngramError, match="reset"):
        hasher.hash_ids(np.zeros((3, 1), dtype=np.int64))
    hasher.reset()
    assert hasher.hash_ids(np.zeros((3, 1), dtype=np.int64)).shape == (3, 1, 2, 6)


def test_out_of_range_token_id_is_refused():
    hasher = _identity_hasher()
    with pytest.raises(EngramError, match="64"):
        hasher.hash_ids([[1, 64]])


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    hasher = _identity_hasher()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    mask = torch.tensor([[True, False, True, True, True]])
    got = hasher.hash_ids(ids, mask)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.shape == (1, 5, 2, 6)
    hasher.reset()
    np.testing.assert_array_equal(got.numpy(), hasher.hash_ids(ids.numpy(), mask.numpy()))


# ---------------------------------------------------------------------- split equality, bucket load
class _ForgetfulHasher(NgramHasher):
    """A broken hasher for negative controls: it drops the carried look-back before every call."""

    def hash_ids(self, token_ids, token_mask=None):
        self._history = None
        return super().hash_ids(token_ids, token_mask)


def test_split_equality_holds_for_every_split_and_catches_a_lost_look_back():
    hasher = _identity_hasher()
    rng = np.random.default_rng(11)
    ids = rng.integers(3, 64, size=12)  # no pad id (2): a lost look-back then always shows
    report = split_equality(hasher, ids)
    assert report["n_splits"] == 11 and report["equal"] == [True] * 11
    assert report["all_equal"] and report["first_unequal"] is None
    np.testing.assert_array_equal(report["whole"], _slow_hash(hasher, [ids.tolist()])[0])
    assert hasher.n_positions == 0  # left reset
    # batched, with a dead token
    batch = rng.integers(0, 64, size=(2, 9))
    mask = rng.random((2, 9)) > 0.2
    both = split_equality(hasher, batch, mask)
    assert both["all_equal"] and both["whole"].shape == (2, 9, 2, 6)
    hasher.reset()
    np.testing.assert_array_equal(both["whole"], hasher.hash_ids(batch, mask))
    # negative control: a hasher that forgets the carried ids fails from the first decode step on
    broken = _ForgetfulHasher(_small_cfg(64), np.arange(64), 64)
    bad = split_equality(broken, ids)
    assert not bad["all_equal"] and bad["first_unequal"] == 1 and not any(bad["equal"])


def test_bucket_load_counts_a_hand_made_layout():
    layout = _identity_hasher().layout
    cols, seq = layout.n_hash_cols, 3
    first_rows = np.array(layout.offsets)  # [layers, cols]: every position on its bucket's first row
    ids = np.broadcast_to(first_rows, (seq, layout.n_layers, cols)).copy()
    ids[2, 0, 1] += 5  # one position of layer 0, column 1 moves five rows down its bucket
    load = bucket_load(layout, ids)
    assert load["n_positions"] == seq and load["layer_ids"] == [1, 2] and load["inside_buckets"]
    zero, one = load["layers"]
    assert zero["rows"] == sum(layout.flat_primes[0]) == 6126
    assert zero["histogram"][:4] == [6126 - cols - 1, 1, 1, cols - 1]
    assert (zero["rows_used"], zero["max_load"], zero["outside"]) == (cols + 1, 3, 0)
    assert zero["mean_load_used"] == pytest.approx(seq * cols / (cols + 1))
    assert one["histogram"][:4] == [6332 - cols, 0, 0, cols] and one["rows_used"] == cols
    for e in load["layers"]:
        assert sum(e["histogram"]) == e["rows"]
        assert sum(n * r for n, r in enumerate(e["histogram"])) == seq * cols
        assert len(e["histogram"]) == len(e["poisson"])
    # an id outside its column's bucket (here: inside the next column's) is reported, not counted
    ids[0, 1, 0] = layout.offsets[1][1]
    moved = bucket_load(layout, ids)
    assert not moved["inside_buckets"] and moved["layers"][1]["outside"] == 1
    assert sum(n * r for n, r in enumerate(moved["layers"][1]["histogram"])) == seq * cols - 1
    with pytest.raises(EngramError, match="hash ids must be"):
        bucket_load(layout, ids[None])


def test_poisson_expectation_is_the_closed_form():
    from math import exp, factorial

    primes, n = (101, 103), 150
    got = poisson_rows(n, primes, 6)
    assert got == pytest.approx([sum(p * exp(-n / p) * (n / p) ** c / factorial(c) for p in primes) for c in range(6)])
    tail = poisson_rows(n, primes)  # by default, until the expectation is below 1e-3 rows
    assert tail[-1] < 1e-3 <= tail[-2] and sum(tail) == pytest.approx(sum(primes), rel=1e-6)
    assert poisson_rows(0, (7,)) == [7.0, 0.0]
    # over a real hashing, the curve counts the same rows and the same positions as the histogram
    hasher = _identity_hasher()
    ids = np.random.default_rng(2).integers(0, 64, size=4000)
    for e in bucket_load(hasher.layout, hasher.hash_ids(ids))["layers"]:
        assert sum(e["poisson"]) == pytest.approx(e["rows"], rel=1e-6)
        assert sum(c * r for c, r in enumerate(e["poisson"])) == pytest.approx(4000 * 6, rel=1e-6)


# ---------------------------------------------------------------------- report and CLI
def _write_cfg(tmp_path, cfg, name="ckpt"):
    directory = tmp_path / name
    write_config_pair(cfg, str(directory))
    return str(directory)


def test_cli_released_config_passes(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli_main(["--config", _write_cfg(tmp_path, RELEASED), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "384,006,168" in text and "16,000,477" in text and str(RELEASED_MULTIPLIERS[14][0]) in text
    report = json.loads(out.read_text())
    assert report["problems"] == []
    assert [e["difference"] for e in report["layers"]] == [0, 0]
    assert report["layers"][0]["multipliers"] == RELEASED_MULTIPLIERS[1]
    assert round(report["layers"][0]["derived_gib"], 2) == 91.55


def test_cli_tampered_rows_fail_and_still_write_json(tmp_path, capsys):
    tampered = dataclasses.replace(RELEASED, engram_num_embeddings=(384006168, 384016683))
    out = tmp_path / "report.json"
    assert cli_main(["--config", _write_cfg(tmp_path, tampered), "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["layers"][1]["difference"] == 1
    assert any("384,016,683" in p for p in report["problems"])
    assert "[fail]" in capsys.readouterr().out


def test_cli_tokenizer_and_text(tmp_path, fold_tokenizer, capsys):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    fold_tokenizer.save(str(tok_dir / "tokenizer.json"))
    good = _write_cfg(tmp_path, _small_cfg(13), "good")
    out = tmp_path / "good.json"
    assert (
        cli_main(["--config", good, "--tokenizer", str(tok_dir), "--text", "Hello world café x", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["tokenizer"]["compressed_size"] == 13
    assert report["tokenizer"]["pad_compressed_id"] == 2
    assert report["text"]["token_ids"] == [4, 21, 7, 12]
    assert report["text"]["inside_tables"] is True
    assert np.array(report["text"]["hash_ids"]).shape == (4, 2, 6)
    capsys.readouterr()
    # a compressed size the tokenizer does not produce: exit 1, report written, both numbers named
    bad = _write_cfg(tmp_path, _small_cfg(14), "bad")
    out = tmp_path / "bad.json"
    assert cli_main(["--config", bad, "--tokenizer", str(tok_dir), "--text", "hello", "--json", str(out)]) == 1
    problems = json.loads(out.read_text())["problems"]
    assert any("13" in p and "14" in p for p in problems)


def test_cli_bad_config_path(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["--config", str(tmp_path / "missing"), "--json", str(out)]) == 1
    assert json.loads(out.read_text())["problems"]
    assert "missing" in capsys.readouterr().err


def test_report_without_compressed_size_is_a_problem():
    report = engram_report(TINY)
    assert any("engram_compressed_vocab_size" in p for p in report["problems"])
    assert [e["derived_rows"] for e in report["layers"]] == [6126, 6332]


def test_bench_reports_a_figure(capsys):
    assert cli_main(["--bench", "--bench-tokens", "512"]) == 0
    assert "512-token prompt" in capsys.readouterr().out


# ---------------------------------------------------------------------- CLI: arguments it cannot use
def _one_sentence(err: str, start: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines, err
    assert lines[-1].startswith(start), err
    return lines[-1]


@pytest.mark.parametrize("case", ["report", "bad config", "bench", "a folder"])
def test_cli_json_that_cannot_be_written_is_one_sentence(tmp_path, capsys, case):
    """Reproduces: --json /nonexistent/x.json was a FileNotFoundError traceback."""
    out = tmp_path / "no-such-folder" / "x.json"
    if case == "a folder":
        out = tmp_path
    args = {
        "report": ["--config", _write_cfg(tmp_path, RELEASED)],
        "bad config": ["--config", str(tmp_path / "missing")],
        "bench": ["--bench", "--bench-tokens", "64"],
        "a folder": ["--config", _write_cfg(tmp_path, RELEASED)],
    }[case]
    assert cli_main(args + ["--json", str(out)]) == 1
    line = _one_sentence(capsys.readouterr().err, f"dsv41 engram: --json {out}: ")
    assert "cannot write" in line


@pytest.mark.parametrize("value", ["0", "-1", str(10**9), "1048577", "many", "1.5"])
def test_bench_tokens_out_of_bounds_is_a_usage_error(capsys, value):
    """Reproduces: --bench-tokens 0 was a ZeroDivisionError, -1 a numpy traceback, 10**9 a 7.45 GiB
    allocation."""
    with pytest.raises(SystemExit) as stop:
        cli_main(["--bench", "--bench-tokens", value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--bench-tokens" in err and "from 1 to 1,048,576" in err and "Traceback" not in err, err


def test_bench_tokens_bound_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "1 to 1,048,576" in " ".join(capsys.readouterr().out.split())


def test_bench_at_the_bounds(capsys):
    assert cli_main(["--bench", "--bench-tokens", "1"]) == 0  # one token: one decode step, no division by 0
    assert "1-token prompt" in capsys.readouterr().out


def test_text_that_is_not_utf8_is_one_sentence(tmp_path, fold_tokenizer, capsys):
    """Reproduces: --text with bytes that are not UTF-8 (argv decodes them to lone surrogates) was a
    TypeError traceback from the tokenizer."""
    import subprocess
    import sys

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    fold_tokenizer.save(str(tok_dir / "tokenizer.json"))
    cfg = _write_cfg(tmp_path, _small_cfg(13))
    base = ["--config", cfg, "--tokenizer", str(tok_dir), "--text"]
    done = subprocess.run(
        [sys.executable, "-m", "dsv41", "engram", *base, b"Hello \xff world"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    line = _one_sentence(done.stderr, "dsv41 engram: error: argument --text: ")
    assert "UTF-8" in line and "\\xff" in line, line
    with pytest.raises(SystemExit) as stop:  # the same in-process, where argv holds the surrogate
        cli_main(base + ["Hello \udcff world"])
    assert stop.value.code == 2
    assert "UTF-8" in capsys.readouterr().err


def test_cli_refuses_impossible_sizes_before_the_prime_search(tmp_path, capsys):
    import time

    absurd = dataclasses.replace(RELEASED, engram_n_heads=2000)  # a prime search quadratic in the columns
    began = time.perf_counter()
    assert cli_main(["--config", _write_cfg(tmp_path, absurd)]) == 1
    assert time.perf_counter() - began < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "engram" in err
