"""`dsv41.load(threads=...)`, `dsv41 generate --threads` and `dsv41 bench threads`: the rule
"auto" follows (one thread for the embedded checkpoint's small expert matrices, every core for the
released geometry), the report's line, and the benchmark's report (no timing thresholds: the
machine is shared and times move)."""

import json
import math

import pytest
import torch

from dsv41 import bench
from dsv41.app.cli import main
from dsv41.core import threads as threads_module
from dsv41.core.config import RELEASED, TINY
from dsv41.core.threads import AUTO_THREADS_MIN_WEIGHTS, all_cores, auto_threads
from dsv41.runtime.loader import load


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_auto_gives_the_embedded_geometry_one_thread_and_the_released_every_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert auto_threads(TINY)[0] == 1
    n, why = auto_threads(RELEASED)
    assert n == all_cores() and why.startswith("auto:") and "5120 x 2304" in why
    # the decode benchmark's checkpoint has the released expert sizes: every core too
    assert auto_threads(bench.decode_config())[0] == all_cores()
    # the boundary: below AUTO_THREADS_MIN_WEIGHTS one thread, at it every core
    assert auto_threads(TINY.replace(dim=2048, moe_inter_dim=AUTO_THREADS_MIN_WEIGHTS // 2048 - 32))[0] == 1
    assert auto_threads(TINY.replace(dim=2048, moe_inter_dim=AUTO_THREADS_MIN_WEIGHTS // 2048))[0] == all_cores()


def test_all_cores_honours_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert all_cores() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert all_cores() >= 1


def test_load_sets_and_reports_the_threads(tiny_checkpoint):
    torch.set_num_threads(2)
    model = load(tiny_checkpoint, quiet=True)  # auto
    assert torch.get_num_threads() == 1 and model.report.threads == 1
    assert "torch threads: 1 (auto: expert matrices 128 x 64 = 8,192 weights" in model.report.summary()
    model = load(tiny_checkpoint, quiet=True, threads=2)
    assert torch.get_num_threads() == 2 and model.report.threads == 2
    assert "torch threads: 2 (threads=2)" in model.report.summary()
    torch.set_num_threads(3)
    model = load(tiny_checkpoint, quiet=True, threads=None)
    assert torch.get_num_threads() == 3 and "torch threads: 3 (left alone (threads=None))" in model.report.summary()


@pytest.mark.parametrize("bad", [0, -1, True, "4", 1.5, "all"])
def test_load_refuses_a_bad_threads_value_before_touching_torch(tiny_checkpoint, bad):
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="threads must be"):
        load(tiny_checkpoint, quiet=True, threads=bad)
    assert torch.get_num_threads() == 2


def test_more_threads_than_cpus_are_refused_in_one_sentence(tiny_checkpoint, capsys, monkeypatch):
    """Thousands of threads crashed torch (a segfault): the count is bounded by the CPUs this
    process may run on, in Python and on the command line."""
    monkeypatch.setattr(threads_module, "machine_cores", lambda: 2)
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="threads=3 is more than the 2 CPUs this process may run on"):
        load(tiny_checkpoint, quiet=True, threads=3)
    assert torch.get_num_threads() == before
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--checkpoint", tiny_checkpoint, "--prompt", "x", "--threads", "10000"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "threads=10000 is more than the 2 CPUs" in err and "Traceback" not in err


def test_generate_threads_flag(tiny_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(threads_module, "machine_cores", lambda: 2)  # two threads are allowed even on a one-core runner
    args = ["generate", "--checkpoint", tiny_checkpoint, "--prompt", "The harbor", "--max-new-tokens", "2"]
    assert main([*args, "--threads", "2"]) == 0
    assert "torch threads: 2 (threads=2)" in capsys.readouterr().err and torch.get_num_threads() == 2
    assert main(args) == 0
    assert "torch threads: 1 (auto:" in capsys.readouterr().err and torch.get_num_threads() == 1
    with pytest.raises(SystemExit) as exc:
        main([*args, "--threads", "0"])
    assert exc.value.code == 2 and "takes auto or a whole number" in capsys.readouterr().err


def test_bench_threads_reports_both_settings_and_their_ratio(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(threads_module, "all_cores", lambda: 2)  # two settings even on a one-core runner
    torch.set_num_threads(2)
    out = tmp_path / "threads.json"
    assert (
        main(
            ["bench", "threads", "--checkpoint", tiny_checkpoint, "--tokens", "2", "--repeats", "3", "--json", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "all 2 cores / 1 thread" in printed and "picks 1" in printed
    report = json.loads(out.read_text())
    assert torch.get_num_threads() == 2  # put back
    assert (report["dim"], report["inter"], report["decode_tokens"], report["repeats"]) == (128, 64, 2, 3)
    assert report["auto_threads"] == 1 and report["all_cores"] == 2 and set(report["settings"]) == {"1", "2"}
    for key, row in report["settings"].items():
        assert row["threads"] == int(key) and len(row["runs"]) == 3
        decode = sorted(r["decode_s"] for r in row["runs"])
        assert row["median_decode_s"] == decode[1] and row["best_decode_s"] == decode[0] > 0
        assert math.isclose(row["tokens_per_s"], 2 / row["median_decode_s"], rel_tol=1e-12)
        assert math.isclose(row["best_tokens_per_s"], 2 / row["best_decode_s"], rel_tol=1e-12)
    assert math.isclose(
        report["ratio_all_over_one"],
        report["settings"]["2"]["tokens_per_s"] / report["settings"]["1"]["tokens_per_s"],
        rel_tol=1e-12,
    )
    assert isinstance(report["same_tokens"], bool)
    assert main(["bench", "threads", "--checkpoint", tiny_checkpoint, "--tokens", "0"]) == 2
