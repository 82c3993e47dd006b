"""Notebook 06 (DSpark) executed in smoke mode on the embedded default, with assertions on the
numbers its sidecars carry, each derived from the config or from the notebook's own runs."""

import pytest
from conftest import notebook_group, run_notebooks_smoke, sidecar

from dsv41.core.config import load_config

pytestmark = notebook_group("06")

EXPECTED_OUTPUTS = sorted(
    [
        f"06_{stem}.{ext}"
        for stem in ("draft_stack", "speculation", "known_acceptance", "verify_cost")
        for ext in ("json", "png", "svg")
    ]
    + ["06_dspark_facts.json"]
)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_checkpoint):
    run, summary = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, "06")
    assert sorted(summary["notebooks"][0]["outputs"]) == EXPECTED_OUTPUTS
    return run


def test_the_stack_and_the_draft_follow_the_config(smoke_run):
    facts = sidecar(smoke_run, "06_dspark_facts")
    cfg = load_config(facts["checkpoint"])
    stack = facts["stack"]
    assert stack["target_layers"] == list(cfg.dspark_target_layer_ids)
    assert stack["block_size"] == cfg.dspark_block_size and stack["stages"] == cfg.n_mtp_layers
    assert (stack["routed_experts"], stack["activated_experts"]) == cfg.moe_shape(cfg.n_layers)
    draft = facts["draft"]
    assert draft["ids_shape"] == [1, cfg.dspark_block_size + 1] and draft["ids"][0] == draft["anchor"]
    assert draft["logits_shape"] == [1, cfg.dspark_block_size, cfg.vocab_size]
    assert draft["confidence_shape"] == [1, cfg.dspark_block_size]
    assert draft["greedy_rows"]


def test_speculation_equals_plain_and_counts_add_up(smoke_run):
    facts = sidecar(smoke_run, "06_dspark_facts")
    spec = facts["speculative"]
    assert spec["equal_to_plain"] and all(spec["equal_to_plain"].values())
    assert spec["tokens"] == facts["max_new_tokens"] - 1
    assert spec["tokens_per_forward"] == pytest.approx(spec["tokens"] / spec["target_forwards"])
    view = sidecar(smoke_run, "06_speculation")
    assert len(view["accepted"]) == spec["steps"] and sum(view["target_forwards"]) == spec["target_forwards"]
    assert all(a <= k <= d for a, k, d in zip(view["accepted"], view["kept"], view["drafted"]))


def test_known_acceptance_is_exact(smoke_run):
    facts = sidecar(smoke_run, "06_dspark_facts")
    cfg = load_config(facts["checkpoint"])
    block = cfg.dspark_block_size
    known = facts["known_acceptance"]
    assert sorted(int(k) for k in known) == list(range(block + 1))
    for k, row in known.items():
        assert row["equal_to_plain"] and row["accepted_exactly_k"], k
        assert row["tokens"] == facts["max_new_tokens"] - 1
    # with every proposal right nothing is rolled back: one forward per step of up to block + 1 tokens
    full = known[str(block)]
    assert full["target_forwards"] == full["steps"]
    assert full["tokens_per_forward"] > known["0"]["tokens_per_forward"]
    assert full["tokens_per_forward"] > 1  # full acceptance: several tokens per forward


def test_verify_cost_bounds(smoke_run):
    cost = sidecar(smoke_run, "06_verify_cost")
    assert cost["overall"][0] == cost["topk"]  # one token reads its k experts
    for m, u in zip(cost["sizes"], cost["overall"]):
        assert cost["topk"] <= u <= min(m * cost["topk"], cost["n_experts"])
    assert cost["break_even_accepted"] == pytest.approx([u / cost["topk"] - 1 for u in cost["overall"]])
    assert all(
        a <= b + 1e-12 for a, b in zip(cost["overall"], cost["overall"][1:])
    )  # a longer verify never reads fewer
    # every one-token forward, at every start and layer, read exactly its k experts
    assert sidecar(smoke_run, "06_dspark_facts")["verify_cost"]["single_token_reads_topk"] is True


def test_reference_partings_sit_on_near_ties(smoke_run):
    """With the reference's arithmetic a speculative run may part from plain decoding only where the
    plain row's top-2 gap is within twice the two rows' difference there."""
    facts = sidecar(smoke_run, "06_dspark_facts")
    partings = facts["reference_partings"]
    assert list(partings) == [facts["prompt"]]  # smoke: the one prompt
    for prompt, entry in partings.items():
        assert entry["tokens"] == facts["max_new_tokens"], prompt
        assert entry["first_parting"] is None or entry["gap_within_twice_the_difference"], prompt
