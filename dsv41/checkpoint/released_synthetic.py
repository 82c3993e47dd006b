"""`dsv41 make-synthetic`: a checkpoint of the whole released geometry (48 shards, 96,085 tensors,
475 GiB apparent) that takes about 11 GiB of disk, to run every command at the full size without
the download.

The dense tensors hold random, plausibly scaled values (`synthetic.random_fill`, a generator per
shard so an interrupted write resumes with the same bytes); the routed experts and the Engram
tables are holes in sparse files, which read back as zeros at the speed of the page allocator, not
of the disk. `real_expert_layers` fills the experts of chosen layers with random FP4 bytes, so disk
reads can be measured on them. `small=True` keeps the layer plan (40 layers, 384 experts, both
Engram layers, the MTP stack) at tiny widths: the same path in well under a GiB, for tests.

The config is the released one but for `engram_compressed_vocab_size`, which follows the
shipped tokenizer (the tiny one at the released vocabulary): 129,138 compressed ids where the
real tokenizer folds to 99,092. The folder's marker, `dsv41-synthetic.json`, records the options
and the shards written so far; a folder without it is written into only when empty.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..core import outdir
from ..core.errors import Dsv41Error

if TYPE_CHECKING:  # annotations only
    from ..core.config import Config

MARKER_NAME = "dsv41-synthetic.json"
MARKER_FORMAT = "dsv41-synthetic-released"
# the widths of the small variant: the released layer plan at the benchmark's tiny dims, and a
# two-layer vision tower (32 layers of width 1024 would be most of its bytes)
SMALL_WIDTHS = dict(
    dim=128,
    moe_inter_dim=64,
    n_heads=4,
    head_dim=64,
    rope_head_dim=32,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    window_size=8,
    index_n_heads=2,
    index_head_dim=32,
    index_topk=8,
    candidate_topk_blocks=4,
    candidate_block_size=2,
    engram_n_heads=2,
    engram_head_dim=32,
    dspark_markov_rank=32,
    vision_n_layers=2,
)
_SPARSE_PROBE_BYTES = 64 << 20
_FREE_MARGIN = 1 << 30  # left free beyond what the checkpoint takes


class SyntheticError(Dsv41Error, RuntimeError):
    """The synthetic checkpoint cannot be written; the message says why and what to do."""


def released_synthetic_config(small: bool = False):
    """The released config (`config.RELEASED`), or its layer plan at tiny widths (`small`)."""
    from ..core.config import RELEASED
    from .engram import build_compressed_token_map
    from .inventory import derived_engram_rows
    from .tokenizer import build_tiny_tokenizer

    cfg = RELEASED.replace(**SMALL_WIDTHS, engram_num_embeddings=None) if small else RELEASED
    # The shipped tokenizer is the tiny one, laid out for the released vocabulary: the Engram hash
    # folds its ids, so the config names its compressed count (the table rows do not depend on it).
    _, n_compressed = build_compressed_token_map(build_tiny_tokenizer(cfg))
    cfg = cfg.replace(engram_compressed_vocab_size=int(n_compressed))
    if small:
        cfg = cfg.replace(engram_num_embeddings=derived_engram_rows(cfg))  # the prime buckets of 2 heads
    problems = cfg.verify()
    if problems:
        raise SyntheticError(f"the synthetic config does not verify: {problems[0]}")
    return cfg


def is_hole(name: str, real_expert_layers: Iterable[int] = ()) -> bool:
    """Whether a tensor is left as a hole: routed experts (but those of `real_expert_layers`) and
    the Engram tables with their scales."""
    if ".engram.embed." in name:
        return True
    if ".ffn.experts." not in name:
        return False
    parts = name.split(".")
    return not (parts[0] == "layers" and int(parts[1]) in set(real_expert_layers))


def plan_bytes(cfg: Config, real_expert_layers: Iterable[int] = ()) -> dict:
    """{"apparent": every payload byte, "on_disk": those written (dense and the real experts)}."""
    from .inventory import expected_tensors

    layers = set(real_expert_layers)
    specs = expected_tensors(cfg)
    written = sum(s.nbytes for s in specs if not is_hole(s.name, layers))
    return {"apparent": sum(s.nbytes for s in specs), "on_disk": written, "tensors": len(specs)}


def keeps_holes(folder: str) -> bool:
    """Whether the file system under `folder` stores a file with a 64 MiB hole in far less space."""
    probe = os.path.join(folder, f".{MARKER_NAME}.sparse-probe")
    try:
        with open(probe, "wb") as f:
            f.seek(_SPARSE_PROBE_BYTES)
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
        return os.stat(probe).st_blocks * 512 < _SPARSE_PROBE_BYTES // 4
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


def read_marker(folder: str) -> dict | None:
    """The marker of a folder make-synthetic wrote (None: missing, or not its format)."""
    return outdir.read_marker(Path(folder), MARKER_NAME, MARKER_FORMAT)


def _check_folder(folder: str, options: dict) -> dict:
    """The marker to continue from ({} for a new or empty folder); OutDirError for a path that is
    or runs through a file, refuses new files or holds what make-synthetic did not write, and
    SyntheticError for a folder it wrote with other options."""
    _, marker = outdir.inspect_folder(
        folder, marker=MARKER_NAME, fmt=MARKER_FORMAT, flag="make-synthetic", command="make-synthetic"
    )
    if marker is None:
        return {}
    if marker.get("options") != options:
        raise SyntheticError(
            f"{folder}: holds a synthetic checkpoint written with other options "
            f"({json.dumps(marker.get('options'), sort_keys=True)}); give another folder"
        )
    return marker


def write_released_synthetic(
    folder: str,
    *,
    small: bool = False,
    real_expert_layers: Iterable[int] = (),
    seed: int = 0,
    progress: bool = True,
    log=print,
) -> dict:
    """Write (or finish, or find already written) the synthetic released checkpoint in `folder`.
    Returns the marker: options, shards written, bytes apparent and on disk, seconds."""
    from tqdm import tqdm

    from ..core.config import write_config_pair
    from .headers import write_index
    from .inventory import expected_tensors, shard_names
    from .tokenizer import build_tiny_tokenizer, tokenizer_config

    cfg = released_synthetic_config(small)
    layers = sorted({int(i) for i in real_expert_layers})
    bad = [i for i in layers if not 0 <= i < cfg.n_layers + cfg.n_mtp_layers]
    if bad:
        raise SyntheticError(
            f"--real-experts names layer {bad[0]}, but the layers run from 0 to {cfg.n_layers + cfg.n_mtp_layers - 1}"
        )
    options = {"geometry": "small" if small else "released", "real_expert_layers": layers, "seed": seed}
    folder = os.path.abspath(folder)
    marker = _check_folder(folder, options)
    if marker.get("complete"):
        log(f"{folder}: the synthetic checkpoint is already complete ({options['geometry']} geometry); reusing it")
        return marker
    sizes = plan_bytes(cfg, layers)
    os.makedirs(folder, exist_ok=True)
    done = set(marker.get("shards_done", []))
    specs = expected_tensors(cfg)
    by_name = {s.name: s for s in specs}
    per_shard: dict[str, list] = {name: [] for name in shard_names(cfg)}
    for spec in specs:
        per_shard[spec.shard].append(spec)
    left = sum(s.nbytes for s in specs if s.shard not in done and not is_hole(s.name, layers))
    free = shutil.disk_usage(folder).free
    if free < left + _FREE_MARGIN:
        raise SyntheticError(
            f"{folder}: needs {(left + _FREE_MARGIN) / 2**30:.1f} GiB free ({left / 2**30:.1f} GiB "
            f"to write and 1 GiB to spare), the disk has {free / 2**30:.1f} GiB; free some or give "
            "a folder on another disk"
        )
    if not keeps_holes(folder):
        raise SyntheticError(
            f"{folder}: its file system does not keep holes in sparse files, so the checkpoint "
            f"would take {sizes['apparent'] / 2**30:.0f} GiB of disk; give a folder on ext4, xfs, "
            "btrfs or tmpfs"
        )
    log(
        f"writing the {options['geometry']} synthetic checkpoint: {len(per_shard)} shards, {sizes['tensors']:,} "
        f"tensors, {sizes['apparent'] / 2**30:.2f} GiB apparent, {sizes['on_disk'] / 2**30:.2f} GiB on disk "
        f"(routed experts{'' if not layers else ' but layers ' + ','.join(map(str, layers))} and Engram tables "
        "are holes)" + (f"; {len(done)} shards were written by an earlier run" if done else "")
    )
    marker = {
        "format": MARKER_FORMAT,
        "options": options,
        "shards_done": sorted(done),
        "complete": False,
        "apparent_bytes": sizes["apparent"],
        "on_disk_bytes": sizes["on_disk"],
        "seconds": float(marker.get("seconds", 0.0)),
    }
    outdir.write_json(os.path.join(folder, MARKER_NAME), marker)
    began = time.perf_counter()
    with tqdm(
        total=len(per_shard),
        initial=len(done),
        desc="make-synthetic",
        unit="shard",
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        for index, (shard, shard_specs) in enumerate(per_shard.items()):
            if shard in done:
                continue
            _write_shard(os.path.join(folder, shard), shard_specs, by_name, layers, seed * 1000 + index)
            done.add(shard)
            marker["shards_done"] = sorted(done)
            marker["seconds"] += time.perf_counter() - began
            began = time.perf_counter()
            outdir.write_json(os.path.join(folder, MARKER_NAME), marker)
            bar.update(1)
    write_index(folder, specs)
    write_config_pair(cfg, folder)
    tokenizer = build_tiny_tokenizer(cfg)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer.to_str(pretty=True))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(tokenizer_config(cfg), indent=2) + "\n")
    marker["complete"] = True
    marker["seconds"] += time.perf_counter() - began
    outdir.write_json(os.path.join(folder, MARKER_NAME), marker)
    return marker


def _write_shard(path: str, specs: list, by_name: dict, real_expert_layers: list[int], seed: int) -> None:
    """One shard under a temporary name, renamed into place when complete: its header, then each
    payload in header order, a hole skipped over (never written)."""
    import torch

    from ..core.cachedir import current_umask
    from .headers import encode_header
    from .synthetic import random_fill

    holes = {s.name for s in specs if is_hole(s.name, real_expert_layers)}
    experts = {s.name for s in specs if ".ffn.experts." in s.name and s.name not in holes}
    dense = [s for s in specs if s.name not in holes and s.name not in experts]
    header, entries = encode_header([(s.name, s.dtype, s.shape) for s in specs])
    fill, g = random_fill(seed), torch.Generator().manual_seed(seed)
    tensors = fill(dense, by_name)
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(header)
        for e in entries:
            if e.name in holes:
                f.seek(e.end - e.begin, os.SEEK_CUR)
                continue
            if e.name in tensors:
                t = tensors.pop(e.name).contiguous()
            elif e.dtype == "I8":  # a real expert's packed FP4 weight
                t = torch.randint(-128, 128, e.shape, dtype=torch.int8, generator=g)
            else:  # its E8M0 scales, in random_fill's range
                t = torch.randint(121, 125, e.shape, dtype=torch.uint8, generator=g)
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.truncate(f.tell())  # a shard that ends in a hole still has its full length
    os.chmod(partial, 0o666 & ~current_umask())
    os.replace(partial, path)


def _layer_list(text: str) -> list[int]:
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of layer numbers, e.g. 3,4; got {text!r}") from None


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 make-synthetic",
        description=(
            "Write a checkpoint of the whole released geometry in the exact release layout (48 shards, 96,085 "
            "tensors, 475 GiB apparent) that takes about 11 GiB of disk: dense tensors random and plausibly scaled, "
            "routed experts and Engram tables as holes in sparse files (they read back as zeros). Run again on the "
            "same folder, it finishes an interrupted write or reuses a finished one."
        ),
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write: new, empty, or one make-synthetic wrote")
    parser.add_argument(
        "--real-experts",
        type=_layer_list,
        default=[],
        metavar="LAYERS",
        help="give these layers' routed experts random bytes on disk (e.g. 3,4: 6.9 GiB each), "
        "so reads of them can be measured",
    )
    parser.add_argument(
        "--small", action="store_true", help="the released layer plan at tiny widths (under 0.2 GiB on disk), for tests"
    )
    parser.add_argument("--seed", type=int, default=0, help="value seed (default 0)")
    args = parser.parse_args(argv)
    if not 0 <= args.seed < 2**31:
        parser.error(f"--seed must be a whole number from 0 to {2**31 - 1:,}")
    try:
        marker = write_released_synthetic(
            args.out_dir,
            small=args.small,
            real_expert_layers=args.real_experts,
            seed=args.seed,
            progress=sys.stderr.isatty(),
        )
    except Dsv41Error as exc:
        print(f"dsv41 make-synthetic: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"dsv41 make-synthetic: cannot write {exc.filename or args.out_dir} ({exc.strerror}); run it again "
            "to finish, or give another folder",
            file=sys.stderr,
        )
        return 1
    print(
        f"{os.path.abspath(args.out_dir)}: {marker['apparent_bytes'] / 2**30:.2f} GiB apparent, "
        f"{marker['on_disk_bytes'] / 2**30:.2f} GiB on disk, written in {marker['seconds']:.0f} s"
    )
    return 0
