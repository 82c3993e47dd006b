"""Routed experts under a memory budget: the budget's arithmetic, the slot cache's positioned reads
(bit-identical experts and logits), the eviction rules shared with the policy lab, one read per
expert per call, and `dsv41 bench stream` end to end on a tiny geometry."""

import json
import os

import pytest
import torch

import dsv41
from dsv41.checkpoint.checkpoint import Checkpoint
from dsv41.checkpoint.eviction import Residency, replay_calls
from dsv41.checkpoint.stores import ExpertCache, SlotCache
from dsv41.core.argtypes import byte_size
from dsv41.generation.generate import decode_n, generate, prefill
from dsv41.observe.cache_policy import pool_hit_rates, pool_steps
from dsv41.runtime.budget import BudgetError, plan_budget, routed_expert_bytes

PROMPT = "the slot cache reads experts from disk while the others are computed"


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    return dsv41.load(tiny_checkpoint, quiet=True, threads=1)


def _memory_for(cfg, slots: int, max_seq_len: int) -> int:
    """The budget that leaves exactly `slots` expert slots."""
    return plan_budget(cfg, 1 << 40, max_seq_len=max_seq_len).budget_for(slots)


def _budgeted(path, cfg, slots, max_seq_len=64, **kw):
    return dsv41.load(
        path, quiet=True, threads=1, max_seq_len=max_seq_len, memory=_memory_for(cfg, slots, max_seq_len), **kw
    )


# ---------------------------------------------------------------------- the budget
def test_memory_sizes_read_binary_and_decimal_units():
    assert byte_size("16GiB") == 16 << 30 and byte_size("12GB") == 12 * 10**9 and byte_size("512 MiB") == 512 << 20
    for bad in ("16G", "-1GiB", "many", "", "nanGiB"):
        with pytest.raises(ValueError, match="memory size"):
            byte_size(bad)


def test_the_budget_gives_what_is_left_to_whole_expert_slots(plain):
    cfg = plain.cfg
    plan = plan_budget(cfg, "4GiB", max_seq_len=64)
    fixed = plan.dense + plan.kv + plan.draft + plan.baseline
    assert plan.fixed == fixed
    assert plan.slot_bytes == routed_expert_bytes(cfg) == ExpertCache(plain.checkpoint, 1).fetch(0, [0])[0].nbytes
    every = cfg.n_layers * cfg.n_routed_experts + sum(
        cfg.moe_shape(cfg.n_layers + stage)[0] for stage in range(cfg.n_mtp_layers if plan.draft else 0)
    )
    assert plan.n_experts == every
    # a few slots short of every expert: the rest of the budget, to the last whole slot
    short = plan.budget_for(every - 3) + plan.slot_bytes - 1
    assert plan_budget(cfg, short, max_seq_len=64).slots == (short - fixed) // plan.slot_bytes == every - 3
    assert "of the" in plan_budget(cfg, short, max_seq_len=64).line()
    # 4 GiB holds the tiny model's experts many times over: one slot each, the rest unspent
    assert (4 * 2**30 - fixed) // plan.slot_bytes > every and plan.slots == every and plan.holds_every_expert
    assert plan.minimum == fixed + cfg.n_activated_experts * plan.slot_bytes
    assert "every expert fits" in plan.line() and plan.as_dict()["slots"] == plan.slots


def test_a_budget_below_the_minimum_names_it(plain):
    plan = plan_budget(plain.cfg, "4GiB", max_seq_len=64)
    hundredths = -(-plan.minimum * 100 // 2**30)  # rounded up: the size named is enough
    with pytest.raises(BudgetError, match=rf"give at least {hundredths // 100}\.{hundredths % 100:02d} GiB"):
        plan_budget(plain.cfg, plan.minimum - 1, max_seq_len=64)


def test_the_load_report_says_how_the_budget_was_spent(tiny_checkpoint, plain):
    model = _budgeted(tiny_checkpoint, plain.cfg, 12)
    assert isinstance(model.experts, SlotCache) and model.experts.slots == 12
    assert "12 expert slots" in model.report.budget and "policy decay" in model.report.budget
    assert model.report.budget in model.report.summary()


# ---------------------------------------------------------------------- the slot cache
@pytest.mark.parametrize("reader, drop", [("direct", "auto"), ("preadv", "auto"), ("pread", False)])
def test_slot_reads_are_the_stored_bytes(plain, reader, drop):
    ckpt = Checkpoint(plain.checkpoint.path)
    old = ExpertCache(ckpt, capacity=0)
    cache = SlotCache(ckpt, 3, reader=reader, drop_pages=drop, n_layers=plain.cfg.n_layers, policy="lru")
    assert cache.drop_pages == (drop == "auto" and hasattr(os, "posix_fadvise"))
    if reader == "direct":
        assert cache.reader == ("direct" if hasattr(os, "O_DIRECT") else "preadv")
        assert cache._pool.data_ptr() % 4096 == 0 and cache._pool.stride(0) % 4096 == 0
    else:
        assert cache.reader == reader and ("dropped" in cache.page_cache) == cache.drop_pages
    for layer, ids in ((0, [1, 5, 9]), (1, [0, 2]), (0, [7, 9])):
        got = cache.fetch(layer, ids)
        for e, packed in zip(ids, got):
            for a, b in zip(packed, old.fetch(layer, [e])[0]):
                assert (
                    a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                )
    assert cache.counters.bytes_read == cache.stats.bytes_read == 6 * cache.slot_bytes  # 3 + 2 + 1 misses
    assert [got.hits, got.misses] == [1, 1]  # expert 9 of layer 0 was still held
    if cache.reader == "direct":  # the shards of this folder opened directly, or the report says why not
        assert "O_DIRECT" in cache.page_cache
        assert any(direct for _, direct in cache._fds) or "would not open" in cache.page_cache
    cache.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system: the direct reader is not offered")
@pytest.mark.parametrize("refusal", ["open", "read"])
def test_a_file_system_that_refuses_direct_reads_gets_buffered_ones(plain, monkeypatch, refusal):
    """tmpfs refuses O_DIRECT at open, some file systems at the read: either way the experts are
    the stored bytes, read buffered, and the report says which shard."""
    import errno

    ckpt = Checkpoint(plain.checkpoint.path)
    old = ExpertCache(ckpt, capacity=0)
    cache = SlotCache(ckpt, 3, reader="direct", n_layers=plain.cfg.n_layers, policy="lru")
    real_open, real_preadv, direct_fds = os.open, os.preadv, set()

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT and refusal == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_preadv(fd, buffers, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "preadv", refusing_preadv)
    for layer, ids in ((0, [1, 5, 9]), (1, [0, 2])):
        for e, packed in zip(ids, cache.fetch(layer, ids)):
            for a, b in zip(packed, old.fetch(layer, [e])[0]):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert "buffered" in cache.page_cache and ckpt.entries["layers.0.ffn.experts.1.w1.weight"][0] in cache.page_cache
    cache.close()


@pytest.mark.parametrize("slots", [5, 40])
def test_logits_are_identical_with_the_slot_cache(tiny_checkpoint, plain, slots):
    """5 slots: every long call overflows the pool and reads in chunks; 40: hits and misses overlap."""
    model = _budgeted(tiny_checkpoint, plain.cfg, slots, max_seq_len=plain.backbone.max_seq_len)
    ids = plain.encode(PROMPT)
    for m in (plain, model):
        m.reset()
    assert torch.equal(prefill(plain, ids), prefill(model, ids))
    a = decode_n(plain, 7, 6)
    b = decode_n(model, 7, 6)
    assert a == b
    stats = model.experts.stats
    wrong_guesses = stats.read_ahead - stats.read_ahead_used
    assert (
        model.experts.counters.bytes_read
        == stats.bytes_read
        == (sum(model.experts.counters.misses.values()) + wrong_guesses) * model.experts.slot_bytes
    )


def test_reading_ahead_changes_no_logit_and_its_guesses_are_used(tiny_checkpoint, plain):
    """The same run with and without the next layer's experts read ahead: identical logits and
    tokens; with it, decode steps read experts ahead, most of which the next layer takes."""
    runs = {}
    for ahead in (False, True):
        model = _budgeted(tiny_checkpoint, plain.cfg, 40, max_seq_len=plain.backbone.max_seq_len, read_ahead=ahead)
        model.reset()
        logits = prefill(model, plain.encode(PROMPT))
        runs[ahead] = (logits, decode_n(model, 7, 6), model.experts.stats, model.experts.counters)
    assert torch.equal(runs[False][0], runs[True][0]) and runs[False][1] == runs[True][1]
    off, on = runs[False][2], runs[True][2]
    assert off.read_ahead == 0 and on.read_ahead > 0
    assert 0 < on.read_ahead_used <= on.read_ahead
    # an expert read ahead is still a miss of the call that uses it: hits + misses per call are unchanged
    calls = lambda c: sum(c.hits.values()) + sum(c.misses.values())  # noqa: E731
    assert calls(runs[False][3]) == calls(runs[True][3])


def test_read_ahead_must_be_a_bool(tiny_checkpoint, plain):
    with pytest.raises(dsv41.LoadError, match="read_ahead must be True or False"):
        _budgeted(tiny_checkpoint, plain.cfg, 40, read_ahead="yes")


# ---------------------------------------------------------------------- the policies
def test_decay_keeps_a_frequent_expert_that_lru_evicts():
    calls = [(t, [key]) for t, key in enumerate("AAAABCA", start=1)]
    lru = replay_calls(calls, 2, "lru")
    decay = replay_calls(calls, 2, "decay", half_life=64)
    assert [h for h, _ in lru] == [0, 1, 1, 1, 0, 0, 0]  # C evicts A, the least recent
    assert [h for h, _ in decay] == [0, 1, 1, 1, 0, 0, 1]  # C evicts B, the least used


def test_a_call_never_evicts_what_it_still_needs():
    pool = Residency(4, "lru")
    pool.plan([1, 2, 3], 1)
    plan = pool.plan([1, 4, 5], 2)  # 1 is a hit; 4 and 5 must not take 1's slot
    assert {s for _, s in plan.misses}.isdisjoint({s for _, s in plan.hits})
    plan = pool.plan(list(range(10, 20)), 3)  # more than the pool: read in chunks of 2
    assert plan.chunk == 2 and len({s for _, s in plan.misses}) == 4


@pytest.mark.parametrize("policy", ["lru", "decay"])
def test_the_lab_replays_the_running_cache_exactly(tiny_checkpoint, plain, policy):
    model = _budgeted(
        tiny_checkpoint, plain.cfg, 20, max_seq_len=plain.backbone.max_seq_len, expert_policy=policy, read_ahead=False
    )  # the lab replays the calls' own reads, no guesses
    result = generate(model, PROMPT, max_new_tokens=12, trace=True)
    counters = model.experts.counters
    replayed = pool_hit_rates(pool_steps(result), 20, policies=(policy, "belady"))
    assert replayed[policy]["hits"] == sum(counters.hits.values())
    assert replayed[policy]["misses"] == sum(counters.misses.values())
    assert replayed["belady"]["hits"] >= replayed[policy]["hits"]


# ---------------------------------------------------------------------- one read per expert per call
def test_a_prefill_reads_each_expert_once(tiny_checkpoint, plain):
    model = _budgeted(tiny_checkpoint, plain.cfg, 1000, max_seq_len=plain.backbone.max_seq_len)
    result = generate(model, PROMPT, max_new_tokens=1, trace=True)
    prefill_keys = [key for layer in pool_steps(result)[0] for key in layer]
    tokens = len(model.encode(PROMPT))
    step = model.experts.counters.steps[0]
    assert step["bytes"] == len(set(prefill_keys)) * model.experts.slot_bytes
    assert len(set(prefill_keys)) < tokens * plain.cfg.n_activated_experts * plain.cfg.n_layers  # not once per token


def test_clearing_the_slot_cache_starts_it_cold(tiny_checkpoint, plain):
    model = _budgeted(tiny_checkpoint, plain.cfg, 1000, max_seq_len=plain.backbone.max_seq_len)
    ids = model.encode(PROMPT)
    model(ids, 0)
    cold = dict(model.experts.counters.steps[0])
    model(ids, 0)  # warm: everything it asks for is held
    assert sum(model.experts.counters.hits.values()) > 0
    model.experts.clear()
    counters = model.experts.counters
    assert counters.hits == {} and counters.misses == {} and counters.steps == [] and counters.bytes_read == 0
    model(ids, 0)  # reads again exactly what the first cold call read
    assert sum(counters.hits.values()) == 0 and counters.steps[0]["bytes"] == cold["bytes"]


# ---------------------------------------------------------------------- bench stream
def test_bench_stream_runs_end_to_end_on_a_tiny_geometry(tmp_path, capsys):
    from dsv41.bench.cli import cli_main

    out = tmp_path / "stream.json"
    argv = [
        "stream",
        "--dir",
        str(tmp_path / "ck"),
        "--small",
        "--experts",
        "16",
        "--memory",
        "2GiB",
        "--tokens",
        "3",
        "--prompt",
        "3",
        "--disk-probe-mib",
        "8",
        "--recorded-tokens",
        "4",
        "--io-threads",
        "2",
        "--json",
        str(out),
    ]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    wrong_guesses = run["read_ahead"] - run["read_ahead_used"]  # read ahead, not used by the next layer
    assert (
        run["bytes_read_per_token"]
        == (run["misses"] + wrong_guesses) * run["budget"]["slot_bytes"] / run["decode_tokens"]
    )
    assert run["prefill_bytes_read"] == run["prefill_distinct_experts"] * run["budget"]["slot_bytes"]
    for key in (
        "disk_bytes_per_s_before",
        "disk_bytes_per_s_after",
        "in_flight_read_fraction",
        "fraction_of_disk_floor",
        "peak_rss_bytes",
        "seconds_per_token",
    ):
        assert run[key] is not None and run[key] > 0, key
    assert isinstance(run["in_flight_measurement_error"], bool) and isinstance(run["floor_measurement_error"], bool)
    for label in ("uniform (random weights)", "recorded (miniature routing, same fraction held)"):
        rates = run["policies"][label]
        assert rates["belady"]["hits"] >= max(rates["lru"]["hits"], rates["decay"]["hits"])
    assert set(run["prediction"]) == {"this machine", "NVMe workstation", "note"}
    printed = capsys.readouterr().out
    assert "uniform (random weights)" in printed and "recorded (miniature routing" in printed
    assert cli_main(argv) == 0 and "reusing the checkpoint" in capsys.readouterr().out


def test_large_tensors_are_filled_in_slabs_with_the_same_values(tiny_checkpoint, plain, monkeypatch):
    from dsv41.runtime import loader

    monkeypatch.setattr(loader, "SLAB_BYTES", 4096)  # every large-enough tensor of the tiny checkpoint goes by slabs
    model = _budgeted(tiny_checkpoint, plain.cfg, 40, max_seq_len=plain.backbone.max_seq_len)
    for (name, a), (_, b) in zip(plain.backbone.named_parameters(), model.backbone.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b
        ), name
    assert model.report.parameters_filled == plain.report.parameters_filled
    assert len(model.report.dequantized) == len(plain.report.dequantized)


def test_auto_reads_small_experts_buffered_and_released_sized_ones_directly(plain):
    """Widening a miniature's 13 KiB experts (six ranges) to 4 KiB boundaries would grow each slot
    several times over: "auto" reads those buffered and says why; a released expert (one 17.93 MiB
    range) grows by a few KiB per tensor, under DIRECT_SLACK."""
    from dsv41.checkpoint.stores import DIRECT_ALIGN, DIRECT_SLACK

    cache = SlotCache(Checkpoint(plain.checkpoint.path), 3, n_layers=plain.cfg.n_layers)
    assert cache.reader != "direct" and "too small for direct reads" in cache.page_cache
    assert cache.pool_bytes == 3 * cache.slot_bytes
    cache.close()
    from dsv41.checkpoint.inventory import expected_tensors
    from dsv41.core.config import RELEASED

    prefix = "layers.0.ffn.experts.0."  # w1, w2, w3 and their scales, as the inventory sizes them
    released = [t.nbytes for t in expected_tensors(RELEASED) if t.name.startswith(prefix)]
    assert len(released) == 6
    widest = sum(-(-(n + DIRECT_ALIGN - 1) // DIRECT_ALIGN) * DIRECT_ALIGN for n in released)
    assert sum(released) < widest <= sum(released) * (1 + DIRECT_SLACK)
