"""The named ablations and activation patching (`dsv41.model.ablations`): each does what its name says at
its sites, and under `Numerics.parity()` an ablated model run in chunks, decoded a token at a time
or rolled back gives the logits of one ablated prefill, bit for bit, on the trained miniature, the
random tiny checkpoint and the released layer plan at small widths."""

import pytest
import torch

import dsv41
from dsv41.core.numerics import Numerics
from dsv41.model import ablations, sequence
from dsv41.model.ablations import AblationError
from dsv41.model.hooks import UnknownSiteError, run_with_hooks
from dsv41.model.trace import ForwardTrace

IDS = [0] + [(37 * i + 11) % 900 + 3 for i in range(39)]  # 40 positions: several compressed groups

ABLATIONS = {
    "engram_off": lambda cfg: ablations.engram_off(),
    "remove_experts": lambda cfg: ablations.remove_experts({1: [0, 3], cfg.n_layers - 1: [2]}),
    "zero_experts": lambda cfg: ablations.zero_experts({2: [1]}),
    "dense_selection": lambda cfg: ablations.dense_selection(),
    "random_selection": lambda cfg: ablations.random_selection(seed=3),
    "plain_residual": lambda cfg: ablations.plain_residual(),
}


def _chunked(model, ids, sizes):
    out, start = [], 0
    for size in sizes:
        out.append(model(ids[start : start + size], start, all_positions=True))
        start += size
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_an_ablation_is_the_same_in_chunks_decoded_and_rolled_back(parity, name):
    model, n = parity, len(IDS)
    with model.intervene(ABLATIONS[name](model.cfg)):
        whole = model(IDS, 0, all_positions=True)
        assert torch.equal(_chunked(model, IDS, [13, 9, 18]), whole)
        decoded = [model(IDS[:25], 0, all_positions=True)]
        decoded += [model(IDS[p : p + 1], p) for p in range(25, n)]
        assert torch.equal(torch.cat([decoded[0][0], torch.cat(decoded[1:])]), whole[0])
        model(IDS[:30], 0)
        for p in range(30, n):
            model(IDS[p : p + 1], p)
        sequence.rollback(model, 12)  # back to 28: the prefill's first 28 positions run again
        again = [model(IDS[p : p + 1], p) for p in range(28, n)]
        assert torch.equal(torch.cat(again), whole[0, 28:])
    assert all(not s.interventions for s in model.sites.values())
    assert not torch.equal(model(IDS, 0, all_positions=True), whole)  # it changed the forward


def _trace(model, ablation=None):
    trace = ForwardTrace()
    if ablation is None:
        model(IDS, 0, trace=trace)
    else:
        with model.intervene(ablation):
            model(IDS, 0, trace=trace)
    return trace


def test_engram_off_passes_the_stream_on_unchanged(reference):
    model = reference
    layer = model.cfg.engram_layer_ids[0]
    names = [f"layers.{layer - 1}.resid_post", f"layers.{layer}.resid_pre"]
    with model.intervene(ablations.engram_off([layer])):
        _, cache = run_with_hooks(model, IDS, 0, names=names)
    assert torch.equal(cache.last(names[0]), cache.last(names[1]))
    assert _trace(model, ablations.engram_off([layer])).interventions == [f"layers.{layer}.engram: Engram off"]
    with pytest.raises(UnknownSiteError):  # a layer without Engram has no such site
        with model.intervene(ablations.engram_off([next(i for i in range(9) if i not in model.cfg.engram_layer_ids)])):
            pass


def test_removed_experts_are_replaced_by_the_routers_next_choices(reference):
    model, layer, gone = reference, 2, [0, 3]
    base = _trace(model).routing_by_layer()[layer]
    cut = _trace(model, ablations.remove_experts({layer: gone})).routing_by_layer()[layer]
    ids, weights = cut["expert_ids"][0], cut["weights"][0]
    assert not torch.isin(ids, torch.tensor(gone)).any()
    untouched = ~torch.isin(base["expert_ids"][0], torch.tensor(gone)).any(-1)  # tokens that chose neither
    assert untouched.any() and not untouched.all()
    assert torch.equal(ids[untouched], base["expert_ids"][0][untouched])
    assert torch.equal(weights[untouched], base["weights"][0][untouched])
    # a token that lost an expert kept its other choices and took the next-best in its place
    touched = ~untouched
    for before, after in zip(base["expert_ids"][0][touched], ids[touched]):
        kept = [e for e in before.tolist() if e not in gone]
        assert set(kept) <= set(after.tolist()) and len(set(after.tolist())) == len(before)
    total = model.cfg.route_scale
    assert torch.allclose(weights.sum(-1), torch.full((len(IDS),), total), atol=1e-5)  # renormalized


def test_zeroed_experts_keep_the_routing(reference):
    model, layer, gone = reference, 2, [1]
    base = _trace(model).routing_by_layer()[layer]
    cut = _trace(model, ablations.zero_experts({layer: gone})).routing_by_layer()[layer]
    assert torch.equal(cut["expert_ids"], base["expert_ids"])
    removed = cut["expert_ids"] == gone[0]
    assert removed.any() and not cut["weights"][removed].any()
    assert torch.equal(cut["weights"][~removed], base["weights"][~removed])


def test_experts_a_layer_lacks_or_too_many_are_refused(reference):
    model, n = reference, reference.cfg.n_routed_experts
    for request, message in (
        ({1: [n]}, f"experts 0 to {n - 1}"),
        ({1: list(range(n - model.cfg.n_activated_experts + 1))}, "leaves fewer than"),
    ):
        with pytest.raises(AblationError, match=message):
            with model.intervene(ablations.remove_experts(request)):
                model(IDS, 0)
    for bad in ({}, {1: []}, {1: [-1]}, {"1": [0]}):
        with pytest.raises(AblationError):
            ablations.remove_experts(bad)


def test_the_selections_dense_and_random(reference):
    model = reference
    base = _trace(model).attention_by_layer()
    dense = _trace(model, ablations.dense_selection()).attention_by_layer()
    handed = {}  # what each topk site was handed in the random run: the indexer's own selection

    def count(name, value, context):
        handed[int(name.split(".")[1])] = (value[0] >= 0).sum(-1)
        return value

    with model.intervene({"layers.*.attn.topk": count}):  # registered first, so it runs first
        drawn = _trace(model, ablations.random_selection(seed=1)).attention_by_layer()
    assert torch.equal(
        _trace(model, ablations.random_selection(seed=1)).attention_by_layer()[4]["selected"], drawn[4]["selected"]
    )
    for layer, rec in base.items():
        if "selected" not in rec:
            continue
        reach = rec["reachable"]
        assert torch.equal((dense[layer]["selected"][0] >= 0).sum(-1), reach)  # every reachable position
        picked = drawn[layer]["selected"][0]
        assert torch.equal((picked >= 0).sum(-1), handed[layer])  # as many as the indexer chose
        assert (picked < reach.unsqueeze(-1)).all()
        for row in picked:
            valid = row[row >= 0]
            assert len(valid.unique()) == len(valid)
    assert any(not torch.equal(drawn[i]["selected"], base[i]["selected"]) for i in base if "selected" in base[i])


def test_a_plain_residual_keeps_the_copies_equal(reference):
    model = reference
    first_engram = min(model.cfg.engram_layer_ids)

    def equal_copies(cache, name):
        stream = cache.last(name)  # [b, s, hc, dim]
        return torch.equal(stream, stream[:, :, :1].expand_as(stream))

    with model.intervene(ablations.plain_residual()):
        _, cache = run_with_hooks(model, IDS, 0, names=["layers.*.resid_post"])
    # up to the first Engram layer; its gates give each copy its own update
    assert all(equal_copies(cache, f"layers.{i}.resid_post") for i in range(first_engram))
    assert not equal_copies(cache, f"layers.{first_engram}.resid_post")
    with model.intervene({**ablations.plain_residual(), **ablations.engram_off()}):
        _, cache = run_with_hooks(model, IDS, 0, names=["layers.*.resid_post"])
    assert all(equal_copies(cache, name) for name in cache)


def test_patching_writes_the_clean_run_at_the_chosen_sites_and_positions(parity):
    model = parity
    corrupted = IDS[:20] + [IDS[20] + 1] + IDS[21:]
    # the last block's streams before and after attention: its FFN collapse reads the mix of the
    # first, and the FFN and the final collapse the second
    top = [f"layers.{model.cfg.n_layers - 1}.{local}" for local in ("resid_pre", "resid_mid")]
    clean = ablations.clean_activations(model, IDS, [*top, "layers.0.resid_pre"], all_positions=True)
    clean_logits = model(IDS, 0, all_positions=True)
    corrupt_logits = model(corrupted, 0, all_positions=True)
    assert not torch.equal(clean_logits, corrupt_logits)
    # there at every position: the logits are the clean run's
    with model.intervene(ablations.patch({name: clean[name] for name in top})):
        assert torch.equal(model(corrupted, 0, all_positions=True), clean_logits)
        assert torch.equal(_chunked(model, corrupted, [7, 21, 12]), clean_logits)
    # the first layer's input at the corrupted position alone: positions before it are the corrupted run's
    with model.intervene(ablations.patch({"layers.0.resid_pre": clean["layers.0.resid_pre"]}, positions=[20])):
        patched = model(corrupted, 0, all_positions=True)
        assert torch.equal(_chunked(model, corrupted, [19, 3, 18]), patched)
    assert torch.equal(patched[:, :20], corrupt_logits[:, :20]) and not torch.equal(patched, corrupt_logits)
    with pytest.raises(AblationError, match="position axis"):
        ablations.patch({"layers.0.ffn.gate": clean[top[0]]})
    with pytest.raises(AblationError, match="past the clean run"):
        with model.intervene(ablations.patch({top[0]: clean[top[0]][:, :10]}, positions=[15])):
            model(corrupted, 0)


@pytest.fixture(scope="module")
def released_small(tmp_path_factory):
    """The released layer plan at small widths (`dsv41 make-synthetic --small`): random dense
    weights, routed experts and Engram tables as holes (zeros), under Numerics.parity()."""
    from dsv41.checkpoint.released_synthetic import write_released_synthetic

    folder = str(tmp_path_factory.mktemp("released-small") / "ck")
    write_released_synthetic(folder, small=True, progress=False, log=lambda _: None)
    return dsv41.load(folder, quiet=True, numerics=Numerics.parity(), max_seq_len=64)


def test_every_ablation_runs_on_the_released_layer_plan(released_small):
    model = released_small
    ids = IDS[:24]
    base = model(ids, 0, all_positions=True)
    # the experts and Engram rows are holes (zeros), so taking them away changes nothing here
    holes = ("engram_off", "remove_experts", "zero_experts")
    for name, make in ABLATIONS.items():
        with model.intervene(make(model.cfg)):
            whole = model(ids, 0, all_positions=True)
            assert whole.isfinite().all() and torch.equal(whole, base) == (name in holes), name
            if name not in holes:
                assert torch.equal(_chunked(model, ids, [11, 13]), whole), name
