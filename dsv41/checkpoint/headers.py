"""safetensors headers without a payload reader: read, validate, write; and `dsv41 make-headers`.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (tensor name ->
dtype, shape, data_offsets relative to the end of the header; optional "__metadata__" of string
pairs), then the data area, which the tensors must tile exactly: no overlap, no hole, no byte past
the end. Reading only the header is what lets the audit run on 3 MB prefixes of a 475 GiB
checkpoint, and writing only headers is what `make-headers` does to stand for that checkpoint.

Standard library only (plus the package's own config and inventory): no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from dsv41.checkpoint.inventory import DTYPE_SIZES
from dsv41.core.config import Config
from dsv41.core.errors import Dsv41Error
from dsv41.core.text import LongInteger, bounded_ints, brief, is_unicode

# The safetensors library refuses headers above 100 MB; anything larger is not a header.
MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"


class HeaderError(Dsv41Error, ValueError):
    """A file whose header cannot be read; the message is one sentence naming the file."""


class HeaderEntry(NamedTuple):
    # a NamedTuple: a released layer shard has 2,342 of these and the audit reads 96,085
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets into the data area, which starts right after the header
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def expected_nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class ShardHeader:
    path: str
    header_len: int
    file_size: int
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""  # the header JSON as stored: two files with equal raw headers are one shard

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start


# ---------------------------------------------------------------------- reading
def plausible_header_length(path: str) -> bool:
    """Whether a file starts like a safetensors file: a header length that fits inside it,
    followed by a JSON object. Lets header prefixes saved under any name be found."""
    try:
        size = os.path.getsize(path)
        if size < 10:
            return False
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER_BYTES and 8 + n <= size and head[8:9] == b"{"


def read_header(path: str) -> ShardHeader:
    """Parse and validate one file's header (never its payload). Raises HeaderError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise HeaderError(
                    f"{path}: only {size} bytes, shorter than the 8-byte header length every "
                    "safetensors file starts with; the file is truncated or not a safetensors file"
                )
            (n,) = struct.unpack("<Q", prefix)
            if n < 2 or n > MAX_HEADER_BYTES:
                raise HeaderError(f"{path}: not a safetensors file (its first 8 bytes declare a {n:,}-byte header)")
            if 8 + n > size:
                raise HeaderError(
                    f"{path}: header length {n:,} runs past the end of the file ({size:,} bytes); "
                    "the file is truncated, download it again"
                )
            raw = f.read(n)
    except OSError as exc:
        raise HeaderError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_header_int)
    except UnicodeDecodeError:
        raise HeaderError(f"{path}: the header is not UTF-8 text, so this is not a safetensors file") from None
    except json.JSONDecodeError as exc:
        raise HeaderError(
            f"{path}: the header is not valid JSON ({exc.msg} at byte {exc.pos}); "
            "the file is damaged or not a safetensors file"
        ) from None
    except LongInteger as exc:
        raise HeaderError(
            f"{path}: the header holds an integer of {exc.digits:,} digits, beyond the 64-bit "
            "offsets and shapes of a safetensors header; the file is damaged or not a shard"
        ) from None
    except RecursionError:
        raise HeaderError(
            f"{path}: the header nests too deep to read (a safetensors header nests three "
            "levels); the file is damaged or not a shard"
        ) from None
    if not isinstance(data, dict):
        raise HeaderError(f"{path}: the header is JSON but not an object, so this is not a safetensors file")
    metadata = data.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings")
    if not all(is_unicode(k) and is_unicode(v) for k, v in metadata.items()):
        raise HeaderError(
            f"{path}: __metadata__ holds a string with an unpaired surrogate escape, "
            "which is not Unicode text; the file is damaged"
        )
    entries = {}
    for name, info in data.items():
        entries[name] = _entry(path, name, info)
    return ShardHeader(path, n, size, entries, metadata, raw)


def _entry(path: str, name: str, info) -> HeaderEntry:
    if not is_unicode(name):
        raise HeaderError(
            f"{path}: tensor name {brief(name)} holds an unpaired surrogate escape, which is not "
            "Unicode text; the file is damaged"
        )
    if type(info) is not dict:
        raise HeaderError(f"{path}: tensor {brief(name)} is described by {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    # type(dtype) is str first: a list or object there is unhashable, and `in DTYPE_SIZES` would raise
    if (
        type(dtype) is str
        and dtype in DTYPE_SIZES
        and type(shape) is list
        and type(offsets) is list
        and len(offsets) == 2
        and type(offsets[0]) is int
        and type(offsets[1]) is int
        and 0 <= offsets[0] <= offsets[1] <= MAX_OFFSET
        and all(type(d) is int and 0 <= d <= MAX_OFFSET for d in shape)
        and _fits(shape, DTYPE_SIZES[dtype])
    ):
        return HeaderEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
    # the slow path only words the problem
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise HeaderError(
            f"{path}: tensor {brief(name)} has unknown dtype {brief(dtype)} (known: {', '.join(sorted(DTYPE_SIZES))})"
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise HeaderError(f"{path}: tensor {brief(name)} has shape {brief(shape)}, not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(
            f"{path}: tensor {brief(name)} has data_offsets {brief(offsets)}, not [begin, end] with 0 <= begin <= end"
        )
    raise HeaderError(
        f"{path}: tensor {brief(name)} has shape {brief(shape)} and data_offsets {brief(offsets)}, "
        "beyond the 64-bit byte range a safetensors file can address"
    )


# safetensors stores offsets and dimensions as 64-bit unsigned integers (usize)
MAX_OFFSET = (1 << 64) - 1
_MAX_INT_DIGITS = 20  # len(str(MAX_OFFSET)); json would otherwise convert up to 4,300 digits (or any, unlimited)


_header_int = bounded_ints(_MAX_INT_DIGITS)  # json.loads' parse_int hook (LongInteger past it)


def _fits(shape: list[int], itemsize: int) -> bool:
    """Whether the tensor's byte size fits in 64 bits; stops multiplying once it cannot, so a long
    shape of huge dimensions costs nothing."""
    n = itemsize
    for d in shape:
        if d == 0:
            return True
        n *= d
        if n > MAX_OFFSET:
            return False
    return True


class TilingProblem(NamedTuple):
    """One way a shard's tensors fail to tile its data area. `kind`: "span" (the offsets do not
    span dtype x shape bytes), "overlap", "gap", "past_end" (the last tensor runs past the file) or
    "trailing" (bytes after the last tensor); `entry` the tensor concerned (None for trailing
    bytes), `previous` the tensor before it in the data area, `position` where that one ends."""

    kind: str
    entry: Optional[HeaderEntry]
    previous: Optional[str]
    position: int


def tiling_problems(header: ShardHeader, header_prefix: bool = False) -> list[TilingProblem]:
    """Every way the tensors fail to tile the data area: spans that do not fit their dtype and
    shape first, then walking the tensors by offset, gaps and overlaps, then the end of the file
    (skipped with header_prefix, where the file is known to stop early). Empty when they tile it.
    The audit words all of them (`layout_problems`), the loader the first."""
    problems = [
        TilingProblem("span", e, None, e.begin) for e in header.entries.values() if e.nbytes != e.expected_nbytes
    ]
    position, previous = 0, None
    for e in sorted(header.entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < position:
            problems.append(TilingProblem("overlap", e, previous, position))
        elif e.begin > position:
            problems.append(TilingProblem("gap", e, previous, position))
        if e.end >= position:
            position, previous = e.end, e.name
    if not header_prefix:
        if position > header.data_size:
            problems.append(TilingProblem("past_end", header.entries[previous], None, position))
        elif position < header.data_size:
            problems.append(TilingProblem("trailing", None, previous, position))
    return problems


def layout_problems(header: ShardHeader, header_prefix: bool = False) -> list[str]:
    """How the tensors fail to tile the data area, one sentence each in the audit's words (empty
    when they do). With header_prefix the file is known to stop early, so only the end-of-file
    test is skipped."""
    out = []
    for p in tiling_problems(header, header_prefix):
        e = p.entry
        if p.kind == "span":
            out.append(
                f"{e.name}: data_offsets span {e.nbytes:,} bytes but {e.dtype} {list(e.shape)} "
                f"needs {e.expected_nbytes:,}"
            )
        elif p.kind == "overlap":
            out.append(f"{e.name}: bytes {e.begin:,}-{e.end:,} overlap {p.previous} (which ends at {p.position:,})")
        elif p.kind == "gap":
            where = f"after {p.previous}" if p.previous else "at the start of the data area"
            out.append(f"{e.name}: a gap of {e.begin - p.position:,} unreferenced bytes {where}")
        elif p.kind == "past_end":
            out.append(
                f"{e.name} ends at byte {p.position:,} of the data area but the file holds only "
                f"{max(header.data_size, 0):,}: the file is truncated (or a header prefix: "
                "pass --header-prefix)"
            )
        else:
            out.append(f"{header.data_size - p.position:,} bytes after the last tensor are referenced by no tensor")
    return out


# ---------------------------------------------------------------------- writing
def encode_header(tensors, metadata: dict[str, str] | None = None) -> tuple[bytes, list[HeaderEntry]]:
    """The header bytes (length + JSON, padded with spaces to 8 bytes) for (name, dtype, shape)
    triples, and the entries with the offsets it assigned. Wider dtypes go first, so every tensor
    starts at a multiple of its element size, which memory-mapped readers rely on."""
    tensors = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in tensors]
    names = [name for name, _, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("tensor names in one file must be unique")
    entries, offset = [], 0
    for name, dtype, shape in sorted(tensors, key=lambda t: -DTYPE_SIZES[t[1]]):
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        entries.append(HeaderEntry(name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    doc = {"__metadata__": dict(metadata if metadata is not None else {"format": "pt"})}
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, entries


def write_shard(
    path: str, tensors, payloads: dict[str, bytes] | None = None, metadata: dict[str, str] | None = None
) -> int:
    """Write a safetensors file for (name, dtype, shape) triples. With payloads (name -> raw
    little-endian bytes, one per tensor) the file is complete; without, only the header is written,
    which is how a header prefix looks. Returns the bytes written."""
    header, entries = encode_header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(header)
        written = len(header)
        if payloads is not None:
            for e in entries:
                data = payloads[e.name]
                if len(data) != e.nbytes:
                    raise ValueError(
                        f"{e.name}: payload of {len(data):,} bytes for {e.dtype} {list(e.shape)} ({e.nbytes:,} bytes)"
                    )
                f.write(data)
                written += len(data)
    return written


def write_index(directory: str, specs) -> str:
    """model.safetensors.index.json for TensorSpecs: total payload bytes and name -> shard file."""
    specs = list(specs)
    doc = {
        "metadata": {"total_size": sum(s.nbytes for s in specs)},
        "weight_map": {s.name: s.shard for s in sorted(specs, key=lambda s: s.name)},
    }
    path = os.path.join(directory, INDEX_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return path


def parse_shard_list(text: str, total: int) -> list[int]:
    """'1-20,44' -> [1, ..., 20, 44]; shard numbers count from 1."""
    chosen = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
            else:
                low = high = int(part)
        except ValueError:
            raise ValueError(f"--shards: {part!r} is not a shard number or a range like 1-20") from None
        if not 1 <= low <= high <= total:
            raise ValueError(f"--shards: {part!r} is outside 1-{total}")
        chosen.update(range(low, high + 1))
    return sorted(chosen)


def write_release_headers(out_dir: str, config: Config | None = None, shards: list[int] | None = None) -> list[str]:
    """Header-only files of a checkpoint in the release layout (the released geometry by default),
    plus both config files and the index; `shards` (numbers from 1) writes a subset, as a partial
    download would leave it. Returns the shard files written."""
    from dsv41.checkpoint.inventory import expected_tensors, shard_names
    from dsv41.core.config import RELEASED, write_config_pair

    config = RELEASED if config is None else config
    specs = expected_tensors(config)
    names = shard_names(config)
    wanted = set(names if shards is None else (names[k - 1] for k in shards))
    os.makedirs(out_dir, exist_ok=True)
    write_config_pair(config, out_dir)
    write_index(out_dir, specs)
    grouped: dict[str, list] = {name: [] for name in names}
    for s in specs:
        grouped[s.shard].append((s.name, s.dtype, s.shape))
    written = []
    for name in names:
        if name in wanted:
            path = os.path.join(out_dir, name)
            write_shard(path, grouped[name])
            written.append(path)
    return written


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 make-headers",
        description=(
            "Write the released checkpoint's shard headers (no payload) from the released geometry, with "
            "config.json, inference/config.json and model.safetensors.index.json beside them, so the "
            "header audit runs on the real inventory without a download."
        ),
    )
    parser.add_argument("out_dir", help="directory to write into (created if needed)")
    parser.add_argument(
        "--shards", metavar="LIST", help="write only these shards, e.g. 1-20,44, to stand for a partial download"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    from dsv41.checkpoint.inventory import shard_names
    from dsv41.core.config import RELEASED

    total = len(shard_names(RELEASED))
    try:
        chosen = parse_shard_list(args.shards, total) if args.shards else None
    except ValueError as exc:
        print(f"dsv41 make-headers: {exc}", file=sys.stderr)
        return 2
    try:
        written = write_release_headers(args.out_dir, RELEASED, chosen)
    except OSError as exc:
        print(f"dsv41 make-headers: cannot write {exc.filename or args.out_dir}: {exc.strerror}", file=sys.stderr)
        return 1
    size = sum(os.path.getsize(p) for p in written)
    print(
        f"wrote {len(written)} of {total} shard headers ({size:,} bytes, no payload), config.json, "
        f"inference/config.json and {INDEX_NAME} to {args.out_dir}"
    )
    print(f"audit them with: dsv41 audit --checkpoint-dir {args.out_dir} --header-prefix")
    return 0
