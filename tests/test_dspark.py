"""The DSpark draft stack and speculative decoding on the embedded checkpoint: the draft contract
(shapes, the anchor, the Markov chain of greedy choices), the draft rings through rollback and
snapshots, and speculative generation equal to plain greedy decoding under Numerics.parity(),
with acceptance, cuts and stops checked against an injected draft source whose proposals are
known to be right or wrong."""

import math

import pytest
import torch

import dsv41
from dsv41.core.numerics import Numerics
from dsv41.generation.conversation import chat
from dsv41.generation.generate import generate
from dsv41.generation.speculative import Speculation, SpeculationStep
from dsv41.model import sequence
from dsv41.runtime.report import MTP, ROUTED

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def f(x):\n    return x",
    "1 2 3 4 5 6 7 8 9",
    "a",
    "The harbor lights came on one by one as the ferry pulled away from the old stone pier.",
]


# ---------------------------------------------------------------------- loading
def test_every_mtp_tensor_is_accounted_for(reference):
    report = reference.report
    mtp = [n for n in report.tensors if n.startswith("mtp.")]
    assert mtp and all(report.tensors[n] in ("loaded", ROUTED) for n in mtp)
    assert {n for n in mtp if report.tensors[n] == ROUTED} == {n for n in mtp if ".ffn.experts." in n}
    params = {n for n, _ in reference.draft_stack.named_parameters()}
    assert params <= {n for n in mtp if report.tensors[n] == "loaded"}
    assert report.draft_bytes_retained == report.predicted_draft_bytes > 0  # measured = derived from the inventory
    off = dsv41.load(reference.report.checkpoint, quiet=True, dspark=False)
    assert off.draft_stack is None and off.report.draft_bytes_retained == 0
    assert all(off.report.tensors[n] == MTP for n in mtp)
    with pytest.raises(ValueError, match="no draft stack"):
        off.draft(5)


def test_the_stack_reads_the_configured_layers(reference):
    cfg = reference.cfg
    feeding = [b.layer for b in reference.backbone.layers if b.feeds_draft]
    assert feeding == sorted(cfg.dspark_target_layer_ids)
    reference(reference.encode("Once upon a time"), 0)
    hidden = reference.backbone.main_hidden
    assert hidden.shape == (1, len(reference.encode("Once upon a time")), cfg.dim * len(feeding))


def test_draft_with_the_stack_off_changes_no_logit(reference):
    off = dsv41.load(reference.report.checkpoint, quiet=True, dspark=False)
    ids = reference.encode(PROMPTS[-1])
    assert torch.equal(reference(ids, 0), off(ids, 0))
    assert torch.equal(reference([7], len(ids)), off([7], len(ids)))


# ---------------------------------------------------------------------- the draft contract
def test_draft_block_shapes_anchor_and_markov_chain(reference):
    cfg = reference.cfg
    logits = reference(reference.encode(PROMPTS[0]), 0)
    anchor = int(logits.argmax())
    block = reference.draft(anchor)
    n = cfg.dspark_block_size
    assert block.ids.dtype == torch.int64 and block.ids.shape == (1, n + 1)
    assert block.logits.dtype == torch.float32 and block.logits.shape == (1, n, cfg.vocab_size)
    assert block.confidence.dtype == torch.float32 and block.confidence.shape == (1, n)
    assert int(block.ids[0, 0]) == anchor
    # greedy: every proposal is the argmax of its row (Markov bias included)
    assert torch.equal(block.ids[0, 1:], block.logits[0].argmax(-1))
    # the confidence head reads [hidden, Markov embedding of the token before]: finite, one per row
    assert torch.isfinite(block.confidence).all()


def test_draft_is_a_function_of_the_state(reference):
    ids = reference.encode(PROMPTS[1])
    reference(ids, 0)
    first = reference.draft(11)
    again = reference.draft(11)
    assert torch.equal(first.logits, again.logits) and torch.equal(first.confidence, again.confidence)
    other = reference.draft(12)
    assert not torch.equal(first.logits, other.logits)  # the anchor is the block's first token


def test_draft_after_rollback_equals_a_fresh_sequence(parity):
    ids = parity.encode(PROMPTS[-1])
    parity(ids, 0)
    fresh = parity.draft(9)
    for token in (3, 4, 5, 6, 7, 8, 9, 10, 11, 12):  # past the 8-slot window: the rings wrap
        parity([token], parity.position)
    sequence.rollback(parity, 10)
    assert torch.equal(parity.draft(9).logits, fresh.logits)
    snap = sequence.snapshot(parity)
    parity([5, 6, 7], parity.position)
    sequence.restore(parity, snap)
    assert torch.equal(parity.draft(9).logits, fresh.logits)


def test_a_draft_needs_a_sequence(reference):
    reference.reset()
    with pytest.raises(ValueError, match="prompt first"):
        reference.draft(3)


def test_decode_feeds_the_rings_as_a_prefill_does(parity):
    """Under parity a prefill and the same tokens fed one at a time leave the same draft state."""
    ids = parity.encode(PROMPTS[-1])
    parity(ids, 0)
    whole = parity.draft(5)
    parity(ids[:1], 0)
    for at in range(1, len(ids)):
        parity(ids[at : at + 1], at)
    assert torch.equal(parity.draft(5).logits, whole.logits)


# ---------------------------------------------------------------------- speculative generation
@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_equals_plain_greedy_under_parity(parity, prompt):
    plain = generate(parity, prompt, max_new_tokens=20, stop_at_eos=False)
    for min_confidence in (0.0, 0.5):
        spec = generate(
            parity, prompt, max_new_tokens=20, stop_at_eos=False, speculative=True, min_confidence=min_confidence
        )
        assert spec.ids == plain.ids
        s = spec.speculation
        assert s.tokens == len(spec.ids) - 1  # the first token comes from the prefill
        assert s.target_forwards == sum(step.target_forwards for step in s.steps)


def _oracle(plain_all, k, wrong_offset=1, vocab=1024):
    """A draft source proposing the plain continuation: k right tokens, then a wrong one."""

    def source(model, anchor, n):
        start = model.position
        assert plain_all[start] == anchor
        right = plain_all[start + 1 : start + 1 + min(k, n)]
        proposals = list(right)
        if len(proposals) < n and start + 1 + len(proposals) < len(plain_all):
            proposals.append((plain_all[start + 1 + len(proposals)] + wrong_offset) % vocab)
        return proposals, [10.0] * len(proposals)

    return source


@pytest.mark.parametrize("k", range(0, 6))
def test_acceptance_is_exactly_the_number_of_right_proposals(parity, k):
    n_draft = parity.cfg.dspark_block_size
    prompt = PROMPTS[0]
    plain = generate(parity, prompt, max_new_tokens=30, stop_at_eos=False)
    plain_all = plain.prompt_ids + plain.ids
    spec = generate(
        parity,
        prompt,
        max_new_tokens=30,
        stop_at_eos=False,
        speculative=True,
        draft_source=_oracle(plain_all, k),
        draft_tokens=n_draft,
    )
    assert spec.ids == plain.ids
    steps = spec.speculation.steps
    for step in steps:
        full = min(k, n_draft)
        if step.kept >= min(full + 1, n_draft):  # not cut by the budget: judged in full
            assert step.accepted == full
        assert step.accepted == min(step.kept, full)
        assert step.target_forwards == 1  # a rejection cuts the verify short in place: no second forward
    assert len(steps) >= 3


def test_a_block_is_cut_by_the_token_budget_and_max_seq_len(tiny_checkpoint):
    model = dsv41.load(tiny_checkpoint, quiet=True, numerics=Numerics.parity(), max_seq_len=24)
    prompt = model.encode(PROMPTS[0])
    budget = 24 - len(prompt) + 1  # every position used, the last token never fed
    plain = generate(model, prompt, max_new_tokens=budget, stop_at_eos=False)
    plain_all = plain.prompt_ids + plain.ids
    spec = generate(
        model, prompt, max_new_tokens=budget, stop_at_eos=False, speculative=True, draft_source=_oracle(plain_all, 5)
    )
    assert spec.ids == plain.ids and len(spec.ids) == budget
    assert model.position <= 24
    last = spec.speculation.steps[-1]
    assert last.kept < last.drafted or last.kept == 0 or last.position + last.kept + 1 <= 24
    for n in (1, 2, 3, 7):
        short = generate(
            model, prompt, max_new_tokens=n, stop_at_eos=False, speculative=True, draft_source=_oracle(plain_all, 5)
        )
        assert short.ids == plain.ids[:n]


def test_eos_inside_an_accepted_block_stops_there(parity):
    prompt = PROMPTS[2]
    plain = generate(parity, prompt, max_new_tokens=16, stop_at_eos=False)
    plain_all = plain.prompt_ids + plain.ids
    eos = plain.ids[6]  # pretend the 7th generated token ends the text
    first = plain.ids.index(eos)
    cfg = parity.cfg
    original = cfg.eos_token_id
    object.__setattr__(cfg, "eos_token_id", eos)
    try:
        stopped = generate(parity, prompt, max_new_tokens=16, speculative=True, draft_source=_oracle(plain_all, 5))
        plain_stopped = generate(parity, prompt, max_new_tokens=16)
    finally:
        object.__setattr__(cfg, "eos_token_id", original)
    assert stopped.ids == plain.ids[: first + 1] == plain_stopped.ids
    assert stopped.finish_reason == "eos"
    # the sequence holds the prompt and the generated tokens but the last, as plain decoding leaves it
    assert parity.position == len(plain.prompt_ids) + first
    assert parity.token_ids[0].tolist() == plain_all[: parity.position]


def test_speculation_summary_counts():
    steps = [
        SpeculationStep(10, 5, 5, 2, [2.0, 1.0, -1.0, 0.5, 0.5], 2, [1, 2, 3]),
        SpeculationStep(13, 5, 3, 3, [3.0, 3.0, 3.0, -4.0, 0.0], 1, [4, 5, 6, 7]),
        SpeculationStep(17, 5, 0, 0, [-3.0] * 5, 1, [8]),
    ]
    s = Speculation(steps)
    assert s.tokens == 8 and s.target_forwards == 4 and s.tokens_per_forward == 2.0
    assert s.mean_accepted == pytest.approx(5 / 3)
    # position 0 judged in two steps, both accepted; position 2: judged twice, accepted once
    assert s.acceptance_by_position() == [1.0, 1.0, 0.5, None, None]
    bins = s.calibration(bins=2)
    judged = [(2.0, True), (1.0, True), (-1.0, False), (3.0, True), (3.0, True), (3.0, True)]
    high = [a for c, a in judged if 1 / (1 + math.exp(-c)) >= 0.5]
    assert bins[1]["count"] == len(high) and bins[1]["accepted_fraction"] == sum(high) / len(high)
    assert bins[0]["count"] == 1 and bins[0]["accepted_fraction"] == 0.0


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"draft_tokens": 0}, "draft_tokens"),
        ({"draft_tokens": 99}, "draft_tokens"),
        ({"min_confidence": 1.5}, "min_confidence"),
        ({"min_confidence": "high"}, "min_confidence"),
    ],
)
def test_bad_speculative_requests_are_one_sentence(reference, kw, message):
    with pytest.raises(ValueError, match=message):
        generate(reference, "hi", max_new_tokens=4, speculative=True, **kw)


def test_reference_numerics_parting_is_reported(reference):
    """Under the reference numerics a verify of several tokens is not the same arithmetic as
    one-token steps; the run still completes and says what it did."""
    spec = generate(reference, PROMPTS[0], max_new_tokens=12, stop_at_eos=False, speculative=True)
    assert len(spec.ids) == 12 and spec.speculation.steps
    assert spec.timings["target_forwards"] == spec.speculation.target_forwards


def test_cutting_the_last_call_short_equals_running_the_kept_part(tiny_checkpoint):
    """rollback(rerun=False) keeps the rows the longer call computed; under parity they are the
    bytes a call of the kept part alone writes: every cache buffer, the draft rings, the next
    logits and drafts, across group boundaries and window wrap-around."""
    import random

    rng = random.Random(0)
    ids = [rng.randrange(3, 1000) for _ in range(40)]
    cut = dsv41.load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())
    rerun = dsv41.load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())
    window = cut.cfg.window_size
    for prefix, length in ((1, 2), (5, 3), (7, 6), (8, window), (9, 5), (16, 4), (23, 6)):
        for keep in range(1, length):
            for model, again in ((cut, False), (rerun, True)):
                model(ids[:prefix], 0)
                model(ids[prefix : prefix + length], prefix)
                assert sequence.rollback(model, length - keep, rerun=again) is again
            assert cut.position == rerun.position == prefix + keep
            assert torch.equal(cut.token_ids, rerun.token_ids)
            buffers = zip(
                list(cut.backbone.named_buffers()) + list(cut.draft_stack.named_buffers()),
                list(rerun.backbone.named_buffers()) + list(rerun.draft_stack.named_buffers()),
            )
            for (name, a), (_, b) in buffers:
                assert torch.equal(a, b), (prefix, length, keep, name)
            more = ids[prefix + keep : prefix + keep + 3]
            assert torch.equal(
                cut(more, cut.position, all_positions=True), rerun(more, rerun.position, all_positions=True)
            )
            assert torch.equal(cut.draft(7).logits, rerun.draft(7).logits)
    # a call longer than the window cannot be cut in place: its kept part runs again
    cut(ids[:3], 0)
    cut(ids[3 : 3 + window + 2], 3)
    assert sequence.rollback(cut, 2, rerun=False) is True


def test_the_command_decodes_speculatively(capsys, parity):
    from dsv41.app.cli import generate_main

    argv = [
        "--checkpoint",
        parity.report.checkpoint,
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "9",
        "--numerics",
        "parity",
    ]
    assert generate_main(argv + ["--quiet"]) == 0
    plain = capsys.readouterr().out
    assert generate_main(argv + ["--speculative", "--draft-tokens", "3", "--min-confidence", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == plain == generate(parity, "Once upon a time", max_new_tokens=9).text + "\n"
    assert "speculative:" in err and "target forwards" in err
    assert generate_main(argv + ["--speculative", "--temperature", "0.8", "--seed", "3", "--quiet"]) == 0
    sampled = capsys.readouterr().out
    assert generate_main(argv + ["--speculative", "--temperature", "0.8", "--seed", "3", "--quiet"]) == 0
    assert capsys.readouterr().out == sampled  # seeded: the same draws again
    assert generate_main(argv + ["--speculative", "--draft-tokens", "9", "--quiet"]) == 1
    assert "draft_tokens" in capsys.readouterr().err


def test_the_benchmark_measures_three_runs_of_the_same_tokens(tiny_checkpoint):
    from dsv41.bench import bench_speculative

    report = bench_speculative(tiny_checkpoint, prompt_tokens=5, decode_tokens=11, log=lambda line: None)
    runs = report["runs"]
    assert all(row["same_tokens"] for row in runs.values())
    assert runs["plain"]["forwards_per_token"] == 1.0
    best = runs["speculative (forced acceptance: best case)"]
    block = report["draft_block"]
    # every proposal right: one forward per block + 1 tokens (the last step cut by the budget)
    assert best["target_forwards"] == -(-11 // (block + 1))
    assert best["mean_accepted"] > 0


# ---------------------------------------------------------------------- sampling
def _chi2_quantile(df: int, level: float) -> float:
    """The chi-square distribution's `level` quantile, by bisection on its CDF (the regularized
    lower incomplete gamma function)."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        cdf = float(
            torch.special.gammainc(
                torch.tensor(df / 2, dtype=torch.float64), torch.tensor(mid / 2, dtype=torch.float64)
            )
        )
        lo, hi = (mid, hi) if cdf < level else (lo, mid)
    return lo


@pytest.mark.parametrize("draft", ["sampled", "certain"])
def test_the_rejection_rule_keeps_the_target_distribution(draft):
    """A proposal drawn from q (or a fixed one), judged against p, and the residual draw on
    rejection: the token that comes out is distributed as p (chi-square, fixed seed)."""
    from dsv41.generation.speculative import judge

    g = torch.Generator().manual_seed(0)
    vocab, draws = 6, 30000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
    counts = torch.zeros(vocab)
    for _ in range(draws):
        x = int(torch.multinomial(q, 1, generator=g)) if draft == "sampled" else 2
        ok, token = judge(p, q if draft == "sampled" else None, x, g)
        counts[x if ok else token] += 1
    expected = p * draws
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < _chi2_quantile(vocab - 1, 0.999), (statistic, counts.tolist(), expected.tolist())
    # and the test can tell: q itself (proposals taken as they come) is far from p
    if draft == "sampled":
        wrong = float(((q * draws - expected) ** 2 / expected).sum())
        assert wrong > _chi2_quantile(vocab - 1, 0.999)


def test_sampled_speculation_is_seeded_and_draws_its_drafts(parity):
    a = generate(
        parity,
        PROMPTS[0],
        max_new_tokens=14,
        stop_at_eos=False,
        speculative=True,
        temperature=0.9,
        seed=5,
        min_confidence=0.0,
    )
    b = generate(
        parity,
        PROMPTS[0],
        max_new_tokens=14,
        stop_at_eos=False,
        speculative=True,
        temperature=0.9,
        seed=5,
        min_confidence=0.0,
    )
    c = generate(
        parity,
        PROMPTS[0],
        max_new_tokens=14,
        stop_at_eos=False,
        speculative=True,
        temperature=0.9,
        seed=6,
        min_confidence=0.0,
    )
    assert a.ids == b.ids and a.ids != c.ids and len(a.ids) == 14
    assert all(0 <= t < parity.cfg.vocab_size for t in a.ids)
    parity(parity.encode(PROMPTS[0]), 0)
    block = parity.draft(5, temperature=0.9, generator=torch.Generator().manual_seed(1))
    assert block.probs.shape == block.logits.shape
    assert torch.allclose(block.probs.sum(-1), torch.ones(1, block.probs.size(1)))
    # with every proposal the target's most likely token at temperature -> 0, sampling accepts them all
    plain = generate(parity, PROMPTS[0], max_new_tokens=12, stop_at_eos=False)
    everything = plain.prompt_ids + plain.ids
    cold = generate(
        parity,
        PROMPTS[0],
        max_new_tokens=12,
        stop_at_eos=False,
        speculative=True,
        temperature=1e-6,
        draft_source=lambda m, anchor, n: (everything[m.position + 1 : m.position + 1 + n], [5.0] * n),
    )
    assert cold.ids == plain.ids and cold.speculation.mean_accepted > 0


def test_a_chat_reply_decoded_speculatively_is_the_plain_reply(parity):
    from dsv41.generation.conversation import Conversation

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    parity.reset()
    plain = chat(parity, messages, max_new_tokens=10, reuse_prefix=False)
    parity.reset()
    spec = chat(parity, messages, max_new_tokens=10, reuse_prefix=False, speculative=True)
    assert spec.raw == plain.raw and spec.generation.ids == plain.generation.ids
    assert spec.generation.speculation is not None
    parity.reset()
    turns = Conversation(parity, system="Be brief.", max_new_tokens=6, speculative=True)
    first = turns.send("Say something.")
    second = turns.send("And more?")
    assert first.generation.speculation is not None and second.generation.speculation is not None
