"""Generation and continuation on input a hostile or hurried user gives: each is one sentence (or,
for Ctrl-C, the text so far and one line), and a refused call leaves the sequence as it was."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from dsv41.app.cli import main
from dsv41.generation.generate import generate
from dsv41.model import sequence


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    import dsv41

    return dsv41.load(tiny_checkpoint, quiet=True)


def _unchanged(model, ids):
    """The sequence after a refused call: still the prompt, and continuing gives what it gave."""
    return model.position == len(ids) and torch.equal(model.token_ids[0], torch.tensor(ids))


@pytest.mark.parametrize("start_pos", [13.0, 7.5, True, "7", None])
def test_a_start_position_that_is_not_a_whole_number_is_refused(model, start_pos):
    ids = model.encode("The harbor at dawn")
    model(ids, 0)
    with pytest.raises(ValueError, match="start_pos must be a whole number"):
        model(ids[-1:], start_pos)
    assert _unchanged(model, ids)


@pytest.mark.parametrize(
    "bad",
    [
        [1.5, 2.0],
        torch.tensor([3.0, 4.0]),
        torch.tensor([True, False]),
        ["a", "b"],
        torch.zeros(1, 1, 2, dtype=torch.long),
    ],
)
def test_token_ids_that_are_not_whole_numbers_are_refused_not_cut(model, bad):
    ids = model.encode("The harbor at dawn")
    model(ids, 0)
    with pytest.raises(ValueError, match="token ids"):
        model(bad, len(ids))
    assert _unchanged(model, ids)
    with pytest.raises(ValueError, match="token ids"):
        generate(model, bad if not isinstance(bad, torch.Tensor) or bad.dim() == 1 else bad, max_new_tokens=1)


def test_whole_ids_of_any_integer_dtype_still_run(model):
    ids = model.encode("The harbor at dawn")
    want = model(ids, 0)
    for dtype in (torch.int32, torch.int16, torch.uint8 if max(ids) < 256 else torch.int32):
        assert torch.equal(model(torch.tensor(ids, dtype=dtype), 0), want)


def test_restore_takes_only_a_snapshot(model):
    ids = model.encode("The harbor at dawn")
    model(ids, 0)
    for bad in (None, {"position": 3}, 5):
        with pytest.raises(ValueError, match=r"restore takes a snapshot from sequence.snapshot\(model\)"):
            sequence.restore(model, bad)
        assert _unchanged(model, ids)


@pytest.mark.parametrize("token", [10**6, -1, 2.0, "5"])
def test_a_draft_from_a_token_outside_the_vocabulary_is_refused(model, token):
    ids = model.encode("The harbor at dawn")
    model(ids, 0)
    with pytest.raises(ValueError, match=r"a draft starts from one token id in \[0, "):
        model.draft(token)
    assert _unchanged(model, ids)
    assert model.draft(5).ids.shape[1] == model.cfg.dspark_block_size + 1


def test_draft_options_without_speculative_are_a_usage_error(tiny_checkpoint, capsys):
    for flags, named in (
        (["--draft-tokens", "2"], "--draft-tokens only works"),
        (["--min-confidence", "0.2"], "--min-confidence only works"),
        (["--draft-tokens", "2", "--min-confidence", "0"], "--draft-tokens and --min-confidence only work"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["generate", "--checkpoint", tiny_checkpoint, "--prompt", "x", *flags])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and named in err and "with --speculative" in err, err


def test_dspark_block_size_0_turns_the_draft_stack_off(tiny_checkpoint, tmp_path, capsys):
    """The config's bounds refused 0, which the README names as the way to turn the stack off."""
    import dsv41

    folder = tmp_path / "no-draft"
    shutil.copytree(tiny_checkpoint, folder)

    def zero(node):
        for key, value in node.items():
            if key == "dspark_block_size":
                node[key] = 0
            elif isinstance(value, dict):
                zero(value)

    for name in ("config.json", "inference/config.json"):
        cfg = json.loads((folder / name).read_text())
        zero(cfg)
        (folder / name).write_text(json.dumps(cfg))
    model = dsv41.load(str(folder), quiet=True)
    assert model.draft_stack is None and "MTP / DSpark (not run)" in model.report.summary()
    assert len(generate(model, "The harbor", max_new_tokens=3).ids) == 3
    with pytest.raises(ValueError, match="dspark_block_size 0"):
        generate(model, "The harbor", max_new_tokens=3, speculative=True)
    assert (
        main(["generate", "--checkpoint", str(folder), "--prompt", "The harbor", "--max-new-tokens", "2", "--quiet"])
        == 0
    )


def test_a_missing_config_names_generates_own_option(tiny_checkpoint, tmp_path, capsys):
    """The audit's message named --config and --checkpoint-dir, options `dsv41 generate` lacks."""
    folder = tmp_path / "no-config"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "config.json").unlink()
    shutil.rmtree(folder / "inference")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (folder, empty):
        assert main(["generate", "--checkpoint", str(path), "--prompt", "x"]) == 1
        err = capsys.readouterr().err
        assert "pass --checkpoint a checkpoint folder" in err, err
        assert "--config" not in err and "--checkpoint-dir" not in err, err


def _ctrl_c_as_in_a_terminal():
    # a test run started in the background (`pytest &`) ignores SIGINT, and so would the command:
    # Python turns SIGINT into KeyboardInterrupt only when it starts with the default action
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_mid_decode_prints_the_text_so_far_and_one_line(tiny_checkpoint):
    """Ctrl-C while decoding printed a traceback and lost the generated text."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsv41",
            "generate",
            "--checkpoint",
            tiny_checkpoint,
            "--prompt",
            "Once upon",
            "--max-new-tokens",
            "3000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    try:
        for line in proc.stderr:  # the decode starts after this line
            if line.startswith("prompt:"):
                break
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    tail = err.strip().splitlines()[-1]
    assert tail.startswith("dsv41 generate: interrupted after ") and "(the text so far is above)" in tail, tail
    produced = int(tail.split("interrupted after ")[1].split()[0])
    assert 0 < produced < 3000 and out.strip(), (produced, out)
