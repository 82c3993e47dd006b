"""Property tests over damaged inputs: whatever bytes a shard header or a config file holds, the
header reader, the config reader and verify(), the audit and the loader end in a result or in the
project's own one-sentence error (HeaderError, ConfigError, AuditError, LoadError), each call
within a time bound. A fuzz of the real header with replaced fields found 693 TypeErrors in 10,000
before `_entry` checked the dtype's type; nesting, 5,000-digit integers and absurd config counts
were the rest (tests/test_headers.py, test_config.py and test_audit.py pin each one).

Bounded for CI: derandomized (the same examples on every run), no example database, a few hundred
examples in all, about half a minute on two cores."""

import gc
import json
import os
import shutil
import struct
import time

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is in the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsv41.checkpoint import audit  # noqa: E402
from dsv41.checkpoint import headers as hd  # noqa: E402
from dsv41.core.config import Config, ConfigError, load_config  # noqa: E402

# seconds one call may take: readers parse a few kilobytes; the audit of the largest inventory
# verify() admits (500,000 tensors) takes about 5 s on two slow cores, the tiny one 0.03 s
READ_S, AUDIT_S, LOAD_S = 2.0, 10.0, 10.0


def fuzz(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
            HealthCheck.filter_too_much,
        ],
    )


# ---------------------------------------------------------------------- JSON of every type and magnitude
MAGNITUDES = [
    0,
    1,
    -1,
    2,
    3,
    4,
    7,
    16,
    32,
    64,
    256,
    500,
    1 << 10,
    1 << 12,
    1 << 13,
    1 << 14,
    1 << 16,
    1 << 17,
    1 << 22,
    1 << 26,
    1 << 30,
    1 << 31,
    1 << 35,
    1 << 63,
    1 << 64,
    10**9,
    10**12,
    137438953471,
    10**30,
    -(10**30),
    10**60,
    10**300,
]
SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from(MAGNITUDES)
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e-20, 0.5, -0.0, 1e308])
    | st.text(max_size=8)
    | st.sampled_from(["F32", "BF16", "I8", "F8_E4M3", "fp8", "fp4", "\ud800", "x" * 300])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


class Quiet(tuple):
    """A fixture's value that a falsifying example prints as one word, not megabytes of shards."""

    def __repr__(self) -> str:
        return "<fixture>"


def one_sentence(exc: Exception) -> None:
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message, message


def bounded(seconds: float, fn, *errors):
    """fn() or the exception of one of `errors` it raised, failing if it took `seconds` or more;
    any other exception fails the test (and hypothesis shrinks it)."""
    began = time.perf_counter()
    try:
        result = fn()
    except errors as exc:
        one_sentence(exc)
        result = exc
    elapsed = time.perf_counter() - began
    assert elapsed < seconds, f"{getattr(fn, '__name__', fn)} took {elapsed:.1f} s"
    return result


def printable(report) -> None:
    """What the CLI does with a report: print it (a lone surrogate would fail here) and dump it."""
    report.format().encode("utf-8")
    json.dumps(report.to_dict())


# ---------------------------------------------------------------------- headers
@pytest.fixture(scope="module")
def shard_dir(tiny_checkpoint, tmp_path_factory):
    """A private copy of the tiny checkpoint whose shards the header tests damage one at a time."""
    copy = tmp_path_factory.mktemp("fuzz-headers") / "checkpoint"
    shutil.copytree(tiny_checkpoint, copy)
    names = sorted(n for n in os.listdir(copy) if n.endswith(".safetensors"))
    return Quiet((copy, {n: (copy / n).read_bytes() for n in names}))


def read_damaged(path) -> None:
    h = bounded(READ_S, lambda: hd.read_header(str(path)), hd.HeaderError)
    if isinstance(h, hd.ShardHeader):
        hd.layout_problems(h)
        hd.layout_problems(h, header_prefix=True)


def audit_damaged(directory, values: bool = False) -> None:
    r = bounded(AUDIT_S, lambda: audit.run_audit(str(directory), values=values), audit.AuditError)
    assert isinstance(r, audit.AuditReport), r  # the directory still has its config: never an AuditError
    printable(r)


def length_prefixed(body: bytes) -> bytes:
    return struct.pack("<Q", len(body)) + body


@fuzz(60)
@given(
    st.one_of(
        st.binary(max_size=256),
        st.binary(max_size=64).map(lambda b: struct.pack("<Q", len(b)) + b),  # a plausible length
        st.integers(1, 5000).map(lambda n: length_prefixed(b"[" * n + b"]" * n)),
    )
)
def test_random_bytes_are_read_or_refused(tmp_path_factory, content):
    # earlier tests' garbage collected now: a finalizer that ran inside a 5,000-deep parse would
    # fail to report itself (RecursionError) and fail this test instead
    gc.collect()
    path = tmp_path_factory.getbasetemp() / "random-bytes.safetensors"
    path.write_bytes(content)
    read_damaged(path)


@fuzz(60)
@given(JSON)
def test_random_json_headers_are_read_or_refused(tmp_path_factory, doc):
    path = tmp_path_factory.getbasetemp() / "random-json.safetensors"
    path.write_bytes(length_prefixed(json.dumps(doc).encode()) + b"\0" * 16)
    read_damaged(path)


@fuzz(100)
@given(st.data())
def test_real_headers_with_replaced_fields(shard_dir, data):
    """A real tiny shard with one to three fields (dtype, shape, data_offsets, a whole entry or the
    metadata) replaced by JSON of any type; the payload stays. The audit reads the whole folder."""
    directory, originals = shard_dir
    name = data.draw(st.sampled_from(sorted(originals)))
    original = originals[name]
    (n,) = struct.unpack("<Q", original[:8])
    doc = json.loads(original[8 : 8 + n])
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(doc)))
        if key == "__metadata__" or not isinstance(doc[key], dict) or data.draw(st.integers(0, 4)) == 0:
            doc[key] = data.draw(JSON)
        else:
            doc[key][data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = data.draw(JSON)
    path = directory / name
    try:
        path.write_bytes(length_prefixed(json.dumps(doc).encode()) + original[8 + n :])
        read_damaged(path)
        audit_damaged(directory)
    finally:
        path.write_bytes(original)


@fuzz(70)
@given(st.data())
def test_real_headers_with_flipped_bytes(shard_dir, data):
    """A real tiny shard with one to four bytes of its length or header JSON overwritten; the audit,
    payload values included, reads the whole folder."""
    directory, originals = shard_dir
    name = data.draw(st.sampled_from(sorted(originals)))
    original = originals[name]
    (n,) = struct.unpack("<Q", original[:8])
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        damaged[data.draw(st.integers(0, 8 + n - 1))] = data.draw(st.integers(0, 255))
    path = directory / name
    try:
        path.write_bytes(bytes(damaged))
        read_damaged(path)
        audit_damaged(directory, values=True)
    finally:
        path.write_bytes(original)


# ---------------------------------------------------------------------- configs
@pytest.fixture(scope="module")
def config_dir(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint's shards, index and tokenizer (linked) beside a config.json the tests
    rewrite; returns the folder and the checkpoint's two config documents."""
    folder = tmp_path_factory.mktemp("fuzz-configs") / "checkpoint"
    folder.mkdir()
    for name in os.listdir(tiny_checkpoint):
        if name.endswith((".safetensors", ".index.json")) or name.startswith("tokenizer"):
            os.symlink(os.path.join(tiny_checkpoint, name), folder / name)
    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        nested = json.load(f)
    with open(os.path.join(tiny_checkpoint, "inference", "config.json")) as f:
        flat = json.load(f)
    return Quiet((folder, nested, flat))


def _leaf_paths(doc: dict, prefix=()):
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            yield from _leaf_paths(value, prefix + (key,))
        yield prefix + (key,)


def mutated_config(data, nested: dict, flat: dict) -> str:
    """One of the real config documents with one to three fields replaced by JSON of any type and
    magnitude (or deleted), as text."""
    doc = json.loads(json.dumps(nested if data.draw(st.booleans()) else flat))
    paths = sorted(set(_leaf_paths(doc)))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        node = doc
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue  # an earlier replacement removed the section
        if data.draw(st.integers(0, 9)) == 0:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = data.draw(JSON)
    return json.dumps(doc)


def read_config(path) -> Config | ConfigError:
    cfg = bounded(READ_S, lambda: load_config(str(path)), ConfigError)
    if isinstance(cfg, Config):
        problems = bounded(READ_S, cfg.verify)
        assert isinstance(problems, list) and all(isinstance(p, str) and "\n" not in p for p in problems)
        if not problems:
            cfg.summary()
    return cfg


def load_or_load_error(path: str):
    """dsv41.load, with LoadError (its one-sentence error) as a result; the loader is another
    engineer's, so anything else it raises fails the test for them to fix, not here."""
    import dsv41
    from dsv41.checkpoint.checkpoint import LoadError

    try:
        return dsv41.load(path, quiet=True)
    except LoadError as exc:
        one_sentence(exc)
        return exc


@fuzz(120)
@given(st.data())
def test_configs_with_replaced_fields(config_dir, data):
    folder, nested, flat = config_dir
    path = folder / "config.json"
    path.write_text(mutated_config(data, nested, flat))
    read_config(path)
    r = bounded(AUDIT_S, lambda: audit.run_audit(str(folder), config=str(path)), audit.AuditError)
    if isinstance(r, audit.AuditReport):
        printable(r)


@fuzz(40)
@given(st.data())
def test_configs_with_replaced_fields_through_load(config_dir, data):
    folder, nested, flat = config_dir
    path = folder / "config.json"
    path.write_text(mutated_config(data, nested, flat))
    read_config(path)
    bounded(LOAD_S, lambda: load_or_load_error(str(folder)))


@fuzz(50)
@given(
    st.one_of(
        JSON,
        st.dictionaries(
            st.sampled_from(
                ["text_config", "quantization_config", "vision_config", "n_layers", "dim", "compress_ratios"]
            ),
            JSON,
            max_size=4,
        ),
    )
)
def test_random_json_config_documents(tmp_path_factory, doc):
    path = tmp_path_factory.getbasetemp() / "random-config.json"
    path.write_text(json.dumps(doc))
    read_config(path)
