"""`dsv41.load` on damaged checkpoints: every failure is a LoadError, one sentence naming the file
(and the tensor) once, with the fix. Each bad checkpoint is a copy of the tiny one with one file
edited: shard extents (gap, overlap, trailing bytes, span), a safetensors error at read time, the
index, tokenizer_config.json, a tensor stored twice, NaN / Inf weights, and a bounded,
deterministic sample of byte-level corruptions of a shard. The loading bar is drawn only on a
terminal, never over nothing, and closed however the load ends."""

import io
import json
import os
import random
import shutil
import struct

import pytest
import torch

from dsv41.checkpoint.checkpoint import Checkpoint, LoadError
from dsv41.runtime.loader import load

pytestmark = pytest.mark.usefixtures("one_thread")

INDEX = "model.safetensors.index.json"
LAYER0 = "model-00003-of-00016.safetensors"  # layer 0: dense FP8 / BF16 / F32 tensors and its experts
HEAD = "model-00011-of-00016.safetensors"  # head.weight and norm.weight only


def _copy(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _split(path):
    """(header JSON as a dict, data area bytes) of a safetensors file."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(path, doc, data: bytes) -> None:
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)


def _by_offset(doc):
    return sorted((k for k in doc if k != "__metadata__"), key=lambda k: doc[k]["data_offsets"])


def _load_error(folder) -> str:
    """The LoadError message of loading `folder` (fails the test on success or another exception)."""
    with pytest.raises(LoadError) as info:
        load(folder, quiet=True)
    message = str(info.value)
    assert "\n" not in message
    return message


def _edit_json(path, change):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc = change(doc)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)


# ---------------------------------------------------------------------- 1. shard extents
def test_a_gap_between_tensors_names_shard_and_tensor(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    shard = os.path.join(folder, LAYER0)
    doc, data = _split(shard)
    last = _by_offset(doc)[-1]
    begin, end = doc[last]["data_offsets"]
    doc[last]["data_offsets"] = [begin + 16, end + 16]
    _join(shard, doc, data[:begin] + bytes(16) + data[begin:])  # 16 unreferenced bytes before the last tensor
    message = _load_error(folder)  # was SafetensorError: invalid offset for tensor
    assert message.startswith(f"{shard}: tensor {last} ")
    assert "gap of 16 unreferenced bytes" in message and "download it again" in message


def test_overlapping_tensors_name_shard_and_both_tensors(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    shard = os.path.join(folder, LAYER0)
    doc, data = _split(shard)
    *_, before, last = _by_offset(doc)
    begin, end = doc[last]["data_offsets"]
    doc[last]["data_offsets"] = [begin - 16, end - 16]
    _join(shard, doc, data[:-16])
    message = _load_error(folder)  # was SafetensorError: invalid offset for tensor
    assert message.startswith(f"{shard}: tensor {last} ") and f"overlaps tensor {before}" in message


def test_trailing_bytes_after_the_last_tensor_name_the_shard(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    shard = os.path.join(folder, LAYER0)
    with open(shard, "ab") as f:
        f.write(bytes(24))
    message = _load_error(folder)  # was SafetensorError: incomplete metadata, file not fully covered
    doc, _ = _split(shard)
    assert message.startswith(f"{shard}: 24 trailing bytes") and _by_offset(doc)[-1] in message


def test_a_span_that_does_not_fit_dtype_and_shape_names_the_tensor(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    shard = os.path.join(folder, HEAD)
    doc, data = _split(shard)
    doc["norm.weight"]["shape"] = [64]  # half the bytes its offsets span
    _join(shard, doc, data)
    message = _load_error(folder)
    assert message.startswith(f"{shard}: tensor norm.weight is BF16 [64] (128 bytes)")


def test_a_truncated_shard_names_the_tensor_that_runs_past_the_end(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    shard = os.path.join(folder, LAYER0)
    os.truncate(shard, os.path.getsize(shard) - 100)
    message = _load_error(folder)
    assert message.startswith(f"{shard}: tensor ") and "truncated, download it again" in message


def test_a_safetensors_error_at_read_time_is_a_load_error(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    ckpt = Checkpoint(folder)  # headers checked; then the shards change on disk before any read
    shard = os.path.join(folder, HEAD)
    os.truncate(shard, os.path.getsize(shard) - 8)
    with pytest.raises(LoadError, match=r"^" + shard + r": tensor head\.weight cannot be read \(.*download it again"):
        ckpt.read("head.weight")
    engram = ckpt.entries["layers.1.engram.embed.weight"][0]
    os.truncate(engram, 100)
    with pytest.raises(LoadError, match=r"^" + engram + r": tensor layers\.1\.engram\.embed\.weight cannot be read"):
        ckpt.rows("layers.1.engram.embed.weight", [[0, 1]])


def test_load_reraises_any_read_error_naming_shard_and_tensor(tiny_checkpoint, monkeypatch):
    import errno

    real = os.preadv

    def failing(fd, buffers, offset, *args):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == HEAD:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", failing)
    message = _load_error(tiny_checkpoint)
    assert message.startswith(os.path.join(tiny_checkpoint, HEAD) + ": tensor ")
    assert os.strerror(errno.EIO) in message


# ---------------------------------------------------------------------- 2. the index
@pytest.mark.parametrize(
    "content, why",
    [
        ("[1, 2]", "holds an array"),
        ('{"weight_map": ["a", "b"]}', "a weight_map that is an array"),
        ('{"metadata": {}}', "no weight_map"),
        ('{"weight_map": {"head.weight": 7}}', "maps 'head.weight' to a number"),
        ('{"weight_map": {"head.weight": null}}', "maps 'head.weight' to null"),
        ('{"weight_map": {}}', "lists no tensors"),
        ('{"weight_map": {"head.weight": "\\ud800.safetensors"}}', "not Unicode text"),
        ('{"weight_map": {', "not valid JSON"),
        ("[" * 100_000, "not JSON this reader accepts"),
    ],
    ids=[
        "list",
        "weight_map-list",
        "no-weight_map",
        "shard-number",
        "shard-null",
        "empty",
        "surrogate",
        "not-json",
        "deep",
    ],
)
def test_a_malformed_index_is_a_load_error_naming_it(tiny_checkpoint, tmp_path, content, why):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    index = os.path.join(folder, INDEX)
    with open(index, "w") as f:
        f.write(content)
    message = _load_error(folder)  # was TypeError / AttributeError (list), RecursionError (nesting)
    assert message.startswith(f"{index}: ") and why in message


@pytest.mark.parametrize(
    "where",
    ["../{}", "{abs}", "sub/{}", "sub\\{}", "./{}", "..", ""],
    ids=["parent", "absolute", "subfolder", "backslash", "dot-slash", "dotdot", "empty"],
)
def test_index_shard_names_outside_the_folder_are_refused(tiny_checkpoint, tmp_path, where):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    os.makedirs(os.path.join(folder, "sub"))
    shutil.copy(os.path.join(folder, HEAD), os.path.join(folder, "sub", HEAD))
    shutil.copy(os.path.join(folder, HEAD), tmp_path / HEAD)  # "../" would find a real file
    name = where.format(HEAD, abs=os.path.join(folder, HEAD))

    def point(doc):
        doc["weight_map"]["head.weight"] = name
        return doc

    _edit_json(os.path.join(folder, INDEX), point)
    message = _load_error(folder)
    assert message.startswith(os.path.join(folder, INDEX) + ": tensor head.weight is listed in ")
    assert "paths and '..' are refused" in message


# ---------------------------------------------------------------------- 3. tokenizer_config.json
@pytest.mark.parametrize(
    "content, why",
    [
        ('{"bos_token": ', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        ('["bos_token"]', "holds an array"),
        ('{"bos_token": 0}', "bos_token is a number (0)"),
        ('{"eos_token": {"content": 1}}', "eos_token is a number (1)"),
        ('{"pad_token": ["<pad>"]}', "pad_token is an array"),
    ],
    ids=["not-json", "not-utf8", "list", "bos-int", "eos-content-int", "pad-list"],
)
def test_a_malformed_tokenizer_config_is_a_load_error_naming_it(tiny_checkpoint, tmp_path, content, why):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    meta = os.path.join(folder, "tokenizer_config.json")
    with open(meta, "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())
    message = _load_error(folder)  # was JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError
    assert message.startswith(f"{meta}: ") and why in message


# ---------------------------------------------------------------------- 4. a tensor stored twice
@pytest.mark.parametrize("with_index", [False, True])
def test_a_tensor_in_two_shards_is_refused_naming_both(tiny_checkpoint, tmp_path, with_index):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    if not with_index:
        os.remove(os.path.join(folder, INDEX))  # without an index the second copy used to win silently
    stray = os.path.join(folder, "model-00004-of-00016.safetensors")
    tensors = load_file(stray)
    tensors["norm.weight"] = torch.full((128,), 7.0, dtype=torch.bfloat16)
    save_file(tensors, stray, metadata={"format": "pt"})
    message = _load_error(folder)
    assert message.startswith(
        f"{folder}: tensor norm.weight is stored in both model-00004-of-00016.safetensors and {HEAD}"
    )


# ---------------------------------------------------------------------- 5. the shard named once
def test_a_bad_shard_is_named_once(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    shard = os.path.join(folder, LAYER0)
    os.truncate(shard, 100)  # HeaderError: header length runs past the end of the file
    message = _load_error(folder)
    assert message.startswith(f"{shard}: header length") and message.count(shard) == 1
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", 8) + b'{"a": 1}')  # HeaderError: a tensor described by int
    message = _load_error(folder)
    assert message.count(shard) == 1 and message.count(LAYER0) == 1


def test_generate_names_a_bad_shard_once(tiny_checkpoint, tmp_path, capsys):
    from dsv41.app.cli import generate_main

    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    shard = os.path.join(folder, LAYER0)
    os.truncate(shard, 100)
    assert generate_main(["--checkpoint", folder, "--prompt", "hi", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert shard in err and err.count(shard) == 1, err


# ---------------------------------------------------------------------- 6. non-finite weights
def test_nan_and_inf_weights_never_crash_the_load(tiny_checkpoint, tmp_path):
    """Detecting them is not the loader's job; loading them must end in a model or a LoadError."""
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_checkpoint, tmp_path / "ck")

    def poison(file, names):
        path = os.path.join(folder, file)
        tensors = load_file(path)
        for name in names:
            t = tensors[name]
            raw = t.view(torch.uint8).reshape(-1)
            if t.dtype == torch.float8_e4m3fn:
                raw[::3] = 0x7F  # E4M3 NaN
            elif t.dtype == torch.float8_e8m0fnu:
                raw[::2] = 0xFF  # E8M0 NaN
            else:
                flat = t.reshape(-1)
                flat[::3] = float("nan")
                flat[1::3] = float("inf")
                flat[2::5] = float("-inf")
        save_file(tensors, path, metadata={"format": "pt"})

    poison(HEAD, ["head.weight", "norm.weight"])  # head promoted BF16 -> F32 at load
    poison(
        LAYER0,
        [
            "layers.0.attn.wo_a.weight",
            "layers.0.attn.wo_a.scale",  # dequantized at load
            "layers.0.attn.wq_a.weight",
            "layers.0.attn.wq_a.scale",
            "layers.0.attn_norm.weight",
            "layers.0.attn.attn_sink",
            "layers.0.hc_attn_fn",
        ],
    )
    try:
        model = load(folder, quiet=True)
    except LoadError:
        return  # a finiteness check someone adds may refuse it: that is a LoadError too
    assert model.report.parameters_filled == (
        len(list(model.backbone.parameters())) + len(list(model.draft_stack.parameters()))
    )


# ---------------------------------------------------------------------- byte-level corruption
def _corruptions(raw: bytes, rng: random.Random):
    """(label, corrupted bytes) for one shard: truncations, header-length edits, random header bytes
    and digit edits (which keep the JSON valid and move offsets, shapes and names instead)."""
    (n,) = struct.unpack("<Q", raw[:8])
    size = len(raw)
    for cut in sorted({0, 1, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, (8 + n + size) // 2, size - 1}):
        yield f"truncated to {cut} bytes", raw[:cut]
    for length in sorted({n ^ (1 << b) for b in (0, 1, 3, 7, 12, 20, 31, 63)} | {0, 1, n - 8, n + 8}):
        yield f"header length {length}", struct.pack("<Q", length) + raw[8:]
    for trial in range(10):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(8, 8 + n)] = rng.randrange(256)
        yield f"random header bytes #{trial}", bytes(data)
    digits = [i for i in range(8, 8 + n) if 48 <= raw[i] <= 57]
    for _ in range(14):
        data = bytearray(raw)
        at = rng.choice(digits)
        data[at] = rng.choice([d for d in b"0123456789" if d != raw[at]])
        yield f"digit at byte {at} -> {chr(data[at])}", bytes(data)


def test_byte_level_corruption_of_a_shard_only_ever_raises_load_error(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "ck")
    rng = random.Random(41)
    surprises, outcomes = [], {"LoadError": 0, "loaded": 0}
    for file in (HEAD, LAYER0):
        shard = os.path.join(folder, file)
        raw = open(shard, "rb").read()
        for label, data in _corruptions(raw, rng):
            with open(shard, "wb") as f:
                f.write(data)
            try:
                load(folder, quiet=True)
                outcomes["loaded"] += 1
            except LoadError as exc:
                outcomes["LoadError"] += 1
                message = str(exc)
                if message.count(shard) > 1 or "\n" in message:
                    surprises.append(f"{file}, {label}: the message names the shard twice or spans lines: {message}")
            except Exception as exc:  # noqa: BLE001 - the point of the test
                surprises.append(f"{file}, {label}: {type(exc).__name__}: {exc}")
        with open(shard, "wb") as f:
            f.write(raw)
    assert not surprises, "\n".join(surprises)
    assert outcomes["LoadError"] > 50, outcomes


# ---------------------------------------------------------------------- progress bars
class Terminal(io.StringIO):
    """A stderr that says it is a terminal, keeping what was drawn on it."""

    def isatty(self) -> bool:
        return True


def test_a_captured_load_keeps_no_loading_bar(tiny_checkpoint, capsys):
    load(tiny_checkpoint, threads=1)
    err = capsys.readouterr().err
    assert "checkpoint" in err or "parameters filled" in err  # the report is there
    assert "\r" not in err and "%|" not in err and "tensor/s" not in err, err


def _screen(drawn: str) -> list[str]:
    """The lines a terminal shows for `drawn`: a carriage return goes back to the line's start and
    what follows overwrites it."""
    lines = []
    for row in drawn.split("\n"):
        shown: list[str] = []
        at = 0
        for part in row.split("\r"):
            shown[at : at + len(part)] = part
            at = 0
        lines.append("".join(shown).rstrip())
    return lines


@pytest.mark.parametrize("stop", [LoadError, KeyboardInterrupt])
def test_a_load_that_stops_leaves_no_bar_under_its_message(tiny_checkpoint, monkeypatch, stop):
    from dsv41.app import cli

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    read, calls = Checkpoint.read, []

    def stopping_read(self, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 5:  # in the middle of filling the parameters
            raise stop(f"{self.path}: stopped on purpose at {name}")
        return read(self, name, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "read", stopping_read)
    assert cli.chat_main(["--checkpoint", tiny_checkpoint]) == (1 if stop is LoadError else 130)
    drawn = terminal.getvalue()
    assert "loading" in drawn  # the bar was drawn on the terminal
    # and cleared before the message, which stands alone on the screen
    shown = [line for line in _screen(drawn) if line]
    assert len(shown) == 1 and shown[0].startswith("dsv41 chat: ") and "%|" not in shown[0], shown


def test_no_bar_is_drawn_over_nothing(tiny_checkpoint, monkeypatch):
    from dsv41.runtime.loader import fill_parameters

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert fill_parameters(torch.nn.Module(), Checkpoint(tiny_checkpoint), None, quiet=False) == set()
    assert terminal.getvalue() == ""
