"""The Numerics value: validated once, the reference by default, one parity preset, and what the
loader and the CLI make of it."""

import dataclasses

import pytest

from dsv41.core.numerics import WINDOW_LAYOUTS, Numerics


def test_the_default_is_the_reference_and_parity_departs_in_every_field():
    assert Numerics() == Numerics(False, "reference", False, "topk")
    assert Numerics.parity() == Numerics(
        fix_stale_index_keys=True, window_layout="uniform", pad_f32_rows=True, tie_break="lowest"
    )
    assert Numerics.named("reference") == Numerics() and Numerics.named("parity") == Numerics.parity()
    assert Numerics().window_layout == WINDOW_LAYOUTS[0]
    # one way to say the reference: the default value, not a second spelling of it
    assert not hasattr(Numerics, "reference")


def test_it_is_frozen_and_with_options_keeps_fields_given_none():
    n = Numerics.parity()
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.pad_f32_rows = False
    plain = n.with_options(tie_break="topk", window_layout=None)
    assert plain == Numerics(True, "uniform", True, "topk") and n == Numerics.parity()
    assert n.as_dict() == {
        "fix_stale_index_keys": True,
        "window_layout": "uniform",
        "pad_f32_rows": True,
        "tie_break": "lowest",
        "summation": "reference",
    }


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(window_layout="ring"), "window_layout must be one of 'reference', 'uniform'"),
        (dict(pad_f32_rows=1), "pad_f32_rows must be True or False"),
        (dict(summation="quick"), "summation must be one of 'reference', 'fast'"),
        (dict(fix_stale_index_keys="yes"), "fix_stale_index_keys must be True or False"),
        (dict(tie_break="random"), "tie_break must be one of 'topk', 'lowest'"),
    ],
)
def test_bad_values_are_refused_by_name(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Numerics(**bad)
    with pytest.raises(ValueError, match="numerics must be one of 'reference', 'parity'"):
        Numerics.named("fast")


def test_load_takes_a_numerics_value_with_its_fields_changed_one_by_one(tiny_checkpoint):
    import dsv41

    m = dsv41.load(tiny_checkpoint, quiet=True, numerics=Numerics.parity().with_options(fix_stale_index_keys=False))
    assert m.numerics == Numerics(False, "uniform", True, "lowest")
    # the one value reaches every layer that reads it
    for block in m.backbone.layers:
        assert block.attn.numerics is m.numerics and block.ffn.gate.pad_f32_rows and block.ffn.experts.batch_invariant
        if block.attn.indexer is not None:
            assert (
                not block.attn.indexer.numerics.fix_stale_index_keys
                and block.attn.indexer.numerics.tie_break == "lowest"
            )
    assert m.backbone.head.pad_f32_rows
    assert dsv41.load(tiny_checkpoint, quiet=True).numerics == Numerics()


def test_the_generate_command_takes_the_numerics_flags(tiny_checkpoint, capsys):
    from dsv41.app.cli import generate_main

    args = ["--checkpoint", tiny_checkpoint, "--prompt", "Numerics", "--max-new-tokens", "3", "--quiet"]
    assert generate_main(args) == 0
    reference = capsys.readouterr().out
    assert generate_main(args + ["--numerics", "parity", "--fix-stale-index-keys"]) == 0
    assert capsys.readouterr().out.count("\n") == reference.count("\n") == 1
    with pytest.raises(SystemExit):
        generate_main(args + ["--numerics", "fast"])
