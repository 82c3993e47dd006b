"""The embedded default: a tiny random-weighted checkpoint written in the exact release format.

`write_tiny_checkpoint(dir, seed)` lays out what the release ships — `config.json` (nested),
`inference/config.json` (flat), `model.safetensors.index.json`, the shards split as the release
splits them, `tokenizer.json` and `tokenizer_config.json` — over the TINY geometry, with every
tensor name, dtype and quantization layout taken from `dsv41.checkpoint.inventory`. The two Engram numbers the
preset leaves open are derived here: the table row counts from the prime layout, the compressed
vocabulary from the tokenizer.

Weights are random but scaled like an initialized model (unit-variance activations through every
linear, norms at one, small hyper-connection and router tensors, zero attention sinks), so a
forward pass gives finite logits of order one. Random numbers come from NumPy's PCG64 bit stream,
one stream per (seed, tensor name), turned into near-normal values with integer sums and exact
IEEE arithmetic only; with the exact power-of-two quantization in `dsv41.checkpoint.formats` the output is
byte-identical for a seed on every machine.

Beside them it leaves `dsv41-tiny.json`, a manifest of the seed, the content version and each
file's size and sha256 (as deterministic as the files): make-tiny replaces only a folder it
describes, unless forced, and the cache rebuilds a folder that no longer matches it.

`default_checkpoint()` builds it once into a user cache and returns the folder; every command that
takes a checkpoint defaults to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dsv41.checkpoint.headers import INDEX_NAME
from dsv41.core.cachedir import cache_dir, cache_error, cache_root, current_umask, file_sha256
from dsv41.core.outdir import replace_folder

# Bump when the writer's output changes in a way the source digest below would not notice.
WRITER_VERSION = 1


# ---------------------------------------------------------------------- config and tokenizer
def tiny_config(tokenizer=None):
    """The TINY preset with engram_num_embeddings (prime layout) and engram_compressed_vocab_size
    (folded tokenizer vocabulary) filled in."""
    from dsv41.checkpoint.engram import EngramLayout, build_compressed_token_map
    from dsv41.checkpoint.tokenizer import build_tiny_tokenizer
    from dsv41.core.config import TINY

    tokenizer = tokenizer or build_tiny_tokenizer(TINY)
    _, n_compressed = build_compressed_token_map(tokenizer)
    rows = EngramLayout.from_config(TINY).derived_num_embeddings
    return TINY.replace(engram_num_embeddings=tuple(rows), engram_compressed_vocab_size=int(n_compressed))


# ---------------------------------------------------------------------- random values
_SQRT3 = math.sqrt(3.0)


def _near_normal(seed: int, name: str, count: int):
    """`count` float64 values with mean 0 and variance 1, the same on every machine.

    Each draw sums four 16-bit uniforms from one 64-bit PCG64 output (Irwin-Hall): the sum is exact
    in float64, so only one rounded multiply separates the bits from the value. The result is
    bounded by +-2*sqrt(3), which also keeps FP8/FP4 block scales free of outliers."""
    import numpy as np

    digest = hashlib.sha256(f"dsv41-tiny\0{seed}\0{name}".encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    raw = np.random.PCG64(np.random.SeedSequence(words)).random_raw(count)
    total = np.zeros(count, dtype=np.float64)
    for shift in (0, 16, 32, 48):
        total += ((raw >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.float64)
    uniform_sum = (total + 2.0) / 65536.0  # sum of four (k + 0.5) / 65536, mean 2, variance 1/3
    return (uniform_sum - 2.0) * _SQRT3


def _init_rule(name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """('zeros' | 'ones' | 'normal', std) for a tensor, from its name and logical shape."""
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf == "attn_sink":
        return "zeros", 0.0  # no extra mass on the sink at start
    if "norm" in parent and leaf == "weight":
        return "ones", 0.0
    if leaf.startswith("hc_"):
        # small: the mixes sit near sigmoid(0) and a near-uniform Sinkhorn comb
        return "normal", 0.02
    if leaf in ("bias", "bias_vl") and parent == "gate":
        return "normal", 0.01  # router balance bias: small, so the scores decide
    if leaf in ("q_weight", "k_weight"):
        return "ones", 0.0  # the Engram gate's per-channel weights start neutral
    if leaf == "bias":
        return "zeros", 0.0
    if name == "embed.weight" or name.endswith(("markov_head.embed.weight", "engram.embed.weight")):
        return "normal", 1.0  # lookup tables: unit rows
    if len(shape) == 1:
        return "normal", 1.0 if name in ("image_start", "image_newline", "image_end") else 0.02
    fan_in = math.prod(shape[1:])
    return "normal", 1.0 / math.sqrt(fan_in)  # unit-variance outputs for unit-variance inputs


def _values(seed: int, name: str, shape: tuple[int, ...]):
    """float32 torch tensor of the logical (unquantized) shape."""
    import torch

    kind, std = _init_rule(name, shape)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32)
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32)
    values = (_near_normal(seed, name, math.prod(shape)) * std).astype("float32")
    return torch.from_numpy(values).reshape(shape)


def _shard_tensors(specs, by_name, seed: int) -> dict:
    """name -> stored torch tensor for one shard's specs, quantized as the specs say."""
    return stored_tensors(specs, by_name, lambda name, shape: _values(seed, name, shape))


def stored_tensors(specs, by_name, values) -> dict:
    """name -> stored torch tensor for one shard's specs: `values(name, logical shape)` (float32)
    quantized as the specs say."""
    import torch

    from dsv41.checkpoint import formats

    out, fp4 = {}, []
    for spec in specs:
        if spec.dtype == "F8_E8M0":
            continue  # written together with its weight
        if spec.dtype in ("F8_E4M3", "I8"):
            scale_name = spec.name[: -len("weight")] + "scale"
            scale_spec = by_name.get(scale_name)
            if not spec.name.endswith(".weight") or scale_spec is None:
                raise RuntimeError(f"{spec.name}: quantized tensor without a {scale_name} beside it")
            if spec.dtype == "I8":
                fp4.append((spec, scale_name, values(spec.name, (spec.shape[0], spec.shape[1] * 2))))
            else:
                block = formats.infer_fp8_block(spec.shape, scale_spec.shape)
                weight, scale = formats.quantize_fp8_blocks(values(spec.name, spec.shape), block)
                out[spec.name], out[scale_name] = weight, scale
        else:
            out[spec.name] = values(spec.name, spec.shape).to(formats.torch_dtype(spec.dtype))
    if fp4:
        # FP4 groups of 32 are independent, so a shard's experts quantize in one call: [groups, 32]
        groups = torch.cat([values.reshape(-1, formats.FP4_BLOCK) for _, _, values in fp4])
        packed, scales = formats.quantize_fp4(groups)
        start = 0
        for spec, scale_name, values in fp4:
            n = values.numel() // formats.FP4_BLOCK
            out[spec.name] = packed[start : start + n].reshape(spec.shape)
            out[scale_name] = scales[start : start + n].reshape(values.shape[0], -1)
            start += n
    for spec in specs:  # the writer and the inventory must agree to the byte
        t = out.get(spec.name)
        if t is None or formats.DTYPE_NAMES[t.dtype] != spec.dtype or tuple(t.shape) != spec.shape:
            got = "missing" if t is None else f"{formats.DTYPE_NAMES[t.dtype]} {list(t.shape)}"
            raise RuntimeError(f"{spec.name}: wrote {got}, the inventory expects {spec.dtype} {list(spec.shape)}")
    return out


# ---------------------------------------------------------------------- writer
# Left in every checkpoint the writer makes: its seed and content version and each file's size and
# sha256, so make-tiny knows what it may replace and the cache what it must rebuild.
MANIFEST_NAME = "dsv41-tiny.json"
_MANIFEST_FORMAT = "dsv41-tiny-checkpoint"


def write_tiny_checkpoint(out_dir, seed: int = 0, progress: bool | None = False, force: bool = False) -> str:
    """Write the tiny checkpoint for `seed` into `out_dir` and return its path.

    It is built in a folder beside `out_dir` and renamed into place when complete. An existing
    `out_dir` must be empty or an earlier tiny checkpoint of the same seed with nothing added;
    `force` replaces whatever is there. progress: a tqdm bar on stderr; None shows it only when
    stderr is a terminal."""
    out = Path(os.path.realpath(out_dir))  # through a link: the checkpoint goes where it points
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is not a directory; give make-tiny a folder")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise NotADirectoryError(f"{out}: {blocker} is a file, not a directory; give make-tiny a folder elsewhere")
    taken = None if force else _occupied(out, seed)
    if taken:
        raise FileExistsError(f"{out}: {taken}; pass --force (force=True) to replace it, or give another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _build_beside(out, seed, progress)
    try:
        replace_folder(tmp, out)
    finally:
        _remove(tmp)
    return str(out)


def _write_files(folder: Path, seed: int, progress: bool | None) -> None:
    """Every file of the checkpoint but the manifest, into the empty `folder`."""
    import torch

    from dsv41.checkpoint.synthetic import write_release_layout
    from dsv41.checkpoint.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    cfg = tiny_config(tokenizer)
    problems = cfg.verify()
    if problems:
        raise RuntimeError(f"the tiny config does not verify: {'; '.join(problems)}")
    if progress is None:
        progress = sys.stderr.isatty()
    # Every tensor here is small, so intra-op threads cost more in hand-offs than they win, and on a
    # busy machine several times more; one thread, restored afterwards. The bytes do not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write_release_layout(
            str(folder),
            cfg,
            lambda specs, by_name: _shard_tensors(specs, by_name, seed),
            tokenizer=tokenizer,
            progress="make-tiny" if progress else None,
        )
    finally:
        torch.set_num_threads(threads)


def _build_beside(target: Path, seed: int, progress: bool | None) -> Path:
    """A new folder beside `target` (one rename puts it in place) holding the complete checkpoint
    and its manifest; removed again if writing fails."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        _write_files(tmp, seed, progress)
        files = {
            rel: {"size": (tmp / rel).stat().st_size, "sha256": file_sha256(tmp / rel)}
            for rel in sorted(_entries(tmp))
            if (tmp / rel).is_file()
        }
        manifest = {"format": _MANIFEST_FORMAT, "seed": seed, "content_version": content_version(), "files": files}
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp made it owner-only
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _entries(folder: Path) -> set[str]:
    """Every file and folder under `folder`, as relative POSIX paths; the manifest excepted."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")} - {MANIFEST_NAME}


def _read_manifest(folder: Path) -> tuple[dict | None, str]:
    """(the manifest in `folder`, "") or (None, what is wrong with it)."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return None, f"{MANIFEST_NAME} is missing"
    except (OSError, ValueError):
        return None, f"{MANIFEST_NAME} is unreadable"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or manifest.get("format") != _MANIFEST_FORMAT
        or not isinstance(manifest.get("seed"), int)
        or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()
        )
    ):
        return None, f"{MANIFEST_NAME} is not a tiny checkpoint manifest"
    return manifest, ""


def _unlisted(folder: Path, manifest: dict) -> list[str]:
    """What `folder` holds that its manifest does not list (the folders of listed files aside)."""
    listed = set(manifest["files"])
    listed |= {parent.as_posix() for rel in listed for parent in Path(rel).parents if parent != Path(".")}
    return sorted(_entries(folder) - listed)


def _occupied(out: Path, seed: int) -> str | None:
    """Why `out` may not be replaced by the checkpoint of `seed` (None: it is missing, empty or an
    earlier tiny checkpoint of that seed with nothing added)."""
    if not out.is_dir() or not any(out.iterdir()):
        return None
    manifest, _ = _read_manifest(out)
    if manifest is None:
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return f"is not empty ({shown}) and holds no tiny checkpoint"
    if manifest["seed"] != seed:
        return f"holds the tiny checkpoint of seed {manifest['seed']}, not {seed}"
    foreign = _unlisted(out, manifest)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return f"holds {foreign[0]}{more} besides the tiny checkpoint"
    return None


# ---------------------------------------------------------------------- cache
# The package files (relative to dsv41/) that decide the random checkpoint's bytes; a test holds
# each to an existing file, so a move cannot leave one hashed as absent.
CONTENT_SOURCES = (
    "core/config.py",
    "checkpoint/inventory.py",
    "checkpoint/headers.py",
    "checkpoint/engram/__init__.py",
    "checkpoint/engram/layout.py",
    "checkpoint/engram/hasher.py",
    "checkpoint/tokenizer.py",
    "checkpoint/formats.py",
    "kernels/codecs.py",
    "checkpoint/tiny.py",
    "checkpoint/synthetic.py",
    "data/corpus.txt",
)


def content_version() -> str:
    """A short tag that changes whenever anything the checkpoint is built from changes: the
    writer version, the sources of the modules that decide its bytes, the corpus and the library
    versions that serialize it. Imports nothing heavy, so finding a cached checkpoint is cheap."""
    from importlib.metadata import PackageNotFoundError, version

    here = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(f"writer {WRITER_VERSION}".encode())
    for rel in CONTENT_SOURCES:
        path = here / rel
        h.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(absent)") + b"\0")
    for lib in ("torch", "numpy", "tokenizers", "safetensors"):
        try:  # read from the installed metadata: no import, so a cache hit stays cheap
            h.update(f"{lib} {version(lib)}\0".encode())
        except PackageNotFoundError:
            h.update(f"{lib} (not installed)\0".encode())
    return f"v{WRITER_VERSION}-{h.hexdigest()[:10]}"


# The cached folders this process has checked: only its first use reads their bytes.
_VERIFIED: set[str] = set()


def default_checkpoint(seed: int = 0, progress: bool | None = None) -> str:
    """The embedded default checkpoint's folder, written on first use and cached after that.

    A process's first use checks every file's size and sha256 against the manifest written with
    them (about 6 MB) and rebuilds a damaged or incomplete folder, saying so in one stderr line.
    The build happens beside the final folder and ends in one rename, so a build that dies half
    way is never mistaken for a checkpoint and two processes racing both succeed. Raises
    CacheError where the cache folder cannot be used."""
    version = content_version()
    final = cache_root() / f"tiny-{seed}-{version}"
    if str(final) in _VERIFIED:
        return str(final)
    damage = _damage(final, seed, version)
    if damage:
        if os.path.lexists(final):
            print(
                f"dsv41: the cached tiny checkpoint {final} is damaged or incomplete ({damage}); rebuilding it",
                file=sys.stderr,
            )
        cache_dir()
        try:
            tmp = _build_beside(final, seed, progress)
            try:
                try:
                    os.rename(tmp, final)
                except OSError:
                    if _damage(final, seed, version):  # not a race lost to an equal build
                        replace_folder(tmp, final)
            finally:
                _remove(tmp)
        except OSError as exc:
            raise cache_error(final, exc) from None
    _VERIFIED.add(str(final))
    return str(final)


def _damage(folder: Path, seed: int, version: str) -> str | None:
    """What differs in `folder` from the checkpoint its manifest describes (None: nothing)."""
    manifest, problem = _read_manifest(folder)
    if manifest is None:
        return problem
    if (manifest["seed"], manifest.get("content_version")) != (seed, version):
        return f"{MANIFEST_NAME} describes another checkpoint"
    unlisted = _unlisted(folder, manifest)
    if unlisted:
        return f"{unlisted[0]} is not part of it"
    files = sorted(manifest["files"].items())
    for rel, entry in files:  # sizes first: a truncated file costs no hashing
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{rel} is {path.stat().st_size} bytes, not {entry['size']}"
    for rel, entry in files:
        if file_sha256(folder / rel) != entry["sha256"]:
            return f"{rel} does not match its sha256"
    return None


# ---------------------------------------------------------------------- CLI
def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 make-tiny",
        description=(
            "Write the embedded default checkpoint: a tiny random-weighted model in the exact release "
            "format (both configs, index, shards, tokenizer). Same seed, same bytes."
        ),
    )
    parser.add_argument(
        "out_dir",
        metavar="OUT_DIR",
        help=("folder to write (created if missing); it must be empty or an earlier tiny checkpoint of the same seed"),
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR whatever it holds")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be a non-negative integer")
    start = time.perf_counter()
    try:
        path = write_tiny_checkpoint(args.out_dir, seed=args.seed, progress=None, force=args.force)
    except OSError as exc:
        # the system's own errors carry a file name; the writer's are already a sentence
        message = (
            (
                f"cannot write {exc.filename} ({exc.strerror}); {args.out_dir} is left as it was: fix that "
                f"and rerun, or give another folder"
            )
            if exc.filename and exc.strerror
            else str(exc)
        )
        print(f"dsv41 make-tiny: {message}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"dsv41 make-tiny: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    index = json.loads((Path(path) / INDEX_NAME).read_text(encoding="utf-8"))
    n_shards = len(set(index["weight_map"].values()))
    print(
        f"{path}: {len(index['weight_map'])} tensors, {index['metadata']['total_size'] / 2**20:.2f} MiB "
        f"in {n_shards} shards, seed {args.seed}, written in {elapsed:.1f} s"
    )
    return 0
