"""`dsv41 audit --values`: read every tensor's payload and count the codes that are not finite values.

The rest of the audit reads headers only; this opt-in pass reads each tensor's byte range from its
shard (the header's data_offsets, after the header), CHUNK_BYTES at a time so memory stays bounded
whatever the tensor's size, and counts per tensor:

- F8_E4M3 (e4m3fn): no infinity; S.1111.111 (0x7F, 0xFF) is NaN, the code a saturating cast
  writes for a value out of range;
- F8_E5M2: exponent all ones is Inf (mantissa 0) or NaN;
- F8_E8M0 (the block scales): 0xFF is NaN, no scale;
- F16 / BF16 / F32 / F64: exponent all ones is Inf (mantissa 0) or NaN.

Integer dtypes (I8 packed FP4 E2M1, whose 16 codes are all finite, U8, the integers, BOOL) have no
such codes and are not read. numpy does the counting; no torch.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from dsv41.checkpoint.audit.report import ValueFinding, ValueScan
from dsv41.checkpoint.headers import HeaderError, read_header

CHUNK_BYTES = 1 << 24  # 16 MiB per read, a multiple of every element size

# safetensors dtype -> (little-endian unsigned view, exponent mask, mantissa mask); all-ones
# exponent with a zero mantissa is Inf, with any other mantissa NaN
_IEEE = {
    "F16": ("<u2", 0x7C00, 0x03FF),
    "BF16": ("<u2", 0x7F80, 0x007F),
    "F32": ("<u4", 0x7F800000, 0x007FFFFF),
    "F64": ("<u8", 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F8_E5M2": ("u1", 0x7C, 0x03),
}
# one-byte formats whose NaN is a fixed set of codes (and which have no Inf)
_NAN_CODES = {"F8_E4M3": (0x7F, 0xFF), "F8_E8M0": (0xFF,)}
SCANNED = frozenset(_IEEE) | frozenset(_NAN_CODES)


def count_codes(dtype: str, data: bytes) -> tuple[int, int]:
    """(NaN, Inf) codes among `data`, the raw little-endian bytes of `dtype` values."""
    if dtype in _NAN_CODES:
        counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
        return int(sum(counts[c] for c in _NAN_CODES[dtype])), 0
    view, exponent, mantissa = _IEEE[dtype]
    v = np.frombuffer(data, dtype=view)
    special = v[(v & exponent) == exponent]
    nan = int(np.count_nonzero(special & mantissa))
    return nan, int(special.size) - nan


def scan_values(paths: list[str], progress: bool = True) -> ValueScan:
    """Read the payload of every floating-point tensor in these shard files (readable headers,
    one file per shard) and count its NaN and Inf codes. A tensor whose bytes are not all in its
    file (a header prefix, a truncated download) is listed as unread, not guessed at."""
    from tqdm import tqdm

    plan, scan = [], ValueScan()
    for path in paths:
        try:
            header = read_header(path)
        except HeaderError as exc:  # the header audit already reported it
            scan.unread.append((os.path.basename(path), str(exc)))
            continue
        scan.files += 1
        for e in sorted(header.entries.values(), key=lambda e: e.begin):
            if e.dtype not in SCANNED:
                scan.not_float += 1
            elif e.end > header.data_size:
                scan.unread.append(
                    (
                        e.name,
                        f"its bytes {e.begin:,}-{e.end:,} run past the end of "
                        f"{os.path.basename(path)} (a header prefix or a truncated file)",
                    )
                )
            else:
                plan.append((path, header.data_start, e))
    bar = tqdm(
        total=sum(e.nbytes for _, _, e in plan),
        desc="reading values",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
        leave=False,
    )
    handle, opened = None, None
    try:
        for path, data_start, e in plan:
            if opened != path:
                if handle:
                    handle.close()
                handle, opened = open(path, "rb"), path
            handle.seek(data_start + e.begin)
            nan = inf = 0
            left = e.nbytes
            while left:
                chunk = handle.read(min(left, CHUNK_BYTES))
                if not chunk:  # the file shrank after its header was read
                    scan.unread.append((e.name, f"{os.path.basename(path)} ended while it was read"))
                    break
                chunk = chunk[: len(chunk) - len(chunk) % _itemsize(e.dtype)]
                n, i = count_codes(e.dtype, chunk)
                nan, inf, left = nan + n, inf + i, left - len(chunk)
                bar.update(len(chunk))
                if not chunk:
                    break
            scan.tensors += 1
            scan.bytes += e.nbytes - left
            if nan or inf:
                scan.findings.append(
                    ValueFinding(
                        e.name, os.path.basename(path), e.dtype, list(e.shape), e.nbytes // _itemsize(e.dtype), nan, inf
                    )
                )
    except OSError as exc:
        scan.unread.append((os.path.basename(opened or ""), f"cannot be read ({exc.strerror or exc})"))
    finally:
        if handle:
            handle.close()
        bar.close()
    return scan


def _itemsize(dtype: str) -> int:
    return np.dtype(_IEEE[dtype][0]).itemsize if dtype in _IEEE else 1
