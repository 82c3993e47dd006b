"""The pickle-free trace file `GenerationTrace.save` writes and `GenerationTrace.load` reads
(`write_trace_file`, `read_trace_file`: the parts of a generation trace, not the class, so that
this module needs only the records).

A file is an NPZ archive of plain arrays and a JSON manifest naming, per record field, the member
that holds each tensor and its torch dtype (bf16 and FP8 stored as same-width integers). Reading
trusts nothing the file declares: sizes, headers, manifest fields, shapes and values are checked
against what a record can hold before any array is read, and each failure is one `TraceFileError`
sentence naming the file. The records themselves are `records.py`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import reprlib
import zipfile
import zlib
from typing import Any, NamedTuple, Optional

import torch

from ...core.config_fields import MAX_LAYERS, VALUE_BOUNDS
from ...core.errors import Dsv41Error
from ...core.text import LongInteger, bounded_ints
from .records import AttentionRecord, EngramRecord, FiniteRecord, ForwardTrace, RoutingRecord, StepRecord

# ---------------------------------------------------------------------- trace files
TRACE_FORMAT = "dsv41.GenerationTrace"
TRACE_VERSION = 1
_MANIFEST = "manifest"
# torch dtypes numpy has no type for, stored as the same bytes in an integer of their width
_VIEW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
if hasattr(torch, "float8_e8m0fnu"):
    _VIEW_AS[torch.float8_e8m0fnu] = torch.uint8
_RECORDS = {"attention": AttentionRecord, "routing": RoutingRecord, "engram": EngramRecord, "finite": FiniteRecord}


class TraceFileError(Dsv41Error, ValueError):
    """A file that is not a trace `GenerationTrace.save` wrote, a damaged or oversized one, or one from a
    newer version: one sentence naming the file and what is wrong with it."""


class TraceContents(NamedTuple):
    """What a trace file holds: a `GenerationTrace`'s fields, in its order."""

    forward: ForwardTrace
    steps: list[StepRecord]
    cache: list[dict]
    meta: dict


def write_trace_file(
    path: str | os.PathLike, forward: ForwardTrace, steps: list[StepRecord], cache: list[dict], meta: dict
) -> str:
    import numpy as np

    path = os.fspath(path)
    arrays: dict[str, Any] = {}

    def tensor(t: torch.Tensor) -> dict:
        key = f"t{len(arrays)}"
        t = t.detach().cpu().contiguous()
        stored = t.view(_VIEW_AS[t.dtype]) if t.dtype in _VIEW_AS else t
        arrays[key] = stored.numpy()
        return {"tensor": key, "dtype": str(t.dtype).removeprefix("torch.")}

    def value(v):
        if isinstance(v, torch.Tensor):
            return tensor(v)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"a trace record holds a {type(v).__name__}, which a trace file cannot keep")

    def record(rec) -> dict:
        return {f.name: value(getattr(rec, f.name)) for f in dataclasses.fields(rec)}

    fwd = forward
    manifest = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "forward": {
            "class": type(fwd).__name__,
            "options": {
                "keep_index_scores": fwd.keep_index_scores,
                "keep_outputs": fwd.keep_outputs,
                "check_finite": getattr(fwd, "check_finite", False),
            },
            **{name: [record(r) for r in getattr(fwd, name, [])] for name in _RECORDS},
            # only where some were active, so a trace without any is the file it always was
            **({"interventions": list(fwd.interventions)} if fwd.interventions else {}),
        },
        "steps": [record(s) for s in steps],
        "cache": [
            {
                **{k: v for k, v in step.items() if k != "layers"},
                "layers": [[int(layer), [int(c) for c in counts]] for layer, counts in step.get("layers", {}).items()],
            }
            for step in cache
        ],
        "meta": meta,
    }
    try:
        text = json.dumps(manifest, allow_nan=True)
    except TypeError as exc:
        raise TypeError(f"the trace's meta or cache holds something JSON cannot keep: {exc}") from None
    arrays[_MANIFEST] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # the archive np.savez_compressed writes, with a fixed date on every member, so the same trace
    # gives the same bytes (and the name stays as given: numpy would append ".npz")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for key, array in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)
    return path


# ---------------------------------------------------------------------- reading a trace file
# A trace file may come from anywhere, so nothing it declares is trusted: the zip directory's
# sizes are checked against a bound, each .npy header against the directory, every manifest field
# against what a record can hold, all before any array is read; only the members the manifest
# names are read, and a member it does not name is refused unread.
MAX_TRACE_BYTES = 4 << 30  # every member uncompressed, together; load(max_bytes=) reads a larger trace
MAX_MANIFEST_BYTES = 256 << 20
MAX_MANIFEST_DEPTH = 32  # a manifest nests six levels; the rest is for meta and extra cache values
MAX_MANIFEST_INT_DIGITS = 20  # every 64-bit integer fits
MAX_TENSOR_DIMS = 8
MAX_LAYER_INDEX = MAX_LAYERS + VALUE_BOUNDS["n_mtp_layers"][1] - 1
MAX_POSITION = VALUE_BOUNDS["max_position_embeddings"][1]
MAX_ROUTED_EXPERTS = VALUE_BOUNDS["n_routed_experts"][1]
MAX_COUNT = (1 << 63) - 1
MAX_INTERVENTION_CHARS = 1000  # "site: label" of one intervention
_MEMBER_NAME = re.compile(r"(manifest|t[0-9]{1,9})\.npy")
_TENSOR_KEY = re.compile(r"t[0-9]{1,9}")
_MANIFEST_KEYS = ("format", "version", "forward", "steps", "cache", "meta")
_OPTIONS = ("keep_index_scores", "keep_outputs", "check_finite")
# the torch dtypes a trace file may name, and the numpy dtype each is stored as
_STORED_AS = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    **{str(t).removeprefix("torch."): str(v).removeprefix("torch.") for t, v in _VIEW_AS.items()},
}
_INTEGER = ("uint8", "int8", "int16", "int32", "int64")


class _NotATrace(Exception):
    """Why a readable file is not a trace at all."""


class _Damage(Exception):
    """What is wrong in a file that claims to be a trace."""


def _shown(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    brief = reprlib.Repr()
    brief.maxstring, brief.maxother, brief.maxlist, brief.maxdict, brief.maxlevel = 40, 40, 3, 3, 2
    return brief.repr(value)


# per record field, the test a plain value must pass: None when it passes, else what it must be
def _whole(low: int, high: int, what: str):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            return f"{what} from {low:,} to {high:,}"

    return check


def _optional(check):
    return lambda value: None if value is None else check(value)


def _one_of(*choices):
    return lambda value: None if value in choices else "one of " + ", ".join(map(repr, choices))


def _flag(value):
    return None if isinstance(value, bool) else "true or false"


def _number(value):
    return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"


def _seconds(value):
    return None if _number(value) is None and value >= 0 else "a number of seconds >= 0"


_LAYER = _whole(0, MAX_LAYER_INDEX, "a layer index")
_POSITION = _whole(0, MAX_POSITION, "a position")
_COUNT = _whole(0, MAX_COUNT, "a count")
_SCALARS = {
    AttentionRecord: {
        "layer": _LAYER,
        "mode": _one_of("full", "reindex", "reuse"),
        "compress_ratio": _whole(0, MAX_POSITION, "a compression ratio"),
        "start_pos": _POSITION,
        "seqlen": _whole(0, MAX_POSITION, "a token count"),
        "selected_by": _optional(_LAYER),
        "index_keys_from": _optional(_LAYER),
        "candidates_from": _optional(_LAYER),
        "wrote_compressed": _flag,
    },
    RoutingRecord: {"layer": _LAYER, "start_pos": _POSITION, "cache_hits": _COUNT, "cache_misses": _COUNT},
    EngramRecord: {"layer": _LAYER, "start_pos": _POSITION},
    # the sites a ForwardTrace checks (its _FINITE_SITES)
    FiniteRecord: {
        "layer": _optional(_LAYER),
        "site": _one_of("embedding", "engram", "attention", "ffn", "head"),
        "start_pos": _POSITION,
        "finite": _flag,
    },
    StepRecord: {
        "position": _POSITION,
        "token": _whole(0, VALUE_BOUNDS["vocab_size"][1] - 1, "a token id"),
        "margin": _number,
        "seconds": _seconds,
    },
}
# per tensor field: its kind of dtype, its axes (one letter each; a letter is one size within a
# record, and "s" is an attention record's seqlen), and the range its values keep (None: any;
# "experts": expert ids below the trace's routed-expert count)
_AXES = {
    "b": "batch",
    "s": "tokens",
    "k": "k",
    "w": "index_topk",
    "T": "compressed positions",
    "n": "blocks",
    "d": "dim",
    "h": "hc_mult",
}
_TENSORS = {
    AttentionRecord: {
        "selected": ("integer", "bsw", (-1, MAX_POSITION)),
        "reachable": ("integer", "s", (0, MAX_POSITION)),
        "kth_score": ("float", "bs", None),
        "next_score": ("float", "bs", None),
        "index_scores": ("float", "bsT", None),
        "candidate_blocks": ("bool", "bsn", None),
        "candidate_kth_score": ("float", "bs", None),
        "candidate_next_score": ("float", "bs", None),
        "output": ("float", "bsd", None),
    },
    RoutingRecord: {
        "expert_ids": ("integer", "bsk", "experts"),
        "weights": ("float", "bsk", None),
        "image_mask": ("bool", "bs", None),
        "text_bias_ids": ("integer", "bsk", "experts"),
    },
    EngramRecord: {"gate": ("float", "bsh", None)},
    FiniteRecord: {},
    StepRecord: {},
}


class _TensorRef(NamedTuple):
    key: str  # the member is key + ".npy"
    dtype: str  # the torch dtype's name
    where: str  # "routing record 3's expert_ids"
    kind: str
    axes: str
    values: Any


class _Header(NamedTuple):
    info: zipfile.ZipInfo
    shape: tuple
    dtype: Any  # numpy's
    offset: int  # bytes before the data


def read_trace_file(path: str | os.PathLike, max_bytes: Optional[int] = None) -> TraceContents:
    path = os.fspath(path)
    limit = MAX_TRACE_BYTES if max_bytes is None else max_bytes
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"max_bytes must be a whole number of bytes >= 0, got {max_bytes!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise TraceFileError(f"{path} is a folder, not a trace file")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError):
        raise TraceFileError(f"{path} is not a trace written by GenerationTrace.save (not an NPZ archive)") from None
    except OSError as exc:
        raise TraceFileError(f"{path} cannot be read ({exc.strerror or exc})") from None
    try:
        with archive:
            return _read_trace(archive, limit, path)
    except _NotATrace as exc:
        raise TraceFileError(f"{path} is not a trace written by GenerationTrace.save ({exc})") from None
    except _Damage as exc:
        raise TraceFileError(f"{path} is a damaged trace file: {exc}") from None
    except MemoryError:
        raise TraceFileError(f"{path} is too large to read into this machine's memory") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise TraceFileError(f"{path} is a damaged trace file ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().rstrip(".") or type(exc).__name__
    return text.splitlines()[0]


def _read_trace(archive: zipfile.ZipFile, limit: int, path: str) -> TraceContents:
    members: dict[str, zipfile.ZipInfo] = {}
    for info in archive.infolist():
        if info.filename in members:
            raise _Damage(f"it holds two members named {_shown(info.filename)}")
        members[info.filename] = info
    if f"{_MANIFEST}.npy" not in members:
        raise _NotATrace("no manifest")
    for name, info in members.items():
        if not _MEMBER_NAME.fullmatch(name):
            raise _Damage(
                f"it holds a member {_shown(name)}, which GenerationTrace.save never writes; nothing in it was read"
            )
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 1:
            raise _Damage(f"member {name} is encrypted or compressed in a way GenerationTrace.save never writes")
    declared = sum(info.file_size for info in members.values())
    if declared > limit:
        raise _Damage(
            f"its members declare {declared:,} bytes uncompressed, past the {limit:,} a trace may take "
            "here (GenerationTrace.load(path, max_bytes=N) reads a larger one)"
        )

    manifest = _read_manifest(archive, members[f"{_MANIFEST}.npy"])
    if not isinstance(manifest, dict) or manifest.get("format") != TRACE_FORMAT:
        raise _NotATrace(f"its manifest names no {TRACE_FORMAT}")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _Damage(f"its manifest's version is {_shown(version)}, not a version number")
    if version > TRACE_VERSION:
        raise TraceFileError(
            f"{path} is a trace file of version {version:,}; this dsv41 reads version {TRACE_VERSION} and older"
        )
    refs: dict[str, _TensorRef] = {}
    plan = _check_manifest(manifest, refs)
    for key, ref in refs.items():
        if f"{key}.npy" not in members:
            raise _Damage(f"{ref.where} names member {key}.npy, but the archive has no such member")
    for name in members:
        if name != f"{_MANIFEST}.npy" and name[: -len(".npy")] not in refs:
            raise _Damage(f"it holds a member {name} that its manifest does not name; nothing in it was read")

    # every header first: shapes and dtypes are checked before any array is read
    headers = {key: _read_header(archive, members[f"{key}.npy"]) for key in refs}
    for key, ref in refs.items():
        _check_stored(ref, headers[key])
    for records in plan["records"].values():
        for cls, where, fields in records:
            _check_shapes(cls, where, fields, headers)
    n_experts = plan["meta"].get("n_routed_experts")
    expert_bound = (
        (n_experts, "its meta declares") if n_experts is not None else (MAX_ROUTED_EXPERTS, "a config may have")
    )

    def tensor(ref: _TensorRef) -> torch.Tensor:
        array = _read_array(archive, headers[ref.key], ref.where)
        t = torch.from_numpy(array.copy())  # a writable tensor of its own
        if ref.dtype != _STORED_AS[ref.dtype]:
            t = t.view(getattr(torch, ref.dtype))
        _check_values(ref, t, expert_bound)
        return t

    forward = ForwardTrace(**plan["options"], interventions=list(plan["interventions"]))
    for kind, records in plan["records"].items():
        for cls, _where, fields in records:
            record = cls(**{k: tensor(v) if isinstance(v, _TensorRef) else v for k, v in fields.items()})
            getattr(forward, kind).append(record)
    steps = [cls(**fields) for cls, where, fields in plan["steps"]]
    return TraceContents(forward, steps, plan["cache"], plan["meta"])


def _read_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> _Header:
    """A member's .npy header, checked against the size the zip directory gives it."""
    import numpy as np

    fmt = np.lib.format
    name = info.filename
    try:
        with archive.open(info) as f:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(f)
            else:
                raise _Damage(
                    f"member {name} is a .npy file of version {version}, which GenerationTrace.save never writes"
                )
            offset = f.tell()
    except _Damage:
        raise
    except (ValueError, TypeError, SyntaxError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as exc:
        raise _Damage(f"member {name} is not a .npy array ({_reason(exc)})") from None
    if dtype.hasobject:
        raise _Damage(f"member {name} holds pickled objects, which are never loaded")
    if fortran:
        raise _Damage(f"member {name} is stored in Fortran order, which GenerationTrace.save never writes")
    if len(shape) > MAX_TENSOR_DIMS or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise _Damage(f"member {name} declares the shape {_shown(shape)}, which no trace tensor has")
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes != info.file_size:
        raise _Damage(
            f"member {name}'s header declares {_shown(tuple(shape))} values of {dtype}, {nbytes:,} bytes, "
            f"but the archive says it holds {max(info.file_size - offset, 0):,}"
        )
    return _Header(info, tuple(shape), dtype, offset)


def _read_array(archive: zipfile.ZipFile, header: _Header, what: str):
    """The data of a member whose header `_read_header` checked: exactly the bytes it declares."""
    import numpy as np

    name = header.info.filename
    nbytes = header.info.file_size - header.offset
    try:
        with archive.open(header.info) as f:
            f.read(header.offset)
            raw = f.read(nbytes)
    except EOFError:
        raw = b""
    except (OSError, zipfile.BadZipFile, zlib.error) as exc:
        raise _Damage(f"member {name} cannot be read ({_reason(exc)})") from None
    if len(raw) != nbytes:
        raise _Damage(f"member {name} is truncated: its header and the archive declare {nbytes:,} bytes of data")
    if header.dtype == np.bool_ and nbytes and np.frombuffer(raw, dtype=np.uint8).max() > 1:
        raise _Damage(f"{what} (member {name}) holds booleans stored as bytes other than 0 and 1")
    return np.frombuffer(raw, dtype=header.dtype).reshape(header.shape)


def _read_manifest(archive: zipfile.ZipFile, info: zipfile.ZipInfo):
    import numpy as np

    header = _read_header(archive, info)
    if header.dtype != np.uint8 or len(header.shape) != 1:
        raise _NotATrace("its manifest is not the UTF-8 bytes of a JSON text")
    if header.shape[0] > MAX_MANIFEST_BYTES:
        raise _Damage(
            f"its manifest declares {header.shape[0]:,} bytes, past the {MAX_MANIFEST_BYTES:,} a trace's "
            "manifest may take"
        )
    raw = _read_array(archive, header, "its manifest").tobytes()
    try:
        return json.loads(raw.decode("utf-8"), parse_int=bounded_ints(MAX_MANIFEST_INT_DIGITS))
    except UnicodeDecodeError:
        raise _Damage("its manifest is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise _Damage(f"its manifest is not valid JSON ({exc.msg} at byte {exc.pos:,})") from None
    except LongInteger as exc:
        raise _Damage(f"its manifest holds an integer of {exc.args[0]:,} digits, past any 64-bit value") from None
    except RecursionError:
        raise _Damage("its manifest nests too deep to read (a trace's manifest nests six levels)") from None


def _too_deep(value) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_MANIFEST_DEPTH:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def _check_manifest(manifest: dict, refs: dict) -> dict:
    """Every field of a manifest checked; its records with a _TensorRef where each tensor goes."""
    unknown = [k for k in manifest if k not in _MANIFEST_KEYS]
    if unknown:
        raise _Damage(f"its manifest holds {_shown(unknown[0])}, which GenerationTrace.save never writes")
    forward = manifest.get("forward")
    if not isinstance(forward, dict):
        raise _Damage(f"its manifest's forward is {_shown(forward)}, not an object")
    unknown = [k for k in forward if k not in ("class", "options", "interventions", *_RECORDS)]
    if unknown:
        raise _Damage(f"its forward trace holds {_shown(unknown[0])}, which GenerationTrace.save never writes")
    if not isinstance(forward.get("class", ""), str):
        raise _Damage(f"its forward trace's class is {_shown(forward['class'])}, not a name")
    options = forward.get("options", {})
    if not isinstance(options, dict):
        raise _Damage(f"its forward trace's options are {_shown(options)}, not an object")
    for name, value in options.items():
        if name not in _OPTIONS:
            raise _Damage(f"its forward trace has an option {_shown(name)}, which a ForwardTrace does not have")
        if not isinstance(value, bool):
            raise _Damage(f"its forward trace's option {name} is {_shown(value)}, not true or false")

    interventions = _listed(forward.get("interventions", []), "its interventions")
    if not all(isinstance(entry, str) and len(entry) <= MAX_INTERVENTION_CHARS for entry in interventions):
        raise _Damage(f"its interventions are {_shown(interventions)}, not a list of short names")

    records = {}
    for kind, cls in _RECORDS.items():
        listed = _listed(forward.get(kind, []), f"its {kind} records")
        records[kind] = [
            (cls, f"{kind} record {i}", _check_record(cls, f"{kind} record {i}", fields, refs))
            for i, fields in enumerate(listed)
        ]
    steps = [
        (StepRecord, f"step {i}", _check_record(StepRecord, f"step {i}", fields, refs))
        for i, fields in enumerate(_listed(manifest.get("steps", []), "its steps"))
    ]
    cache = [
        _check_cache_step(f"cache step {i}", step)
        for i, step in enumerate(_listed(manifest.get("cache", []), "its cache steps"))
    ]

    meta = manifest.get("meta", {})
    if not isinstance(meta, dict):
        raise _Damage(f"its meta is {_shown(meta)}, not an object")
    if _too_deep(meta):
        raise _Damage(f"its meta nests more than {MAX_MANIFEST_DEPTH} levels deep")
    for name, check in (
        ("n_routed_experts", _whole(1, MAX_ROUTED_EXPERTS, "a count of routed experts")),
        ("expert_cache", _whole(0, MAX_COUNT, "a cache size")),
    ):
        if name in meta and (expected := check(meta[name])):
            raise _Damage(f"its meta's {name} is {_shown(meta[name])}, not {expected}")
    return {
        "options": options,
        "interventions": interventions,
        "records": records,
        "steps": steps,
        "cache": cache,
        "meta": dict(meta),
    }


def _listed(value, what: str) -> list:
    if not isinstance(value, list):
        raise _Damage(f"{what} are {_shown(value)}, not a list")
    return value


def _check_record(cls, where: str, fields, refs: dict) -> dict:
    if not isinstance(fields, dict):
        raise _Damage(f"{where} is {_shown(fields)}, not an object")
    scalars, tensors = _SCALARS[cls], _TENSORS[cls]
    for name in fields:
        if name not in scalars and name not in tensors:
            raise _Damage(f"{where} holds a field {_shown(name)}, which a {cls.__name__} does not have")
    out = {}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in fields:
            if required:
                raise _Damage(f"{where} lacks its {f.name}")
            continue
        value = fields[f.name]
        if f.name in scalars:
            if expected := scalars[f.name](value):
                raise _Damage(f"{where}'s {f.name} is {_shown(value)}, not {expected}")
            out[f.name] = value
        elif value is None and not required:
            out[f.name] = None
        else:
            out[f.name] = _tensor_ref(f"{where}'s {f.name}", value, tensors[f.name], refs)
    return out


def _tensor_ref(where: str, value, spec, refs: dict) -> _TensorRef:
    if not isinstance(value, dict) or set(value) != {"tensor", "dtype"}:
        raise _Damage(f"{where} is {_shown(value)}, not a reference to a stored tensor")
    key, dtype = value["tensor"], value["dtype"]
    if not isinstance(key, str) or not _TENSOR_KEY.fullmatch(key):
        raise _Damage(f"{where} names the member {_shown(key)}, which GenerationTrace.save never writes")
    if dtype not in _STORED_AS:
        raise _Damage(f"{where} has the dtype {_shown(dtype)}, which a trace file does not store")
    if key in refs:
        raise _Damage(
            f"{where} names member {key}.npy a second time ({refs[key].where} names it too; each tensor is stored once)"
        )
    kind, axes, values = spec
    refs[key] = _TensorRef(key, dtype, where, kind, axes, values)
    return refs[key]


def _check_cache_step(where: str, step) -> dict:
    if not isinstance(step, dict):
        raise _Damage(f"{where} is {_shown(step)}, not an object")
    for name in ("start_pos", "seqlen"):
        if expected := _POSITION(step.get(name)):
            raise _Damage(f"{where}'s {name} is {_shown(step.get(name))}, not {expected}")
    layers = step.get("layers", [])
    pairs = isinstance(layers, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and _LAYER(p[0]) is None
        and isinstance(p[1], list)
        and len(p[1]) == 2
        and all(_COUNT(c) is None for c in p[1])
        for p in layers
    )
    if not pairs:
        raise _Damage(f"{where}'s layers are {_shown(layers)}, not [layer, [hits, misses]] pairs")
    if _too_deep(step):
        raise _Damage(f"{where} nests more than {MAX_MANIFEST_DEPTH} levels deep")
    return {**{k: v for k, v in step.items() if k != "layers"}, "layers": {layer: list(c) for layer, c in layers}}


def _check_stored(ref: _TensorRef, header: _Header) -> None:
    import numpy as np

    member = header.info.filename
    if header.dtype != np.dtype(_STORED_AS[ref.dtype]):
        raise _Damage(
            f"{ref.where} (member {member}) is stored as {header.dtype} values, but the manifest calls "
            f"it {ref.dtype}, which is stored as {_STORED_AS[ref.dtype]}"
        )
    is_kind = {
        "integer": ref.dtype in _INTEGER,
        "bool": ref.dtype == "bool",
        "float": ref.dtype not in _INTEGER and ref.dtype != "bool",
    }[ref.kind]
    if not is_kind:
        raise _Damage(f"{ref.where} (member {member}) holds {ref.dtype} values, not {ref.kind} ones")
    if len(header.shape) != len(ref.axes):
        raise _Damage(
            f"{ref.where} (member {member}) is {len(header.shape)}-D {list(header.shape)}; it is "
            f"[{', '.join(_AXES[a] for a in ref.axes)}]"
        )


def _check_shapes(cls, where: str, fields: dict, headers: dict) -> None:
    """Within a record, one size per axis (an attention record's tokens: its seqlen), and no record
    past the last position."""
    sizes: dict[str, tuple[int, str]] = {}
    if cls is AttentionRecord:
        sizes["s"] = (fields["seqlen"], "seqlen")
    for name, ref in fields.items():
        if not isinstance(ref, _TensorRef):
            continue
        shape = headers[ref.key].shape
        for axis, size in zip(ref.axes, shape):
            if axis not in sizes:
                sizes[axis] = (size, name)
            elif sizes[axis][0] != size:
                known, by = sizes[axis]
                theirs = f"its seqlen is {known:,}" if by == "seqlen" else f"its {by} has {_AXES[axis]} = {known:,}"
                raise _Damage(f"{where}'s {name} has {_AXES[axis]} = {size:,}, but {theirs}")
    tokens = sizes.get("s", (0, ""))[0]
    if "start_pos" in fields and fields["start_pos"] + tokens > MAX_POSITION:
        raise _Damage(
            f"{where} runs from position {fields['start_pos']:,} over {tokens:,} tokens, past the "
            f"{MAX_POSITION:,} positions any config may have"
        )


def _check_values(ref: _TensorRef, t: torch.Tensor, expert_bound) -> None:
    if ref.values is None or t.numel() == 0:
        return
    low, high = int(t.min()), int(t.max())
    if ref.values == "experts":
        n, source = expert_bound
        if low < 0 or high >= n:
            bad = low if low < 0 else high
            raise _Damage(
                f"{ref.where} holds expert {bad:,}, outside the {n:,} routed experts {source} (ids 0 to {n - 1:,})"
            )
        return
    lowest, highest = ref.values
    if low < lowest or high > highest:
        raise _Damage(f"{ref.where} holds {low if low < lowest else high:,}, outside {lowest:,} to {highest:,}")
