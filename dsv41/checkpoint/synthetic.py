"""Writing a checkpoint in the release layout over any geometry: the shards `inventory` names for
a config, the index, both configs and the tiny tokenizer, the weights from a fill.

Two fills exist because they answer two needs: `tiny.py`'s reproducible one (byte-identical on
every machine, values quantized from a seeded stream, what the embedded default checkpoint is
built from) and `random_fill` here, a fast one for the benchmarks' real-size layers (torch's
generator, routed experts as random FP4 bytes, the largest tensors drawn a slab of rows at a time),
where only finite, plausibly scaled numbers matter.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only
    from dsv41.core.config import Config

# fill(specs of one shard, every spec by name) -> {name: stored tensor} for that shard
Fill = Callable[[list, dict], dict]


def write_release_layout(
    folder: str, cfg: Config, fill: Fill, *, tokenizer=None, progress: str | None = None, streamed: bool = False
) -> None:
    """Every file of a checkpoint of `cfg` but a manifest, into `folder` (created if missing):
    each shard from `fill`, the index, the nested and flat configs, tokenizer.json and
    tokenizer_config.json (`tokenizer`: the tiny one for `cfg` unless given). `progress`: the label
    of a tqdm bar over the shards on stderr (None: no bar). `streamed`: each shard's routed experts
    are drawn and written one tensor at a time (`write_streamed_shard`), so a layer of 384 released
    experts (7.2 GB) never sits in memory at once; the other tensors come from `fill` as before."""
    from tqdm import tqdm

    from dsv41.checkpoint.formats import save_safetensors
    from dsv41.checkpoint.headers import write_index
    from dsv41.checkpoint.inventory import expected_tensors, shard_names
    from dsv41.checkpoint.tokenizer import build_tiny_tokenizer, tokenizer_config
    from dsv41.core.config import write_config_pair

    os.makedirs(folder, exist_ok=True)
    specs = expected_tensors(cfg)
    by_name = {spec.name: spec for spec in specs}
    shards = shard_names(cfg)
    per_shard: dict[str, list] = {name: [] for name in shards}
    for spec in specs:
        per_shard[spec.shard].append(spec)
    with tqdm(total=len(shards), desc=progress or "", unit="shard", file=sys.stderr, disable=not progress) as bar:
        for shard in shards:
            if streamed:
                write_streamed_shard(os.path.join(folder, shard), per_shard[shard], by_name, fill)
            else:
                save_safetensors(fill(per_shard[shard], by_name), os.path.join(folder, shard))
            bar.update(1)
    write_index(folder, specs)
    write_config_pair(cfg, folder)
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer(cfg)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer.to_str(pretty=True))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(tokenizer_config(cfg), indent=2) + "\n")


def write_streamed_shard(path: str, specs: list, by_name: dict, fill: Fill, seed: int = 0) -> None:
    """One shard written tensor by tensor: the header first (`headers.encode_header`), then each
    payload in its order; routed experts as random FP4 bytes with E8M0 scales drawn as they are
    written, everything else from `fill`."""
    import torch

    from dsv41.checkpoint.headers import encode_header

    routed = {s.name for s in specs if ".ffn.experts." in s.name}
    dense = fill([s for s in specs if s.name not in routed], by_name)
    header, entries = encode_header([(s.name, s.dtype, s.shape) for s in specs])
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(header)
        for e in entries:
            if e.name in dense:
                t = dense.pop(e.name).contiguous()
            elif e.dtype == "I8":
                t = torch.randint(-128, 128, e.shape, dtype=torch.int8, generator=g)
            else:  # an expert's E8M0 scales, in the range random_fill draws them from
                t = torch.randint(121, 125, e.shape, dtype=torch.uint8, generator=g)
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    from dsv41.core.cachedir import current_umask

    os.chmod(path, 0o666 & ~current_umask())


# ---------------------------------------------------------------------- the fast fill
def random_fill(seed: int = 0) -> Fill:
    """The benchmarks' fill: one torch generator drawn in shard order. Routed experts are random
    FP4 bytes with E8M0 scales; FP8 tensors are quantized from random values; everything else is
    written as stored."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def fill(specs: list, by_name: dict) -> dict:
        from dsv41.checkpoint import formats

        tensors = {}
        for spec in specs:
            if spec.dtype == "F8_E8M0":
                continue  # written with its weight
            if spec.dtype == "I8":
                tensors[spec.name] = torch.randint(-128, 128, spec.shape, dtype=torch.int8, generator=g)
                scale = by_name[spec.name[: -len("weight")] + "scale"]
                tensors[scale.name] = torch.randint(121, 125, scale.shape, dtype=torch.uint8, generator=g).view(
                    torch.float8_e8m0fnu
                )
            elif spec.dtype == "F8_E4M3":
                scale = by_name[spec.name[: -len("weight")] + "scale"]
                block = formats.infer_fp8_block(spec.shape, scale.shape)
                tensors[spec.name], tensors[scale.name] = formats.quantize_fp8_blocks(
                    _random_values(spec.name, spec.shape, g), block
                )
            else:
                tensors[spec.name] = _stored(spec.name, spec.shape, formats.torch_dtype(spec.dtype), g)
        return tensors

    return fill


def _random_values(name: str, shape: tuple, g):
    """float32 values for a dense tensor: ones for norms, zeros for sinks and biases, small mixes,
    unit-variance outputs elsewhere."""
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "attn_sink" or (leaf == "bias" and ".gate." not in name):
        return torch.zeros(shape)
    if (leaf == "weight" and "norm" in name.rsplit(".", 2)[-2]) or leaf in ("q_weight", "k_weight"):
        return torch.ones(shape)
    std = (
        0.02
        if leaf.startswith("hc_") or len(shape) == 1
        else 1.0
        if name.endswith("embed.weight")
        else 1.0 / math.sqrt(math.prod(shape[1:]))
    )
    return torch.randn(shape, generator=g) * std


def _stored(name: str, shape: tuple, dtype, g):
    """`_random_values` in the stored dtype, drawn a slab of rows at a time, so the released
    embedding and head (129,280 x 5,120) never exist in float32 at once."""
    import torch

    rows = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
    if len(shape) < 2 or shape[0] <= rows:
        return _random_values(name, shape, g).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        # the slab's values as `_random_values` scales the whole tensor (by its fan-in, not its rows)
        out[r0:r1] = _random_values(name, (r1 - r0,) + tuple(shape[1:]), g).to(dtype)
    return out
