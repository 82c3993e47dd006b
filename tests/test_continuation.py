"""A forward of any length at any position: chunked prefill equals one-shot prefill and
token-by-token decoding bit for bit under Numerics.parity(); rollback and snapshots continue
exactly as a sequence that never went further; a refused or failed call changes nothing."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv41
from dsv41.core.numerics import Numerics
from dsv41.generation.generate import generate
from dsv41.model import sequence

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def wide_window(tmp_path_factory, one_thread):
    """The tiny checkpoint written over a config with a 128-position window, so a window row
    spans more than one 64-column sparse_attn chunk (the released window)."""
    from dsv41.checkpoint import tiny
    from dsv41.core import config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "TINY", config.TINY.replace(window_size=128))
        path = tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("wide") / "ckpt", seed=0)
    model = dsv41.load(path, quiet=True, numerics=Numerics.parity())
    assert model.cfg.window_size == 128
    return model


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _in_chunks(model, ids, sizes) -> torch.Tensor:
    """Logits of every position, fed as consecutive chunks of `sizes` -> [len(ids), vocab]."""
    out, at = [], 0
    for size in sizes:
        out.append(model(torch.tensor([ids[at : at + size]]), at, all_positions=True)[0])
        at += size
    return torch.cat(out)


def _split(draw_sizes, n):
    sizes, left = [], n
    for size in draw_sizes:
        if left == 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    return sizes + ([left] if left else [])


@CASES
@given(sizes=st.lists(st.integers(1, 23), min_size=1, max_size=8), n=st.integers(2, 60), seed=st.integers(0, 99))
def test_any_chunking_equals_one_shot_prefill_and_decoding_under_parity(parity, sizes, n, seed):
    ids = _ids(n, seed)
    chunks = _split(sizes, n)
    one_shot = parity(torch.tensor([ids]), 0, all_positions=True)[0]
    assert torch.equal(_in_chunks(parity, ids, chunks), one_shot), chunks
    assert torch.equal(_in_chunks(parity, ids, [1] * n), one_shot)


def test_chunks_that_end_inside_a_group_or_outrun_the_window(parity):
    cfg = parity.cfg
    ids = _ids(3 * cfg.window_size + 5, 7)
    one_shot = parity(torch.tensor([ids]), 0, all_positions=True)[0]
    ratio = max(cfg.compress_ratios)
    # a chunk ending inside a compression group, then one longer than the window; then chunks
    # that each wrap the ring
    for chunks in ([1, ratio + 1, 2 * cfg.window_size + 1], [cfg.window_size + 3] * 2):
        chunks = chunks + [len(ids) - sum(chunks)]
        assert torch.equal(_in_chunks(parity, ids, chunks), one_shot), chunks


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(1, 70), min_size=2, max_size=5), seed=st.integers(0, 99))
def test_a_window_wider_than_one_attention_chunk_keeps_the_equality(wide_window, sizes, seed):
    ids = _ids(150, seed)
    one_shot = wide_window(torch.tensor([ids]), 0, all_positions=True)[0]
    assert torch.equal(_in_chunks(wide_window, ids, _split(sizes, len(ids))), one_shot)


def test_the_reference_arithmetic_parts_by_the_amount_reported(reference, capsys):
    # the reference has no chunked prefill: its window rows, stale index keys and top-k ties
    # depend on the call shape, so chunks part from one-shot prefill; how far is measured here
    ids = _ids(48, 3)
    one_shot = reference(torch.tensor([ids]), 0, all_positions=True)[0]
    chunked = _in_chunks(reference, ids, [5, 11, 32])
    delta = (chunked - one_shot).abs().amax(-1)
    with capsys.disabled():
        print(
            f"\nreference numerics, chunks 5+11+32 vs one-shot: max |dlogit| {delta.max():.3g}, "
            f"first parting at position {int(torch.nonzero(delta)[0]) if delta.any() else None}"
        )
    assert torch.isfinite(delta).all()
    # the first chunk is a prefill of its own (not of the 48 tokens: BLAS rounds a 5-row GEMM
    # differently from a 48-row one on some CPUs, so its rows need not equal one-shot's)
    assert torch.equal(chunked[:5], reference(torch.tensor([ids[:5]]), 0, all_positions=True)[0])
    # one chunk is exactly the one-shot prefill, one token per call exactly decoding
    assert torch.equal(_in_chunks(reference, ids, [48]), one_shot)


@CASES
@given(
    a=st.integers(1, 30),
    b=st.integers(1, 25),
    c=st.integers(1, 12),
    seed=st.integers(0, 99),
    b_in_one_call=st.booleans(),
    use_parity=st.booleans(),
)
def test_rollback_continues_as_if_the_sequence_never_went_further(
    parity, reference, a, b, c, seed, b_in_one_call, use_parity
):
    model = parity if use_parity else reference
    ids = _ids(a + b + c, seed)
    head, tail, other = ids[:a], ids[a : a + b], ids[a + b :]
    model(torch.tensor([head]), 0)
    want = model(torch.tensor([other]), a, all_positions=True)

    if b_in_one_call:
        model(torch.tensor([head + tail]), 0)  # a ends inside the call that is rolled back
    else:
        model(torch.tensor([head]), 0)
        for i, t in enumerate(tail):
            model(torch.tensor([[t]]), a + i)
    sequence.rollback(model, b)
    assert model.position == a and model.token_ids.tolist() == [head]
    assert torch.equal(model(torch.tensor([other]), a, all_positions=True), want)


def test_rollback_covers_group_flushes_and_ring_wraps(parity, reference):
    cfg = parity.cfg
    for model in (parity, reference):
        ratio, win = max(cfg.compress_ratios), cfg.window_size
        head = _ids(ratio + 1, 1)  # ends inside a compression group
        tail = _ids(2 * win + ratio, 2)  # flushes groups and wraps the window ring
        other = _ids(5, 3)
        model(torch.tensor([head]), 0)
        want = model(torch.tensor([other]), len(head), all_positions=True)
        model(torch.tensor([head]), 0)
        model(torch.tensor([tail]), len(head))
        sequence.rollback(model, len(tail))
        assert torch.equal(model(torch.tensor([other]), len(head), all_positions=True), want)


def test_rollback_reaches_back_as_far_as_the_calls_it_kept(tiny_checkpoint):
    model = dsv41.load(tiny_checkpoint, quiet=True, undo_calls=3)
    model(torch.tensor([_ids(6, 0)]), 0)
    for p in range(6, 12):
        model(torch.tensor([[5]]), p)
    assert sequence.rollback_limit(model) == 9  # the last 3 calls
    before = sequence.snapshot(model)
    with pytest.raises(ValueError, match="to position 9 at the earliest"):
        sequence.rollback(model, 4)
    assert model.position == 12  # a refused rollback changes nothing
    sequence.rollback(model, 3)
    assert model.position == 9
    sequence.restore(model, before)
    assert model.position == 12
    with pytest.raises(ValueError, match="rollback takes 0 to 12 positions"):
        sequence.rollback(model, 13)
    sequence.rollback(model, 12)
    assert model.position == 0


def test_snapshots_let_another_request_reuse_a_prefix(parity, reference):
    prefix, first, second = _ids(20, 4), _ids(6, 5), _ids(9, 6)
    parity(torch.tensor([prefix + second]), 0)
    want = parity(torch.tensor([[7]]), len(prefix) + len(second))
    parity(torch.tensor([prefix]), 0)
    shared = sequence.snapshot(parity)
    parity(torch.tensor([first]), len(prefix))
    sequence.restore(parity, shared)
    parity(torch.tensor([second]), len(prefix))
    assert torch.equal(parity(torch.tensor([[7]]), len(prefix) + len(second)), want)
    with pytest.raises(ValueError, match="another model"):
        sequence.restore(reference, shared)


def test_undo_records_and_snapshots_each_hold_what_they_need(parity):
    # an undo record: where its call started and ended, its ids to run again, the rows it may
    # overwrite; a snapshot: the whole sequence's ids and rows, and the undo records before it
    ids = _ids(12, 7)
    parity(torch.tensor([ids[:9]]), 0)
    parity(torch.tensor([ids[9:]]), 9)
    first, last = parity.undo_records
    assert isinstance(last, sequence.CallRecord) and (last.start, last.end) == (9, 12)
    assert last.ids.tolist() == [ids[9:]]
    assert [(rows.start, rows.end) for rows in last.attention.layers] == [(9, 12)] * parity.cfg.n_layers
    snap = sequence.snapshot(parity)
    assert isinstance(snap, sequence.Snapshot) and snap.position == 12 and snap.token_ids.tolist() == [ids]
    assert snap.undo == (first, last) and all(rows.start == 0 for rows in snap.attention.layers)
    assert repr(snap) == "Snapshot(position=12, batch=1, undo_calls=2)"


def _state(model) -> list[torch.Tensor]:
    return [t.clone() for t in model.backbone.buffers()] + [model.token_ids.clone()]


def test_a_refused_or_failed_call_leaves_the_sequence_as_it_was(reference, monkeypatch):
    model = reference
    model(torch.tensor([_ids(10, 8)]), 0)
    before, hashed = _state(model), model.hasher.state()
    with pytest.raises(ValueError, match="start_pos 4, but this sequence has 10 positions"):
        model(torch.tensor([[5, 6]]), 4)
    with pytest.raises(
        ValueError,
        match=f"positions 10 to {model.backbone.max_seq_len + 2} exceed max_seq_len {model.backbone.max_seq_len}",
    ):
        model(torch.tensor([_ids(model.backbone.max_seq_len - 7, 1)]), 10)
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(torch.tensor([[model.cfg.vocab_size]]), 10)

    def broken(*args, **kwargs):
        raise RuntimeError("a layer failed half way")

    monkeypatch.setattr(model.backbone.layers[5].ffn, "forward", broken)
    with pytest.raises(RuntimeError, match="half way"):
        model(torch.tensor([_ids(7, 9)]), 10)  # layers 0-4 wrote their caches before the failure
    monkeypatch.undo()
    after = _state(model)
    assert model.position == 10 and all(torch.equal(x, y) for x, y in zip(before, after))
    assert (model.hasher.state()[0] == hashed[0]).all() and model.hasher.state()[1] == hashed[1]


def test_generate_prefills_in_chunks_and_reuses_a_shared_prefix(parity):
    prompt = _ids(37, 11)
    whole = generate(parity, prompt, max_new_tokens=6, stop_at_eos=False)
    chunked = generate(parity, prompt, max_new_tokens=6, stop_at_eos=False, prefill_chunk=5)
    assert chunked.ids == whole.ids and whole.timings["reused_positions"] == 0
    # a second turn: the first turn's sequence (prompt + all but the last new token) is kept
    turn2 = whole.prompt_ids + whole.ids + _ids(9, 12)
    generate(parity, prompt, max_new_tokens=6, stop_at_eos=False)
    again = generate(parity, turn2, max_new_tokens=4, stop_at_eos=False, reuse_prefix=True)
    assert again.timings["reused_positions"] == len(prompt) + 5
    fresh = generate(parity, turn2, max_new_tokens=4, stop_at_eos=False)
    assert again.ids == fresh.ids
    # a prompt that parts early rolls back to the shared part when the undo record reaches it
    generate(parity, prompt, max_new_tokens=2, stop_at_eos=False)
    edited = prompt[:30] + _ids(5, 13)
    rerun = generate(parity, edited, max_new_tokens=3, stop_at_eos=False, reuse_prefix=True)
    assert rerun.timings["reused_positions"] == 30
    assert rerun.ids == generate(parity, edited, max_new_tokens=3, stop_at_eos=False).ids
    with pytest.raises(ValueError, match="prefill_chunk must be a whole number >= 1"):
        generate(parity, prompt, prefill_chunk=0)
