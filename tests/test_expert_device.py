"""Where routed experts live and run: `expert_device` resolved by the loader through
`kernels.experts.expert_devices`, the one-line CPU fallback when CUDA is absent, device lists, and
the model's routed path against the reference `fp4_gemm` experts."""

import math
import time

import pytest
import torch

from dsv41.app.cli import generate_main as cli_main
from dsv41.app.cli import main as cli_main_all
from dsv41.checkpoint.stores import DictExpertStore
from dsv41.generation.generate import generate
from dsv41.kernels import experts as kernel_experts
from dsv41.kernels import triton_experts
from dsv41.kernels.experts import PackedExpert, routed_experts_reference
from dsv41.model.moe import RoutedExperts
from dsv41.runtime.loader import load

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.cuda.is_available() and triton_experts.available()
needs_no_gpu = pytest.mark.skipif(CUDA, reason="checks the CPU fallback; this machine has CUDA and Triton")
PROMPT = "Once upon a time"


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The fallback line is printed once per process; start each test with none printed yet."""
    monkeypatch.setattr(kernel_experts, "_SAID", set())


@pytest.fixture(scope="module")
def cpu_model(tiny_checkpoint):
    return load(tiny_checkpoint, quiet=True)


def _fallback_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "routed experts stay on the CPU" in line]


@needs_no_gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:1", ["cuda:0", "cuda:1"]])
def test_cuda_without_cuda_falls_back_with_one_line(spec, tiny_checkpoint, cpu_model, capsys, fresh_warnings):
    model = load(tiny_checkpoint, expert_device=spec, quiet=True)
    got = generate(model, PROMPT, max_new_tokens=4, stop_at_eos=False)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and len(_fallback_lines(err)) == 1, err
    assert model.experts.devices == [torch.device("cpu")]
    assert got.ids == generate(cpu_model, PROMPT, max_new_tokens=4, stop_at_eos=False).ids
    assert all(t.device.type == "cpu" for w in model.experts._lru.values() for p in w.values() for t in p)


def test_cpu_and_cpu_lists_print_nothing(tiny_checkpoint, cpu_model, capsys, fresh_warnings):
    model = load(tiny_checkpoint, expert_device=["cpu", "cpu"], quiet=True)
    assert model.experts.devices == [torch.device("cpu")]
    ids = cpu_model.encode(PROMPT)
    assert torch.equal(model(ids, 0), cpu_model(ids, 0))
    assert capsys.readouterr().err == ""


def test_bad_device_specs_raise_one_sentence(tiny_checkpoint):
    with pytest.raises(ValueError, match="expert_device 'nonsense'"):
        load(tiny_checkpoint, expert_device="nonsense", quiet=True)
    with pytest.raises(ValueError, match="all be cpu or all be cuda"):
        load(tiny_checkpoint, expert_device=["cpu", "cuda"], quiet=True)


@needs_no_gpu
def test_cli_expert_device_cuda_falls_back(tiny_checkpoint, cpu_model, capsys, fresh_warnings):
    code = cli_main(
        [
            "--checkpoint",
            tiny_checkpoint,
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "4",
            "--expert-device",
            "cuda",
            "--quiet",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and len(err.splitlines()) == 1 and len(_fallback_lines(err)) == 1, err
    assert out == generate(cpu_model, PROMPT, max_new_tokens=4).text + "\n"
    # a device list takes the same path
    code = cli_main(
        [
            "--checkpoint",
            tiny_checkpoint,
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "2",
            "--expert-device",
            "cuda:0,cuda:1",
            "--quiet",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and out and err == ""  # the fallback line was printed once, above
    # a string that names no device is still refused in one sentence
    code = cli_main(["--checkpoint", tiny_checkpoint, "--prompt", PROMPT, "--expert-device", "gpu0"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1 and "expert-device" in err


# ---------------------------------------------------------------------- numerics
def _packed_expert(gen, dim=64, inter=32, adversarial=None):
    from dsv41.checkpoint.formats import quantize_fp4

    parts = []
    for rows, cols in ((inter, dim), (dim, inter), (inter, dim)):  # w1, w2, w3
        w, s = quantize_fp4(torch.randn(rows, cols, generator=gen) / math.sqrt(cols))
        if adversarial == "max":  # every code +-6
            w = torch.where(torch.rand(w.shape, generator=gen) < 0.5, 0x77, 0xFF).to(w.dtype)
        elif adversarial == "zeros":
            w = torch.zeros_like(w)
        elif adversarial == "scales":  # E8M0 extremes within a row
            raw = s.view(torch.uint8).clone()
            raw[:, 0], raw[:, -1] = 127 - 60, 127 + 20
            s = raw.view(torch.float8_e8m0fnu)
        parts += [w.view(torch.float4_e2m1fn_x2), s]
    return PackedExpert(*parts)


@pytest.mark.parametrize("adversarial", [None, "max", "zeros", "scales"])
def test_model_routed_experts_equal_the_reference_fp4_gemm_path(adversarial):
    gen = torch.Generator().manual_seed(11)
    experts = {(0, e): _packed_expert(gen, adversarial=adversarial if e % 2 else None) for e in range(6)}
    x = (torch.randn(7, 64, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(7)])
    weights = torch.rand(7, 3, generator=gen)
    routed = RoutedExperts(0, DictExpertStore(experts), swiglu_limit=10.0)
    got = routed(x, ids, weights)
    ref = routed_experts_reference(x, ids, weights, {e: p for (_, e), p in experts.items()}, 10.0)
    # FP32-accumulation tolerance: only the order of float32 additions differs, which can move a
    # bf16-rounded GEMM output by one bf16 step
    scale = ref.abs().max().clamp_min(1e-30)
    assert torch.isfinite(got).all() and (got - ref).abs().max() <= 2.0**-7 * scale
    assert routed.last_fetch.hits == len(torch.unique(ids)) and routed.last_fetch.misses == 0


# ---------------------------------------------------------------------- GPU only
@pytest.mark.parametrize("spec", ["cuda", ["cuda:0"]])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and Triton")
def test_experts_on_cuda_generate_the_cpu_tokens(spec, tiny_checkpoint, cpu_model, capsys):
    model = load(tiny_checkpoint, expert_device=spec, quiet=True)
    got = generate(model, PROMPT, max_new_tokens=4, stop_at_eos=False)
    assert capsys.readouterr().err == ""
    assert all(t.device.type == "cuda" for w in model.experts._lru.values() for p in w.values() for t in p)
    want = generate(cpu_model, PROMPT, max_new_tokens=4, stop_at_eos=False)
    # the Triton kernels sum in another order: the tokens agree unless a logit margin is ulp-thin
    assert got.ids[0] == want.ids[0]


# ---------------------------------------------------------------------- dense quantized linears
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float4_e2m1fn_x2])
def test_dense_linear_runs_fused_and_equals_the_reference(dtype):
    from dsv41.kernels import linear
    from dsv41.model.layers import Linear, init_random_

    lin = init_random_(Linear(96, 80, dtype), seed=5)
    gen = torch.Generator().manual_seed(6)
    for rows in (1, 3, 9):
        x = (torch.randn(2, rows, 96, generator=gen) * 4).to(torch.bfloat16)
        got, ref = lin(x), linear(x, lin.weight, lin.scale)
        assert got.shape == ref.shape == (2, rows, 80) and got.dtype == torch.bfloat16
        # only the float32 addition order differs: at most one bf16 rounding step apart
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7 + 1e-30).all()
        # a token's output does not depend on the tokens sharing the call
        assert torch.equal(lin(x[:, :1]), got[:, :1])


# ---------------------------------------------------------------------- the GPU bench's clocks and targets
def test_profiled_seconds_sums_the_events_it_names():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from dsv41.bench.experts import profiled_seconds

    a = torch.randn(96, 96)

    def three_products():
        for _ in range(3):
            a @ a

    began = time.perf_counter()
    seconds = profiled_seconds(three_products, [ProfilerActivity.CPU], DeviceType.CPU, "aten::mm", lambda: None)
    assert 0 < seconds <= time.perf_counter() - began
    with pytest.raises(LookupError, match="no .* event named no_such_kernel .*aten::mm"):
        profiled_seconds(three_products, [ProfilerActivity.CPU], DeviceType.CPU, "no_such_kernel", lambda: None)


def test_on_the_cpu_the_bench_clocks_are_the_wall_clock():
    from dsv41.bench.experts import device_seconds, kernel_seconds

    cpu = torch.device("cpu")
    seconds, method = kernel_seconds(lambda: time.sleep(0.01), cpu, 2, "_fp4_gemv_kernel")
    assert method == "wall clock (CPU)" and seconds >= 0.01 and device_seconds(lambda: None, cpu, 2) >= 0


@pytest.mark.skipif(triton_experts.triton is None, reason="Triton is not installed")
def test_the_bench_names_the_triton_kernels_the_profiler_reports():
    from dsv41.bench.experts import GEMM_KERNEL, GEMV_KERNEL

    for name in (GEMV_KERNEL, GEMM_KERNEL):
        assert getattr(triton_experts, name).fn.__name__ == name  # the name a GPU profiler shows for its launches


def test_gpu_targets_are_judged_from_the_measured_fractions():
    from dsv41.bench.experts import GPU_GEMM_TARGET, GPU_GEMM_TOKENS, GPU_GEMV_TARGET, _gpu_targets

    lines = []
    report = {
        "shapes": [
            {"tokens": 1, "gemv_fraction_of_memory_bandwidth": GPU_GEMV_TARGET, "gemv_method": "m"},
            {"tokens": 16},
        ],
        "gemm": {"tokens": GPU_GEMM_TOKENS, "fraction_of_bf16_matmul": GPU_GEMM_TARGET * 0.99, "fp4_method": "m"},
    }
    gemv, gemm = _gpu_targets(report, lines.append)
    assert (gemv["what"], gemv["met"], gemm["what"], gemm["met"]) == ("decode GEMVs", True, "expert GEMMs", False)
    assert gemm["measured"] == report["gemm"]["fraction_of_bf16_matmul"] and len(lines) == 2
    assert "NOT met" in lines[1] and lines[0].endswith(": met")
    report["gemm"]["tokens"] = GPU_GEMM_TOKENS // 2  # another token count is measured, not judged
    assert [t["what"] for t in _gpu_targets(report, lines.append)] == ["decode GEMVs"]


def test_bench_interpret_mode_is_refused_in_one_sentence_where_it_cannot_run(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = ["bench", "experts", "--interpret", "--tokens", "1", "--experts", "6", "--dims", "64,32"]
    assert cli_main_all(args) == 2
    err = capsys.readouterr().err
    want = "TRITON_INTERPRET=1" if triton_experts.triton is not None else "needs Triton installed"
    assert err.count("\n") == 1 and want in err
    assert cli_main_all([*args, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop --device cuda" in err
    assert cli_main_all([*args, "--gemm-tokens", "-1"]) == 2
    assert "--gemm-tokens must be 0 or more" in capsys.readouterr().err
