"""The trained miniature written in the release format: both configs, the index, the shards with
FP8 block-scaled dense weights, FP4 E2M1 experts and E8M0 scales (`tiny.stored_tensors`, the
random checkpoint's own writer), the tokenizer, and `dsv41-miniature.json`: the corpus, the seed,
the steps, the losses and the training seconds, with each file's size and sha256."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from ..checkpoint.miniature import MANIFEST_FORMAT, MANIFEST_NAME, MiniatureError, verify

if TYPE_CHECKING:  # annotations only
    from ..core.config import Config


def write_miniature(folder: str, cfg: Config, tokenizer, params: dict, facts: dict) -> str:
    """Write the checkpoint of `params` (name -> float32, logical shapes) into `folder`, built
    beside it and renamed into place (`outdir.replace_folder`: an earlier checkpoint there is
    removed only once the new one has its place; the work folder's claim has checked that it holds
    nothing else); returns the folder."""
    from ..checkpoint.synthetic import write_release_layout
    from ..checkpoint.tiny import stored_tensors
    from ..core.cachedir import file_sha256
    from ..core.outdir import replace_folder

    folder = os.path.realpath(folder)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", suffix=".partial", dir=parent)
    try:
        write_release_layout(
            tmp,
            cfg,
            lambda specs, by_name: stored_tensors(
                specs, by_name, lambda name, shape: params[name].detach().float().reshape(shape)
            ),
            tokenizer=tokenizer,
        )
        files = {}
        for root, _, names in os.walk(tmp):
            for name in sorted(names):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, tmp).replace(os.sep, "/")
                files[rel] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
        manifest = {"format": MANIFEST_FORMAT, **facts, "files": dict(sorted(files.items()))}
        with open(os.path.join(tmp, MANIFEST_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the packaged folder from other users
        replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def write_initialization(folder: str, source: str) -> tuple[str, int]:
    """(the folder, the seed): the trainer's random initialization (`masters.initialized_params`, step 0 of
    a run) for the tokenizer and seed of the miniature checkpoint at `source`, written in the
    release format like a trained one, so a measure that loads checkpoints sets the two side by
    side. MiniatureError when `source` holds no miniature manifest."""
    from .masters import initialized_params
    from .workdir import TOKENIZER_NAME, miniature_tokenizer

    manifest = verify(source)
    if manifest is None or "seed" not in manifest:
        raise MiniatureError(
            f"{source} is not a miniature checkpoint with a seed in its manifest (dsv41-miniature.json); "
            "the random initialization is made for one, such as the embedded miniature or what dsv41 train wrote"
        )
    tokenizer, cfg = miniature_tokenizer(os.path.join(source, TOKENIZER_NAME))
    seed = manifest["seed"]
    params = initialized_params(cfg, seed)
    facts = {"seed": seed, "steps": 0, "training_seconds": 0.0, "random_initialization_of": os.path.realpath(source)}
    return write_miniature(folder, cfg, tokenizer, params, facts), seed
