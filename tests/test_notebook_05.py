"""Notebook 05 (generation) executed in smoke mode on the embedded default, with assertions on the
numbers its sidecars carry (as tests/test_notebooks.py does for 01 and 02)."""

import math

import nbformat
import pytest
import torch
from conftest import notebook_group, run_notebooks_smoke, sidecar

from dsv41.core.config import RELEASED, TINY, load_config
from dsv41.core.numerics import Numerics
from dsv41.observe import cache_policy
from dsv41.observe.cache_policy import replay_counts
from dsv41.widgets import chance_balance
from dsv41.widgets.ties import never_cut

pytestmark = notebook_group("05")

EXPECTED_OUTPUTS = sorted(
    [
        f"05_{stem}.{ext}"
        for stem in ("routing", "expert_cache", "ties", "expert_policy", "chunked_prefill", "rollback")
        for ext in ("json", "png", "svg")
    ]
    + ["05_generation_facts.json"]
)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_checkpoint):
    """Notebook 05 executed once in smoke mode on the session's tiny checkpoint (never the user
    cache) for these tests."""
    # one torch thread in the kernel: two threads on two shared cores run the tiny model several
    # times slower than one
    run, summary = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, "05")
    assert sorted(summary["notebooks"][0]["outputs"]) == EXPECTED_OUTPUTS
    return run


_sidecar = sidecar


@pytest.mark.slow
def test_load_report_accounts_for_every_tensor(smoke_run):
    facts = _sidecar(smoke_run, "05_generation_facts")
    assert facts["smoke"] is True and facts["max_new_tokens"] == 6
    cfg = load_config(facts["checkpoint"])
    load = facts["load"]
    assert load["accounted"] == load["checkpoint_tensors"] == sum(load["buckets"].values())
    assert load["accounted_names_equal"] and load["unexpected"] == []
    assert load["bytes_retained"] == load["predicted_bytes_retained"] > 0
    assert load["parameters_filled"] == load["model_parameters"]
    assert load["buckets"]["loaded"] == load["tensors_read"]
    # every routed expert stays on disk: w1, w2, w3 and their scales per expert and layer, the
    # draft stages' own experts included
    draft_experts = cfg.moe_shape(cfg.n_layers)[0] * cfg.n_mtp_layers
    assert (
        load["buckets"]["routed experts (read on demand)"] == (cfg.n_layers * cfg.n_routed_experts + draft_experts) * 6
    )
    assert facts["timings"] == {"per_token_recorded": 6, "generated": 6, "all_positive": True}


@pytest.mark.slow
def test_routing_sidecar(smoke_run):
    facts = _sidecar(smoke_run, "05_generation_facts")
    routing = _sidecar(smoke_run, "05_routing")
    n, k = routing["n_tokens"], routing["top_k"]
    assert k == load_config(facts["checkpoint"]).n_activated_experts
    assert n["prefill"] + n["decode"] == n["all"] == facts["routing"]["n_positions"]
    assert facts["routing"]["load_sums"] == [n["all"] * k] * len(routing["layers"])
    # per layer and expert, the prefill's and the decode's tokens make up all of them
    load = routing["load"]
    for prefill, decode, both in zip(load["prefill"], load["decode"], load["all"]):
        assert [a + b for a, b in zip(prefill, decode)] == both
    assert all(facts["routing"]["prefill_plus_decode_equals_all"])
    assert n["decode"] == 5  # 6 new tokens: the last never goes through the model
    for phase in ("all", "prefill", "decode"):
        assert [sum(row) for row in routing["load"][phase]] == [n[phase] * k] * len(routing["layers"])
        balance = routing["balance"][phase]
        assert all(m >= 1.0 for m in balance["max_over_mean"]) and all(0 <= h <= 1 for h in balance["entropy"])
        # the chance line and band drawn: uniform random routing of the phase's token count
        assert routing["chance"][phase] == chance_balance(n[phase], routing["n_experts"], k)
        for kind in ("text", "image"):
            part = routing["by_tokens"][kind]
            assert part["chance"][phase] == chance_balance(part["n_tokens"][phase], routing["n_experts"], k)
    assert facts["routing"]["weights_sum_to_route_scale"]


@pytest.mark.slow
def test_cache_hits_and_misses_are_the_routed_lookups_and_the_replay_reproduces_them(smoke_run):
    facts = _sidecar(smoke_run, "05_generation_facts")
    cache = _sidecar(smoke_run, "05_expert_cache")
    capacity = cache["capacity"]
    assert capacity == facts["expert_cache"] == 6
    assert facts["cache"]["counters_only_this_run"]  # a freshly loaded model: the counters are this run's
    # the phase structure the (not exported) timings figure shows: one call over the prompt, then one per token
    n = _sidecar(smoke_run, "05_routing")["n_tokens"]
    assert cache["steps"] == [{"start_pos": 0, "seqlen": n["prefill"]}] + [
        {"start_pos": n["prefill"] + i, "seqlen": 1} for i in range(n["decode"])
    ]
    for i, layer in enumerate(cache["layers"]):
        calls = cache["lookup_ids"][str(layer)]
        assert all(call == sorted(set(call)) and all(0 <= e < cache["n_experts"] for e in call) for call in calls)
        recorded = [[h, m] for h, m in zip(cache["hits"][i], cache["misses"][i])]
        assert replay_counts(calls, capacity) == recorded, layer  # replayed here from the sidecar alone
        assert recorded[0][0] == 0  # a freshly loaded model: the prefill finds the cache cold
        row = facts["cache"]["per_layer"][str(layer)]
        assert row["hits"] + row["misses"] == row["lookups"] == sum(map(len, calls)) <= row["token_choices"]
        assert (row["counter_hits"], row["counter_misses"]) == (row["hits"], row["misses"])
        assert (row["record_hits"], row["record_misses"]) == (row["hits"], row["misses"])
        assert row["replay_per_call_equal"], layer  # the notebook's own replay, call by call
    rates = cache["replay_hit_rate"]
    assert rates[cache["replay_sizes"].index(capacity)] == cache["recorded_hit_rate"]
    assert rates[0] == 0.0 and all(a <= b for a, b in zip(rates, rates[1:]))
    assert rates[-1] == pytest.approx(1 - sum(cache["distinct"]) / sum(cache["lookups"]))
    held = facts["cache"]
    assert held["replay_hit_rate_at_capacity"] == held["recorded_hit_rate"] == cache["recorded_hit_rate"]
    assert (
        abs(held["replay_hit_rate_all_experts"] - held["compulsory_hit_rate"]) < 1e-12
    )  # all experts held: only first reads miss


@pytest.mark.slow
def test_under_a_budget_the_cache_figure_is_the_shared_pool(tmp_path_factory, tiny_checkpoint):
    """With `memory` the experts sit in one pool of slots for every layer: the notebook replays
    that pool (the running cache's own bookkeeping), which reproduces the run's counts, and its
    figure and table speak of the pool, not of a cache per layer."""
    import dsv41

    plan = dsv41.load(tiny_checkpoint, quiet=True, threads=1, memory="2GiB").report.budget_plan  # as the notebook loads
    fixed = plan["dense"] + plan["kv"] + plan["draft"] + plan["baseline"]
    memory = fixed + 40 * plan["slot_bytes"]  # 40 slots for the tiny model's layers
    run, _ = run_notebooks_smoke(tmp_path_factory, tiny_checkpoint, "05", parameters={"memory": str(memory)})
    facts, cache = _sidecar(run, "05_generation_facts"), _sidecar(run, "05_expert_cache")
    pool = cache["pool"]
    assert pool == facts["cache"]["pool"] and pool["slots"] == cache["capacity"] == 40
    assert pool["layers_sharing"] == len(cache["layers"]) and pool["policy"] == "decay"
    assert pool["replay_equals_recorded"] and pool["replay_hit_rate"] == cache["recorded_hit_rate"]
    assert pool["replay_hits"] == sum(map(sum, cache["hits"]))
    assert pool["replay_misses"] == sum(map(sum, cache["misses"]))
    assert "replay_at_capacity" not in cache  # no per-layer LRU claims this run's counts
    executed = nbformat.read(run / "05_generation.ipynb", as_version=4)
    shown = "".join(str(o.get("data", {}).get("text/html", "")) for c in executed.cells for o in c.get("outputs", []))
    assert "expert pool of 40 slots shared by" in shown and "equal to the run: True" in shown


@pytest.mark.slow
def test_policy_replay_reproduces_the_cache_and_belady_bounds_every_policy(smoke_run):
    facts = _sidecar(smoke_run, "05_generation_facts")
    policy, cache = _sidecar(smoke_run, "05_expert_policy"), _sidecar(smoke_run, "05_expert_cache")
    cfg = load_config(facts["checkpoint"])
    assert (
        facts["policy"]["round_trip_routing_equal"] and facts["policy"]["round_trip_dict_equal"]
    )  # the trace file lost nothing
    sizes, capacity = policy["capacities"], facts["expert_cache"]
    assert sizes == list(range(cfg.n_routed_experts + 1)) and policy["capacity"] == capacity
    at_run = sizes.index(capacity)
    # a miss reads w1, w2, w3 [inter x dim] of the released geometry as packed FP4 (half a byte each)
    # plus one E8M0 scale per 32 values
    inter_dim = RELEASED.moe_inter_dim * RELEASED.dim
    assert policy["bytes_per_miss"] == 3 * (inter_dim // 2 + inter_dim // 32) == cache_policy.expert_bytes()
    # LRU is the loader's ExpertCache: the recorded counts at the run's size, section 5's replay at every size
    per_layer = facts["cache"]["per_layer"]
    for i, layer in enumerate(policy["layers"]):
        assert policy["hits"]["lru"][i][at_run] == per_layer[str(layer)]["hits"], layer
        assert policy["lookups"][i] - policy["hits"]["lru"][i][at_run] == per_layer[str(layer)]["misses"], layer
    assert policy["hit_rate"]["lru"][at_run] == cache["recorded_hit_rate"]
    assert all(abs(a - b) < 1e-12 for a, b in zip(policy["hit_rate"]["lru"], cache["replay_hit_rate"]))
    compulsory = 1 - sum(policy["distinct"]) / sum(policy["lookups"])
    nothing_cached = sum(policy["decode_lookups"]) * policy["mib_per_miss"] / policy["decode_tokens"]
    for p in policy["policies"]:
        rates = policy["hit_rate"][p]
        assert rates[0] == 0.0 and abs(rates[-1] - compulsory) < 1e-12, p  # nothing kept; everything kept
        assert all(a <= b for a, b in zip(rates, rates[1:])), p  # more room never hurts any of the four
        # Belady bounds every policy, in every layer at every size
        assert all(
            h <= b for row, best in zip(policy["hits"][p], policy["hits"]["belady"]) for h, b in zip(row, best)
        ), p
        # with nothing cached every decode lookup reads one expert
        assert abs(policy["disk_mib_per_decode_token"][p][0] - nothing_cached) < 1e-9, p


@pytest.mark.slow
def test_prefill_and_decode_agree_until_the_first_cut(smoke_run):
    facts = _sidecar(smoke_run, "05_generation_facts")
    cfg = load_config(facts["checkpoint"])
    ties = _sidecar(smoke_run, "05_ties")
    cut = ties["first_cut"]
    assert cut == cfg.index_topk  # the ratio-1 indexer reaches index_topk + 1 positions first at position 8
    assert all(g is None for row in ties["gap"] for g in row[:cut])
    assert all(g >= 0 for row in ties["gap"] for g in row if g is not None)
    # the view holds the model as loaded, with the reference's arithmetic: before the cut the logits
    # part by rounding only (within a bf16 step of their scale), selections and routing not at all
    cmp, reference = ties["comparison"], facts["reference"]
    assert reference["numerics"] == Numerics().as_dict()
    assert cmp["positions"] == reference["positions"] == 20  # smoke: the comparison is capped
    assert cmp["max_abs_diff"] == reference["max_abs_diff"]
    assert max(cmp["max_abs_diff"][:cut]) <= torch.finfo(torch.bfloat16).eps * cmp["max_abs_logit"]
    assert math.isfinite(reference["untruncated_max_abs_diff"])
    assert reference["first_argmax_divergence"] is None or reference["first_argmax_divergence"] >= cut
    assert cmp["first_argmax_divergence"] is None or cmp["first_argmax_divergence"] >= cut
    # under the parity options: bit for bit until the cut
    parity = facts["parity"]
    assert parity["numerics"] == Numerics.parity().as_dict()
    assert parity["identical_until_first_cut"] and parity["untruncated_positions"] == cut
    assert parity["max_abs_diff"][:cut] == [0.0] * cut
    assert parity["first_logit_divergence"] is None or parity["first_logit_divergence"] >= cut
    partings = list(cmp["selection_parting"].values()) + list(cmp["routing_parting"].values())
    assert all(p >= cut for positions in partings for p in positions)
    firsts = list(parity["selection_parting"].values()) + list(parity["routing_parting"].values())
    assert all(p >= cut for p in firsts)
    assert len(ties["margins"]) == 6 and all(m >= 0 for m in ties["margins"])
    # the rows the gap panel leaves out (named in its title) are those that never cut
    assert ties["never_cut"] == never_cut(ties["rows"], ties["gap"])
    assert all(all(g is None for g in ties["gap"][ties["rows"].index(row)]) for row in ties["never_cut"])
    # and with parity()'s tie rule and stale-key fix as well: past the cut too, at every position
    assert parity["max_abs_diff"] == [0.0] * parity["positions"] and parity["first_logit_divergence"] is None
    assert parity["selection_parting"] == parity["routing_parting"] == {}


@pytest.mark.slow
def test_executed_notebook_keeps_its_figures_and_names_the_embedded_model(smoke_run):
    nb = nbformat.read(str(smoke_run / "05_generation.ipynb"), as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4  # three views and the timings
    assert any("trained miniature" in c.source for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.slow
def test_every_chunking_is_the_one_shot_prefill_under_parity(smoke_run):
    facts = _sidecar(smoke_run, "05_generation_facts")
    chunked = _sidecar(smoke_run, "05_chunked_prefill")
    n, ratio, window = chunked["n_positions"], chunked["compress_ratio"], chunked["window"]
    prompt_tokens = len(_sidecar(smoke_run, "05_rollback")["prompt_ids"])
    assert (
        n == prompt_tokens + facts["max_new_tokens"] - 1 == len(chunked["ids"])
    )  # every id that went through the model
    assert (ratio, window) == (max(TINY.compress_ratios), TINY.window_size)
    sizes = chunked["chunkings"]
    assert all(sum(s) == n and all(c >= 1 for c in s) for s in sizes.values())
    assert sizes["one shot"] == [n] and sizes["one token per call"] == [1] * n
    ends = [sum(s[: i + 1]) for s in sizes.values() for i in range(len(s) - 1)]  # where a call ends before the last
    assert any(end % ratio for end in ends)  # one ends inside a compression group
    assert any(max(s) > window for s in sizes.values() if len(s) > 1)  # one chunk outruns the window
    assert any(len(s) > 2 and all(c > window for c in s[:-1]) for s in sizes.values())  # chunks that each wrap the ring
    numerics = chunked["numerics"]
    assert numerics == {"reference": Numerics().as_dict(), "parity": Numerics.parity().as_dict()}
    # parity: every chunking gives the one-shot logits bit for bit, at every position
    for name, diffs in chunked["max_abs_diff"]["parity"].items():
        assert diffs == [0.0] * n, name
    # the reference: only one shot is one shot; decoding token by token parts (by rounding first), and
    # the other chunkings part too; finite everywhere, and reported
    reference = chunked["max_abs_diff"]["reference"]
    assert reference["one shot"] == [0.0] * n and max(reference["one token per call"]) > 0
    assert all(d >= 0 and d == d and d != float("inf") for diffs in reference.values() for d in diffs)
    assert facts["chunked_prefill"]["max_abs_diff"] == {
        k: {c: max(d) for c, d in v.items()} for k, v in chunked["max_abs_diff"].items()
    }
    assert chunked["max_abs_logit"]["reference"] > 0 and chunked["max_abs_logit"]["parity"] > 0


@pytest.mark.slow
def test_rollback_continues_as_a_fresh_run(smoke_run):
    facts = _sidecar(smoke_run, "05_generation_facts")
    rb = _sidecar(smoke_run, "05_rollback")
    n_new, prompt, other = facts["max_new_tokens"], rb["prompt_ids"], rb["other_ending_ids"]
    assert rb["numerics"] == Numerics.parity().as_dict()
    keep = rb["keep"]
    assert keep == 2 * len(prompt) // 3 and keep % 2 == 1  # the kept part ends inside a ratio-2 group
    # the first run: the prompt (two calls) and all but the last new token; back to the end of the first call
    assert rb["position_before"] == len(prompt) + n_new - 1
    assert rb["rolled_back"] == rb["position_before"] - keep and rb["position_after"] == keep
    assert rb["rollback_limit"] == 0  # every call is still remembered
    assert rb["reused_positions"] == {"first": 0, "second": keep, "fresh": 0}
    assert other and other != prompt[keep : keep + len(other)]  # continued differently
    gen = rb["generated"]
    assert len(gen["first"]) == len(gen["second"]) == n_new and gen["second"] == gen["fresh"]
    # bit for bit against the fresh run: ids, margins, routing ids and weights, logits
    assert rb["equal_to_fresh"] == {
        "ids": True,
        "margins": True,
        "routing_ids": True,
        "routing_weights": True,
        "logits": True,
    }
    assert rb["max_abs_logit_diff_to_fresh"] == 0.0
    assert facts["rollback"]["equal_to_fresh"] == rb["equal_to_fresh"] and facts["rollback"]["keep"] == keep
    # the diverging part's routing, per layer: one row of k distinct expert ids per position from the rollback point
    k, n_experts, layers = rb["top_k"], rb["n_experts"], rb["layers"]
    assert (k, n_experts) == (TINY.n_activated_experts, TINY.n_routed_experts) and layers == list(range(TINY.n_layers))
    lengths = {"first": rb["position_before"] - keep, "second": len(other) + n_new - 1}
    for run, length in lengths.items():
        for layer in layers:
            rows = rb["expert_ids"][run][str(layer)]
            assert len(rows) == length and all(len(set(r)) == k and all(0 <= e < n_experts for e in r) for r in rows)
    # the shared panel is the overlap of the two runs' expert sets, position by position
    common = min(lengths.values())
    assert rb["shared"] == [
        [
            len(set(a) & set(b))
            for a, b in zip(
                rb["expert_ids"]["first"][str(layer)][:common], rb["expert_ids"]["second"][str(layer)][:common]
            )
        ]
        for layer in layers
    ]
