"""scripts/gpu-check: its CPU mode run end to end (TRITON_INTERPRET=1, the smoke sizes), and its
pieces: which test files it collects, how it reads pytest's report and judges it, the one line
naming missing modules, a step that hangs, and a budget that is spent."""

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _load_script():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


gpu_check = _load_script()


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


# ---------------------------------------------------------------------- the whole run, CPU mode
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `scripts/gpu-check --cpu` run (the smoke sizes, the Triton interpreter): its exit status,
    output and folder."""
    if not HAVE_TRITON:
        pytest.skip("Triton is not installed: CPU mode runs the experts bench through its interpreter")
    out = tmp_path_factory.mktemp("gpu-check")
    done = _run("--cpu", "--out", str(out))
    return done, out


@pytest.mark.slow
def test_cpu_mode_runs_every_step_and_writes_the_summary(cpu_run):
    done, out = cpu_run
    summary = json.loads((out / "gpu-check.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert summary["mode"] == "cpu" and summary["sizes"] == "smoke" and summary["ok"]
    assert list(summary["steps"]) == ["preflight", "tests", "experts", "generate", "decode"]
    assert all(s["status"] == "ok" and s["seconds"] <= s["timeout_s"] for s in summary["steps"].values())
    assert summary["missing_modules"] == [] and summary["seconds"] <= summary["budget_s"]
    assert summary["prepare"].startswith("written in the background")
    pre = summary["steps"]["preflight"]["result"]
    assert pre["dsv41_from_source_tree"] and pre["TRITON_INTERPRET"] == "1" and pre["problem"] is None
    # everything printed is in the log, each step's lines under its name
    log = (out / "gpu-check.log").read_text()
    assert all(f"[{name}] " in log for name in ("preflight", "tests", "experts", "generate", "decode", "prepare"))
    assert log.splitlines()[-1] in done.stdout and "== summary (all steps ok)" in log
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "gpu-check.json",
            "gpu-check.log",
            "gpu-tests.json",
            "bench-experts.json",
            "generate.json",
            "bench-decode-released.json",
        ]
    )


@pytest.mark.slow
def test_cpu_mode_gpu_tests_skip_for_want_of_cuda_only(cpu_run):
    _, out = cpu_run
    tests = json.loads((out / "gpu-tests.json").read_text())
    assert tests["files"] == gpu_check.gpu_test_files()
    assert tests["counts"]["failed"] == 0 and tests["counts"]["passed"] == 0 and tests["counts"]["skipped"] > 0
    assert all("CUDA" in s["message"] for s in tests["skipped"]), tests["skipped"]


@pytest.mark.slow
def test_cpu_mode_experts_bench_ratios_are_its_own_measurements(cpu_run):
    _, out = cpu_run
    rep = json.loads((out / "bench-experts.json").read_text())
    assert rep["interpret"] and rep["device"] == "cpu" and (rep["dim"], rep["inter"]) == (64, 32)
    assert rep["memory_bandwidth_bytes_per_s"] == pytest.approx(2 * rep["copy_bandwidth_bytes_per_s"], rel=1e-12)
    (decode,) = rep["shapes"]
    assert decode["tokens"] == 1 and decode["gemv_method"] == "wall clock (CPU)"
    assert decode["gemv_fraction_of_memory_bandwidth"] == pytest.approx(
        decode["packed_bytes"] / decode["gemv_s"] / rep["memory_bandwidth_bytes_per_s"], rel=1e-12
    )
    gemm = rep["gemm"]
    assert gemm["tokens"] == 32 and gemm["kernel"] == "_fp4_gemm_kernel"
    assert gemm["flops"] == 2 * 32 * 3 * rep["dim"] * rep["inter"]
    assert gemm["fraction_of_bf16_matmul"] == pytest.approx(gemm["bf16_matmul_s"] / gemm["fp4_s"], rel=1e-12)
    assert "targets" not in rep  # judged at the released sizes only
    figures = json.loads((out / "gpu-check.json").read_text())["figures"]
    assert figures["decode_gemv_fraction_of_memory_bandwidth"] == decode["gemv_fraction_of_memory_bandwidth"]
    assert figures["gemm_32_fraction_of_bf16_matmul"] == gemm["fraction_of_bf16_matmul"]


@pytest.mark.slow
def test_cpu_mode_generation_compares_both_checkpoints(cpu_run):
    _, out = cpu_run
    gen = json.loads((out / "generate.json").read_text())
    assert gen["ok"] and gen["device"] == "cpu" and gen["new_tokens"] == 4
    assert [c["checkpoint"] for c in gen["checkpoints"]] == ["tiny", "miniature"]
    for c in gen["checkpoints"]:
        # in CPU mode the "device" run is the CPU path itself: bit for bit the same logits and tokens
        assert c["experts_on"] == ["cpu"] and c["tokens_equal"] and c["device"]["max_abs_logit_diff"] == 0
        assert len(c["cpu_ids"]) == 4 and c["finite"]
        steps = c["device"]["steps"]
        assert [s["step"] for s in steps] == [0, 1, 2, 3] and all(s["cpu_top2_margin"] >= 0 for s in steps)
        assert c["reference"]["steps"] and len(c["reference"]["ids"]) == 4
    decode = json.loads((out / "bench-decode-released.json").read_text())
    assert decode["expert_device"] == "cpu" and list(decode["settings"]) == ["1"]


# ---------------------------------------------------------------------- the pieces
def test_only_the_files_holding_gpu_tests_are_collected(tmp_path):
    (tmp_path / "tests").mkdir()
    marked = {
        "test_a.py": "import pytest\n\n@pytest.mark.gpu\ndef test_x(): pass\n",
        "test_b.py": "import pytest\npytestmark = [pytest.mark.gpu]\n",
        "test_c.py": "# mentions pytest.mark.gpu in a comment only\ndef test_y(): pass\n",
        "helper_d.py": "@pytest.mark.gpu\n",
    }
    for name, text in marked.items():
        (tmp_path / "tests" / name).write_text(text)
    assert gpu_check.gpu_test_files(tmp_path) == ["tests/test_a.py", "tests/test_b.py"]
    here = gpu_check.gpu_test_files()
    assert "tests/test_expert_device.py" in here and "tests/test_gpu_check.py" not in here


def _junit(tmp_path, cases: str) -> Path:
    path = tmp_path / "report.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return path


def test_the_pytest_report_is_judged_by_mode(tmp_path):
    passed = '<testcase classname="tests.test_a" name="test_ok" time="0.5"/>'
    skipped = '<testcase classname="tests.test_a" name="test_cuda"><skipped message="needs a CUDA device"/></testcase>'
    failed = '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2"/></testcase>'
    report = gpu_check.junit_summary(_junit(tmp_path, passed + skipped + failed))
    assert report["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert report["failed"] == [{"test": "tests.test_a::test_bad", "message": "assert 1 == 2"}]
    assert gpu_check.tests_verdict(report, 1, cpu=False) == (False, "1 passed, 1 failed, 1 skipped")
    only_skips = gpu_check.junit_summary(_junit(tmp_path, skipped))
    ok, said = gpu_check.tests_verdict(only_skips, 0, cpu=True)
    assert ok and "skip without CUDA" in said
    ok, said = gpu_check.tests_verdict(only_skips, 0, cpu=False)  # on the GPU a skip is a test not run
    assert not ok and "did not run" in said
    assert gpu_check.tests_verdict(gpu_check.junit_summary(_junit(tmp_path, passed)), 0, cpu=False)[0]
    assert gpu_check.tests_verdict(gpu_check.junit_summary(_junit(tmp_path, "")), 5, cpu=True) == (
        False,
        "pytest ran no gpu test",
    )
    assert gpu_check.junit_summary(tmp_path / "absent.xml") is None
    assert gpu_check.tests_verdict(None, 4, cpu=False) == (False, "pytest wrote no readable report (exit 4)")


def test_missing_modules_are_named_in_one_line():
    assert gpu_check.missing_modules(["json", "no_such_module_here"]) == ["no_such_module_here"]
    line = gpu_check.missing_line(["pytest", "tokenizers"])
    assert line == "missing: pytest (the gpu tests), tokenizers (loading and writing checkpoints)"
    assert "\n" not in line and gpu_check.missing_line([]).startswith("python modules: all present")


def test_a_step_that_hangs_is_ended_at_its_timeout(tmp_path):
    out = gpu_check.Output(tmp_path / "log")
    began = time.monotonic()
    child = gpu_check.Child(
        "hang",
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"],
        dict(os.environ),
        out,
    )
    info = child.wait(3)
    out.close()
    assert info["timed_out"] and info["returncode"] is not None and child.proc.poll() is not None
    assert time.monotonic() - began < 30 and "started" in info["output_tail"]
    assert "[hang] started" in (tmp_path / "log").read_text()


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path):
    done = _run("--cpu", "--budget", "1", "--out", str(tmp_path), timeout=120)
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert done.returncode == 1 and not summary["ok"]
    steps = summary["steps"]
    assert steps["preflight"] == {"status": "not run", "reason": "the time budget (1 s) is spent"}
    assert all(
        s["status"] == "not run" and "the preflight did not pass" in s["reason"]
        for name, s in steps.items()
        if name != "preflight"
    )
    assert "NOT all steps ok" in done.stdout


def test_bad_usage_is_refused_in_one_line(tmp_path):
    for args, words in ((["--only", "tests,bogus"], "--only takes"), (["--budget", "-3"], "--budget must be")):
        done = _run(*args, "--out", str(tmp_path), timeout=60)
        assert done.returncode == 2 and words in done.stderr and done.stdout == ""
    assert not (tmp_path / "gpu-check.json").exists()


def test_generation_verdict_reports_divergence_and_fails_on_errors_or_host_experts():
    def cell(name, device_ids, margin, diff, on):
        steps = [
            {"step": 0, "cpu_top2_margin": 5.0, "max_abs_logit_diff": 0.01, "finite": True},
            {"step": 1, "cpu_top2_margin": margin, "max_abs_logit_diff": diff, "finite": True},
        ]
        return {
            "checkpoint": name,
            "experts_on": on,
            "finite": True,
            "tokens_equal": device_ids == [1, 2],
            "device": {
                "ids": device_ids,
                "first_divergence": None if device_ids == [1, 2] else 1,
                "steps": steps,
                "max_abs_logit_diff": diff,
            },
            "reference": {"max_abs_logit_diff": 0.0},
        }

    report = {
        "checkpoints": [
            cell("tiny", [1, 2], 3.0, 0.02, ["cuda:0"]),
            cell("miniature", [1, 7], 0.004, 0.003, ["cuda:0"]),
        ]
    }
    ok, said = gpu_check._generate_verdict(report, "cuda")
    assert ok  # different tokens are reported, not a failure: they need not be equal (WHY_TOKENS)
    assert "tiny: tokens equal" in said and "miniature: tokens differ from step 1 (CPU top-2 margin 0.004" in said
    report["checkpoints"][0]["experts_on"] = ["cpu"]  # asked for CUDA, the experts stayed on the host
    assert not gpu_check._generate_verdict(report, "cuda")[0]
    assert gpu_check._generate_verdict(report, "cpu")[0]
    report["checkpoints"].append({"checkpoint": "broken", "error": "RuntimeError: boom", "ran": ["cpu"]})
    ok, said = gpu_check._generate_verdict(report, "cpu")
    assert not ok and "broken: failed after cpu: RuntimeError: boom" in said
