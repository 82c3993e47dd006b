"""Tampered and hostile trace files: `GenerationTrace.load` and `dsv41 replay` answer each with one
sentence, check every declared size before reading it, read only the members the manifest names,
and keep the replay's memory to what the trace holds. Every file is crafted here and stays small:
the huge sizes are claims in headers, never allocations."""

import io
import json
import struct
import zipfile

import numpy as np
import pytest
import torch

from dsv41.model.trace import (
    AttentionRecord,
    EngramRecord,
    FiniteRecord,
    ForwardTrace,
    GenerationTrace,
    RoutingRecord,
    StepRecord,
    TraceFileError,
)
from dsv41.model.trace import file as trace_module
from dsv41.observe import cache_policy as cp


def _trace(first_ids=((0, 1), (1, 2)), later_ids=((2, 3),)):
    forward = ForwardTrace()
    first = torch.tensor([list(first_ids)])
    forward.routing.append(RoutingRecord(0, 0, first, torch.ones(first.shape)))
    later = torch.tensor([list(later_ids)])
    forward.routing.append(
        RoutingRecord(0, first.shape[1], later, torch.ones(later.shape), cache_hits=1, cache_misses=1)
    )
    forward.attention.append(
        AttentionRecord(
            0,
            "full",
            4,
            0,
            2,
            selected=torch.tensor([[[0, -1], [0, -1]]]),
            reachable=torch.tensor([0, 0]),
            kth_score=torch.zeros(1, 2),
        )
    )
    forward.engram.append(EngramRecord(0, 0, torch.full((1, 2, 4), 0.5)))
    forward.finite.append(FiniteRecord(None, "head", 0, True))
    return GenerationTrace(
        forward, [StepRecord(1, 5, 0.5, 0.01)], [{"start_pos": 0, "seqlen": 2, "layers": {0: [0, 3]}}]
    )


META = {"n_routed_experts": 8, "expert_cache": 2}


def _saved(tmp_path, trace=None, meta=META, name="good.npz"):
    return (trace or _trace()).save(tmp_path / name, meta=meta)


def _npy(array) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def _members(path) -> dict:
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def _manifest(members) -> dict:
    return json.loads(np.load(io.BytesIO(members["manifest.npy"])).tobytes().decode("utf-8"))


def _write(path, members, compression=zipfile.ZIP_DEFLATED) -> str:
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return str(path)


def _tampered(tmp_path, edit=None, text=None, members=None, drop=(), trace=None, meta=META):
    """A good trace rewritten: `edit(manifest)` changes its manifest in place (or `text` replaces it),
    `members` adds or replaces members, `drop` removes them."""
    parts = _members(_saved(tmp_path, trace, meta))
    if text is None:
        manifest = _manifest(parts)
        if edit is not None:
            edit(manifest)
        text = json.dumps(manifest)
    parts["manifest.npy"] = _npy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8))
    parts.update(members or {})
    for name in drop:
        del parts[name]
    return _write(tmp_path / "bad.npz", parts)


def _claim_size(path, name: str, size: int) -> None:
    """Patch the zip's central directory so that member `name` declares `size` uncompressed bytes
    (a stored member without zip64: the field at offset 24 of its directory entry)."""
    blob = bytearray(open(path, "rb").read())
    at = 0
    while (at := blob.find(b"PK\x01\x02", at)) >= 0:
        length = struct.unpack_from("<H", blob, at + 28)[0]
        if blob[at + 46 : at + 46 + length] == name.encode():
            struct.pack_into("<I", blob, at + 24, size)
            open(path, "wb").write(bytes(blob))
            return
        at += 4
    raise AssertionError(f"no directory entry for {name}")


def _refused(path, *says, **load_options) -> str:
    with pytest.raises(TraceFileError) as caught:
        GenerationTrace.load(path, **load_options)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message, message
    for part in says:
        assert part in message, message
    return message


def _replay_refuses(path, capsys, *says, code=1, args=()):
    assert cp.cli_main([str(path), *args]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv41 replay: ") and "\n" not in err and "Traceback" not in err, err
    for part in says:
        assert part in err, err
    return err


def _routing(manifest, i=0) -> dict:
    return manifest["forward"]["routing"][i]


def _member_of(manifest, field, i=0) -> str:
    return _routing(manifest, i)[field]["tensor"] + ".npy"


@pytest.fixture
def opened(monkeypatch):
    """The names of the members the loader opens."""
    names = []
    real = zipfile.ZipFile.open

    def spy(self, name, *args, **kwargs):
        names.append(getattr(name, "filename", name))
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    return names


# ---------------------------------------------------------------------- valid traces stay as they were
def test_a_good_trace_loads_and_replays_as_before(tmp_path):
    trace = _trace()
    back = GenerationTrace.load(_saved(tmp_path, trace))
    assert back.meta == META and back.cache == trace.cache
    for name in ("routing", "attention", "engram", "finite"):
        for mine, theirs in zip(getattr(trace.forward, name), getattr(back.forward, name)):
            assert repr(mine) == repr(theirs)
    assert cp.policy_data(back) == cp.policy_data(trace, n_experts=8, capacity=2)


# ---------------------------------------------------------------------- the replay's memory
def test_an_expert_id_past_the_declared_count_is_one_sentence(tmp_path, capsys):
    # one id of 10**12 once made the replay allocate per possible id until the OOM killer came
    huge = _saved(tmp_path, _trace(later_ids=((2, 10**12),)))
    _refused(huge, "routing record 1", "expert_ids", "1,000,000,000,000", "8 routed experts")
    _replay_refuses(huge, capsys, "expert_ids", "1,000,000,000,000")
    # without a declared count the bound is the most experts a config may have
    undeclared = _saved(tmp_path, _trace(later_ids=((2, 10**12),)), meta={}, name="undeclared.npz")
    _refused(undeclared, "expert_ids", "16,384")
    # and a trace built in memory meets the same bound in the replay
    with pytest.raises(ValueError, match="16,384"):
        cp.policy_data(_trace(later_ids=((2, 10**12),)))
    with pytest.raises(ValueError, match="expert -3"):
        cp.policy_data(_trace(later_ids=((2, -3),)), n_experts=8)


def test_a_declared_expert_count_past_any_config_is_one_sentence(tmp_path, capsys):
    path = _saved(tmp_path, meta={"n_routed_experts": 10**10})
    _refused(path, "n_routed_experts", "10,000,000,000", "16,384")
    _replay_refuses(path, capsys, "n_routed_experts")
    for bad in (0, -4, True, "8", 2.5):
        _refused(_saved(tmp_path, meta={"n_routed_experts": bad}, name="bad.npz"), "n_routed_experts")
    _refused(_saved(tmp_path, meta={"expert_cache": -1}, name="cache.npz"), "expert_cache")
    with pytest.raises(ValueError, match="16,384"):
        cp.policy_data(_trace(), n_experts=10**10)
    trace = _trace()
    trace.meta["n_routed_experts"] = 10**10  # in memory, where no loader checked it
    with pytest.raises(ValueError, match="the trace's n_routed_experts is 10,000,000,000; .* 16,384"):
        cp.policy_data(trace)


def test_experts_past_any_config_is_a_usage_error(tmp_path, capsys):
    path = _saved(tmp_path)
    _replay_refuses(path, capsys, "--experts", "16,384", code=2, args=["--experts", str(10**9)])
    _replay_refuses(path, capsys, "--experts", code=2, args=["--experts", "0"])
    assert cp.cli_main([path, "--experts", "16384", "--capacity", "2"]) == 0
    capsys.readouterr()


def test_the_static_ranking_lists_every_expert_but_counts_only_those_seen():
    calls = cp.routing_calls(_trace())[0]
    assert cp.static_ranking(calls, 6) == [2, 1, 0, 3, 4, 5]  # 1 and 2 two tokens each, 2 in two calls
    assert cp.static_ranking(calls[:1], 3) == [1, 0, 2]  # ids at or past n_experts are not ranked


# ---------------------------------------------------------------------- members and their sizes
def test_a_member_the_manifest_does_not_name_is_refused_unread(tmp_path, opened):
    path = _tampered(tmp_path, members={"t999.npy": b"\0" * 64})
    _claim_size(path, "t999.npy", 2**31)  # the directory says 2 GiB, as in the issue
    opened.clear()
    _refused(path, "t999.npy", "does not name")
    assert "t999.npy" not in opened
    for name in ("notes.txt", "../t1.npy", "manifest.npy.bak"):
        _refused(_tampered(tmp_path, members={name: b"hello"}), repr(name))
    # a member the manifest names that is missing
    first = _member_of(_manifest(_members(_saved(tmp_path))), "weights")
    _refused(_tampered(tmp_path, drop=[first]), first, "no such member")


def test_every_member_is_sized_from_its_directory_and_header_before_reading(tmp_path, monkeypatch):
    good = _manifest(_members(_saved(tmp_path)))
    ids = _member_of(good, "expert_ids")
    # a header claiming 10**12 values over a member of a few bytes
    claim = io.BytesIO()
    np.lib.format.write_array_header_1_0(claim, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
    path = _tampered(tmp_path, members={ids: claim.getvalue() + b"\0" * 16})
    _refused(path, ids, "8,000,000,000,000 bytes", "holds")
    # a directory claiming as much as the header, more than the data there: found short, not allocated
    gate = good["forward"]["engram"][0]["gate"]["tensor"] + ".npy"
    both = io.BytesIO()
    np.lib.format.write_array_header_1_0(both, {"descr": "<f4", "fortran_order": False, "shape": (1, 2, 100_000_000)})
    parts = _members(_tampered(tmp_path, members={gate: both.getvalue() + b"\0" * 16}))
    path = _write(tmp_path / "stored.npz", parts, compression=zipfile.ZIP_STORED)
    _claim_size(path, gate, len(both.getvalue()) + 800_000_000)
    _refused(path, gate, "truncated")
    # all members together against the bound, from the directory alone
    _refused(_saved(tmp_path), "bytes", "max_bytes", max_bytes=1000)
    monkeypatch.setattr(trace_module, "MAX_TRACE_BYTES", 1000)
    _refused(_saved(tmp_path), "1,000")
    monkeypatch.undo()
    # a manifest past its own bound
    monkeypatch.setattr(trace_module, "MAX_MANIFEST_BYTES", 100)
    _refused(_saved(tmp_path), "manifest", "100")


def test_member_headers_that_lie_are_one_sentence(tmp_path):
    good = _manifest(_members(_saved(tmp_path)))
    ids, weights = _member_of(good, "expert_ids"), _member_of(good, "weights")
    for member in (
        _npy(np.asfortranarray(np.zeros((2, 2, 2), dtype=np.int64))),  # Fortran order
        _npy(np.zeros((1, 2, 2), dtype=">i8")),  # big-endian
        _npy(np.zeros((1, 2, 2), dtype=[("a", "<i8")])),  # a structured dtype
        b"PK not a numpy file",
    ):
        _refused(_tampered(tmp_path, members={ids: member}), ids)
    _refused(_tampered(tmp_path, members={weights: _npy_pickled()}), weights, "pickle")
    # a byte changed after writing: the member's CRC no longer matches
    path = _write(tmp_path / "flipped.npz", _members(_saved(tmp_path)), compression=zipfile.ZIP_STORED)
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(weights)
    blob = bytearray(open(path, "rb").read())
    name_len, extra_len = struct.unpack_from("<HH", blob, info.header_offset + 26)
    blob[info.header_offset + 30 + name_len + extra_len + info.file_size - 1] ^= 0x40
    open(path, "wb").write(bytes(blob))
    _refused(path, weights, "CRC")
    # booleans stored as bytes other than 0 and 1
    trace = _trace()
    trace.forward.routing[0].image_mask = torch.ones(1, 2, dtype=torch.bool)
    trace.forward.routing[0].text_bias_ids = trace.forward.routing[0].expert_ids.clone()
    mask = _routing(_manifest(_members(_saved(tmp_path, trace))))["image_mask"]["tensor"] + ".npy"
    twos = _npy(np.full((1, 2), 2, dtype=np.uint8)).replace(b"'|u1'", b"'|b1'")
    _refused(_tampered(tmp_path, trace=trace, members={mask: twos}), "image_mask", "0 and 1")


def _npy_pickled() -> bytes:
    out = io.BytesIO()
    np.save(out, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return out.getvalue()


# ---------------------------------------------------------------------- the manifest
def test_a_manifest_nested_deep_or_malformed_is_one_sentence(tmp_path):
    _refused(_tampered(tmp_path, text="[" * 100_000), "nests")
    _refused(
        _tampered(
            tmp_path,
            text='{"format": "dsv41.GenerationTrace", "version": 1, "forward": {},'
            ' "meta": {"a": ' + "[" * 200 + "]" * 200 + "}}",
        ),
        "nests",
    )
    _refused(_tampered(tmp_path, text='{"format": ' + "9" * 5000 + "}"), "digits")
    _refused(_tampered(tmp_path, text='{"format": '), "not valid JSON")
    parts = _members(_saved(tmp_path))
    parts["manifest.npy"] = _npy(np.frombuffer(b"\xff\xfe{}", dtype=np.uint8))
    _refused(_write(tmp_path / "latin.npz", parts), "UTF-8")
    parts["manifest.npy"] = _npy(np.zeros(4, dtype=np.float32))
    _refused(_write(tmp_path / "floats.npz", parts), "manifest")


@pytest.mark.parametrize(
    "label, edit, says",
    [
        ("1-D expert ids", lambda m: None, ("expert_ids", "1-D")),
        ("5-D expert ids", lambda m: None, ("expert_ids", "5-D")),
        ("negative ids", lambda m: None, ("expert_ids", "-7")),
        (
            "relabelled dtype",
            lambda m: _routing(m)["expert_ids"].update(dtype="float32"),
            ("expert_ids", "float32", "int64"),
        ),
        ("ids as floats", lambda m: None, ("expert_ids", "integer")),
        ("an unknown dtype", lambda m: _routing(m)["expert_ids"].update(dtype="load"), ("expert_ids", "'load'")),
        ("layer -5", lambda m: _routing(m).update(layer=-5), ("routing record 0", "layer", "-5")),
        ("start_pos -100", lambda m: _routing(m, 1).update(start_pos=-100), ("routing record 1", "start_pos", "-100")),
        ("a bool as a layer", lambda m: _routing(m).update(layer=True), ("layer", "True")),
        ("a string as a position", lambda m: _routing(m).update(start_pos="0"), ("start_pos",)),
        ("weights of another shape", lambda m: None, ("weights", "expert_ids")),
        ("an attention mode", lambda m: m["forward"]["attention"][0].update(mode="sideways"), ("mode", "sideways")),
        ("a seqlen the tensors lack", lambda m: m["forward"]["attention"][0].update(seqlen=10**9), ("seqlen",)),
        ("a finite site", lambda m: m["forward"]["finite"][0].update(site="elsewhere"), ("site",)),
        ("a step token", lambda m: m["steps"][0].update(token=-1), ("step 0", "token")),
        ("a cache step", lambda m: m["cache"][0].update(layers=[[0, [1]]]), ("cache step 0",)),
        ("an unknown field", lambda m: _routing(m).update(colour="red"), ("colour",)),
        ("a missing field", lambda m: _routing(m).pop("layer"), ("layer",)),
        (
            "a tensor named twice",
            lambda m: _routing(m, 1).update(expert_ids=_routing(m)["expert_ids"]),
            ("second time",),
        ),
        ("a tensor reference to a path", lambda m: _routing(m)["expert_ids"].update(tensor="../x"), ("'../x'",)),
        ("records not a list", lambda m: m["forward"].update(routing={"0": 1}), ("routing",)),
        ("an unknown option", lambda m: m["forward"]["options"].update(keep_everything=True), ("keep_everything",)),
        ("a version of True", lambda m: m.update(version=True), ("version",)),
        ("an unknown key", lambda m: m.update(extra=1), ("'extra'",)),
    ],
)
def test_tampered_records_are_one_sentence(tmp_path, capsys, label, edit, says):
    good = _manifest(_members(_saved(tmp_path)))
    ids, weights = _member_of(good, "expert_ids"), _member_of(good, "weights")
    members = {
        "1-D expert ids": {ids: _npy(np.array([0, 1, 1, 2]))},
        "5-D expert ids": {ids: _npy(np.zeros((1, 2, 2, 1, 1), dtype=np.int64))},
        "negative ids": {ids: _npy(np.array([[[0, 1], [-7, 2]]]))},
        "relabelled dtype": {},
        "ids as floats": {ids: _npy(np.zeros((1, 2, 2), dtype=np.float32))},
        "weights of another shape": {weights: _npy(np.ones((1, 2, 3), dtype=np.float32))},
    }.get(label, {})
    if label == "ids as floats":
        edit = lambda m: _routing(m)["expert_ids"].update(dtype="float32")  # noqa: E731
    path = _tampered(tmp_path, edit, members=members)
    _refused(path, *says)
    _replay_refuses(path, capsys, says[0])


def test_a_trace_of_a_newer_version_or_format_says_so(tmp_path):
    _refused(_tampered(tmp_path, lambda m: m.update(version=99)), "version 99")
    _refused(_tampered(tmp_path, lambda m: m.update(format="other")), "is not a trace")


def test_every_record_field_has_a_check():
    # a field added to a record without one would make load refuse the traces save writes
    import dataclasses

    for cls in (AttentionRecord, RoutingRecord, EngramRecord, FiniteRecord, StepRecord):
        checked = set(trace_module._SCALARS[cls]) | set(trace_module._TENSORS[cls])
        assert checked == {f.name for f in dataclasses.fields(cls)}, cls.__name__
