import json
import os
import re
import subprocess
import sys

import pytest

from dsv41.core.config import (
    RELEASED,
    TINY,
    Config,
    ConfigError,
    compare_layouts,
    load_config,
    resolve_config_path,
    write_config_pair,
)
from dsv41.core.config_fields import FLAT_KEYS, NESTED_ONLY_KEYS

RELEASE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference", "deepseek-v4.1-flash")
NESTED_FILE = os.path.join(RELEASE_DIR, "config.json")
FLAT_FILE = os.path.join(RELEASE_DIR, "inference", "config.json")

needs_release = pytest.mark.skipif(
    not os.path.isfile(NESTED_FILE), reason="the released config pair is not beside this checkout (../shared/reference)"
)

# Written by hand from the Transformers layout, not derived from the alias table, so the tests
# below check the table rather than agree with it.
TOY_NESTED = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 250,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"},
    "text_config": {
        "vocab_size": 256,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "rope_theta": 10000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 8,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 256,
        },
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 4,
        "compress_ratios": [0, 2, 1, 1, 0],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [1, 2],
        "index_source_layer_ids": [1, 2, 3],
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "candidate_source_layer_id": 2,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": [0, 2],
        "engram_num_embeddings": [10, 20],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 5,
        "engram_n_heads": 1,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 200,
        "num_nextn_predict_layers": 1,
        "dspark_block_size": 3,
        "dspark_noise_token_id": 251,
        "dspark_target_layer_ids": [3],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 1,
    },
    "vision_config": {
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 16,
        "min_pixels": 784,
        "max_wh_ratio": None,
    },
}


def toy() -> Config:
    return Config.from_dict(json.loads(json.dumps(TOY_NESTED)))


def test_toy_nested_reads_every_field_and_verifies():
    cfg = toy()
    assert cfg.layout == "nested"
    assert cfg.dim == 64 and cfg.n_activated_experts == 2 and cfg.window_size == 4
    assert cfg.original_seq_len == 256 and cfg.rope_factor == 8
    assert cfg.candidate_source_layer == 2 and cfg.engram_pad_id == 2
    assert cfg.dtype == "fp8" and cfg.param_dtype == "bfloat16"  # the dtype trap, modelled
    assert cfg.verify() == []


def test_flat_round_trip_of_toy_reads_identically():
    cfg = toy()
    flat = Config.from_dict(cfg.as_reference_dict())
    assert flat.layout == "flat"
    assert flat.as_reference_dict() == cfg.as_reference_dict()
    assert sorted(line.split(":")[0] for line in cfg.differs_from(flat)) == sorted(NESTED_ONLY_KEYS)
    # the nested-only fields are absent on the flat side, not defaulted
    assert flat.param_dtype is None and flat.bos_token_id is None
    assert flat.verify() == []


def test_nested_writer_round_trips():
    cfg = toy()
    again = Config.from_dict(cfg.as_nested_dict())
    assert again == cfg and again.differs_from(cfg) == []


@needs_release
def test_released_pair_round_trips_to_the_flat_file_exactly():
    with open(FLAT_FILE) as f:
        flat_json = json.load(f)
    assert len(flat_json) == 64 and set(flat_json) == set(FLAT_KEYS)
    nested, flat = load_config(NESTED_FILE), load_config(FLAT_FILE)
    assert nested.as_reference_dict() == flat_json
    assert flat.as_reference_dict() == flat_json
    assert nested.unknown_keys == () and flat.unknown_keys == ()


@needs_release
def test_released_pair_differs_only_in_transformers_fields():
    nested, flat = load_config(NESTED_FILE), load_config(FLAT_FILE)
    fields = [line.split(":")[0] for line in nested.differs_from(flat)]
    assert sorted(fields) == sorted(NESTED_ONLY_KEYS) and len(fields) == 12


@needs_release
def test_released_preset_equals_the_shared_files():
    nested = load_config(NESTED_FILE)
    assert nested == RELEASED, nested.differs_from(RELEASED)
    with open(NESTED_FILE) as f:
        assert RELEASED.as_nested_dict() == json.load(f)
    assert nested.verify() == [] and load_config(FLAT_FILE).verify() == []


def test_released_preset_modes_partition_the_backbone():
    modes = RELEASED.layer_modes
    assert [i for i, m in enumerate(modes) if m == "full"] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m == "reindex"] == [24, 28, 32, 36]
    assert modes.count("reuse") == 32
    assert RELEASED.max_seq_len == 1048576 and RELEASED.n_hash_cols == 24


def test_flat_config_derives_max_seq_len_from_yarn():
    flat = Config.from_dict(RELEASED.as_reference_dict())
    assert flat.max_position_embeddings is None
    assert flat.max_seq_len == RELEASED.original_seq_len * RELEASED.rope_factor == 1048576


def test_tiny_preset_exercises_every_branch():
    cfg = TINY.replace(engram_num_embeddings=(1, 1), engram_compressed_vocab_size=10)
    assert cfg.verify() == []
    modes = cfg.layer_modes
    assert {"full", "reindex", "reuse"} == set(modes)
    ratios = cfg.compress_ratios[: cfg.n_layers]
    assert 0 in ratios and {cfg.compress_ratios[s] for s in cfg.kv_source_layers} == {1, 2}
    assert cfg.candidate_source_layer in cfg.index_source_layers
    assert any(cfg.layer_mode(i) == "full" for i in cfg.engram_layer_ids)
    assert any(cfg.layer_mode(i) != "full" for i in cfg.engram_layer_ids)
    assert cfg.n_mtp_layers == 3 and cfg.vision_n_layers > 0
    for field in (
        "dim",
        "moe_inter_dim",
        "q_lora_rank",
        "head_dim",
        "rope_head_dim",
        "o_lora_rank",
        "index_head_dim",
        "engram_head_dim",
        "vision_dim",
        "vocab_size",
    ):
        assert getattr(cfg, field) % 32 == 0, field


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"candidate_source_layer": 0}, "not an index source"),
        ({"compress_ratios": (0, 2, 2, 1, 0)}, "compresses at ratio"),
        ({"compress_ratios": (2, 2, 1, 1, 0)}, "no KV source is at or before it"),
        ({"compress_ratios": (0, 2, 1, 1)}, "expected n_layers + n_mtp_layers"),
        ({"compress_ratios": (0, 2, 1, 1, 1)}, "MTP layers must not read"),
        ({"engram_layer_ids": (2, 0)}, "distinct and ascending"),
        ({"engram_layer_ids": (0, 9)}, "inside the backbone"),
        ({"engram_num_embeddings": (10,)}, "Engram row counts"),
        ({"image_token_id": 256}, "outside the vocabulary"),
        ({"engram_pad_id": 3}, "pad_token_id"),
        ({"vision_n_heads": 3}, "not divisible"),
        ({"index_source_layers": (1, 3)}, "every KV source must also be an index source"),
        ({"dspark_target_layer_ids": (2,)}, "last 1 backbone layers"),
        ({"dim": None}, "required fields missing: dim"),
    ],
)
def test_verify_reports_broken_relationships(change, fragment):
    problems = toy().replace(**change).verify()
    assert any(fragment in p for p in problems), problems


def test_nested_only_fields_are_required_only_for_nested_layout():
    cfg = toy().replace(topk_method=None)
    assert any("topk_method" in p for p in cfg.verify())
    flat = Config.from_dict(cfg.as_reference_dict())
    assert flat.verify() == []


def test_unknown_keys_are_reported_not_fatal():
    data = dict(RELEASED.as_reference_dict(), some_future_key=1)
    cfg = Config.from_dict(data)
    assert cfg.unknown_keys == ("some_future_key",) and cfg.verify() == []


def test_directory_resolution_prefers_nested_then_flat(tmp_path):
    nested, flat = write_config_pair(toy(), str(tmp_path))
    assert resolve_config_path(str(tmp_path)) == nested
    os.remove(nested)
    assert resolve_config_path(str(tmp_path)) == flat
    assert load_config(str(tmp_path)).layout == "flat"
    os.remove(flat)
    with pytest.raises(ConfigError, match="no config.json or inference/config.json"):
        resolve_config_path(str(tmp_path))


def test_bad_json_is_one_sentence(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dsv41", "config", *args], capture_output=True, text=True)


def test_cli_prints_layout_summary_and_verdict(tmp_path):
    write_config_pair(toy(), str(tmp_path))
    run = _cli(str(tmp_path), "--json", str(tmp_path / "report.json"))
    assert run.returncode == 0, run.stderr
    assert "(nested)" in run.stdout and "[ok] the config is self-consistent" in run.stdout
    assert "4 layers + 1 draft, dim 64" in run.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["problems"] == [] and report["flat"]["dim"] == 64


def test_cli_fails_only_when_verify_finds_something(tmp_path):
    write_config_pair(toy().replace(candidate_source_layer=0), str(tmp_path))
    run = _cli(str(tmp_path / "inference" / "config.json"))
    assert run.returncode == 1 and "(flat)" in run.stdout and "not an index source" in run.stdout
    missing = _cli(str(tmp_path / "nope"))
    assert missing.returncode == 1 and "no such file" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("compress_ratios", 5, "field compress_ratios is 5, expected list of int"),
        ("n_layers", "40", 'field n_layers is "40", expected int'),
        ("engram_layer_ids", [1, "14"], "expected list of int"),
        ("score_func", 3, "expected str"),
        ("hc_eps", True, "expected float"),
    ],
)
def test_a_mistyped_field_is_one_sentence_naming_it(tmp_path, field, value, fragment):
    data = RELEASED.as_reference_dict()
    data[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        load_config(str(path))
    run = _cli(str(path))
    assert run.returncode == 1 and fragment in run.stderr and "Traceback" not in run.stderr


def test_compare_layouts_of_a_written_pair(tmp_path):
    write_config_pair(toy(), str(tmp_path))
    report = compare_layouts(str(tmp_path))
    assert report["nested"] == "nested" and report["flat"] == "flat"
    assert report["flat file from nested"] and report["flat file from flat"] and report["nested round trip"]
    assert report["dtype (quantization)"] == "fp8" and report["param_dtype (storage)"] == "bfloat16"
    assert sorted(line.split(":")[0] for line in report["differs"]) == sorted(NESTED_ONLY_KEYS)
    # a flat file edited by hand no longer follows from the nested one
    flat_path = tmp_path / "inference" / "config.json"
    data = json.loads(flat_path.read_text())
    data["index_topk"] = 8
    flat_path.write_text(json.dumps(data))
    report = compare_layouts(str(tmp_path))
    assert not report["flat file from nested"] and report["flat file from flat"]
    assert any(line.startswith("index_topk:") for line in report["differs"])


# ---------------------------------------------------------------------- malformed files (found by fuzzing)
def _write(tmp_path, text: str | bytes, name="config.json"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[" * 100_000 + "]" * 100_000, "nests too deep"),  # was RecursionError
        ('{"text_config": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deep"),
        ('{"dim": ' + "1" * 5_000 + "}", "an integer of 5,000 digits"),  # was ValueError (4,300-digit limit)
        ('{"dim": -' + "9" * 41 + "}", "an integer of 41 digits"),
        ('{"a": ' + "[" * 40 + "]" * 40 + "}", "nests more than 32 levels"),  # parsable, but the readers recurse
        ('{"score_func": "\\ud800"}', "unpaired surrogate"),  # no terminal can print it
        ('{"text_config": {}, "quantization_config": {"weight_block_size": 5}}', "weight_block_size is 5"),
        (
            '{"text_config": {}, "quantization_config": {"weight_block_size": ["a", "b"]}}',
            "expected a list of two integers",
        ),
        ('{"text_config": {}, "quantization_config": {"weight_block_size": [32]}}', "expected a list of two integers"),
        ('{"n_layers": {"a": 1}}', "field n_layers is an object of 1 keys, expected int"),
        ('{"compress_ratios": ' + json.dumps(list(range(5000)) + ["x"]) + "}", "is a list of 5,001 items"),
    ],
    ids=[
        "array-deep",
        "object-deep",
        "int-5000-digits",
        "int-41-digits",
        "depth-40",
        "surrogate",
        "block-int",
        "block-strings",
        "block-short",
        "object-for-int",
        "long-list-message",
    ],
)
def test_every_malformed_config_is_one_config_error(tmp_path, text, fragment):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(path) and "\n" not in message and len(message) < 400


def test_an_unreadable_config_file_is_a_config_error(tmp_path, monkeypatch):
    path = _write(tmp_path, "{}")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(ConfigError, match="cannot be read .Permission denied."):
        load_config(path)


def test_cli_json_to_a_missing_folder_is_one_sentence(tmp_path):
    write_config_pair(toy(), str(tmp_path))
    run = _cli(str(tmp_path), "--json", "/nonexistent/x.json")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "/nonexistent/x.json" in lines[0] and "No such file or directory" in lines[0]


# ---------------------------------------------------------------------- values no checkpoint can have
# Each passed `dsv41 config` as [ok] before; the counts then hung or exhausted memory in anything
# that enumerated them (the audit, the inventory, the loader).
ABSURD = [
    (("text_config", "rms_norm_eps"), float("nan"), "norm_eps (text_config.rms_norm_eps) is NaN, not a finite number"),
    (("text_config", "rms_norm_eps"), float("inf"), "is Infinity, not a finite number"),
    (("text_config", "rope_theta"), -1, "rope_theta is -1, it must be above 1"),
    (("text_config", "rope_theta"), 1, "rope_theta is 1, it must be above 1"),  # YaRN divides by log(theta)
    (("text_config", "rope_scaling", "beta_fast"), 0, "beta_fast is 0, outside [1, 1,024]"),  # YaRN divides by it
    (
        ("text_config", "rope_scaling", "factor"),
        0.5,
        "rope_factor (text_config.rope_scaling.factor) is 0.5, it must be at least 1",
    ),
    (("text_config", "hidden_size"), -1, "dim (text_config.hidden_size) is -1, outside [1, 131,072]"),
    (("text_config", "num_attention_heads"), 0, "n_heads (text_config.num_attention_heads) is 0, outside [1, 4,096]"),
    (("text_config", "o_groups"), 0, "o_groups is 0"),  # verify() divided by it
    (("text_config", "n_routed_experts"), 10**12, "n_routed_experts is 1,000,000,000,000, outside [1, 16,384]"),
    (("text_config", "num_hidden_layers"), 10**9, "n_layers (text_config.num_hidden_layers) is 1,000,000,000"),
    (("text_config", "num_nextn_predict_layers"), 137438953471, "is 137,438,953,471, outside [0, 64]"),
    (("text_config", "rope_theta"), 10**39 * 10**300, None),  # replaced below: the reader refuses 340 digits
    (("text_config", "compress_ratios"), [0] * 5000, "compress_ratios has 5,000 entries"),
    (("text_config", "engram_num_embeddings"), [10, 2**40], "engram_num_embeddings holds 1,099,511,627,776"),
    (("quantization_config", "weight_block_size"), [0, 32], "weight_block_size [0, 32] is not two integers"),
    # in range one by one, too many together
    (("text_config", "engram_n_heads"), 1_000, "= 4,000 hash columns, above the 384"),
]
ABSURD = [case for case in ABSURD if case[2] is not None]


@pytest.mark.parametrize("path, value, fragment", ABSURD, ids=[f"{p[-1]}={v!r:.12}" for p, v, _ in ABSURD])
def test_verify_rejects_values_no_checkpoint_can_have(tmp_path, path, value, fragment):
    import time

    data = json.loads(json.dumps(TOY_NESTED))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    file = _write(tmp_path, json.dumps(data))
    began = time.perf_counter()
    problems = load_config(file).verify()
    assert time.perf_counter() - began < 1
    assert any(fragment in p for p in problems), problems
    run = _cli(file)
    assert run.returncode == 1 and "[fail]" in run.stdout and "[ok]" not in run.stdout
    assert fragment in run.stdout and "Traceback" not in run.stderr


def test_the_bounds_admit_the_release_with_room_to_grow():
    assert RELEASED.value_problems() == [] and TINY.value_problems() == [] and toy().value_problems() == []
    grown = RELEASED.replace(
        n_layers=80,
        n_routed_experts=768,
        dspark_target_layer_ids=tuple(range(77, 80)),
        compress_ratios=RELEASED.compress_ratios + (1,) * 40,
    )
    assert grown.value_problems() == []  # twice the layers and twice the experts: still an inventory
    assert RELEASED.inventory_tensor_bound() == 96_812 and RELEASED.engram_column_count() == 48


def test_value_problems_skip_unstated_fields_and_python_made_values():
    assert Config(dim=None).value_problems() == []
    # a value built in Python can exceed what str() converts; the message still forms
    problems = RELEASED.replace(dim=10**5000, rope_theta=10**400).value_problems()
    assert problems == [
        "dim (text_config.hidden_size) is an integer of about 5,001 digits, outside [1, 131,072]",
        "rope_theta is an integer of about 401 digits, not a finite number",
    ]


def test_counts_in_range_one_by_one_can_imply_too_many_tensors(tmp_path):
    cfg = RELEASED.replace(n_routed_experts=3_000)  # 40 x 3,000 experts x 6 tensors: 7.5x the release
    problems = cfg.verify()
    assert problems == [
        "these counts imply up to 724,652 tensors (n_layers 40 + n_mtp_layers 3 layers of 3,000 "
        "routed experts); an inventory holds at most 500,000"
    ]
    write_config_pair(cfg, str(tmp_path))
    run = _cli(str(tmp_path))
    assert run.returncode == 1 and "[fail] 1 problem(s)" in run.stdout


def test_the_field_table_is_the_one_schema():
    """The alias map and the bounds come from config_fields.FIELDS, and the fields written out in
    Config and VerifiedConfig are its rows: names in its order, its types, its defaults."""
    import dataclasses

    from dsv41.core.config import VerifiedConfig
    from dsv41.core.config_fields import FIELDS, FLOAT_LIMITS, LIST_BOUNDS, VALUE_BOUNDS

    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names)) == 76
    schema = dataclasses.fields(Config)[: len(FIELDS)]
    assert [f.name for f in schema] == names
    # a file silent on a field leaves it None; the provenance fields come after the schema's
    assert [(f.type, f.default) for f in schema] == [(row.annotation, None) for row in FIELDS]
    assert {f.name for f in dataclasses.fields(Config)[len(FIELDS) :]} == {
        "layout",
        "source",
        "nested_format",
        "unknown_keys",
    }
    runtime = dataclasses.fields(VerifiedConfig)
    assert [f.name for f in runtime] == names
    assert [f.type for f in runtime] == [row.annotation if row.may_be_absent else row.kind for row in FIELDS]
    # the runtime default where the table has one, None where the field may be absent, else none
    expected = [
        row.default if row.default is not None else None if row.may_be_absent else dataclasses.MISSING for row in FIELDS
    ]
    assert [f.default for f in runtime] == expected
    assert FLAT_KEYS + NESTED_ONLY_KEYS == tuple(names)
    numeric = [f.name for f in FIELDS if f.kind in ("int", "float") or f.kind.startswith("tuple[")]
    assert sorted(numeric) == sorted(list(VALUE_BOUNDS) + list(LIST_BOUNDS) + list(FLOAT_LIMITS))
    assert all(f.bound is not None for f in FIELDS if f.name in numeric)


def test_the_verified_view_has_no_none_where_runtime_code_defended_against_it():
    view = RELEASED.verified()
    assert (view.n_mtp_layers, view.dspark_block_size, view.candidate_source_layer) == (3, 5, 20)
    assert view.vision_max_wh_ratio is None  # null in the release: no limit
    silent = RELEASED.replace(
        n_mtp_layers=None,
        swiglu_limit=None,
        candidate_source_layer=None,
        engram_layer_ids=None,
        norm_topk_prob=None,
        vision_rope_theta=None,
    ).verified()
    assert (silent.n_mtp_layers, silent.swiglu_limit, silent.candidate_source_layer) == (0, 0.0, -1)
    assert (silent.engram_layer_ids, silent.norm_topk_prob, silent.vision_rope_theta) == ((), True, 10000.0)
    with pytest.raises(ConfigError, match="fields a model needs are not set: dim"):
        RELEASED.replace(dim=None).verified()
    with pytest.raises(ConfigError, match="o_groups is 0, outside"):
        RELEASED.replace(o_groups=0).verified()


# TINY leaves the two fields the checkpoint writer derives unset; verify() needs every field stated
_TINY_STATED = TINY.replace(engram_num_embeddings=(1009, 1013), engram_compressed_vocab_size=1000)


def test_the_ratio_source_rule_names_each_break_once():
    """TINY with layer 1 compressing before any source, and layer 3 at ratio 1 behind the ratio-2
    source 2: the breaks, which verify() and the audit both word from Config.source_breaks."""
    cfg = _TINY_STATED.replace(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0))
    assert cfg.compressed_readers() == [1, 2, 3, 4, 5, 6]
    assert cfg.source_breaks() == [(1, "KV", None), (1, "index", None), (3, "KV", 2), (3, "index", 2)]
    assert cfg.source_breaks(cfg.index_source_layers, kinds=("KV",)) == []
    reader_lines = [p for p in cfg.verify() if p.startswith("layer ")]
    assert reader_lines == [
        "layer 1 reads compressed positions (ratio 2) but no KV source is at or before it",
        "layer 1 reads compressed positions (ratio 2) but no index source is at or before it",
        "layer 3 (ratio 1) reads the KV source 2, which compresses at ratio 2",
        "layer 3 (ratio 1) reads the index source 2, which compresses at ratio 2",
    ]


_READER = re.compile(
    r"layer (\d+)(?: \(ratio \d+\))? (?:reads compressed positions \(ratio \d+\) but no |has no |"
    r"reads (?:the )?)(KV|index) source(?: (\d+))?"
)


def _breaks_named(text: str) -> list[tuple[int, str, int | None]]:
    return [(int(layer), kind, int(src) if src else None) for layer, kind, src in _READER.findall(text)]


def test_verify_and_the_audit_name_the_same_ratio_source_breaks():
    """Over random ratios and sources, verify() and the audit's readers check name exactly the
    breaks of Config.source_breaks (the audit quotes its first few)."""
    from types import SimpleNamespace

    hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
    st = hypothesis.strategies
    from dsv41.checkpoint.audit.checks.config import CHECKS
    from dsv41.checkpoint.audit.evidence import SHOWN
    from dsv41.checkpoint.audit.report import PASS

    readers_check = next(c for c in CHECKS if c.id == "config.readers_have_sources")
    n = TINY.n_layers
    layers = st.lists(st.integers(0, n - 1), unique=True).map(lambda ids: tuple(sorted(ids)))

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(ratios=st.lists(st.sampled_from([0, 1, 2, 4]), min_size=n, max_size=n), kv=layers, extra=layers)
    def run(ratios, kv, extra):
        cfg = _TINY_STATED.replace(
            compress_ratios=tuple(ratios) + (0,) * TINY.n_mtp_layers,
            kv_source_layers=kv,
            index_source_layers=tuple(sorted(set(kv) | set(extra))),
        )
        breaks = cfg.source_breaks()
        assert _breaks_named("\n".join(cfg.verify())) == breaks
        status, detail = readers_check.run(SimpleNamespace(cfg=cfg))
        assert (status == PASS) == (not breaks)
        if breaks:
            assert _breaks_named(detail) == breaks[:SHOWN]

    run()
