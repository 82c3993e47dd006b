"""Generation: greedy determinism and tie-breaking, seeded Gumbel-max sampling, prefill against
token-by-token decoding, the trace, and `dsv41 generate` on good and bad input."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from dsv41.app.cli import generate_main as cli_main
from dsv41.core.numerics import Numerics
from dsv41.generation.generate import (
    NonFiniteLogits,
    compare_prefill_decode,
    decode_n,
    decode_one,
    generate,
    prefill,
)
from dsv41.model.sampling import greedy, sample
from dsv41.model.trace import ForwardTrace
from dsv41.runtime.loader import load

pytestmark = pytest.mark.usefixtures("one_thread")
# the opt-ins under which a prefill and token-by-token decode share their arithmetic


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load(tiny_checkpoint, quiet=True)


@pytest.fixture(scope="module")
def parity_model(tiny_checkpoint):
    return load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())


# ---------------------------------------------------------------------- sampling
def test_greedy_breaks_ties_to_the_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0, 0.5]])
    assert greedy(logits).tolist() == [1, 0, 4]
    assert sample(logits, temperature=0.0).tolist() == [1, 0, 4]


def test_gumbel_max_is_seeded_and_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draw = lambda seed: [
        int(sample(logits, 1.0, g)) for g in [torch.Generator().manual_seed(seed)] for _ in range(4000)
    ]
    first, again = draw(7), draw(7)
    assert first == again  # the same seed reproduces the draws
    freq = torch.bincount(torch.tensor(first), minlength=4).float() / len(first)
    want = torch.softmax(logits[0], -1)
    assert torch.allclose(freq, want, atol=0.03)
    # temperature flattens: at T = 2 the rarest id shows up more often than at T = 1
    hot = [int(sample(logits, 2.0, g)) for g in [torch.Generator().manual_seed(7)] for _ in range(4000)]
    assert hot.count(3) > first.count(3)


# ---------------------------------------------------------------------- the verbs
def test_greedy_generation_is_deterministic(model):
    a = generate(model, "Once upon a time", max_new_tokens=6, stop_at_eos=False)
    b = generate(model, "Once upon a time", max_new_tokens=6, stop_at_eos=False)
    assert a.ids == b.ids and len(a.ids) == 6 and a.text == b.text == model.decode(a.ids)
    assert a.finish_reason == "length"
    assert a.prompt_ids == model.encode("Once upon a time") and a.prompt_ids[0] == model.cfg.bos_token_id
    assert set(a.timings) >= {"prefill_s", "decode_s", "per_token_s"} and len(a.timings["per_token_s"]) == 6
    # each token is the argmax of the logits the verbs return for the same sequence
    logits = prefill(model, a.prompt_ids)
    assert int(greedy(logits)) == a.ids[0]
    assert decode_n(model, a.ids[0], 5) == a.ids[1:]


def test_seeded_sampling_is_reproducible(model):
    run = lambda seed: (
        generate(model, "Once upon a time", max_new_tokens=5, temperature=1.5, seed=seed, stop_at_eos=False).ids
    )
    first = run(3)
    assert run(3) == first
    assert any(run(s) != first for s in (4, 5, 6))


def test_callback_sees_every_token_and_can_stop(model):
    seen = []

    def callback(step, token, logits):
        seen.append((step, token, tuple(logits.shape)))
        return step < 2  # stop after the third token

    result = generate(model, "Stop early", max_new_tokens=8, callback=callback, stop_at_eos=False)
    assert [s for s, _, _ in seen] == [0, 1, 2] and [t for _, t, _ in seen] == result.ids
    assert result.finish_reason == "callback" and seen[0][2] == (1, model.cfg.vocab_size)


# ---------------------------------------------------------------------- prefill against decode
def test_prefill_then_decode_equals_one_longer_prefill(parity_model):
    # 8 positions: no indexer, candidate-block or window top-k can truncate yet (index_topk 8,
    # 4 candidate blocks of 2, window 8), so under the parity options the two orders agree bit for bit
    model = parity_model
    ids = model.encode("Four score and seven years")[:8]
    assert len(ids) == 8
    whole = prefill(model, ids)
    prefill(model, ids[:5])
    for t in ids[5:]:
        last = decode_one(model, t)
    assert torch.equal(last, whole)

    report = compare_prefill_decode(model, ids)
    assert report.identical and report.first_argmax_divergence is None
    assert report.selections == {} and report.routing == {}
    assert report.max_abs_diff == [0.0] * 8
    assert report.numerics == Numerics.parity().as_dict()
    assert "window_layout='uniform'" in report.summary()


def test_reference_numerics_part_prefill_and_decode_by_rounding_only(model):
    # the same 8 untruncated positions with the reference's arithmetic: a decode step's float32
    # GEMMs take one row, which this machine's BLAS (MKL) computes with another kernel, so the
    # logits differ from the first position on (measured) -- by rounding: the stream between
    # sublayers is bf16, so the difference stays within a bf16 step of the logits' scale, and no
    # selection, routing or greedy token moves
    ids = model.encode("Four score and seven years")[:8]
    report = compare_prefill_decode(model, ids)
    assert report.numerics == Numerics().as_dict()
    assert not report.identical and report.first_logit_divergence == 0
    assert max(report.max_abs_diff) <= torch.finfo(torch.bfloat16).eps * report.max_abs_logit
    assert report.first_argmax_divergence is None
    assert report.selections == {} and report.routing == {}


def test_comparison_locates_where_truncation_begins(parity_model):
    model = parity_model
    ids = model.encode("A longer prompt, long enough that the indexer has to choose among its keys.")[:20]
    report = compare_prefill_decode(model, ids)
    assert report.positions == 20 and len(report.max_abs_diff) == 20
    # before any top-k can cut (position 8 at ratio 1), both orders agree exactly
    assert report.max_abs_diff[:8] == [0.0] * 8
    if not report.identical:
        assert report.first_logit_divergence >= 8
        partings = report.selection_partings | report.routing_partings
        assert all(p >= 8 for positions in partings.values() for p in positions)
        assert report.selections == {layer: ps[0] for layer, ps in report.selection_partings.items()}
    assert "position" in report.summary() or "bit for bit" in report.summary()
    assert model.position == 0  # left reset


# ---------------------------------------------------------------------- the trace
def test_trace_records_routing_engram_selections_and_margins(model):
    cfg = model.cfg
    result = generate(model, "Trace me", max_new_tokens=3, trace=True, stop_at_eos=False)
    n = len(result.prompt_ids) + 2  # positions that went through the model
    trace = result.trace
    routing = trace.routing()
    assert sorted(routing) == list(range(cfg.n_layers))
    for rec in routing.values():
        assert rec["expert_ids"].shape == (1, n, cfg.n_activated_experts)
        assert torch.allclose(rec["weights"].sum(-1), torch.full((1, n), cfg.route_scale), atol=1e-5)
        assert rec["positions"].tolist() == list(range(n))
    gates = trace.engram_gates()
    assert sorted(gates) == list(cfg.engram_layer_ids)
    assert all(
        g["gate"].shape == (1, n, cfg.hc_mult) and ((g["gate"] > 0) & (g["gate"] < 1)).all() for g in gates.values()
    )
    att = trace.attention()
    assert att[4]["selected"].shape[:2] == (1, n)  # ratio-1 full layer: indexer selections
    assert "candidate_blocks" in att[4]  # layer 4 is the candidate source
    assert len(trace.margins) == 3 and all(m >= 0 for m in trace.margins)
    assert [s.token for s in trace.steps] == result.ids
    assert len(trace.cache) == 3 and trace.cache[0]["seqlen"] == len(result.prompt_ids)
    for step in trace.cache:
        assert sorted(step["layers"]) == list(range(cfg.n_layers))
    json.dumps(trace.to_dict())  # plain data all the way down


# ---------------------------------------------------------------------- the command
def _run(capsys, *argv):
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generates_on_stdout_only(tiny_checkpoint, capsys, model):
    code, out, err = _run(
        capsys, "--checkpoint", tiny_checkpoint, "--prompt", "Once upon a time", "--max-new-tokens", "4", "--quiet"
    )
    assert code == 0 and err == ""
    expected = generate(model, "Once upon a time", max_new_tokens=4)
    assert out == expected.text + "\n"


def test_cli_rejects_an_empty_prompt(tiny_checkpoint, capsys):
    code, out, err = _run(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "", "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1 and "empty" in err


def test_cli_rejects_a_prompt_longer_than_the_context(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "short"
    shutil.copytree(tiny_checkpoint, folder)
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["text_config"]["max_position_embeddings"] = 16
    cfg_file.write_text(json.dumps(cfg))
    code, out, err = _run(capsys, "--checkpoint", str(folder), "--prompt", "word " * 40, "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1 and "longer than" in err and "16" in err


def test_cli_rejects_a_checkpoint_whose_audit_fails(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, folder)
    shard = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))[3]
    with open(folder / shard, "r+b") as f:
        f.truncate(os.path.getsize(folder / shard) // 2)
    code, out, err = _run(capsys, "--checkpoint", str(folder), "--prompt", "hello", "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1 and shard in err


def test_cli_rejects_a_tokenizer_that_disagrees_with_the_config(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "mismatch"
    shutil.copytree(tiny_checkpoint, folder)
    meta_file = folder / "tokenizer_config.json"
    meta = json.loads(meta_file.read_text())
    meta["eos_token"] = meta["pad_token"]  # the config says eos is id 1; this token is id 2
    meta_file.write_text(json.dumps(meta))
    code, out, err = _run(capsys, "--checkpoint", str(folder), "--prompt", "hello", "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1 and "disagree" in err


def test_cli_rejects_bad_numbers(tiny_checkpoint, capsys):
    code, _, err = _run(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "x", "--temperature", "-1")
    assert code == 1 and "temperature" in err
    code, _, err = _run(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "x", "--expert-device", "nonsense")
    assert code == 1 and "expert-device" in err and math.isfinite(code)


def test_a_run_that_exactly_fills_the_caches_is_allowed(tiny_checkpoint):
    small = load(tiny_checkpoint, quiet=True, max_seq_len=12)
    prompt = small.encode("The cat sat")[:4]
    assert len(prompt) == 4
    # 4 prompt positions + 8 fed-back tokens = 12; the 9th new token is sampled, never fed
    result = generate(small, prompt, max_new_tokens=9, stop_at_eos=False)
    assert len(result.ids) == 9
    with pytest.raises(ValueError, match="need 13 positions, more than max_seq_len 12"):
        generate(small, prompt, max_new_tokens=10, stop_at_eos=False)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "argv, kwargs, words",
    [
        (["--temperature", "nan"], dict(temperature=float("nan")), "temperature must be a finite number"),
        (["--temperature", "-1"], dict(temperature=-1.0), "temperature must be a finite number"),
        (["--temperature", "inf"], dict(temperature=float("inf")), "temperature must be a finite number"),
        (["--seed", str(2**64)], dict(seed=2**64), "seed must be a whole number in [0, 2**64)"),
        (["--seed", "-1"], dict(seed=-1), "seed must be a whole number in [0, 2**64)"),
        (["--max-new-tokens", "-3"], dict(max_new_tokens=-3), "max_new_tokens must be a whole number >= 0"),
    ],
)
def test_bad_sampling_arguments_get_one_sentence_in_python_and_from_the_cli(
    tiny_checkpoint, capsys, model, argv, kwargs, words
):
    code, out, err = _run(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "x", "--quiet", *argv)
    assert code == 1 and out == "" and err.count("\n") == 1 and words in err
    with pytest.raises(ValueError, match=re.escape(words)):
        generate(model, "x", **{"max_new_tokens": 2, **kwargs})


def test_an_empty_or_non_utf8_prompt_is_the_same_error_in_python_and_from_the_cli(tiny_checkpoint, capsys, model):
    for prompt, words in (("", "the prompt is empty"), ("caf\udce9", "the prompt is not valid UTF-8")):
        code, out, err = _run(capsys, "--checkpoint", tiny_checkpoint, "--prompt", prompt, "--quiet")
        assert code == 1 and out == "" and err.count("\n") == 1 and words in err
        with pytest.raises(ValueError, match=words):
            generate(model, prompt)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(model, [])


def test_a_non_utf8_argv_prompt_is_one_sentence(tiny_checkpoint):
    # a byte that is not UTF-8 reaches Python as a surrogate escape
    run = subprocess.run(
        [sys.executable, "-m", "dsv41", "generate", "--checkpoint", tiny_checkpoint, "--prompt", b"caf\xe9", "--quiet"],
        capture_output=True,
    )
    err = run.stderr.decode("utf-8", "replace")
    assert run.returncode == 1 and run.stdout == b"" and err.count("\n") == 1 and "not valid UTF-8" in err


def test_max_seq_len_must_be_positive(tiny_checkpoint, capsys):
    code, out, err = _run(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "x", "--max-seq-len", "0")
    assert code == 1 and out == "" and err.count("\n") == 1 and "--max-seq-len must be > 0" in err


def test_cli_names_the_flag_when_the_new_tokens_do_not_fit(tiny_checkpoint, capsys):
    code, out, err = _run(
        capsys,
        "--checkpoint",
        tiny_checkpoint,
        "--prompt",
        "The cat sat on the mat",
        "--max-seq-len",
        "4",
        "--max-new-tokens",
        "8",
        "--quiet",
    )
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "more than max_seq_len 4" in err and "(raise --max-seq-len)" in err


def _with_nan(tiny_checkpoint, tmp_path, name: str):
    """A copy of the tiny checkpoint whose tensor `name` holds one NaN (first element)."""
    import safetensors.torch as st

    folder = tmp_path / "nan"
    shutil.copytree(tiny_checkpoint, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index[name]
    tensors = st.load_file(shard)
    weight = tensors[name].clone()
    weight.view(-1)[0] = float("nan")
    tensors[name] = weight
    st.save_file(tensors, shard, metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize(
    "name, where",
    [("norm.weight", "the first non-finite output is head"), ("layers.3.attn_norm.weight", "layer 3's attention site")],
)
def test_nan_weights_stop_generation_naming_where_it_began(tiny_checkpoint, tmp_path, capsys, name, where):
    folder = _with_nan(tiny_checkpoint, tmp_path, name)
    broken = load(folder, quiet=True)
    with pytest.raises(NonFiniteLogits, match=re.escape(where)):
        generate(broken, "hello", max_new_tokens=3)
    assert broken.position == 0  # the diagnosis left the model reset
    code, out, err = _run(capsys, "--checkpoint", folder, "--prompt", "hello", "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1 and "NaN or Inf" in err and where in err


def test_finite_checks_record_every_site_and_change_nothing(model):
    ids = model.encode("Finite everywhere")
    plain = model(ids, 0)
    trace = ForwardTrace(check_finite=True)
    checked = model(ids, 0, trace=trace)
    assert torch.equal(plain, checked) and trace.first_non_finite() is None
    sites = [(r.layer, r.site) for r in trace.finite]
    engram = set(model.cfg.engram_layer_ids)
    want = [(None, "embedding")]
    for layer in range(model.cfg.n_layers):
        want += ([(layer, "engram")] if layer in engram else []) + [(layer, "attention"), (layer, "ffn")]
    assert sites == want + [(None, "head")]


def test_max_seq_len_beyond_the_config_is_refused_before_any_cache_is_sized(tiny_checkpoint, capsys):
    limit = load(tiny_checkpoint, quiet=True).cfg.max_seq_len
    with pytest.raises(ValueError, match=re.escape(f"max_seq_len must lie in [1, {limit}]")):
        load(tiny_checkpoint, quiet=True, max_seq_len=limit + 1)
    code, out, err = _run(capsys, "--checkpoint", tiny_checkpoint, "--prompt", "x", "--max-seq-len", str(10**12))
    assert code == 1 and out == "" and err.count("\n") == 1 and "max_position_embeddings" in err


def test_a_cache_that_is_a_file_is_one_sentence_where_the_cache_is_needed(
    tmp_path, monkeypatch, capsys, miniature_checkpoint
):
    from dsv41.checkpoint import tiny
    from dsv41.core.cachedir import CacheError

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "file"))
    monkeypatch.setattr(tiny, "_VERIFIED", set(), raising=False)
    with pytest.raises(CacheError, match="DSV41_CACHE") as caught:
        tiny.default_checkpoint()
    assert "\n" not in str(caught.value)
    # the embedded miniature is read where the package holds it: generating needs no cache folder
    code, out, err = _run(capsys, "--prompt", "x", "--quiet", "--max-new-tokens", "2")
    assert code == 0 and out.strip()


def test_cli_prefill_chunk_gives_the_same_text(tiny_checkpoint, capsys):
    args = [
        "--checkpoint",
        tiny_checkpoint,
        "--prompt",
        "A prompt long enough for a few chunks",
        "--quiet",
        "--numerics",
        "parity",
        "--max-new-tokens",
        "5",
    ]
    assert cli_main(args) == 0
    whole = capsys.readouterr().out
    assert cli_main(args + ["--prefill-chunk", "3"]) == 0
    assert capsys.readouterr().out == whole
    code, out, err = _run(capsys, *args, "--prefill-chunk", "0")
    assert code == 1 and out == "" and "prefill_chunk must be a whole number >= 1" in err and "--prefill-chunk" in err


def test_every_prompt_form_is_made_one_prompt_on_entry(model):
    from dsv41.generation.generate import as_prompt
    from dsv41.model.vision import TEXT, Prompt

    text = "The harbor at dawn"
    ids = model.encode(text)
    for given in (text, ids, torch.tensor(ids, dtype=torch.int32), model.prepare(text)):
        prompt = as_prompt(model, given)
        assert isinstance(prompt, Prompt) and prompt.ids == ids and not prompt.images
        assert set(prompt.token_types) == {TEXT}
    with pytest.raises(ValueError, match="images= goes with a text prompt"):
        as_prompt(model, ids, ["image.png"])
    with pytest.raises(ValueError, match="one list of whole numbers"):
        as_prompt(model, [ids])


def test_the_length_and_chunk_checks_the_cli_shares():
    from dsv41.generation.generate import check_length, check_prefill_chunk

    check_length(10, 3, 12)
    with pytest.raises(ValueError, match=r"need 13 positions, more than max_seq_len 12 \(raise --max-seq-len\)"):
        check_length(10, 4, 12, hint=" (raise --max-seq-len)")
    with pytest.raises(ValueError, match="the prompt is 20 tokens, longer than the model's 16-token maximum"):
        check_length(20, 1, 64, model_limit=16)
    check_prefill_chunk(None)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunk must be a whole number >= 1"):
            check_prefill_chunk(bad)


def test_one_sampler_draws_what_each_caller_drew_before():
    """Plain, speculative and draft sampling share sampling.py: the same noise stream and argmax as
    the formula each wrote out before (softmax(logits / T) divided by Exponential(1) noise)."""
    from dsv41.model import sampling

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    for temperature in (0.3, 1.0, 2.5):
        want_gen = torch.Generator().manual_seed(7)
        probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
        want = (probs / torch.empty_like(probs).exponential_(1.0, generator=want_gen)).argmax(dim=-1)
        got = sampling.sample(logits, temperature, torch.Generator().manual_seed(7))
        assert torch.equal(got, want)
        draft_probs = torch.softmax(logits / temperature, dim=-1, dtype=torch.float32)  # the draft stack's form
        assert torch.equal(sampling.probabilities(logits, temperature), draft_probs)
    assert torch.equal(sampling.sample(logits, 0.0), logits.argmax(dim=-1))


def test_chunk_sizes_cover_the_tokens_in_order():
    from dsv41.generation.generate import chunk_sizes

    assert chunk_sizes(10) == [10] and chunk_sizes(10, 3) == [3, 7] and chunk_sizes(10, 4, 4, 4) == [4, 4, 2]
    assert chunk_sizes(3, 1, 1, 1, 1) == [1, 1, 1] and chunk_sizes(5, 9) == [5] and chunk_sizes(0) == []
