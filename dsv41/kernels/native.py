"""The native CPU expert kernels (native.c): built once per machine with its C compiler, loaded
through ctypes.

The library is compiled on first use into the dsv41 cache (`$DSV41_CACHE`, else
~/.cache/dsv41) under a name derived from the source, the compiler, the flags and the CPU's
feature flags, so a cache shared by different machines never hands one a library built for the
other's instruction set. Its sha256 is recorded beside it (`NAME.so.sha256`) and only a library
that matches its record is loaded; anything else under that name (a half-copied cache, another
build) is rebuilt, with one line on stderr. `$CC` picks the compiler (default `cc`). Building takes
about a second; where it cannot be done (no compiler, a read-only cache, a failed build)
`available()` is False and `unavailable_reason()` says why in one sentence; callers then take the
plain-PyTorch path.

Which of the kernels' paths run is read from the CPU at run time and can be held lower, so that
any machine runs every path a smaller CPU would take: `$DSV41_ISA` (or `forced_isa` in Python)
names the highest instruction-set level the kernels may use, one of ISA_LEVELS. "amx" and
"avx512_bf16" keep the many-token products in BF16 (torch's BF16 GEMM) and take one token's FP4
(and, with AVX-512 VBMI, FP8) products on the BF16 dot-product instruction; "avx512" is a build
without the BF16 instructions, as a CPU with AVX-512 but not them has: the many-token products in
float32, one token's on the AVX-512 float body; "avx2" is a build with AVX-512 turned off (an AVX2-only CPU's kernels);
"plain" the portable C build. A level above what the CPU has is refused.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from ..core.cachedir import CacheError, cache_dir, cache_error, current_umask, file_sha256

SOURCE = Path(__file__).with_name("native.c")
_ABI_VERSION = 13  # must equal ABI_VERSION in native.c
# Instruction-set levels the kernels can be held to, lowest first (see the module docstring).
ISA_LEVELS = ("plain", "avx2", "avx512", "avx512_bf16", "amx")
ISA_ENV = "DSV41_ISA"
# What each level adds to the one below it, in torch's names for the CPU's features.
_LEVEL_FEATURES = {
    "avx2": ("avx2", "fma3", "f16c"),
    "avx512": ("avx512_f", "avx512_bw", "avx512_dq", "avx512_vl"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}
# -ffp-contract=off: a multiply and an add stay two roundings, as in the reference
_COMMON_FLAGS = ["-shared", "-fPIC", "-pthread", "-std=c11", "-ffp-contract=off", "-Wall"]
_BLOCK = 32


# Up to this many tokens per weight the kernel follows the reference's block order; more take a
# BLAS GEMM over decoded rows, several times faster there, equal to the reference up to float32
# addition order.
BLOCK_ORDER_MAX_TOKENS = 8
# The many-token path's working buffers (activations, decoded rows, the product before its powers
# of two) are kept per thread between calls up to this size each: fresh ones of a few MiB cost
# their page faults on every call, several percent of a prefill GEMM.
_WORKSPACE_KEPT_BYTES = 64 << 20
# Activations smaller than this (values) are quantized on one thread: waking the others costs more.
_QUANT_PARALLEL_VALUES = 1 << 16


class NativeKernels:
    """The loaded library: `gemm` for the fused expert products, plus what it was built with."""

    def __init__(self, lib: ctypes.CDLL, path: Path, flags: list[str], level: str):
        self._lib = lib
        self.path = path
        self.flags = flags
        self.level = level  # the ISA level it was built for (ISA_LEVELS)
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.dsv41_gemm_many.argtypes = [ptr, i64, c_int]
        lib.dsv41_activation.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, c_int]
        lib.dsv41_scale_range.argtypes = [ptr, i64, i64, ptr, ptr]
        lib.dsv41_decode.argtypes = [c_int, ptr, ptr, ptr, i64, ptr, i64, i64, i64, c_int, c_int]
        lib.dsv41_apply_powers.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, c_int]
        lib.dsv41_act_quant.argtypes = [ptr, c_int, i64, i64, i64, ptr, ptr, c_int]
        self.simd = bool(lib.dsv41_simd())
        self.avx512 = bool(lib.dsv41_avx512())  # one token's products on the AVX-512 body
        self.fp4_dot = bool(lib.dsv41_fp4_dot())  # one token's FP4 products on the BF16 dot product
        self.fp8_dot = bool(lib.dsv41_fp8_dot())  # and its FP8 ones (AVX-512 VBMI too)
        self.openmp = bool(lib.dsv41_openmp())
        self._kept = threading.local()

    def _workspace(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized [rows, cols] buffer, this thread's own, reused by later calls when small
        enough (_WORKSPACE_KEPT_BYTES).

        Always a normal tensor, never an inference tensor, whatever grad mode the caller is in: a
        buffer first made under torch.inference_mode() could not be written by a later call outside
        it, while a normal one takes writes in every mode."""
        numel = rows * cols
        with torch.inference_mode(False):
            if numel * dtype.itemsize > _WORKSPACE_KEPT_BYTES:
                return torch.empty(rows, cols, dtype=dtype)
            kept = self._kept.__dict__.setdefault("buffers", {})
            buf = kept.get((name, dtype))
            if buf is None or buf.numel() < numel:
                buf = kept[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(rows, cols)

    def gemm(
        self,
        fp4: bool,
        a: torch.Tensor,
        a_scale: torch.Tensor,
        act_block: int,
        weights: list,
        rows_per_scale: int,
        span: int,
        chunk_values: int,
        *,
        block_order: bool = False,
        bf16: bool = False,
    ):
        """The fused GEMMs of one set of tokens with one or more weights of one format, E8M0-scaled
        -> for each weight (its product [M, N], token ok bool [M] or None, row ok bool [N] or None);
        None: every token and row is ok.

        a: FP8 bytes uint8 [M, K] with E8M0 scale bytes [M, K/act_block]; weights: (packed,
        w_scale) pairs, packed uint8 [N, K/2] (FP4) or [N, K] (E4M3) with E8M0 scale bytes
        [ceil(N / rows_per_scale), K/32]. An activation byte holding the E4M3 NaN code makes every
        output of its token NaN, as in the reference GEMM.

        Up to BLOCK_ORDER_MAX_TOKENS tokens, or any number with `block_order`: the op layer's
        fp4_gemm / fp8_gemm in their own order (block partials scaled and added in K order),
        float32, nothing to recompute. Otherwise: each token's and row's scales split into the
        largest power of two and relative scales, the rows of all the weights decoded
        `chunk_values` values at a time into one float32 buffer, one BLAS GEMM per chunk, the
        powers of two applied after (the token's first); tokens or rows whose scales span more
        than `span` octaves (or are NaN) are not ok, and their outputs are left to the caller.
        Products are float32.

        `bf16` (the many-token path only): decode rows and activations to BF16 instead, exactly
        (see dsv41_decode), for torch's BF16 GEMM, which accumulates in float32 and rounds once
        to BF16 (AMX or AVX-512 BF16 where the CPU has them, see `prefill_path`); the powers of
        two then scale that BF16 result in place (dsv41_apply_powers): the product rounded to
        BF16 as the reference rounds it, up to float32 addition order. The products are BF16,
        column blocks of one [M, sum N] result."""
        a, a_scale = a.contiguous(), a_scale.contiguous()
        weights = [(packed.contiguous(), w_scale.contiguous()) for packed, w_scale in weights]
        m, k = a.shape
        if m <= BLOCK_ORDER_MAX_TOKENS or block_order:
            outs = self.gemm_many(
                [(fp4, a, a_scale, act_block, packed, w_scale, rows_per_scale) for packed, w_scale in weights]
            )
            return [(out, None, None) for out in outs]

        shapes = f"K={k} act_block={act_block}"
        dtype = torch.bfloat16 if bf16 else torch.float32
        values, a_top, a_low = self._decoded_activations(a, a_scale, act_block, dtype, shapes)
        tops = [self._scale_range(w_scale, shapes) for _, w_scale in weights]
        out_t, first_rows = self._decoded_products(
            fp4, values, weights, tops, rows_per_scale, chunk_values, dtype, shapes
        )
        return self._scaled_products(out_t, weights, tops, first_rows, a_top, a_low, rows_per_scale, span, bf16, shapes)

    def _decoded_activations(self, a, a_scale, act_block: int, dtype, shapes: str):
        """The activations decoded to `dtype` values [M, K] (dsv41_activation) and each token's scale
        exponent range [M], as `split_powers` takes it."""
        m, k = a.shape
        values = self._workspace("activations", m, k, dtype)
        a_top, a_low = torch.empty(m, dtype=torch.int32), torch.empty(m, dtype=torch.int32)
        self._check(
            self._lib.dsv41_activation(
                a.data_ptr(),
                a_scale.data_ptr(),
                m,
                k,
                act_block,
                values.data_ptr(),
                a_top.data_ptr(),
                a_low.data_ptr(),
                int(dtype == torch.bfloat16),
            ),
            shapes,
        )
        return values, a_top, a_low

    def _scale_range(self, w_scale, shapes: str):
        """The scale exponent range of each scale row of one weight (dsv41_scale_range), as
        `split_powers` takes it."""
        scale_rows, blocks = w_scale.shape
        w_top, w_low = torch.empty(scale_rows, dtype=torch.int32), torch.empty(scale_rows, dtype=torch.int32)
        self._check(
            self._lib.dsv41_scale_range(w_scale.data_ptr(), scale_rows, blocks, w_top.data_ptr(), w_low.data_ptr()),
            shapes,
        )
        return w_top, w_low

    def _decoded_products(
        self, fp4: bool, values, weights: list, tops: list, rows_per_scale: int, chunk_values: int, dtype, shapes: str
    ):
        """(every weight's product before the powers of two, [sum N, M] (a transposed view for BF16),
        the first row of each weight in it)."""
        # the weights' rows end to end, each chunk of rows one GEMM: BF16 into the columns of one
        # [M, sum N] result (written through its transpose); float32 into the rows of a [sum N, M]
        # one, a layout whose float32 GEMM gives the same bits at any thread count
        m, k = values.shape
        bf16 = dtype == torch.bfloat16
        threads = torch.get_num_threads()
        first_rows = [0]
        for packed, _ in weights:
            first_rows.append(first_rows[-1] + packed.size(0))
        total = first_rows[-1]
        chunks = -(-total // max(1, chunk_values // k))
        rows = -(-total // chunks)  # chunks of equal size: no short last GEMM
        buf = self._workspace("decoded rows", rows, k, dtype)
        out_t = torch.empty(m, total, dtype=dtype).t() if bf16 else self._workspace("product", total, m, dtype)
        for c0 in range(0, total, rows):
            c1 = min(total, c0 + rows)
            for (packed, w_scale), (w_top, _), first in zip(weights, tops, first_rows):
                r0, r1 = max(c0, first) - first, min(c1, first + packed.size(0)) - first  # this weight's rows
                if r0 < r1:
                    into = buf[first + r0 - c0]
                    self._check(
                        self._lib.dsv41_decode(
                            int(fp4),
                            packed.data_ptr(),
                            w_scale.data_ptr(),
                            w_top.data_ptr(),
                            rows_per_scale,
                            into.data_ptr(),
                            r0,
                            r1,
                            k,
                            threads,
                            int(bf16),
                        ),
                        shapes,
                    )
            torch.mm(buf[: c1 - c0], values.t(), out=out_t[c0:c1])
        return out_t, first_rows

    def _scaled_products(
        self,
        out_t,
        weights: list,
        tops: list,
        first_rows: list,
        a_top,
        a_low,
        rows_per_scale: int,
        span: int,
        bf16: bool,
        shapes: str,
    ) -> list:
        """Each weight's (product [M, N] with the powers of two applied, token ok, row ok)."""
        m, total = out_t.size(1), out_t.size(0)
        threads = torch.get_num_threads()
        a_pow, token_ok = split_powers(a_top, a_low, span)
        results = []
        for (packed, _), (w_top, w_low), first in zip(weights, tops, first_rows):
            n = packed.size(0)
            w_pow, row_ok = (t.repeat_interleave(rows_per_scale)[:n] for t in split_powers(w_top, w_low, span))
            product = out_t[first : first + n].t()  # [M, N]
            if bf16:
                self._check(
                    self._lib.dsv41_apply_powers(
                        product.data_ptr(), m, n, total, a_top.data_ptr(), w_top.data_ptr(), rows_per_scale, threads
                    ),
                    shapes,
                )
            else:  # the token's power of two first, then the row's, as the reference applies a_s, w_s
                product = product * a_pow.unsqueeze(1) * w_pow.unsqueeze(0)
            results.append((product, token_ok, row_ok))
        return results

    def act_quant(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """quant.act_quant with E8M0 scales, byte for byte: float32 or BF16 x [..., K] on the CPU
        -> (float8_e4m3fn [..., K], float8_e8m0fnu [..., K/block]); block a multiple of 32."""
        flat = x.reshape(-1, x.size(-1)).contiguous()  # [M, K]
        m, k = flat.shape
        codes = torch.empty(m, k, dtype=torch.uint8)
        scales = torch.empty(m, k // block, dtype=torch.uint8)
        threads = torch.get_num_threads() if m * k >= _QUANT_PARALLEL_VALUES else 1
        self._check(
            self._lib.dsv41_act_quant(
                flat.data_ptr(),
                int(flat.dtype == torch.bfloat16),
                m,
                k,
                block,
                codes.data_ptr(),
                scales.data_ptr(),
                threads,
            ),
            f"K={k} block={block}",
        )
        return (
            codes.view(torch.float8_e4m3fn).reshape(x.shape),
            scales.view(torch.float8_e8m0fnu).reshape(*x.shape[:-1], k // block),
        )

    def gemm_many(self, products: list) -> list[torch.Tensor]:
        """Several block-order products (the op layer's own order, any token count) in one
        parallel pass: each item is (fp4, a, a_scale, act_block, packed, w_scale, rows_per_scale)
        as for `gemm`; returns float32 [M, N] for each."""
        descs = (_GemmDesc * len(products))()
        keep, outs = [], []  # the tensors the descriptors point into live until the call returns
        for desc, (fp4, a, a_scale, act_block, packed, w_scale, rows_per_scale) in zip(descs, products):
            a, a_scale = a.contiguous(), a_scale.contiguous()
            packed, w_scale = packed.contiguous(), w_scale.contiguous()
            m, k = a.shape
            n = packed.size(0)
            out_t = torch.empty(n, m, dtype=torch.float32)  # [N, M]: a token group's results are adjacent
            keep += [a, a_scale, packed, w_scale]
            outs.append(out_t)
            desc.w, desc.w_scale, desc.a, desc.a_scale = (t.data_ptr() for t in (packed, w_scale, a, a_scale))
            desc.out = out_t.data_ptr()
            desc.rows_per_scale, desc.act_block, desc.m, desc.n, desc.k, desc.fp4 = (
                rows_per_scale,
                act_block,
                m,
                n,
                k,
                int(fp4),
            )
        self._check(
            self._lib.dsv41_gemm_many(descs, len(products), torch.get_num_threads()),
            ", ".join(f"K={d.k} act_block={d.act_block}" for d in descs),
        )
        return [out_t.t() for out_t in outs]

    @staticmethod
    def _check(status: int, shapes) -> None:
        if status == -2:
            raise MemoryError("the native expert kernel could not allocate its working memory")
        if status != 0:
            raise ValueError(
                f"the native expert kernel does not take {shapes} "
                f"(K and act_block multiples of {_BLOCK}, act_block dividing K)"
            )


class _GemmDesc(ctypes.Structure):
    """native.c's dsv41_gemm_desc, field for field."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("w_scale", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("a_scale", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("rows_per_scale", ctypes.c_int64),
        ("act_block", ctypes.c_int64),
        ("m", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("fp4", ctypes.c_int64),
    ]


def split_powers(top: torch.Tensor, low: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each E8M0 scale row's largest and smallest byte, int32 [rows] -> (its power of two
    2**(top - 127) float32, ok bool: the row spans at most `span` octaves and is not NaN)."""
    from .codecs import e8m0_decode

    return e8m0_decode(top.to(torch.uint8)), (top - low <= span) & (top < 255)


# How many-token products run, by what this CPU has (`prefill_path`): the first two decode to
# BF16 for torch's BF16 GEMM (AMX tiles, or AVX-512 BF16 dot products), the others to float32 for
# its float32 GEMM, decoded with AVX2 or plain C.
PREFILL_PATHS = ("amx", "avx512_bf16", "avx2", "plain")


def cpu_capability() -> dict:
    """torch's view of this CPU's instruction sets (the flags its own kernels dispatch on)."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError):  # a torch without the query: assume none
        return {}


def prefill_path(kernels: Optional["NativeKernels"] = None) -> str:
    """The many-token path the kernels take, one of PREFILL_PATHS: the CPU's, read at run time,
    held to the ISA level in force (`isa_level`)."""
    kernels = kernels if kernels is not None else load()
    level = kernels.level if kernels is not None else isa_level()
    if level in ("amx", "avx512_bf16"):
        return level
    return "avx2" if kernels is not None and kernels.simd else "plain"


def cpu_isa_level() -> str:
    """The highest of ISA_LEVELS this CPU has every feature of (and of each level below)."""
    caps = cpu_capability()
    level = "plain"
    for candidate in ISA_LEVELS[1:]:
        if not all(caps.get(feature) for feature in _LEVEL_FEATURES[candidate]):
            break
        level = candidate
    return level


def runnable_isa_levels() -> tuple[str, ...]:
    """Every level this CPU can be held to, lowest first: what the kernel tests run on."""
    return ISA_LEVELS[: ISA_LEVELS.index(cpu_isa_level()) + 1]


def check_isa_level(level: str, source: str = "level") -> str:
    """`level` if this CPU can run it, else ValueError in one sentence."""
    if level not in ISA_LEVELS:
        raise ValueError(f"{source} {level!r} is not an instruction-set level; use one of {', '.join(ISA_LEVELS)}")
    if level not in runnable_isa_levels():
        raise ValueError(
            f"{source} {level!r} is above what this CPU has ({cpu_isa_level()}): "
            f"a level can hold the kernels lower, never higher"
        )
    return level


_FORCED: list[str] = []  # forced_isa's levels, innermost last


def isa_level() -> str:
    """The level in force: `forced_isa`'s, else $DSV41_ISA, else the CPU's own."""
    if _FORCED:
        return _FORCED[-1]
    value = os.environ.get(ISA_ENV, "").strip()
    return check_isa_level(value, f"${ISA_ENV}") if value else cpu_isa_level()


@contextmanager
def forced_isa(level: str):
    """Run the block with the kernels held to `level` (process-wide, like $DSV41_ISA): how the
    tests run every path this CPU can take."""
    _FORCED.append(check_isa_level(level))
    try:
        yield load()
    finally:
        _FORCED.pop()


# Built or failed once per process and level: (the library handle or None, the reason there is none).
_STATE: dict = {}


# What each request resolved to (a forced level, or $DSV41_ISA's value, "" when unset): load() is
# on every product's path, and reading the CPU's features costs more than a small product.
_LEVEL_OF_REQUEST: dict = {}


def load() -> Optional[NativeKernels]:
    """The native kernels for the level in force, built on first use; None where they cannot be
    built or loaded."""
    request = ("forced", _FORCED[-1]) if _FORCED else ("env", os.environ.get(ISA_ENV, ""))
    level = _LEVEL_OF_REQUEST.get(request)
    if level is None:
        level = _LEVEL_OF_REQUEST[request] = isa_level()
    if level not in _STATE:
        try:
            _STATE[level] = _build_and_load(level), None
        except _Unavailable as exc:
            _STATE[level] = None, str(exc)
    return _STATE[level][0]


def available() -> bool:
    return load() is not None


def unavailable_reason() -> Optional[str]:
    load()
    return _STATE[isa_level()][1]


def _flag_sets(level: str) -> list[list[str]]:
    """The builds to try for `level`, best first: -march=native (AVX2/FMA/F16C and AVX-512 where
    the CPU has them; "avx2" turns AVX-512 off, "avx512" its BF16 instructions) with OpenMP
    (torch's runtime, see native.c), then without OpenMP, then the portable build, which is all
    "plain" tries."""
    if level == "plain":
        return [["-O3"]]
    native = ["-O3", "-march=native"] + {"avx2": ["-mno-avx512f"], "avx512": ["-mno-avx512bf16"]}.get(level, [])
    return [native + ["-fopenmp"], native, ["-O3"]]


class _Unavailable(Exception):
    pass


def _build_and_load(level: str) -> NativeKernels:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise _Unavailable(f"no C compiler ({compiler}) on PATH")
    try:
        folder = cache_dir("native")
    except CacheError as exc:
        raise _Unavailable(str(exc)) from None
    source = SOURCE.read_bytes()
    errors = []
    for flags in _flag_sets(level):
        path = folder / f"dsv41_native-{_build_key(compiler, flags, source)}.so"
        unknown = _not_ours(path)
        if unknown:
            if path.exists():
                print(f"dsv41: {path} {unknown}; rebuilding it", file=sys.stderr)
            error = _compile(compiler, flags, path)
            if error:
                errors.append(f"{' '.join(flags)}: {error}")
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            errors.append(f"loading {path}: {exc}")
            continue
        abi = getattr(lib, "dsv41_abi_version", None)
        if abi is None or abi() != _ABI_VERSION:
            errors.append(f"{path} is ABI {abi() if abi else '(none)'}, expected {_ABI_VERSION}")
            continue
        return NativeKernels(lib, path, flags, level)
    raise _Unavailable("the native expert kernels did not build: " + "; ".join(errors))


def _record(path: Path) -> Path:
    """Where the sha256 of the library at `path` is kept, written by the build that made it."""
    return path.with_name(path.name + ".sha256")


def _not_ours(path: Path) -> Optional[str]:
    """Why the file at `path` is not a library this cache built (None: it is)."""
    if not path.is_file():
        return "is missing"
    try:
        recorded = _record(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return f"has no readable {_record(path).name}"
    if file_sha256(path) != recorded:
        return f"does not match the sha256 in {_record(path).name}"
    return None


def _build_key(compiler: str, flags: list[str], source: bytes) -> str:
    h = hashlib.sha256(source)
    h.update(" ".join([compiler, *flags, *_COMMON_FLAGS, platform.machine()]).encode())
    h.update(_compiler_version(compiler).encode())
    if "-march=native" in flags:
        h.update(_cpu_features().encode())
    return h.hexdigest()[:16]


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, flags: list[str], path: Path) -> Optional[str]:
    """Build into a temporary name and rename into place, so racing processes both succeed and a
    half-written library is never loaded; its sha256 record goes first, so a library in place is
    never newer than its record. Returns the compiler's complaint, or None."""
    temps = []
    try:
        for suffix in (".so", ".sha256"):
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=suffix, dir=path.parent)
            os.close(fd)
            temps.append(tmp)
        library, record = temps
        done = subprocess.run(
            [compiler, *flags, *_COMMON_FLAGS, "-o", library, str(SOURCE)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            errors = [line for line in lines if "error" in line] or lines
            return errors[0] if errors else f"exit status {done.returncode}"
        with open(record, "w", encoding="ascii") as f:
            f.write(file_sha256(library) + "\n")
        os.chmod(record, 0o666 & ~current_umask())  # mkstemp made it owner-only
        os.replace(record, _record(path))
        os.replace(library, path)
        return None
    except OSError as exc:
        return str(cache_error(path, exc))
    except subprocess.SubprocessError as exc:
        return str(exc)
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
