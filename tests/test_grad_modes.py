"""The model and its kernels take calls in any grad mode and at every instruction-set level this
CPU can run: a model loaded, run or snapshotted under torch.inference_mode() keeps working under
no_grad or plain grad mode (and back), with the same bits."""

import pytest
import torch
from conftest import HAVE_CC, native_levels

from dsv41.model import sequence

MODES = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}
PROMPT = "The many-token path takes a prompt of this length, past eight tokens per expert."


def _run_everything(model, modes):
    """Prefill, decode, roll back, snapshot, decode again, restore, reset and prefill again, each
    step in the next of `modes` (cycled) -> the logits of every step."""
    ids = model.encode(PROMPT)
    steps = [
        lambda: model(ids, 0),
        lambda: model([int(ids[-1])], len(ids)),
        lambda: (sequence.rollback(model, 3), model([int(ids[-3])], len(ids) - 2))[1],
        lambda: model._keep.__setitem__("snap", sequence.snapshot(model)),
        lambda: model([7], model.position),
        lambda: (sequence.restore(model, model._keep["snap"]), model([7], model.position))[1],
        lambda: (model.reset(), model(ids[:12], 0))[1],
    ]
    model._keep = {}
    out = []
    for i, step in enumerate(steps):
        with MODES[modes[i % len(modes)]]():
            got = step()
        if isinstance(got, torch.Tensor):
            out.append(got.clone())
    return out


@pytest.mark.parametrize("load_mode", list(MODES))
def test_a_model_made_in_one_grad_mode_runs_in_every_other(tiny_checkpoint, load_mode):
    import dsv41

    with MODES[load_mode]():
        model = dsv41.load(tiny_checkpoint, quiet=True)
        want = _run_everything(model, [load_mode])
    # every step in another mode than the one before, and the load's mode among them
    got = _run_everything(model, [m for m in MODES if m != load_mode] + [load_mode])
    assert len(got) == len(want) == 6
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on PATH: the native kernels cannot be built here")
def test_the_model_gives_the_same_bits_at_every_instruction_set_level_under_parity(parity):
    """Under Numerics.parity() the routed experts run in block order, which every build sums the
    same way: a prefill of many tokens and the decode after it are bit-identical at every level
    this CPU runs (AVX-512, AVX2, plain C; the BF16 and float32 many-token paths)."""
    from dsv41.kernels import native

    runs = {}
    for level in native_levels():
        with native.forced_isa(level):
            runs[level] = _run_everything(parity, ["inference", "no_grad"])
    first = runs[native_levels()[0]]
    for level, got in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, first)), level


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler on PATH: the native kernels cannot be built here")
def test_the_reference_arithmetic_at_every_level_agrees_up_to_addition_order(reference):
    """Under the reference's arithmetic a prefill's expert GEMMs take the level's many-token path
    (BF16 or float32 GEMM): the logits agree to float32 addition order and the greedy choice is
    the same at every level."""
    from dsv41.kernels import native

    ids = reference.encode(PROMPT)
    logits = {}
    for level in native_levels():
        with native.forced_isa(level):
            reference.reset()
            logits[level] = reference(ids, 0).float()
    base = logits[native_levels()[0]]
    for level, got in logits.items():
        assert int(got.argmax()) == int(base.argmax()), level
        assert (got - base).abs().max() <= 0.05 * base.abs().max(), level
