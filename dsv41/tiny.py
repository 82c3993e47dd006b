"""The embedded default: a tiny random-weighted checkpoint written in the exact release format.

`write_tiny_checkpoint(dir, seed)` lays out what the release ships — `config.json` (nested),
`inference/config.json` (flat), `model.safetensors.index.json`, the shards split as the release
splits them, `tokenizer.json` and `tokenizer_config.json` — over the TINY geometry, with every
tensor name, dtype and quantization layout taken from `dsv41.inventory`. The two Engram numbers the
preset leaves open are derived here: the table row counts from the prime layout, the compressed
vocabulary from the tokenizer.

Weights are random but scaled like an initialized model (unit-variance activations through every
linear, norms at one, small hyper-connection and router tensors, zero attention sinks), so a
forward pass gives finite logits of order one. Random numbers come from NumPy's PCG64 bit stream,
one stream per (seed, tensor name), turned into near-normal values with integer sums and exact
IEEE arithmetic only; with the exact power-of-two quantization in `dsv41.formats` the output is
byte-identical for a seed on every machine.

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

from dsv41.cachedir import cache_root, current_umask
from dsv41.headers import INDEX_NAME

# Bump when the writer's output changes in a way the source digest below would not notice.
WRITER_VERSION = 1


# ---------------------------------------------------------------------- config and tokenizer
def tiny_config(tokenizer=None):
    """The TINY preset with engram_num_embeddings (prime layout) and engram_compressed_vocab_size
    (folded tokenizer vocabulary) filled in."""
    from dsv41.config import TINY
    from dsv41.engram import EngramLayout, build_compressed_token_map
    from dsv41.tokenizer import build_tiny_tokenizer

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
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
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
    from dsv41 import formats

    import torch

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
                fp4.append((spec, scale_name, _values(seed, spec.name, (spec.shape[0], spec.shape[1] * 2))))
            else:
                block = formats.infer_fp8_block(spec.shape, scale_spec.shape)
                weight, scale = formats.quantize_fp8_blocks(_values(seed, spec.name, spec.shape), block)
                out[spec.name], out[scale_name] = weight, scale
        else:
            out[spec.name] = _values(seed, spec.name, spec.shape).to(formats.torch_dtype(spec.dtype))
    if fp4:
        # FP4 groups of 32 are independent, so a shard's experts quantize in one call: [groups, 32]
        groups = torch.cat([values.reshape(-1, formats.FP4_BLOCK) for _, _, values in fp4])
        packed, scales = formats.quantize_fp4(groups)
        start = 0
        for spec, scale_name, values in fp4:
            n = values.numel() // formats.FP4_BLOCK
            out[spec.name] = packed[start:start + n].reshape(spec.shape)
            out[scale_name] = scales[start:start + n].reshape(values.shape[0], -1)
            start += n
    for spec in specs:  # the writer and the inventory must agree to the byte
        t = out.get(spec.name)
        if t is None or formats.DTYPE_NAMES[t.dtype] != spec.dtype or tuple(t.shape) != spec.shape:
            got = "missing" if t is None else f"{formats.DTYPE_NAMES[t.dtype]} {list(t.shape)}"
            raise RuntimeError(f"{spec.name}: wrote {got}, the inventory expects {spec.dtype} {list(spec.shape)}")
    return out


# ---------------------------------------------------------------------- writer
def write_tiny_checkpoint(out_dir, seed: int = 0, progress: bool | None = False) -> str:
    """Write the tiny checkpoint for `seed` into `out_dir` (created if needed) and return its path.

    progress: a tqdm bar on stderr; None shows it only when stderr is a terminal."""
    from dsv41.config import write_config_pair
    from dsv41.formats import save_safetensors
    from dsv41.headers import write_index
    from dsv41.inventory import expected_tensors, shard_names
    from dsv41.tokenizer import build_tiny_tokenizer, tokenizer_config

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is not a directory; give make-tiny a folder")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tiny_tokenizer()
    cfg = tiny_config(tokenizer)
    problems = cfg.verify()
    if problems:
        raise RuntimeError(f"the tiny config does not verify: {'; '.join(problems)}")
    specs = expected_tensors(cfg)
    by_name = {s.name: s for s in specs}
    shards = shard_names(cfg)
    per_shard: dict[str, list] = {name: [] for name in shards}
    for spec in specs:
        per_shard[spec.shard].append(spec)

    import torch
    from tqdm import tqdm

    if progress is None:
        progress = sys.stderr.isatty()
    # Every tensor here is small, so intra-op threads cost more in hand-offs than they win, and on a
    # busy machine several times more; one thread, restored afterwards. The bytes do not depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tqdm(total=len(shards), desc="make-tiny", unit="shard", file=sys.stderr, disable=not progress) as bar:
            for shard in shards:
                save_safetensors(_shard_tensors(per_shard[shard], by_name, seed), str(out / shard))
                bar.update(1)
    finally:
        torch.set_num_threads(threads)

    write_index(str(out), specs)
    write_config_pair(cfg, str(out))
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg), indent=2) + "\n", encoding="utf-8")

    stale = sorted(p.name for p in out.glob("*.safetensors") if p.name not in per_shard)
    if stale:
        print(f"make-tiny: note: {out} also holds shards this checkpoint does not list: {', '.join(stale)}",
              file=sys.stderr)
    return str(out)


# ---------------------------------------------------------------------- cache
def content_version() -> str:
    """A short tag that changes whenever anything the checkpoint is built from changes: the
    writer version, the sources of the modules that decide its bytes, the corpus and the library
    versions that serialize it. Imports nothing heavy, so finding a cached checkpoint is cheap."""
    from importlib.metadata import PackageNotFoundError, version

    here = Path(__file__).resolve().parent
    h = hashlib.sha256(f"writer {WRITER_VERSION}".encode())
    for rel in ("config.py", "inventory.py", "headers.py", "engram.py", "tokenizer.py", "formats.py",
                "kernels/codecs.py", "tiny.py", "data/corpus.txt"):
        path = here / rel
        h.update(rel.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(absent)") + b"\0")
    for lib in ("torch", "numpy", "tokenizers", "safetensors"):
        try:  # read from the installed metadata: no import, so a cache hit stays cheap
            h.update(f"{lib} {version(lib)}\0".encode())
        except PackageNotFoundError:
            h.update(f"{lib} (not installed)\0".encode())
    return f"v{WRITER_VERSION}-{h.hexdigest()[:10]}"


def default_checkpoint(seed: int = 0, progress: bool | None = None) -> str:
    """The embedded default checkpoint's folder, written on first use and cached after that.

    The folder is built under a temporary name and renamed into place in one step, so a build that
    dies half way is never mistaken for a checkpoint; two processes racing both succeed."""
    root = cache_root()
    final = root / f"tiny-{seed}-{content_version()}"
    if (final / INDEX_NAME).is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=root))
    try:
        write_tiny_checkpoint(tmp, seed=seed, progress=progress)
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp made it owner-only
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / INDEX_NAME).is_file():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


# ---------------------------------------------------------------------- CLI
def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsv41 make-tiny", description=(
        "Write the embedded default checkpoint: a tiny random-weighted model in the exact release "
        "format (both configs, index, shards, tokenizer). Same seed, same bytes."))
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be a non-negative integer")
    start = time.perf_counter()
    try:
        path = write_tiny_checkpoint(args.out_dir, seed=args.seed, progress=None)
    except (OSError, RuntimeError) as exc:
        print(f"dsv41 make-tiny: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    index = json.loads((Path(path) / INDEX_NAME).read_text(encoding="utf-8"))
    n_shards = len(set(index["weight_map"].values()))
    print(f"{path}: {len(index['weight_map'])} tensors, {index['metadata']['total_size'] / 2**20:.2f} MiB "
          f"in {n_shards} shards, seed {args.seed}, written in {elapsed:.1f} s")
    return 0
