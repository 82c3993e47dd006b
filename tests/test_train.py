"""Training runs through the model's own forward: the forward over master weights against the
loaded checkpoint's, the draft stack's anchored path against its drafts, and `dsv41 train`."""

import pytest
import torch

import dsv41
from dsv41.core.numerics import Numerics
from dsv41.kernels import masked_attention, sparse_attn
from dsv41.train import masters


def _ids(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 990, (1, n), generator=gen)
    ids[0, 0] = 0
    return ids


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True)


@pytest.fixture(scope="module")
def params(tiny_checkpoint):
    return masters.checkpoint_params(tiny_checkpoint)


def _run(model, params, ids, hasher, *, qat=True, index_loss=False):
    masters.set_qat(model, qat)
    hasher.reset()
    with masters.holding(model, masters.weights(params, masters.weight_specs(model.cfg), qat)):
        return masters.forward(model, ids, hasher(ids), index_loss=index_loss)


def test_training_forward_is_the_inference_forward(loaded, params, native_level):
    """The model built for training, over the release checkpoint's own weights held as float32
    masters on their storage grid, under the reference summation: the inference forward's logits
    bit for bit at every position of a prefill long enough for every layer mode, the compressor,
    the indexer's top-k and the candidate blocks to select; the same forward code either way
    (`masters.forward` is the backbone's own, without a cache)."""
    ids = _ids(160)
    with torch.inference_mode():
        expected = loaded(ids, all_positions=True)
    model = masters.trainable_model(loaded.cfg, numerics=Numerics(), batch=1, seq_len=160)
    with torch.no_grad():
        got = _run(model, params, ids, loaded.hasher).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"


def test_the_fast_summation_is_the_reference_up_to_float32_order(loaded, params):
    ids = _ids(96, seed=1)
    runs = []
    for summation in ("reference", "fast"):
        model = masters.trainable_model(loaded.cfg, numerics=Numerics(summation=summation), batch=1, seq_len=96)
        with torch.no_grad():
            runs.append(_run(model, params, ids, loaded.hasher).logits)
    a, b = runs
    assert not torch.equal(a, b)  # another order of float32 sums
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95
    assert (a - b).abs().mean() < 0.05 * a.abs().mean()


def test_masked_attention_is_sparse_attention():
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 5, 3, 16, generator=gen), torch.randn(2, 9, 16, generator=gen)
    # distinct rows per query, as the window and the top-k give them, some absent (-1)
    idxs = torch.stack([torch.randperm(9, generator=gen)[:4] for _ in range(10)]).view(2, 5, 4).int()
    idxs[0, 1, 2:] = -1
    sink = torch.randn(3, generator=gen)
    a = sparse_attn(q, kv, sink, idxs, 0.25).float()
    b = masked_attention(q, kv, sink, idxs, 0.25).float()
    assert torch.allclose(a, b, atol=1e-2, rtol=1e-2)  # both bf16


def test_anchored_drafts_are_the_draft_stacks_drafts(tiny_checkpoint, params, native_level):
    """The draft stack's whole-sequence path over a batch of anchors (training's) gives, row for
    row, the logits and confidence of the stack's own drafts after a prefill ending at each anchor,
    bit for bit, when fed the draft's own proposals as the previous tokens. Under
    `Numerics.parity()`: a batch of anchors runs its float32 GEMMs over more rows than one draft,
    and only the padded GEMMs round alike at any row count."""
    from dsv41.generation.generate import prefill

    loaded = dsv41.load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())
    c = loaded.cfg
    n = c.window_size + 24
    ids = _ids(n, seed=4)
    anchors = [c.window_size - 1, c.window_size + 5, n - c.dspark_block_size - 2]
    drafts = []
    for p in anchors:
        with torch.inference_mode():
            logits = prefill(loaded, ids[:, : p + 1])
            drafts.append(loaded.draft(int(ids[0, p + 1])))
        assert logits is not None
    model = masters.trainable_model(c, numerics=Numerics.parity(), batch=1, seq_len=n)
    with torch.no_grad():
        target = _run(model, params, ids, loaded.hasher)
        values = masters.weights(params, masters.weight_specs(c), qat=True)
        with masters.holding(model, values):
            tokens = torch.stack([d.ids[0, :-1] for d in drafts]).unsqueeze(0)  # [1, A, block]
            tokens[..., 1:] = int(c.dspark_noise_token_id)
            previous = torch.stack([d.ids[0, :-1] for d in drafts]).unsqueeze(0)
            logits, confidence, _ = model.draft_stack.anchored(
                target.main_hidden, torch.tensor([anchors]), tokens, previous
            )
    for i, d in enumerate(drafts):
        assert torch.equal(logits[i], d.logits[0]), f"anchor {anchors[i]}: {(logits[i] - d.logits[0]).abs().max():.3g}"
        assert torch.equal(confidence[i], d.confidence[0])


def test_the_confidence_head_learns_on_the_contexts_inference_judges():
    """A draft row is judged at inference only after the anchor and every earlier proposal were the
    target's greedy tokens: `greedy_context` keeps a row while the text agrees with the target's
    argmax at the anchor and at each row before it, and drops it (and every later row) from the first
    disagreement on; the mask follows each anchor, batch row by batch row."""
    from dsv41.train.draft import greedy_context

    text = torch.tensor([[5, 1, 2, 3, 4, 9, 7, 8], [0, 6, 6, 6, 6, 6, 6, 6]])
    # the target's argmax at q predicts the token at q + 1
    greedy = torch.tensor([[1, 2, 0, 4, 9, 7, 8, 0], [6, 0, 6, 6, 6, 6, 6, 6]])
    anchors = torch.tensor([[0, 3], [0, 2]])
    expected = torch.zeros(2, 2, 3, dtype=torch.bool)
    for b in range(2):
        for a in range(2):
            p = int(anchors[b, a])
            for i in range(3):
                expected[b, a, i] = all(int(text[b, q + 1]) == int(greedy[b, q]) for q in range(p, p + i + 1))
    got = greedy_context(text, greedy, anchors, 3)
    assert torch.equal(got, expected)
    assert got[0, 0].tolist() == [True, True, False] and got[1, 0].tolist() == [True, False, False]
    assert got[0, 1].all() and got[1, 1].all()


def test_one_backward_trains_through_every_mechanism(loaded, params):
    """One backward through the model's own forward (training's fast summation, QAT) reaches the
    hyper-connection mixes (through Sinkhorn), the Engram table and gates, every expert that
    routed a token, the compressor and, through their own KL loss only, the indexers."""
    masters_ = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    model = masters.trainable_model(loaded.cfg, numerics=Numerics(summation="fast"), batch=1, seq_len=64)
    ids = _ids(64, seed=2)
    out = _run(model, masters_, ids, loaded.hasher, index_loss=True)
    loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    loss.backward(retain_graph=True)
    grads = {k: v.grad for k, v in masters_.items()}
    for name in (
        "layers.0.hc_attn_fn",
        "layers.0.hc_attn_base",
        "layers.1.engram.embed.weight",
        "layers.2.engram.q_weight",
        "layers.2.attn.compressor.wgate.weight",
        "layers.4.attn.wq_b.weight",
        "layers.7.ffn.shared_experts.w2.weight",
        "head.weight",
        "embed.weight",
    ):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert grads["layers.2.attn.indexer.wq_b.weight"] is None  # the LM loss does not reach the indexer
    used = out.expert_load[3].nonzero().flatten().tolist()
    assert used and all(grads[f"layers.3.ffn.experts.{e}.w1.weight"].abs().sum() > 0 for e in used)
    unused = (out.expert_load[3] == 0).nonzero().flatten().tolist()
    assert all(grads[f"layers.3.ffn.experts.{e}.w1.weight"] is None for e in unused)
    sum(out.index_kl.values()).backward()
    assert sorted(out.index_kl) == [2, 4, 6]
    assert masters_["layers.6.attn.indexer.wq_b.weight"].grad.abs().sum() > 0
    # the model's own parameter slots are back as they were
    assert all(not p.requires_grad for p in model.backbone.parameters())


@pytest.mark.slow
def test_dsv41_train_smoke_run_learns_resumes_and_writes_a_loadable_checkpoint(tmp_path):
    """A short `dsv41 train` (small batches, eager Sinkhorn, one thread): the loss falls, a run cut
    in two and resumed takes the same steps to the same weights, and the checkpoint it writes loads
    and gives the logits of the training model's reference forward over its weights."""
    import json

    from dsv41.train.cli import cli_main

    common = [
        "--batch",
        "2",
        "--seq-len",
        "48",
        "--steps",
        "50",
        "--draft-steps",
        "2",
        "--no-compile",
        "--threads",
        "1",
        "--held-out-windows",
        "2",
    ]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert cli_main(["--out", str(whole), *common]) == 0
    assert cli_main(["--out", str(halves), "--stop-at", "26", *common]) == 0
    assert not (halves / "checkpoint").exists()
    assert cli_main(["--out", str(halves), "--resume", *common]) == 0

    def state(folder):
        """(state.json's object, the tensors by name): the run's state, pickle-free."""
        from safetensors.torch import load_file

        document = json.loads((folder / "state.json").read_text())
        return document, load_file(folder / document["tensors"]["file"])

    facts = json.loads((whole / "facts.json").read_text())
    losses = [r["loss"] for r in state(whole)[0]["log"] if r["phase"] != "draft"]
    assert len(losses) == 50 and sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0, losses
    assert facts["steps"] == 52 and facts["corpus"]["train"]["files"] > 100
    assert (
        facts["held_out"]["release_format"]["bits_per_byte"]
        < facts["held_out"]["random_initialization"]["bits_per_byte"]
    )

    a, b = state(whole)[1], state(halves)[1]
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), "a resumed run takes the same steps"

    # the draft phase goes on from the written checkpoint: its manifest's backbone facts carried
    ckpt = str(whole / "checkpoint")
    more = tmp_path / "more"
    longer = [a if a != "2" or common[i - 1] != "--draft-steps" else "4" for i, a in enumerate(common)]
    assert cli_main(["--out", str(more), "--draft-from", ckpt, *common]) == 1  # 2 draft steps are done already
    assert cli_main(["--out", str(more), "--draft-from", ckpt, *longer]) == 0
    went_on = json.loads((more / "facts.json").read_text())
    assert went_on["steps"] == 54 and went_on["draft_continued_from"]["steps"] == 52
    assert went_on["final_train_loss"] == facts["final_train_loss"] and went_on["tokens_seen"] == facts["tokens_seen"]
    assert went_on["training_seconds"] > facts["training_seconds"]
    log = state(more)[0]["log"]
    assert [r["step"] for r in log] == [52, 53] and all(r["phase"] == "draft" for r in log)

    model = dsv41.load(ckpt, quiet=True)
    assert model.report.embedded.startswith(f"a miniature written by dsv41 train at {ckpt}")
    ids = _ids(40, seed=3)
    with torch.inference_mode():
        expected = model(ids, all_positions=True)
    trained = masters.trainable_model(model.cfg, numerics=Numerics(), batch=1, seq_len=40)
    with torch.no_grad():
        got = _run(trained, masters.checkpoint_params(ckpt), ids, model.hasher).logits
    assert torch.equal(got, expected)


def test_the_random_initialization_is_the_trainers_step_zero_in_the_release_format(tmp_path, miniature_checkpoint):
    """`write_initialization` writes `masters.initialized_params` for the source miniature's tokenizer and
    seed as the release stores it (what `dsv41 parse-rate --random-init` loads as the floor)."""
    import filecmp

    from dsv41.checkpoint.miniature import read_manifest
    from dsv41.core.config import load_config
    from dsv41.train.masters import logical_shape, round_to_storage, weight_specs
    from dsv41.train.release import write_initialization

    folder, seed = write_initialization(str(tmp_path / "random"), miniature_checkpoint)
    assert seed == read_manifest(miniature_checkpoint)["seed"]
    assert read_manifest(folder)["steps"] == 0
    assert filecmp.cmp(f"{folder}/tokenizer.json", f"{miniature_checkpoint}/tokenizer.json", shallow=False)
    cfg = load_config(folder)
    written, drawn = masters.checkpoint_params(folder), masters.initialized_params(cfg, seed)
    for name, (spec, scale) in weight_specs(cfg).items():
        stored = round_to_storage(drawn[name], spec, scale).reshape(logical_shape(spec))
        assert torch.equal(written[name].reshape(stored.shape), stored), name
