"""safetensors header I/O (every malformed case the audit must survive) and `make-headers`."""

import json
import os
import struct

import pytest

from dsv41.checkpoint import headers as hd
from dsv41.core.config import RELEASED, load_config

TENSORS = [("a.weight", "F8_E4M3", (4, 8)), ("a.scale", "F8_E8M0", (1, 1)), ("b", "F32", (3,)), ("c", "BF16", (2, 3))]


def raw_file(path, header: dict | bytes, payload: bytes = b"") -> str:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + payload)
    return str(path)


def test_round_trip_with_payload(tmp_path):
    path = tmp_path / "x.safetensors"
    payloads = {
        name: bytes(range(1, 1 + hd.DTYPE_SIZES[d] * (s[0] * (s[1] if len(s) > 1 else 1)))) for name, d, s in TENSORS
    }
    written = hd.write_shard(str(path), TENSORS, payloads, metadata={"format": "pt"})
    assert written == os.path.getsize(path)
    h = hd.read_header(str(path))
    assert h.header_len % 8 == 0
    assert h.metadata == {"format": "pt"}
    assert {n: (e.dtype, e.shape) for n, e in h.entries.items()} == {n: (d, s) for n, d, s in TENSORS}
    assert hd.layout_problems(h) == []
    for e in h.entries.values():  # wide dtypes first keeps every tensor aligned to its element size
        assert e.begin % hd.DTYPE_SIZES[e.dtype] == 0
    with open(path, "rb") as f:  # each payload lands where its offsets say
        f.seek(h.data_start + h.entries["b"].begin)
        assert f.read(12) == payloads["b"]


def test_header_only_file_is_a_prefix(tmp_path):
    path = str(tmp_path / "p.safetensors")
    hd.write_shard(path, TENSORS)
    h = hd.read_header(path)
    assert h.data_size == 0
    assert hd.layout_problems(h, header_prefix=True) == []
    problems = hd.layout_problems(h)
    assert len(problems) == 1 and "truncated" in problems[0] and "--header-prefix" in problems[0]


def test_payload_of_wrong_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="b: payload of 4 bytes"):
        hd.write_shard(str(tmp_path / "w.safetensors"), [("b", "F32", (3,))], {"b": b"1234"})


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "only 0 bytes"),
        (b"\x05\x00\x00", "only 3 bytes"),
        (struct.pack("<Q", 500) + b"{}", "header length 500 runs past the end of the file"),
        (struct.pack("<Q", 4) + b"{x: ", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not an object"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not UTF-8"),
        (b"this is a text file, not a shard", "not a safetensors file"),
    ],
)
def test_unreadable_headers_name_the_file(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(hd.HeaderError, match=message) as info:
        hd.read_header(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "F9", "shape": [1], "data_offsets": [0, 1]}, "unknown dtype 'F9'"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "not a list of non-negative integers"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets"),
        ("F32", "not an object"),
    ],
)
def test_malformed_entries(tmp_path, entry, message):
    path = raw_file(tmp_path / "m.safetensors", {"t": entry}, b"\0" * 8)
    with pytest.raises(hd.HeaderError, match=message):
        hd.read_header(path)


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    "tensors, payload, message",
    [
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "overlap a"),
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}, 20, "a gap of 4 unreferenced bytes after a"),
        ({"a": entry("F32", [2], 4, 12)}, 12, "at the start of the data area"),
        ({"a": entry("F32", [2], 0, 12)}, 12, "span 12 bytes but F32 [2] needs 8"),
        ({"a": entry("F32", [4], 0, 16)}, 10, "file holds only 10"),
        ({"a": entry("F32", [2], 0, 8)}, 11, "3 bytes after the last tensor"),
    ],
)
def test_layout_problems(tmp_path, tensors, payload, message):
    h = hd.read_header(raw_file(tmp_path / "l.safetensors", tensors, b"\0" * payload))
    problems = hd.layout_problems(h)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    "tensors, payload, kind",
    [
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "overlap"),
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}, 20, "gap"),
        ({"a": entry("F32", [2], 0, 12)}, 12, "span"),
        ({"a": entry("F32", [4], 0, 16)}, 10, "past_end"),
        ({"a": entry("F32", [2], 0, 8)}, 11, "trailing"),
    ],
)
def test_one_tiling_check_serves_the_audit_and_the_loader(tmp_path, tensors, payload, kind):
    from dsv41.checkpoint.checkpoint import Checkpoint, LoadError

    shard = raw_file(tmp_path / "l.safetensors", tensors, b"\0" * payload)
    h = hd.read_header(shard)
    problems = hd.tiling_problems(h)
    assert problems[0].kind == kind and len(hd.layout_problems(h)) == len(problems)
    assert hd.tiling_problems(h, header_prefix=True) == [p for p in problems if p.kind not in ("past_end", "trailing")]
    with pytest.raises(LoadError) as info:  # the loader words the first of the same problems
        Checkpoint(str(tmp_path))
    assert str(info.value).startswith(shard + ": ") and "download it again" in str(info.value)


def test_plausible_header_length(tmp_path):
    good = str(tmp_path / "h00001.bin")
    hd.write_shard(good, TENSORS)
    text = tmp_path / "notes.txt"
    text.write_text("hello world, this is text")
    js = tmp_path / "config.json"
    js.write_text('{"a": 1}')
    assert hd.plausible_header_length(good)
    assert not hd.plausible_header_length(str(text))
    assert not hd.plausible_header_length(str(js))


def test_parse_shard_list():
    assert hd.parse_shard_list("1-20,44", 48) == list(range(1, 21)) + [44]
    assert hd.parse_shard_list("3", 48) == [3]
    for bad in ("0-2", "47-49", "x", "5-3"):
        with pytest.raises(ValueError, match="--shards"):
            hd.parse_shard_list(bad, 48)


@pytest.fixture(scope="module")
def released_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("released")
    assert hd.cli_main([str(out)]) == 0
    return out


def test_make_headers_writes_the_released_checkpoint(released_dir):
    shards = sorted(p for p in os.listdir(released_dir) if p.endswith(".safetensors"))
    assert len(shards) == 48 and shards[0] == "model-00001-of-00048.safetensors"
    tensors, total = 0, 0
    for name in shards:
        h = hd.read_header(str(released_dir / name))
        assert hd.layout_problems(h, header_prefix=True) == []
        assert h.data_size == 0  # headers only
        tensors += len(h.entries)
        total += sum(e.nbytes for e in h.entries.values())
    assert (tensors, total) == (96_085, 510_286_023_000)
    index = json.loads((released_dir / hd.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 510_286_023_000
    assert len(index["weight_map"]) == 96_085
    assert index["weight_map"]["layers.1.engram.embed.weight"] == "model-00047-of-00048.safetensors"
    assert load_config(str(released_dir / "config.json")) == RELEASED
    assert (
        load_config(str(released_dir / "inference" / "config.json")).as_reference_dict() == RELEASED.as_reference_dict()
    )


def test_make_headers_subset(tmp_path, capsys):
    assert hd.cli_main([str(tmp_path), "--shards", "1-2,44"]) == 0
    written = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    assert written == [
        "model-00001-of-00048.safetensors",
        "model-00002-of-00048.safetensors",
        "model-00044-of-00048.safetensors",
    ]
    index = json.loads((tmp_path / hd.INDEX_NAME).read_text())
    assert len(index["weight_map"]) == 96_085  # the index describes the whole release
    assert "wrote 3 of 48" in capsys.readouterr().out


def test_make_headers_bad_usage(tmp_path, capsys):
    assert hd.cli_main([str(tmp_path), "--shards", "40-50"]) == 2
    assert "outside 1-48" in capsys.readouterr().err
    assert hd.cli_main([]) == 2
    assert not any(p.endswith(".safetensors") for p in os.listdir(tmp_path))


# ---------------------------------------------------------------------- damage found by fuzzing
# Each of these raised something other than HeaderError before (TypeError, RecursionError, a plain
# ValueError): the audit then died with a traceback instead of listing the shard as unreadable.
@pytest.mark.parametrize(
    "entry, message",
    [
        # 693 of 10,000 fuzzed headers with one field replaced crashed on these: `[] in DTYPE_SIZES`
        ({"dtype": [], "shape": [1], "data_offsets": [0, 1]}, r"unknown dtype \[\]"),
        ({"dtype": {}, "shape": [1], "data_offsets": [0, 1]}, r"unknown dtype \{\}"),
        ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}, r"unknown dtype \['F32'\]"),
        ({"dtype": None, "shape": [1], "data_offsets": [0, 4]}, "unknown dtype None"),
        # safetensors offsets and dimensions are 64-bit
        ({"dtype": "F32", "shape": [2**64], "data_offsets": [0, 4]}, "beyond the 64-bit byte range"),
        ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}, "beyond the 64-bit byte range"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 2**64]}, "beyond the 64-bit byte range"),
    ],
    ids=["dtype-list", "dtype-object", "dtype-list-of-name", "dtype-null", "dim-2^64", "bytes-2^82", "offset-2^64"],
)
def test_malformed_entries_found_by_fuzzing(tmp_path, entry, message):
    path = raw_file(tmp_path / "m.safetensors", {"t": entry}, b"\0" * 8)
    with pytest.raises(hd.HeaderError, match=message) as info:
        hd.read_header(path)
    assert str(info.value).startswith(path)


@pytest.mark.parametrize(
    "body, message",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests too deep"),  # was RecursionError
        (b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deep"),
        (
            b'{"t": {"dtype": "F32", "shape": [' + b"7" * 5_000 + b'], "data_offsets": [0, 4]}}',
            "an integer of 5,000 digits",
        ),  # was ValueError: Exceeds the limit (4300 digits)
        (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, -' + b"9" * 30 + b"]}}", "an integer of 30 digits"),
        (b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "unpaired surrogate"),
        (b'{"__metadata__": {"format": "\\udfff"}}', "unpaired surrogate"),
    ],
    ids=[
        "array-100000-deep",
        "object-100000-deep",
        "int-5000-digits",
        "int-30-digits",
        "surrogate-name",
        "surrogate-metadata",
    ],
)
def test_pathological_headers_are_one_sentence(tmp_path, body, message):
    path = raw_file(tmp_path / "deep.safetensors", body, b"\0" * 4)
    with pytest.raises(hd.HeaderError, match=message) as info:
        hd.read_header(path)
    text = str(info.value)
    assert text.startswith(path) and "\n" not in text and len(text) < 400


def test_messages_about_huge_values_stay_short(tmp_path):
    name = "n" * 1_000_000
    path = raw_file(
        tmp_path / "big.safetensors",
        {name: {"dtype": "F32", "shape": list(range(-1, 100_000)), "data_offsets": [0, 4]}},
        b"\0" * 4,
    )
    with pytest.raises(hd.HeaderError, match="a list of 100,001 items") as info:
        hd.read_header(path)
    assert len(str(info.value)) < 400


def test_a_long_shape_of_huge_dimensions_is_cheap(tmp_path):
    # a byte count that cannot fit 64 bits is refused as soon as it cannot, without multiplying on
    import time

    path = raw_file(
        tmp_path / "s.safetensors",
        {"t": {"dtype": "F32", "shape": [2**63] * 200_000, "data_offsets": [0, 4]}},
        b"\0" * 4,
    )
    began = time.perf_counter()
    with pytest.raises(hd.HeaderError, match="64-bit"):
        hd.read_header(path)
    assert time.perf_counter() - began < 2
