"""What each mechanism is worth (`dsv41.observe.experiments`, `dsv41 ablate`): the held-out windows, the bits
a run costs, the paired bootstrap on crafted numbers, the study arithmetic and the command's files.
The studies' numbers on the miniature are held by notebook 09's test."""

import json
import math

import numpy as np
import pytest
import torch

import dsv41
from dsv41.app.cli import main
from dsv41.observe import experiments
from dsv41.observe.experiments import ExperimentError, HeldOut, compare, paired_bootstrap, verdict
from dsv41.observe.learned import TOKEN_CLASSES


@pytest.fixture(scope="module")
def model():
    return dsv41.load(quiet=True, max_batch_size=4, max_seq_len=64)  # the embedded miniature


@pytest.fixture(scope="module")
def windows(model):
    return experiments.held_out(model, 3, 32)


def test_the_windows_are_the_held_out_streams_evenly_spaced(model, windows):
    from dsv41.train.corpus import load_corpus
    from dsv41.train.data import encode_documents, token_byte_lengths

    stream = encode_documents(model.tokenizer, load_corpus().held_out, int(model.cfg.eos_token_id))
    assert windows.stream_tokens == len(stream)
    available = len(stream) // 32
    assert windows.starts == [(i * available) // 3 * 32 for i in range(3)]
    for row, start in enumerate(windows.starts):
        assert windows.targets[row].tolist() == stream[start : start + 32].tolist()
        assert windows.inputs[row].tolist() == [model.cfg.bos_token_id, *stream[start : start + 31].tolist()]
    assert np.array_equal(windows.nbytes, token_byte_lengths(model.tokenizer)[windows.targets.numpy()])
    assert set(np.unique(windows.classes)) <= set(range(-1, len(TOKEN_CLASSES)))
    with pytest.raises(ExperimentError, match="fewer than"):
        experiments.held_out(model, available + 1, 32)


def test_bits_are_the_targets_cross_entropy_and_an_identity_costs_nothing(model, windows):
    base = experiments.bits(model, windows)
    logits = model(windows.inputs[:1], 0, all_positions=True)
    expected = torch.nn.functional.cross_entropy(logits[0].double(), windows.targets[0], reduction="none") / math.log(2)
    assert np.allclose(base[0], expected.numpy(), rtol=1e-12)
    same = experiments.bits(model, windows, {"layers.*.resid_post": lambda name, value, context: value})
    result = compare(windows, base, same)
    assert result["difference"] == 0.0 and result["interval"] == [0.0, 0.0] and result["spans_zero"]
    assert "spans zero" in verdict(result)


def test_the_paired_bootstrap_on_crafted_windows():
    nbytes = np.full(50, 10.0)
    base = np.random.default_rng(1).normal(20.0, 3.0, 50)
    # one bit more per window: exactly 0.1 bits per byte, whatever the resampling
    diff, low, high = paired_bootstrap(base, base + 1.0, nbytes)
    assert diff == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    # noise of mean zero around the same windows: an interval that holds zero
    noisy = base + np.random.default_rng(2).normal(0.0, 1.0, 50)
    diff, low, high = paired_bootstrap(base, noisy, nbytes)
    assert low < diff < high and low < 0 < high
    # pairing: a shift far smaller than the spread between windows is still told apart
    diff, low, high = paired_bootstrap(base, base + 0.05 + np.random.default_rng(3).normal(0, 0.01, 50), nbytes)
    assert 0 < low < diff < high
    with pytest.raises(ExperimentError, match="same windows"):
        paired_bootstrap(base, base[:10], nbytes)


def test_compare_splits_by_the_targets_class():
    classes = np.array([[0, 1, 1, 3], [1, 3, 0, -1]])
    nbytes = np.array([[1, 4, 2, 1], [3, 1, 1, 0]])
    base = np.ones((2, 4))
    other = base + (classes == 1)  # one more bit on each identifier
    windows = HeldOut(torch.zeros(2, 4), torch.zeros(2, 4), nbytes, classes, [0, 4], 8)
    result = compare(windows, base, other)
    assert result["difference"] == pytest.approx(3 / 13)
    by = result["by_class"]
    assert set(by) == {TOKEN_CLASSES[0], TOKEN_CLASSES[1], TOKEN_CLASSES[3]}
    assert by["identifier"]["difference"] == pytest.approx(3 / 9) and by["identifier"]["tokens"] == 3
    assert by["whitespace"]["difference"] == 0.0 and by["whitespace"]["spans_zero"]


def test_the_expert_grid_is_cut_to_a_budget(model):
    layers, experts = experiments.expert_grid(model)
    assert layers == list(range(model.cfg.n_layers)) and experts == list(range(model.cfg.n_routed_experts))
    layers, experts = experiments.expert_grid(model, max_runs=40)
    assert len(layers) * len(experts) <= 40 and experts == list(range(16)) and layers == [0, 7]  # first and last
    with pytest.raises(ExperimentError):
        experiments.expert_grid(model, layers=[99])


def test_patch_prompts_line_up_or_are_refused(model, tiny_checkpoint):
    names = experiments.patch_names(model)
    assert names == list(experiments.PATCH_NAMES[: experiments.PATCH_PAIRS])  # the first ten are one token each here
    prompts, firsts = experiments.patch_prompts(model)
    assert prompts.shape[0] == len(names) == len(set(firsts.tolist()))
    differ = (prompts != prompts[:1]).any(0).nonzero().flatten().tolist()
    assert len(differ) == experiments.PATCH_TEMPLATE.count("{name}")  # one token per occurrence
    # another tokenizer: the names whose prompts share the commonest length, in the candidates' order
    other = dsv41.load(tiny_checkpoint, quiet=True)
    names = experiments.patch_names(other)
    prompts, firsts = experiments.patch_prompts(other, names=names)
    assert 2 <= len(names) <= experiments.PATCH_PAIRS and len(set(firsts.tolist())) == len(names)
    assert names == [n for n in experiments.PATCH_NAMES if n in names]
    with pytest.raises(ExperimentError, match="different lengths"):
        experiments.patch_prompts(model, names=["value", "configuration_manager"])
    with pytest.raises(ExperimentError, match="at least 2"):
        experiments.patch_prompts(model, names=["value"])


def test_patching_only_the_renamed_positions_measures_those_cells_alone(model, tmp_path):
    names = experiments.patch_names(model, pairs=3)
    every = experiments.patching_study(model, names=names, max_layers=2)
    few = experiments.patching_study(model, names=names, max_layers=2, positions="renamed")
    length = len(every["tokens"])
    renamed = every["renamed_positions"]
    assert every["patched_positions"] == list(range(length))
    assert few["patched_positions"] == sorted({*renamed, length - 1}) and few["positions"] == "renamed"
    assert few["gap"] == every["gap"] and few["gap_interval"] == every["gap_interval"]
    rec_all, rec_few = (np.array(s["recovered"], dtype=float) for s in (every, few))
    assert not np.isnan(rec_all).any()
    measured = ~np.isnan(rec_few)
    # the cells it measures are the full map's, bit for bit; what it leaves is after the first rename
    assert np.array_equal(rec_few[measured], rec_all[measured])
    assert measured[:, few["patched_positions"]].all() and measured[:, : renamed[0]].all()
    left = np.argwhere(~measured)
    assert left.size and all(p not in few["patched_positions"] and p > renamed[0] for _, p in left)
    for key in ("interval_low", "interval_high"):
        assert all(v is None for row, m in zip(few[key], measured) for v, ok in zip(row, m) if not ok)
    assert not np.array(few["spans_zero"])[~measured].any()
    fig = experiments.patching_figure(few)  # the unmeasured cells drawn apart, named in the legend
    assert "not patched" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    with pytest.raises(ExperimentError, match="positions must be one of all, renamed"):
        experiments.patching_study(model, names=names, positions="some")


def test_dsv41_ablate_writes_its_numbers_and_figures(tmp_path, capsys):
    out = tmp_path / "ablate"
    args = ["ablate", "--out", str(out), "--windows", "2", "--tokens", "24", "--batch", "2"]
    assert main([*args, "--studies", "hyper_connections,indexer", "--quiet"]) == 0
    facts = json.loads((out / "ablate.json").read_text())
    assert (
        facts["windows"] == 2 and facts["tokens"] == 24 and set(facts) >= {"baseline", "indexer", "hyper_connections"}
    )
    for study in ("indexer", "hyper_connections", "summary"):
        assert all((out / f"ablate_{study}.{ext}").is_file() for ext in ("png", "svg", "json"))
    plain = facts["hyper_connections"]["plain_residual"]
    low, high = plain["interval"]
    assert low <= plain["difference"] <= high and plain["spans_zero"] == (low <= 0 <= high)
    # its own folder again is fine; one it did not write, or a study it does not know, is refused
    assert (
        main(
            [*args, "--studies", "patching", "--patch-positions", "renamed", "--max-patch-layers", "2"]
            + ["--patch-pairs", "3", "--quiet"]
        )
        == 0
    )
    patching = json.loads((out / "ablate.json").read_text())["patching"]
    assert patching["positions"] == "renamed" and len(patching["layers"]) == 2
    assert patching["names"] == list(experiments.PATCH_NAMES[:3]) and len(patching["pairs"]) == 3
    assert patching["patched_positions"] == sorted({*patching["renamed_positions"], len(patching["tokens"]) - 1})
    assert main([*args, "--studies", "hyper_connections", "--quiet"]) == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["ablate", "--out", str(tmp_path / "other"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsv41 ablate: --out") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        main(["ablate", "--studies", "everything"])
    assert exit_.value.code == 2


def test_spaced_layers_run_from_the_first_to_the_last():
    from dsv41.observe.experiments import spaced

    for n in range(1, 50):
        for most in range(1, n + 3):
            got = spaced(range(n), most)
            assert got == sorted(set(got)) and len(got) == min(n, most)  # distinct, in order, as many as asked
            assert got[0] == 0 and (most == 1 or got[-1] == n - 1)  # both ends (the first alone for one)
            gaps = np.diff(got)
            assert len(gaps) == 0 or gaps.max() - gaps.min() <= 1  # evenly spaced
