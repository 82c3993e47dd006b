"""A checkpoint directory on disk: its index and shard headers checked, its tensors read by name.

`Checkpoint(path)` parses every shard's header (never a payload), refuses shards whose tensors do
not tile their data area (the check `headers.tiling_problems` runs for the audit too), a tensor
stored twice and an index that lists a tensor elsewhere; then `read(name)` reads one tensor and
`rows(name, ids)` gathers rows of a 2-D tensor, both with positioned reads into buffers of their
own (no shard is ever mapped). Every problem is a `LoadError`: one sentence naming the file (and
the tensor), with the fix.

The JSON the checkpoint carries (the index, tokenizer_config.json) is read by `read_json`, which
turns every way a damaged file can fail (unreadable, not UTF-8, not JSON, nested too deep, an
integer too long) into that one sentence.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np
import torch

from ..core.errors import Dsv41Error
from ..core.text import brief, is_unicode, json_kind, named
from .formats import SAFETENSORS_DTYPES
from .headers import INDEX_NAME, HeaderError, read_header, tiling_problems
from .inventory import DTYPE_SIZES

# the most one read() asks of the kernel: Linux moves at most 0x7ffff000 bytes per call
_MAX_READ = 1 << 30


class LoadError(Dsv41Error, ValueError):
    """A checkpoint that cannot be loaded; the message is one sentence naming the file or tensor."""


def read_json(path: str):
    """A JSON file's value, or LoadError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise LoadError(
            f"{path}: cannot be read ({exc.strerror}); check its permissions or download it again"
        ) from None
    except UnicodeDecodeError:
        raise LoadError(f"{path}: not UTF-8 text, so not a JSON file; download it again") from None
    except json.JSONDecodeError as exc:
        raise LoadError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); download it again") from None
    except (ValueError, RecursionError) as exc:  # an integer too long to convert, nesting too deep
        raise LoadError(f"{path}: not JSON this reader accepts ({exc}); download it again") from None


def _plain_file_name(name: str) -> bool:
    """A file name inside the checkpoint directory: no separator, no '..', no absolute path."""
    return (
        bool(name)
        and "/" not in name
        and "\\" not in name
        and ".." not in name
        and "\0" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
        and not os.path.isabs(name)
    )


def _read_index(index: str) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> shard file name), checked."""
    doc = read_json(index)
    if not isinstance(doc, dict):
        raise LoadError(f"{index}: holds {json_kind(doc)}, not an object with a weight_map; download the index again")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        what = "no weight_map" if weight_map is None else f"a weight_map that is {json_kind(weight_map)}"
        raise LoadError(f"{index}: has {what}, not an object of tensor name -> shard file; download the index again")
    for name, file in weight_map.items():
        if not isinstance(name, str) or not isinstance(file, str):
            raise LoadError(
                f"{index}: weight_map maps {brief(name)} to {json_kind(file)} ({brief(file)}), not a "
                "tensor name to a shard file name; download the index again"
            )
        if not (is_unicode(name) and is_unicode(file)):
            raise LoadError(
                f"{index}: weight_map maps {brief(name)} to {brief(file)}, which holds an unpaired "
                "surrogate escape and is not Unicode text; download the index again"
            )
        if not _plain_file_name(file):
            shown = name if len(name) <= 120 else name[:116] + " ..."
            raise LoadError(
                f"{index}: tensor {shown} is listed in {brief(file)}, which is not a file name in "
                "the checkpoint directory (paths and '..' are refused); download the index again"
            )
    return weight_map


def _read_shard_header(shard: str):
    """One shard's parsed header, or LoadError naming the shard once."""
    try:
        return read_header(shard)
    except HeaderError as exc:
        raise LoadError(named(shard, str(exc))) from None
    except (ValueError, TypeError, RecursionError) as exc:  # read_header lets a few malformed headers through
        raise LoadError(
            f"{shard}: the header cannot be parsed ({type(exc).__name__}: {exc}); the file is damaged "
            "or not a safetensors file, download it again"
        ) from None


def _tiling_error(shard: str, header) -> Optional[str]:
    """The first way a shard's tensors fail to tile its data area (`headers.tiling_problems`), as
    one sentence naming the shard and the tensor; None when they tile it."""
    problems = tiling_problems(header)
    if not problems:
        return None
    kind, e, previous, position = problems[0]
    fix = "the shard is damaged, download it again"
    if kind == "span":
        return (
            f"{shard}: tensor {e.name} is {e.dtype} {list(e.shape)} ({e.expected_nbytes:,} bytes) but its "
            f"data_offsets span {e.nbytes:,} bytes; {fix}"
        )
    if kind == "overlap":
        return (
            f"{shard}: tensor {e.name} (data bytes {e.begin:,}-{e.end:,}) overlaps tensor {previous}, "
            f"which ends at byte {position:,}; {fix}"
        )
    if kind == "gap":
        where = f"after tensor {previous}" if previous is not None else "at the start of the data area"
        return (
            f"{shard}: tensor {e.name} starts at data byte {e.begin:,}, leaving a gap of "
            f"{e.begin - position:,} unreferenced bytes {where}; {fix}"
        )
    if kind == "past_end":
        return (
            f"{shard}: tensor {e.name} runs past the end of the file (its data ends at byte {position:,}, the "
            f"file holds {max(header.data_size, 0):,}); the shard is truncated, download it again"
        )
    after = f"after the last tensor, {previous}," if previous is not None else "after the header"
    return f"{shard}: {header.data_size - position:,} trailing bytes {after} belong to no tensor; {fix}"


# ---------------------------------------------------------------------- the checkpoint on disk
class Checkpoint:
    """The shards of a checkpoint directory, headers parsed, payloads read by name.

    `read(name)` reads one whole tensor; `rows(name, ids)` gathers rows of a 2-D tensor without
    touching the others. Nothing is read until asked for."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        index = os.path.join(self.path, INDEX_NAME)
        if os.path.isfile(index):
            weight_map = _read_index(index)
            files = sorted(set(weight_map.values()))
            if not files:
                raise LoadError(f"{index}: the weight_map lists no tensors; download the index again")
        else:
            weight_map = None
            try:
                files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            except OSError as exc:
                raise LoadError(f"{self.path}: cannot list the directory ({exc.strerror})") from None
        if not files:
            raise LoadError(f"{self.path}: no .safetensors shards and no {INDEX_NAME}")
        self.entries = {}  # name -> (shard path, HeaderEntry, data start)
        self._sizes: dict[str, int] = {}  # shard path -> its size in bytes when its header was checked
        for file in files:
            shard = os.path.join(self.path, file)
            if not os.path.isfile(shard):
                raise LoadError(f"{shard}: listed in {INDEX_NAME} but missing; download it again")
            header = _read_shard_header(shard)
            problem = _tiling_error(shard, header)
            if problem:
                raise LoadError(problem)
            for name, entry in header.entries.items():
                earlier = self.entries.get(name)
                if earlier is not None:
                    raise LoadError(
                        f"{self.path}: tensor {name} is stored in both {os.path.basename(earlier[0])} "
                        f"and {file}; a tensor must live in one shard only, so remove the stray copy "
                        "(or download the checkpoint again)"
                    )
                self.entries[name] = (shard, entry, header.data_start)
            self._sizes[shard] = header.data_start + header.data_size
        if weight_map is not None:
            for name, file in weight_map.items():
                got = self.entries.get(name)
                if got is None or os.path.basename(got[0]) != file:
                    raise LoadError(f"{index}: tensor {name} is listed in {file}, but that shard does not hold it")
        self._fds: dict[str, int] = {}  # shard path -> its open file, kept until `release`

    # Every payload byte is read with positioned reads (os.preadv) straight into its final buffer.
    # A mapping of a whole shard is never made: a private mapping is charged in full against the
    # memory the kernel will commit (the released Engram shards are 94.56 GiB each), and a shard
    # truncated under a mapping kills the process with SIGBUS where a read returns short.
    def _fd(self, shard: str, name: str) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            try:
                fd = os.open(shard, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                size = os.fstat(fd).st_size
            except OSError as exc:
                raise self._damage(shard, name, exc) from None
            if size != self._sizes[shard]:
                os.close(fd)
                raise self._damage(
                    shard,
                    name,
                    ValueError(f"the file holds {size:,} bytes, {self._sizes[shard]:,} when its header was checked"),
                )
            self._fds[shard] = fd
        return fd

    def _damage(self, shard: str, name: str, exc: BaseException) -> LoadError:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return LoadError(
            f"{shard}: tensor {name} cannot be read ({why}); the shard is damaged or changed on disk, download it again"
        )

    def _pread_into(self, shard: str, name: str, buffer: np.ndarray, offset: int) -> None:
        """Fill the uint8 array `buffer` from byte `offset` of `shard`; a short read is a LoadError."""
        fd, view, done = self._fd(shard, name), memoryview(buffer).cast("B"), 0
        try:
            while done < len(view):
                got = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
                if got == 0:
                    raise EOFError(
                        f"the file ends {len(view) - done:,} bytes short of where its header says the tensor ends"
                    )
                done += got
        except (OSError, EOFError) as exc:
            raise self._damage(shard, name, exc) from None

    def release(self) -> None:
        """Close every shard file `read` opened."""
        fds, self._fds = getattr(self, "_fds", {}), {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        self.release()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> str:
        return self.entries[name][1].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1].shape

    def nbytes(self, name: str) -> int:
        return self.entries[name][1].nbytes

    def read(self, name: str) -> torch.Tensor:
        """One whole tensor, read into a buffer of its own (packed FP4 comes back as int8, as stored)."""
        entry = self.entries[name][1]
        return self.read_slab(name, 0, entry.shape[0]) if entry.shape else self._read_bytes(name, 0, entry.nbytes, ())

    def read_slab(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor (its first dimension), read into a buffer of their own."""
        entry = self.entries[name][1]
        rows = entry.shape[0]
        if not 0 <= start <= stop <= rows:
            raise IndexError(f"{name}: rows [{start}, {stop}) are outside [0, {rows})")
        row_bytes = math.prod(entry.shape[1:]) * DTYPE_SIZES[entry.dtype]
        return self._read_bytes(name, start * row_bytes, (stop - start) * row_bytes, (stop - start, *entry.shape[1:]))

    def _read_bytes(self, name: str, begin: int, nbytes: int, shape: tuple[int, ...]) -> torch.Tensor:
        shard, entry, data_start = self.entries[name]
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._pread_into(shard, name, out.numpy(), data_start + entry.begin + begin)
        return out.view(SAFETENSORS_DTYPES[entry.dtype]).reshape(shape)

    def rows(self, name: str, ids: np.ndarray) -> torch.Tensor:
        """Rows `ids` (any shape, int) of a 2-D tensor -> [*ids.shape, cols]: each distinct row is
        read once (runs of neighbouring rows in one read), nothing else of the tensor is touched."""
        shard, entry, start = self.entries[name]
        row_bytes = math.prod(entry.shape[1:]) * DTYPE_SIZES[entry.dtype]
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= entry.shape[0]):
            raise IndexError(f"{name}: row ids must lie in [0, {entry.shape[0]}), got {flat.min()}..{flat.max()}")
        distinct, where = np.unique(flat, return_inverse=True)
        table = np.empty((distinct.size, row_bytes), dtype=np.uint8)  # [distinct rows, row bytes]
        # runs of consecutive row ids: run k covers distinct[breaks[k]:breaks[k + 1]]
        breaks = np.flatnonzero(np.diff(distinct) != 1) + 1
        bounds = np.concatenate(([0], breaks, [distinct.size])).tolist()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                self._pread_into(shard, name, table[lo:hi], start + entry.begin + int(distinct[lo]) * row_bytes)
        out = torch.from_numpy(table[where.reshape(-1)])  # [n, row_bytes] uint8
        return out.view(SAFETENSORS_DTYPES[entry.dtype]).reshape(*np.shape(ids), *entry.shape[1:])
