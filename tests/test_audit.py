"""The header audit: the released inventory passes all 39 checks, a partial download leaves named
shards to wait on, the negative control fails, and every kind of bad input ends in a failed check
or one sentence with exit 1 (2 for bad usage), never a traceback."""

import json
import os
import shutil
import struct
from collections import Counter, defaultdict

import pytest

from dsv41.checkpoint import audit, headers
from dsv41.checkpoint.inventory import derived_engram_rows, expected_tensors, shard_contents
from dsv41.core.config import TINY, write_config_pair

ENGRAM_WAITING = {"engram.projections", "engram.dtype", "engram.row_block", "packing.fp8_block"}


# ---------------------------------------------------------------------- helpers
def tiny_config():
    return TINY.replace(engram_num_embeddings=derived_engram_rows(TINY), engram_compressed_vocab_size=700)


def write_checkpoint(directory, cfg=None, payload=True, index=True, mutate=None):
    """A checkpoint in the release layout with zero payloads (or headers only). `mutate` may
    rewrite the spec list (name, dtype, shape, shard) before writing, to plant a defect."""
    cfg = cfg or tiny_config()
    os.makedirs(directory, exist_ok=True)
    write_config_pair(cfg, str(directory))
    specs = expected_tensors(cfg)
    rows = [(s.name, s.dtype, s.shape, s.shard) for s in specs]
    if mutate:
        rows = mutate(rows)
    grouped = defaultdict(list)
    for name, dtype, shape, shard in rows:
        grouped[shard].append((name, dtype, shape))
    for shard, tensors in grouped.items():
        payloads = None
        if payload:
            payloads = {n: bytes(headers.DTYPE_SIZES[d] * _numel(s)) for n, d, s in tensors}
        headers.write_shard(os.path.join(directory, shard), tensors, payloads)
    if index:
        headers.write_index(str(directory), specs)
    return directory


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def shard_of(cfg, what):
    return next(name for name, held in shard_contents(cfg) if held == what)


def statuses(report):
    return {c.id: c.status for c in report.checks}


def not_passed(report):
    return {c.id: c.status for c in report.checks if c.status != audit.PASS}


def cli(args, capsys):
    code = audit.cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def link_release(src, dst, numbers, config_text=None):
    """A view of the released header tree holding only some shards (a partial download)."""
    os.makedirs(dst / "inference")
    for k in numbers:
        name = f"model-{k:05d}-of-00048.safetensors"
        os.symlink(src / name, dst / name)
    os.symlink(src / headers.INDEX_NAME, dst / headers.INDEX_NAME)
    (dst / "config.json").write_text(config_text or (src / "config.json").read_text())
    shutil.copy(src / "inference" / "config.json", dst / "inference" / "config.json")
    return dst


# ---------------------------------------------------------------------- the released geometry
@pytest.fixture(scope="module")
def released_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("released")
    assert headers.cli_main([str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def released_report(released_dir):
    return audit.run_audit(str(released_dir), header_prefix=True)


def test_released_headers_pass_all_39_checks(released_report):
    r = released_report
    assert (len(r.checks), r.passed, r.failed, r.undecided, r.exit_code) == (39, 39, 0, 0, 0)
    assert Counter(c.group for c in r.checks) == {
        "Config": 13,
        "Engram": 5,
        "CSA2": 5,
        "Inventory": 4,
        "Packing": 3,
        "Experts": 3,
        "DSpark": 3,
        "Vision": 2,
        "Index": 1,
    }
    assert (r.tensors, r.bytes, r.expected_tensors, r.index_tensors) == (96_085, 510_286_023_000, 96_085, 96_085)
    assert len(r.files) == 48 and not r.missing_shards and not r.duplicates
    text = r.format()
    assert "96,085 of 96,085 readable, 510,286,023,000 bytes (475.24 GiB)" in text
    assert "39 checks: 39 passed, 0 failed, 0 undecided" in text
    assert "declared=[384006168, 384016682] derived=[384006168, 384016682]" in r.check("engram.rows").detail


def test_released_category_table_and_layer_partition(released_report):
    r = released_report
    table = {row.category: (row.tensors, f"{row.bytes / 2**30:.2f}") for row in r.categories}
    assert table == {
        "routed experts": (94_464, "275.67"),
        "Engram": (12, "189.13"),
        "attention": (603, "4.80"),
        "embedding and head": (3, "2.47"),
        "shared experts": (240, "1.32"),
        "vision and aligner": (266, "0.90"),
        "MTP / DSpark": (97, "0.66"),
        "norms and hyper-connections": (400, "0.29"),
    }
    assert r.layer_modes == {
        "full": [2, 8, 14, 20],
        "reindex": [24, 28, 32, 36],
        "reuse": [i for i in range(40) if i not in (2, 8, 14, 20, 24, 28, 32, 36)],
    }
    assert Counter(r.layer_tensor_counts) == {2_334: 31, 2_337: 4, 2_340: 1, 2_341: 1, 2_342: 2, 2_348: 1}
    assert (
        r.layer_tensor_counts[1] == 2_340 and r.layer_tensor_counts[14] == 2_348 and r.layer_tensor_counts[20] == 2_341
    )


def test_partial_release_waits_on_the_engram_shards(released_dir, tmp_path):
    partial = link_release(released_dir, tmp_path / "p46", range(1, 47))
    r = audit.run_audit(str(partial), header_prefix=True)
    waiting = {"model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors"}
    assert (r.passed, r.failed, r.undecided, r.exit_code) == (35, 0, 4, 0)
    assert {c.id for c in r.checks if c.status == audit.UNDECIDED} == ENGRAM_WAITING
    for c in r.checks:
        if c.status == audit.UNDECIDED:
            assert set(c.waits_on) == waiting and "model-00047-of-00048.safetensors" in c.detail
    assert r.missing_shards == sorted(waiting)
    assert r.check("csa2.modes").status == audit.PASS  # presence comes from the index

    strict = r.as_required_complete()
    assert (strict.passed, strict.failed, strict.undecided, strict.exit_code) == (35, 4, 0, 1)
    assert r.undecided == 4  # the original report is left as it was
    assert "--require-complete" in strict.check("engram.dtype").detail


def test_first_twenty_shards(released_dir, tmp_path):
    r = audit.run_audit(str(link_release(released_dir, tmp_path / "p20", range(1, 21))), header_prefix=True)
    assert r.failed == 0 and r.undecided > 0 and r.passed + r.undecided == 39
    shapes = r.check("inventory.shapes")
    assert shapes.status == audit.UNDECIDED
    assert shapes.waits_on == [f"model-{k:05d}-of-00048.safetensors" for k in range(21, 47)]
    assert "26 shards: 21-46 of model-NNNNN-of-00048.safetensors" in shapes.detail
    assert r.check("experts.backbone_count").status == audit.PASS
    assert r.tensors == sum(f.tensors for f in r.files) and 0 < r.tensors < 96_085


def test_negative_control_engram_heads(released_dir, tmp_path, capsys):
    nested = json.loads((released_dir / "config.json").read_text())
    nested["text_config"]["engram_n_heads"] = 7
    copy = link_release(released_dir, tmp_path / "neg", range(1, 49), json.dumps(nested))
    code, out, _ = cli(["--checkpoint-dir", copy, "--header-prefix", "--json", tmp_path / "neg.json"], capsys)
    assert code == 1
    doc = json.loads((tmp_path / "neg.json").read_text())
    failed = {c["id"]: c["detail"] for c in doc["checks"] if c["status"] == "fail"}
    assert set(failed) == {"engram.rows", "engram.projections"}
    assert "derived=[336004849, 336012883]" in failed["engram.rows"]
    assert "[FAIL     ] engram.rows" in out


# ---------------------------------------------------------------------- a tiny checkpoint
@pytest.fixture
def tiny(tmp_path):
    return write_checkpoint(tmp_path / "tiny")


def test_tiny_complete_checkpoint_passes_require_complete(tiny, capsys):
    code, out, _ = cli(["--checkpoint-dir", tiny, "--require-complete"], capsys)
    assert code == 0
    assert "39 checks: 39 passed, 0 failed, 0 undecided" in out
    assert "Reindex     1  [6]" in out


def test_header_only_files_need_header_prefix(tmp_path):
    d = write_checkpoint(tmp_path / "h", payload=False)
    strict = audit.run_audit(str(d))
    assert not_passed(strict) == {"packing.extents": audit.FAIL}
    assert "pass --header-prefix" in strict.check("packing.extents").detail
    assert audit.run_audit(str(d), header_prefix=True).passed == 39


def test_json_report(tiny, tmp_path, capsys):
    out_path = tmp_path / "report.json"
    code, _, _ = cli(["--checkpoint-dir", tiny, "--json", out_path], capsys)
    doc = json.loads(out_path.read_text())
    assert code == 0 == doc["summary"]["exit_code"]
    assert len(doc["checks"]) == 39 and all(c["status"] == "pass" and c["detail"] for c in doc["checks"])
    assert {"id", "group", "title", "status", "detail", "waits_on"} <= set(doc["checks"][0])
    cfg = tiny_config()
    specs = expected_tensors(cfg)
    assert doc["totals"]["tensors"] == doc["totals"]["expected_tensors"] == doc["totals"]["index_tensors"] == len(specs)
    assert doc["totals"]["bytes"] == sum(s.nbytes for s in specs) and doc["totals"]["shards_missing"] == 0
    assert [row["category"] for row in doc["categories"]][:2] == ["routed experts", "Engram"]
    assert sum(row["tensors"] for row in doc["categories"]) == len(specs)
    assert doc["layer_modes"]["full"] == [2, 4]


def test_list_tensors(tiny, capsys):
    code, out, err = cli(["--checkpoint-dir", tiny, "--list-tensors", r"^layers\.1\.engram\."], capsys)
    rows = [line.split("\t") for line in out.strip().splitlines()]
    assert code == 0 and len(rows) == 6 and all(len(r) == 5 for r in rows)
    by_name = {r[0]: r for r in rows}
    table = by_name["layers.1.engram.embed.weight"]
    assert table[1] == "F8_E4M3" and json.loads(table[2]) == [6126, 32] and int(table[3]) == 6126 * 32
    assert table[4] == shard_of(tiny_config(), "Engram table of layer 1")
    assert "6 tensor(s) match" in err


def test_duplicate_shard_is_skipped_and_reported(tiny):
    name = shard_of(tiny_config(), "layer 3")
    shutil.copy(tiny / name, tiny / "zz-copy.bin")
    r = audit.run_audit(str(tiny))
    assert r.duplicates == [(str(tiny / "zz-copy.bin"), str(tiny / name))]
    assert r.passed == 39 and r.tensors == len(expected_tensors(tiny_config()))
    assert "skipped zz-copy.bin: its header duplicates" in r.format()


def test_arbitrary_names_without_index_are_found_by_their_header(tiny):
    os.remove(tiny / headers.INDEX_NAME)
    for k, name in enumerate(sorted(p for p in os.listdir(tiny) if p.endswith(".safetensors"))):
        os.rename(tiny / name, tiny / f"h{k:05d}.bin")
    r = audit.run_audit(str(tiny))
    assert (len(r.checks), r.passed) == (38, 38)
    assert {f.shard for f in r.files} == {name for name, _ in shard_contents(tiny_config())}


def test_missing_shard_without_index_is_undecided(tiny):
    cfg = tiny_config()
    gone = shard_of(cfg, "layer 5")
    os.remove(tiny / headers.INDEX_NAME)
    os.remove(tiny / gone)
    r = audit.run_audit(str(tiny))
    assert r.failed == 0 and r.undecided > 0 and r.missing_shards == [gone]
    assert all(c.waits_on == [gone] for c in r.checks if c.status == audit.UNDECIDED)
    assert r.layer_modes["unknown"] == [5]
    strict = audit.run_audit(str(tiny), require_complete=True)
    assert strict.undecided == 0 and strict.failed == r.undecided and strict.exit_code == 1


def test_a_wrong_shape_fails_while_other_shards_are_missing(tmp_path):
    def widen(rows):
        return [(n, d, (s[0], s[1] + 32) if n == "layers.0.attn.wq_a.weight" else s, sh) for n, d, s, sh in rows]

    d = write_checkpoint(tmp_path / "w", mutate=widen)
    os.remove(d / shard_of(tiny_config(), "layer 5"))
    r = audit.run_audit(str(d))
    assert r.check("inventory.shapes").status == audit.FAIL
    assert "layers.0.attn.wq_a.weight is [64, 160], expected [64, 128]" in r.check("inventory.shapes").detail
    assert r.check("packing.fp8_block").status == audit.FAIL  # the scale no longer covers it in 32x32


def _retype(target, dtype, shape=None):
    """A mutate that stores `target` as `dtype` (and `shape`, when given), everything else as is."""

    def change(rows):
        assert target in {n for n, _, _, _ in rows}
        return [(n, dtype, tuple(shape or s), sh) if n == target else (n, d, s, sh) for n, d, s, sh in rows]

    return change


# (tensor, stored dtype, stored shape or None for the inventory's, expected text, checks that must fail)
WRONG_DTYPES = [
    (
        "layers.0.attn.wq_a.weight",
        "I8",
        None,
        "layers.0.attn.wq_a.weight is I8, expected F8_E4M3",
        {"inventory.shapes", "packing.fp8_block"},
    ),
    (
        "layers.0.ffn.shared_experts.w1.weight",
        "I8",
        None,
        "layers.0.ffn.shared_experts.w1.weight is I8, expected F8_E4M3",
        {"inventory.shapes", "packing.fp8_block"},
    ),
    (
        "mtp.0.main_proj.weight",
        "I8",
        None,
        "mtp.0.main_proj.weight is I8, expected F8_E4M3",
        {"inventory.shapes", "packing.fp8_block", "dspark.main_proj"},
    ),
    (
        "layers.2.ffn.experts.3.w2.weight",
        "F8_E4M3",
        None,
        "layers.2.ffn.experts.3.w2.weight is F8_E4M3, expected I8",
        {"inventory.shapes", "experts.fp4", "packing.fp8_block"},
    ),
    # a BF16 norm stored as F32 over half the elements: the same byte extent, so only the dtype check sees it
    (
        "layers.1.attn_norm.weight",
        "F32",
        (64,),
        "layers.1.attn_norm.weight is F32 [64], expected BF16 [128]",
        {"inventory.shapes", "inventory.unquantized"},
    ),
    (
        "layers.3.hc_ffn_base",
        "BF16",
        (48,),
        "layers.3.hc_ffn_base is BF16 [48], expected F32 [24]",
        {"inventory.shapes", "inventory.unquantized"},
    ),
    (
        "layers.1.engram.embed.weight",
        "I8",
        None,
        "layers.1.engram.embed.weight is I8 [6126, 32], expected F8_E4M3",
        {"engram.dtype"},
    ),
]


@pytest.mark.parametrize("name, dtype, shape, sentence, failing", WRONG_DTYPES, ids=[w[0] for w in WRONG_DTYPES])
@pytest.mark.parametrize("payload", [True, False], ids=["tiny", "header-only"])
def test_a_wrong_dtype_fails_naming_the_tensor(tmp_path, capsys, name, dtype, shape, sentence, failing, payload):
    spec = {s.name: s for s in expected_tensors(tiny_config())}[name]
    d = write_checkpoint(tmp_path / "t", payload=payload, mutate=_retype(name, dtype, shape))
    stored = headers.read_header(str(d / spec.shard)).entries[name]
    assert stored.dtype == dtype and stored.nbytes == spec.nbytes  # same bytes on disk: no extent check can see it
    r = audit.run_audit(str(d), header_prefix=not payload, require_complete=True)
    assert not_passed(r) == {cid: audit.FAIL for cid in failing}
    assert len(r.checks) == 39 and r.passed == 39 - len(failing) and r.exit_code == 1
    owner = "engram.dtype" if ".engram." in name else "inventory.shapes"
    assert sentence in r.check(owner).detail
    if spec.dtype == "F8_E4M3" and ".engram." not in name:
        assert f"{name} is {dtype}, expected F8_E4M3" in r.check("packing.fp8_block").detail
    args = ["--checkpoint-dir", d, "--require-complete"] + ([] if payload else ["--header-prefix"])
    code, out, _ = cli(args, capsys)
    assert code == 1 and f"[FAIL     ] {owner}" in out and sentence in out


def test_many_wrong_dtypes_are_named_first_few_then_counted(tmp_path):
    cfg = tiny_config()
    targets = [s.name for s in expected_tensors(cfg) if s.name.endswith(".attn.wq_a.weight")]
    assert len(targets) == cfg.n_layers + cfg.n_mtp_layers > audit.SHOWN

    def retype_all(rows):
        return [(n, "I8" if n in targets else d, s, sh) for n, d, s, sh in rows]

    r = audit.run_audit(str(write_checkpoint(tmp_path / "m", mutate=retype_all)), require_complete=True)
    detail = r.check("inventory.shapes").detail
    for name in targets[: audit.SHOWN]:
        assert f"{name} is I8, expected F8_E4M3" in detail
    assert targets[audit.SHOWN] not in detail
    assert detail.endswith(f"... and {len(targets) - audit.SHOWN} more")


def test_a_wrong_dtype_fails_while_other_shards_are_missing(tmp_path):
    d = write_checkpoint(tmp_path / "w", mutate=_retype("layers.0.attn.wq_a.weight", "I8"))
    os.remove(d / shard_of(tiny_config(), "layer 5"))
    r = audit.run_audit(str(d))
    assert r.check("inventory.shapes").status == audit.FAIL
    assert "layers.0.attn.wq_a.weight is I8, expected F8_E4M3" in r.check("inventory.shapes").detail


def test_unexpected_tensor_fails_the_inventory(tmp_path):
    def plant(rows):
        shard = next(sh for n, _, _, sh in rows if n.startswith("layers.3."))
        return rows + [("layers.3.attn.compressor.wkv.weight", "BF16", (64, 128), shard)]

    r = audit.run_audit(str(write_checkpoint(tmp_path / "x", mutate=plant)))
    failed = not_passed(r)
    assert failed["inventory.layer_sets"] == audit.FAIL and failed["csa2.compressor"] == audit.FAIL
    assert failed["index.shards"] == audit.FAIL  # the index (written from the clean inventory) lacks it
    assert (
        "layers.3.attn.compressor.wkv.weight is not in the config's inventory" in r.check("inventory.layer_sets").detail
    )


def test_index_that_disagrees_with_a_shard(tiny):
    index = json.loads((tiny / headers.INDEX_NAME).read_text())
    index["weight_map"]["head.weight"] = shard_of(tiny_config(), "layer 0")
    (tiny / headers.INDEX_NAME).write_text(json.dumps(index))
    r = audit.run_audit(str(tiny))
    assert not_passed(r) == {"index.shards": audit.FAIL}
    assert "lacks 1 tensor(s) the index assigns it, e.g. head.weight" in r.check("index.shards").detail


def test_unreadable_index_fails_only_the_index_check(tiny):
    (tiny / headers.INDEX_NAME).write_text("{not json")
    r = audit.run_audit(str(tiny))
    assert not_passed(r) == {"index.shards": audit.FAIL}
    assert "not valid JSON" in r.check("index.shards").detail


def test_config_that_disagrees_with_the_tensors(tiny, tmp_path, capsys):
    other = tmp_path / "other"
    write_config_pair(tiny_config().replace(index_source_layers=(2, 4)), str(other))
    code, out, _ = cli(["--checkpoint-dir", tiny, "--config", other / "inference" / "config.json"], capsys)
    assert code == 1
    r = audit.run_audit(str(tiny), config=str(other))
    assert r.config_layout == "nested"
    assert r.check("csa2.index_queries").status == audit.FAIL
    assert "indexer.wq_b on layer 6" in r.check("csa2.index_queries").detail
    assert r.check("csa2.modes").status == audit.FAIL


def test_flat_config_gives_the_same_verdict(tiny):
    r = audit.run_audit(str(tiny), config=str(tiny / "inference" / "config.json"))
    assert r.config_layout == "flat" and r.passed == 39


def test_config_missing_keys_fails_checks_without_traceback(tiny, tmp_path, capsys):
    flat = json.loads((tiny / "inference" / "config.json").read_text())
    del flat["dim"]
    (tmp_path / "flat.json").write_text(json.dumps(flat))
    code, out, _ = cli(["--checkpoint-dir", tiny, "--config", tmp_path / "flat.json"], capsys)
    assert code == 1
    r = audit.run_audit(str(tiny), config=str(tmp_path / "flat.json"))
    assert r.check("config.required_keys").detail == "missing: dim"
    assert "not evaluated" in r.check("inventory.shapes").detail
    assert r.check("config.engram_layers").status == audit.PASS


def test_expect_fp8_block(tiny, capsys):
    code, out, _ = cli(["--checkpoint-dir", tiny, "--expect-fp8-block", "64", "64"], capsys)
    assert code == 1
    assert "[FAIL     ] packing.fp8_block" in out and "64x64" in out


# ---------------------------------------------------------------------- bad input
def _rewrite_header(path, change):
    """Rewrite a shard's header JSON through `change(dict)`, keeping the payload bytes as they are."""
    h = headers.read_header(str(path))
    with open(path, "rb") as f:
        f.seek(h.data_start)
        payload = f.read()
    doc = json.loads(h.raw)
    change(doc)
    body = json.dumps(doc).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + payload)


def _head_shard(tiny):
    return tiny / shard_of(tiny_config(), "head and norm")


def test_overlapping_offsets(tiny):
    def overlap(doc):
        doc["norm.weight"]["data_offsets"] = [0, 256]

    _rewrite_header(_head_shard(tiny), overlap)
    detail = audit.run_audit(str(tiny)).check("packing.extents").detail
    assert "overlap" in detail and _head_shard(tiny).name in detail


def test_gapped_offsets(tiny):
    def gap(doc):
        begin, end = doc["norm.weight"]["data_offsets"]
        doc["norm.weight"]["data_offsets"] = [begin + 2, end + 2]

    _rewrite_header(_head_shard(tiny), gap)
    r = audit.run_audit(str(tiny))
    assert "a gap of 2 unreferenced bytes" in r.check("packing.extents").detail
    assert r.exit_code == 1


def test_offsets_past_end_of_file(tiny):
    def past(doc):
        begin, end = doc["head.weight"]["data_offsets"]
        doc["head.weight"]["data_offsets"] = [begin + 10**6, end + 10**6]

    _rewrite_header(_head_shard(tiny), past)
    assert "the file is truncated" in audit.run_audit(str(tiny)).check("packing.extents").detail


def test_truncated_payload(tiny, capsys):
    path = _head_shard(tiny)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)
    code, out, _ = cli(["--checkpoint-dir", tiny], capsys)
    assert code == 1 and "[FAIL     ] packing.extents" in out and "truncated" in out


@pytest.mark.parametrize(
    "damage, sentence",
    [
        (lambda p: open(p, "r+b").truncate(40), "runs past the end of the file"),
        (lambda p: p.write_bytes(p.read_bytes()[:8] + b"[" + p.read_bytes()[9:]), "not valid JSON"),
        (lambda p: p.write_bytes(p.read_bytes().replace(b'"BF16"', b'"BF99"', 1)), "unknown dtype 'BF99'"),
        (lambda p: p.write_text("just some text saved under a shard's name"), "not a safetensors file"),
    ],
)
def test_unreadable_shard_is_one_sentence_and_exit_1(tiny, capsys, damage, sentence):
    path = _head_shard(tiny)
    damage(path)
    code, out, err = cli(["--checkpoint-dir", tiny], capsys)
    assert code == 1
    assert sentence in err and str(path) in err
    r = audit.run_audit(str(tiny))
    assert [p for p, _ in r.unreadable] == [str(path)]
    assert r.check("inventory.shapes").detail == f"{path.name} is unreadable, so its tensors cannot be checked"
    assert r.check("experts.fp4").status == audit.PASS  # the other shards are still audited


def _without_config(d):
    write_checkpoint(d)
    os.remove(d / "config.json")
    shutil.rmtree(d / "inference")


@pytest.mark.parametrize(
    "setup, sentence",
    [
        (lambda d: None, "no safetensors shards here"),
        (lambda d: (d / "notes.txt").write_text("no shards, only notes"), "no safetensors shards here"),
        (_without_config, "no config.json or inference/config.json"),
    ],
)
def test_unusable_directory_is_one_sentence_and_exit_1(tmp_path, capsys, setup, sentence):
    d = tmp_path / "ckpt"
    d.mkdir()
    setup(d)
    code, out, err = cli(["--checkpoint-dir", d], capsys)
    assert code == 1 and out == ""
    assert sentence in err and str(d) in err and len(err.strip().splitlines()) == 1
    with pytest.raises(audit.AuditError):
        audit.run_audit(str(d))


def test_missing_directory_and_missing_index(tmp_path, tiny, capsys):
    code, _, err = cli(["--checkpoint-dir", tmp_path / "nowhere"], capsys)
    assert code == 1 and "no such directory" in err
    code, _, err = cli(["--checkpoint-dir", tiny, "--index", tmp_path / "none.json"], capsys)
    assert code == 1 and "no such index file" in err


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--checkpoint-dir"],
        ["--checkpoint-dir", ".", "--list-tensors", "("],
        ["--checkpoint-dir", ".", "--expect-fp8-block", "0", "32"],
        ["--checkpoint-dir", ".", "--bogus"],
    ],
)
def test_bad_usage_exits_2(args, capsys):
    code, _, _ = cli(args, capsys)
    assert code == 2


# ---------------------------------------------------------------------- the written tiny checkpoint
def test_written_tiny_checkpoint_passes_and_a_retyped_weight_in_it_fails(tiny_checkpoint, tmp_path):
    """The checkpoint dsv41.checkpoint.tiny writes (real payloads) passes all 39; relabelling one dense FP8
    weight as I8 in its header, the reviewer's probe, fails the dtype check by name."""
    r = audit.run_audit(tiny_checkpoint, require_complete=True)
    assert (len(r.checks), r.passed, r.exit_code) == (39, 39, 0)
    copy = tmp_path / "retyped"
    shutil.copytree(tiny_checkpoint, copy)
    for name in ("layers.0.attn.wq_a.weight", "layers.0.ffn.shared_experts.w1.weight"):
        shard = next(f.path for f in r.files if name in headers.read_header(f.path).entries)

        def relabel(doc, name=name):
            assert doc[name]["dtype"] == "F8_E4M3"
            doc[name]["dtype"] = "I8"

        _rewrite_header(copy / os.path.basename(shard), relabel)
    bad = audit.run_audit(str(copy), require_complete=True)
    assert not_passed(bad) == {"inventory.shapes": audit.FAIL, "packing.fp8_block": audit.FAIL}
    for name in ("layers.0.attn.wq_a.weight", "layers.0.ffn.shared_experts.w1.weight"):
        assert f"{name} is I8, expected F8_E4M3" in bad.check("inventory.shapes").detail


# ---------------------------------------------------------------------- a config no checkpoint can have
ABSURD = [
    ({"norm_eps": float("nan")}, "norm_eps (text_config.rms_norm_eps) is NaN, not a finite number"),
    ({"rope_theta": -1}, "rope_theta is -1, it must be above 1"),
    ({"dim": -1}, "dim (text_config.hidden_size) is -1"),
    ({"n_heads": 0}, "n_heads (text_config.num_attention_heads) is 0"),
    ({"n_routed_experts": 10**12}, "n_routed_experts is 1,000,000,000,000"),
    ({"n_layers": 10**9}, "n_layers (text_config.num_hidden_layers) is 1,000,000,000"),
    ({"n_mtp_layers": 137438953471}, "n_mtp_layers (text_config.num_nextn_predict_layers) is 137,438,953,471"),
]


@pytest.mark.parametrize("change, sentence", ABSURD, ids=[next(iter(c)) for c, _ in ABSURD])
def test_an_absurd_config_fails_its_config_check_promptly(tiny, tmp_path, capsys, change, sentence):
    """These hung the audit (or exhausted memory) enumerating the inventory; now the audit reports
    the value as config.required_keys's failure, evaluates nothing else, and returns at once."""
    import time

    good = audit.run_audit(str(tiny))
    other = tmp_path / "absurd"
    write_config_pair(tiny_config().replace(**change), str(other))
    began = time.perf_counter()
    r = audit.run_audit(str(tiny), config=str(other))
    assert time.perf_counter() - began < 2
    assert [c.id for c in r.checks] == [c.id for c in good.checks] and len(r.checks) == 39
    required = r.check("config.required_keys")
    assert required.status == audit.FAIL and sentence in required.detail
    assert required.title.endswith("are present, with values a checkpoint can have")
    for c in r.checks:
        if c.id != "config.required_keys":
            assert c.status == audit.FAIL and c.detail.startswith(
                "not evaluated: the config has values no checkpoint can have"
            )
    assert r.exit_code == 1 and r.expected_tensors == 0 and r.tensors == len(expected_tensors(tiny_config()))
    json.dumps(r.to_dict())
    code, out, _ = cli(["--checkpoint-dir", tiny, "--config", other, "--json", tmp_path / "r.json"], capsys)
    assert code == 1 and "[FAIL     ] config.required_keys" in out and sentence in out
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["failed"] == 39


def test_passing_titles_and_json_keys_are_unchanged(tiny):
    r = audit.run_audit(str(tiny))
    assert r.check("config.required_keys").title == "the 36 keys the tensor inventory is derived from are present"
    doc = r.to_dict()
    assert "values" not in doc and "value_problems" not in doc["summary"]


# ---------------------------------------------------------------------- --values: the payloads
def _patch(path, entry_offset: int, data: bytes):
    with open(path, "r+b") as f:
        f.seek(entry_offset)
        f.write(data)


def _located(directory, name):
    """(shard path, absolute byte offset of the tensor's first element, header entry)."""
    for shard in sorted(os.listdir(directory)):
        if shard.endswith(".safetensors"):
            h = headers.read_header(str(directory / shard))
            if name in h.entries:
                return directory / shard, h.data_start + h.entries[name].begin, h.entries[name]
    raise AssertionError(name)


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path):
    """A copy of the embedded default checkpoint (dsv41.checkpoint.tiny's bytes, seed 0), safe to damage."""
    copy = tmp_path / "payloads"
    shutil.copytree(tiny_checkpoint, copy)
    return copy


def test_values_of_a_clean_checkpoint_report_none(tiny_copy, tmp_path, capsys):
    r = audit.run_audit(str(tiny_copy), values=True)
    v = r.values
    assert v.findings == [] and v.unread == [] and v.files == 16 and r.exit_code == 0
    assert v.tensors + v.not_float == r.tensors and v.tensors > 0
    assert v.bytes == sum(
        e.nbytes
        for f in r.files
        for e in headers.read_header(f.path).entries.values()
        if e.dtype not in ("I8", "U8", "I16", "I32", "I64", "BOOL")
    )
    code, out, err = cli(["--checkpoint-dir", tiny_copy, "--values", "--json", tmp_path / "v.json"], capsys)
    assert code == 0 and "no NaN or Inf codes" in out
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["values"]["findings"] == [] and doc["summary"]["value_problems"] == 0


def test_values_name_a_nan_in_norm_weight_with_its_count(tiny_copy, tmp_path, capsys):
    path, start, entry = _located(tiny_copy, "norm.weight")
    assert entry.dtype == "BF16"
    _patch(path, start + 2 * 5, struct.pack("<H", 0x7FC1))  # a BF16 NaN at element 5
    _patch(path, start + 2 * 9, struct.pack("<H", 0xFF80))  # -Inf at element 9
    _patch(path, start + 2 * 11, struct.pack("<H", 0xFFC0))  # a negative NaN at element 11
    assert audit.run_audit(str(tiny_copy)).exit_code == 0  # the headers are as they were
    r = audit.run_audit(str(tiny_copy), values=True)
    [finding] = r.values.findings
    assert (finding.tensor, finding.dtype, finding.nan, finding.inf, finding.elements) == (
        "norm.weight",
        "BF16",
        2,
        1,
        128,
    )
    assert finding.shard == path.name and r.exit_code == 1 and r.passed == 39
    code, out, err = cli(["--checkpoint-dir", tiny_copy, "--values", "--json", tmp_path / "v.json"], capsys)
    assert code == 1
    assert f"[FAIL     ] norm.weight (BF16 [128] in {path.name}): 2 NaN and 1 Inf of 128 values" in out
    assert "values: 1 tensor(s) with non-finite codes; exit 1" in out
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["values"]["findings"] == [
        {
            "tensor": "norm.weight",
            "shard": path.name,
            "dtype": "BF16",
            "shape": [128],
            "elements": 128,
            "nan": 2,
            "inf": 1,
        }
    ]
    assert doc["summary"]["value_problems"] == 1 and doc["summary"]["exit_code"] == 1


def test_values_find_fp8_nan_codes_and_e8m0_nan_scales(tiny_copy):
    weight, scale = "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale"
    path, start, entry = _located(tiny_copy, weight)
    assert entry.dtype == "F8_E4M3"
    _patch(path, start, b"\x7f\xff\x7e\xfe")  # NaN, NaN, 448, -448: only the first two are not finite
    path, start, entry = _located(tiny_copy, scale)
    assert entry.dtype == "F8_E8M0"
    _patch(path, start + 1, b"\xff")  # the E8M0 NaN: no scale
    path, start, entry = _located(tiny_copy, "layers.0.attn.attn_sink")
    assert entry.dtype == "F32"
    _patch(path, start, struct.pack("<ff", float("inf"), float("nan")))
    found = {f.tensor: (f.dtype, f.nan, f.inf) for f in audit.run_audit(str(tiny_copy), values=True).values.findings}
    assert found == {weight: ("F8_E4M3", 2, 0), scale: ("F8_E8M0", 1, 0), "layers.0.attn.attn_sink": ("F32", 1, 1)}


def test_values_of_header_prefixes_are_unread_not_guessed(tmp_path):
    d = write_checkpoint(tmp_path / "h", payload=False)
    r = audit.run_audit(str(d), header_prefix=True, values=True)
    assert r.values.tensors == 0 and r.values.findings == [] and r.exit_code == 0
    assert len(r.values.unread) == r.tensors - r.values.not_float > 0
    assert "run past the end" in r.values.unread[0][1] and "[not read ]" in r.format()


@pytest.mark.parametrize(
    "dtype, codes, counts",
    [
        ("F8_E4M3", b"\x7f\xff\x00\x7e\x80", (2, 0)),
        ("F8_E5M2", b"\x7c\xfc\x7d\xff\x7b", (2, 2)),
        ("F8_E8M0", b"\xff\xfe\x00", (1, 0)),
        ("BF16", struct.pack("<5H", 0x7F80, 0xFF80, 0x7FC0, 0x7F7F, 0x0001), (1, 2)),
        ("F16", struct.pack("<4H", 0x7C00, 0xFC01, 0x7BFF, 0x0000), (1, 1)),
        ("F32", struct.pack("<4f", float("inf"), float("-inf"), float("nan"), 3.4e38), (1, 2)),
        ("F64", struct.pack("<3d", float("nan"), 1e308, float("-inf")), (1, 1)),
    ],
)
def test_count_codes(dtype, codes, counts):
    from dsv41.checkpoint.audit.values import count_codes

    assert count_codes(dtype, codes) == counts


def test_values_read_in_bounded_chunks(tiny_copy, monkeypatch):
    from dsv41.checkpoint.audit import values

    monkeypatch.setattr(values, "CHUNK_BYTES", 64)  # many chunks per tensor: counts must not change
    path, start, entry = _located(tiny_copy, "head.weight")
    _patch(path, start + entry.nbytes - 2, struct.pack("<H", 0x7FC0))  # the very last element
    _patch(path, start + 62, struct.pack("<H", 0x7F80))  # the last element of the first 64-byte chunk
    [finding] = audit.run_audit(str(tiny_copy), values=True).values.findings
    assert (finding.tensor, finding.nan, finding.inf) == ("head.weight", 1, 1)
