"""Hardening of the memory budget: a size of any spelling is a whole number of bytes from 1 to
1 EiB or one sentence (never an OverflowError or a MemoryError), a budget above the machine's
memory is refused naming it before anything is allocated, the free slots of a pool of any size
cost nothing, the minimum a refusal names is enough, and `load` checks its expert policy with or
without a budget. The parser and the plan from it are fuzzed."""

import os
import re
import time
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dsv41  # noqa: E402
from dsv41.checkpoint.checkpoint import Checkpoint, LoadError  # noqa: E402
from dsv41.checkpoint.eviction import Residency, replay_calls  # noqa: E402
from dsv41.checkpoint.stores import SlotCache  # noqa: E402
from dsv41.core.argtypes import MAX_BYTES, byte_size  # noqa: E402
from dsv41.core.config import load_config  # noqa: E402
from dsv41.core.errors import Dsv41Error  # noqa: E402
from dsv41.runtime import budget  # noqa: E402
from dsv41.runtime.budget import GIB, BudgetError, plan_budget  # noqa: E402

UNITS = {
    "": 1,
    "b": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
# the sizes the issue found: each overflowed a float or built a list as long as the budget's slots
HUGE = ["1e100", "1e308GiB", "999999TiB", 10**400, 1e100, "1" + "0" * 5000, "1e" + "9" * 5000]


def fuzz(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def one_sentence(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint):
    return load_config(tiny_checkpoint)


def physical_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------- the parser
@pytest.mark.parametrize("size", HUGE, ids=lambda s: repr(s)[:16])
def test_a_huge_size_is_one_sentence_or_a_size_within_the_range(size):
    try:
        value = byte_size(size)
    except ValueError as exc:
        assert isinstance(exc, Dsv41Error)
        assert "at most" in one_sentence(exc)
    else:
        assert 1 <= value <= MAX_BYTES


def test_sizes_are_read_exactly_not_through_a_float():
    # 2**53 + 1 bytes is not a float; nor is 1.1 GiB's byte count
    assert byte_size(str(2**53 + 1)) == 2**53 + 1
    assert byte_size("1.1GiB") == int(Fraction("1.1") * GIB)
    assert byte_size("1e3MiB") == 1000 << 20 and byte_size(".5KiB") == 512
    assert byte_size("1024TiB") == 1 << 50 and byte_size(MAX_BYTES) == MAX_BYTES
    assert byte_size(np.float64(2.5e9)) == 2_500_000_000 and byte_size(np.int64(7)) == 7  # numpy's numbers too
    with pytest.raises(ValueError, match="at most"):
        byte_size(MAX_BYTES + 1)


NUMBER = st.builds(
    lambda whole, frac, exp: whole + frac + exp,
    st.from_regex(r"[0-9]{0,22}", fullmatch=True),
    st.sampled_from(["", "."]) | st.from_regex(r"\.[0-9]{1,12}", fullmatch=True),
    st.sampled_from([""]) | st.integers(-30, 30).map(lambda e: f"e{e}"),
)


@fuzz(300)
@given(number=NUMBER, unit=st.sampled_from(sorted(UNITS)), space=st.sampled_from(["", " "]))
def test_a_number_with_a_unit_is_its_exact_bytes_rounded_down(number, unit, space):
    text = f"{number}{space}{unit}"
    try:
        exact = Fraction(number) * UNITS[unit]
    except ValueError:  # "", ".", "e5": not a number
        exact = None
    try:
        value = byte_size(text)
    except ValueError as exc:
        one_sentence(exc)
        assert exact is None or not 1 <= exact // 1 <= MAX_BYTES, (text, exc)
    else:
        assert exact is not None and value == exact // 1 and 1 <= value <= MAX_BYTES


ANYTHING = (
    st.text(max_size=40)
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(HUGE + ["-0", "0.4", "-1GiB", "1e-400GiB", "inf", "nan", "1_000", "١٢", "16G"])
    | st.none()
    | st.booleans()
    | st.lists(st.integers(), max_size=2)
    | st.builds(lambda n, u: n + u, NUMBER, st.sampled_from(sorted(UNITS)))
)


@fuzz(400)
@given(size=ANYTHING)
def test_any_value_is_a_positive_size_or_one_sentence(size):
    began = time.perf_counter()
    try:
        value = byte_size(size)
    except ValueError as exc:
        assert isinstance(exc, Dsv41Error)
        one_sentence(exc)
    else:
        assert type(value) is int and 1 <= value <= MAX_BYTES
    assert time.perf_counter() - began < 1.0


@fuzz(150)
@given(size=ANYTHING, seq=st.integers(1, 64), baseline=st.integers(0, 3 * GIB))
def test_the_plan_from_any_value_fits_the_budget_or_is_one_load_error(cfg, size, seq, baseline):
    try:
        plan = plan_budget(cfg, size, max_seq_len=seq, baseline=baseline)
    except LoadError as exc:  # BudgetError included
        one_sentence(exc)
        return
    assert plan.memory == byte_size(size)
    spent = plan.dense + plan.kv + plan.draft + plan.baseline + plan.slots * plan.slot_bytes
    # all of it spent, to the last whole slot, unless every routed expert already has one
    assert spent <= plan.memory and (plan.memory < spent + plan.slot_bytes or plan.slots == plan.n_experts)
    assert plan.slots <= plan.n_experts
    assert plan.slots >= cfg.n_activated_experts and plan.memory >= plan.minimum


# ---------------------------------------------------------------------- the minimum named
@fuzz(60)
@given(baseline=st.integers(0, 4 * GIB), seq=st.integers(1, 64))
def test_the_minimum_a_refusal_names_is_enough(cfg, baseline, seq):
    with pytest.raises(BudgetError) as caught:
        plan_budget(cfg, 1, max_seq_len=seq, baseline=baseline)
    stated = re.search(r"give at least ([0-9,.]+) GiB", one_sentence(caught.value)).group(1).replace(",", "")
    plan = plan_budget(cfg, f"{stated}GiB", max_seq_len=seq, baseline=baseline)  # no BudgetError: enough
    # and not more than a hundredth of a GiB above what is needed
    assert plan.memory - plan.minimum < GIB / 100
    assert f"minimum for this checkpoint is {stated} GiB" in plan.line()


def test_the_issue_s_minimum_is_rounded_up(cfg):
    # the issue's case: a minimum of 1,614,816,676 bytes was named as 1.50 GiB, 4,203,940 bytes short
    minimum = 1_614_816_676
    fixed = plan_budget(cfg, MAX_BYTES, max_seq_len=64, baseline=0).minimum
    hundredths = -(-minimum * 100 // GIB)  # rounded up
    assert hundredths * GIB // 100 >= minimum > (hundredths - 1) * GIB // 100
    with pytest.raises(BudgetError, match=rf"give at least {hundredths // 100}\.{hundredths % 100:02d} GiB"):
        plan_budget(cfg, 1, max_seq_len=64, baseline=minimum - fixed)


# ---------------------------------------------------------------------- the machine
def test_a_budget_above_the_machine_is_refused_naming_its_memory(tiny_checkpoint):
    have = budget.machine_memory()
    assert have is not None and have[0] <= physical_bytes()
    for size in (have[0] + 1, "999999TiB", "1TB" if 10**12 > have[0] else have[0] + GIB):
        with pytest.raises(BudgetError) as caught:
            dsv41.load(tiny_checkpoint, quiet=True, threads=1, memory=size)
        message = one_sentence(caught.value)
        assert f"({have[0]:,} bytes)" in message and "give at most" in message


def test_the_machine_is_its_physical_memory_or_a_lower_container_limit(tmp_path, monkeypatch):
    unlimited, limited = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    unlimited.write_text("max\n")
    monkeypatch.setattr(budget, "_CGROUP_LIMITS", (str(unlimited),))
    assert budget.machine_memory()[0] == physical_bytes()
    limited.write_text(f"{GIB}\n")
    monkeypatch.setattr(budget, "_CGROUP_LIMITS", (str(unlimited), str(limited)))
    limit, what = budget.machine_memory()
    assert limit == GIB and str(limited) in what
    with pytest.raises(BudgetError, match=r"more than the 1\.00 GiB \(1,073,741,824 bytes\)"):
        budget.check_machine(GIB + 1)
    budget.check_machine(GIB)  # exactly what there is: allowed


def test_a_pool_the_system_refuses_is_a_load_error(tiny_checkpoint, cfg):
    # more bytes than any address space: the allocator refuses at once, before a page is touched
    with pytest.raises(LoadError, match="smaller memory budget") as caught:
        SlotCache(Checkpoint(tiny_checkpoint), 1 << 40, n_layers=cfg.n_layers)
    one_sentence(caught.value)


# ---------------------------------------------------------------------- the free slots
def test_a_pool_of_a_trillion_slots_costs_nothing_to_keep():
    tracemalloc.start()
    try:
        began = time.perf_counter()
        pool = Residency(10**12, "decay")
        plan = pool.plan([(0, e) for e in range(8)], 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [slot for _, slot in plan.misses] == list(range(8))  # never-used slots first, slot 0 first
    assert peak < 1 << 20 and time.perf_counter() - began < 1.0


def test_freed_slots_go_in_the_same_order_as_before():
    # what the list of free slots did: slot 0 first, each eviction's slot to the key that evicted
    pool = Residency(3, "lru")
    assert [s for _, s in pool.plan(["a", "b", "c"], 1).misses] == [0, 1, 2]
    assert pool.plan(["d"], 2).misses == [("d", 0)]  # a, the least recent, gives up slot 0
    pool.clear()
    assert [s for _, s in pool.plan(["x", "y"], 3).misses] == [0, 1]
    assert replay_calls([(1, [1, 2]), (2, [3]), (3, [1])], 2, "lru") == [[0, 2], [0, 1], [0, 1]]


# ---------------------------------------------------------------------- load's own checks
def test_the_expert_policy_is_checked_without_a_budget(tiny_checkpoint):
    with pytest.raises(LoadError, match="expert_policy must be one of lru, decay, got 'bogus'"):
        dsv41.load(tiny_checkpoint, quiet=True, threads=1, expert_policy="bogus")
    with pytest.raises(LoadError, match="expert_policy"):
        dsv41.load(tiny_checkpoint, quiet=True, threads=1, expert_policy=["lru"])


@pytest.mark.parametrize("size", HUGE + ["-1GiB", "lots", [1]], ids=lambda s: repr(s)[:16])
def test_load_raises_only_load_error_for_any_budget(tiny_checkpoint, size):
    with pytest.raises(LoadError) as caught:
        dsv41.load(tiny_checkpoint, quiet=True, threads=1, memory=size)
    one_sentence(caught.value)


# ---------------------------------------------------------------------- the commands
@pytest.mark.parametrize("command", ["chat", "generate"])
@pytest.mark.parametrize("size, code", [("1e308GiB", 2), ("999999TiB", 1)])
def test_the_commands_answer_a_huge_budget_in_one_line(tiny_checkpoint, capsys, command, size, code):
    from dsv41.app import cli

    extra = ["--prompt", "x"] if command == "generate" else []
    try:
        got = cli.main([command, "--checkpoint", tiny_checkpoint, "--quiet", "--memory", size] + extra)
    except SystemExit as exit_:  # argparse's usage error
        got = exit_.code
    out, err = capsys.readouterr()
    assert got == code and out == "", err
    lines = err.splitlines()
    if code == 2:  # a usage error: argparse's usage, then its one line
        lines = [line for line in lines if not line.startswith(("usage: ", " "))]
    assert len(lines) == 1 and lines[0].startswith(f"dsv41 {command}: ") and "memory" in lines[0], err


def test_a_whole_number_flag_names_a_huge_value_briefly():
    """`--steps` with 401 digits was echoed whole in the usage error."""
    import argparse

    from dsv41.core.argtypes import whole_number

    with pytest.raises(argparse.ArgumentTypeError) as info:
        whole_number(1, 10, "steps")("9" * 401)
    message = str(info.value)
    assert message.startswith("must be a whole number of steps from 1 to 10, got '999") and len(message) < 160
