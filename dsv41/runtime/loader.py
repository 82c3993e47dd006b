"""Loading a checkpoint: the steps from a directory to a `model.Model` ready to run.

`dsv41.load(path)` resolves the directory (default: the embedded checkpoint, built on first use),
joins the expert-parallel group when asked, reads and verifies the config, opens the shards
(`checkpoint.Checkpoint`: headers checked, nothing read yet), checks every tensor header against
`dsv41.checkpoint.inventory` (a missing or mis-shaped tensor is an error naming it), sets torch's threads
(`dsv41.core.threads`), builds an empty `model.Model` and fills its dense parameters by name, in the
dtypes the released runtime holds them (`report.runtime_dtype`). The vision tower (`vision.*`,
`aligner.*` and the span delimiters) is part of the dense tree. With `mtp.*` stages in the
checkpoint and dspark_block_size > 0 it builds and fills the DSpark draft stack too, which
speculative generation runs (`dspark=False` leaves the stages on disk).

Two families never enter memory at load time (`dsv41.checkpoint.stores`): the routed experts, which an
`ExpertCache` reads per layer on demand and keeps packed, and the Engram tables, whose rows are
read from the shard on each forward (or from RAM with `resident_engram=True`).

What the load did is returned as `model.report`, a `report.LoadReport`: every checkpoint tensor
accounted for as loaded, left on disk on purpose, or unexpected, with the bytes retained next to
the bytes `report.predict_retained_bytes` derives from the inventory alone.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..checkpoint.checkpoint import Checkpoint, LoadError, read_json
from ..checkpoint.eviction import DEFAULT_POLICY, EXPERT_POLICIES
from ..checkpoint.formats import DTYPE_NAMES, SAFETENSORS_DTYPES, dequantize
from ..checkpoint.inventory import expected_tensors, is_vision_name
from ..checkpoint.miniature import describe as describe_embedded
from ..checkpoint.stores import (
    DEFAULT_EXPERT_CACHE,
    ExpertCache,
    OnDiskEngramTable,
    OwnedExpertStore,
    ResidentEngramTable,
    SlotCache,
)
from ..core.config import Config, ConfigError, load_config
from ..core.numerics import Numerics
from ..core.text import brief, is_whole, json_kind, named
from ..core.threads import apply_threads, check_threads
from ..kernels.experts import expert_devices
from ..model.attention import check_cache_format
from ..model.model import Model
from .budget import budget_bytes, check_machine, plan_budget
from .report import (
    MTP,
    ROUTED,
    UNEXPECTED,
    LoadReport,
    disposition,
    predict_draft_bytes,
    predict_retained_bytes,
    settle_buckets,
    unique_bytes,
)

# Attention caches are sized for this many positions unless asked otherwise (the released config
# allows a million, whose caches alone would not fit a host).
DEFAULT_MAX_SEQ_LEN = 4096
# The caches hold one row per sequence; generation here runs one (larger batches are for tests).
MAX_BATCH_SIZE = 64


@dataclass(frozen=True)
class CacheOptions:
    """What `load`'s cache keywords ask for, checked: the attention caches sized for `max_seq_len` positions (None:
    min(config, DEFAULT_MAX_SEQ_LEN)) of `max_batch_size` rows, `cache_format` "packed" (the stored
    FP8 / FP4 formats with their scales) or "bf16" (the reference runtime's BF16 buffers; the
    logits are the same bit for bit), and `undo_calls`, how many calls `sequence.rollback` can undo."""

    max_seq_len: Optional[int] = None
    max_batch_size: int = 1
    undo_calls: int = 64
    cache_format: str = "packed"

    def check(self) -> None:
        """LoadError for a value no config can make right (max_seq_len is checked against the config)."""
        try:
            check_cache_format(self.cache_format)
        except ValueError as exc:
            raise LoadError(str(exc)) from None
        if not is_whole(self.max_batch_size) or not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise LoadError(f"max_batch_size must lie in [1, {MAX_BATCH_SIZE}], got {self.max_batch_size}")
        if not is_whole(self.undo_calls) or self.undo_calls < 0:
            raise LoadError(f"undo_calls must be a whole number >= 0, got {brief(self.undo_calls)}")


@dataclass(frozen=True)
class Placement:
    """Where the two families that never enter memory at load time live: the routed experts
    (`expert_device`: "cpu", "cuda", "cuda:1" or a list of CUDA devices, experts spread round-robin;
    `expert_cache`: packed experts kept per layer; `expert_parallel`: this process is one rank of a
    torch.distributed group and holds only its share) and the Engram tables (`resident_engram`:
    copied into RAM instead of read from the shards on each forward). `memory` (bytes, or a size such as
    "16GiB", at most the machine's memory) replaces the count with a budget: `budget.plan_budget`
    gives what the dense part, the caches, the draft stack and the process leave to a
    `stores.SlotCache` of whole expert slots, read from disk with positioned reads and freed by
    `expert_policy` ("lru" or "decay", `eviction`; checked with or without a budget); host memory only.
    `read_ahead`: under a budget, each layer names the next layer's likely experts to read while it
    computes (`stores.SlotCache`). Off by default: on a machine whose reads cost CPU time (two cores
    copying from the page cache) the reads slow the compute they overlap more than they save;
    `dsv41 bench whole` measures both ways in one run."""

    expert_device: Any = "cpu"
    expert_cache: int = DEFAULT_EXPERT_CACHE
    expert_parallel: bool = False
    resident_engram: bool = False
    memory: Any = None
    expert_policy: str = DEFAULT_POLICY
    read_ahead: bool = False


def load(
    path: Optional[str] = None,
    *,
    numerics: Optional[Numerics] = None,
    max_seq_len: Optional[int] = None,
    max_batch_size: int = 1,
    undo_calls: int = 64,
    cache_format: str = "packed",
    expert_device: Any = "cpu",
    expert_cache: int = DEFAULT_EXPERT_CACHE,
    expert_parallel: bool = False,
    resident_engram: bool = False,
    memory: Any = None,
    expert_policy: str = DEFAULT_POLICY,
    read_ahead: bool = False,
    threads="auto",
    dspark: bool = True,
    quiet: bool = False,
) -> Model:
    """Load a checkpoint directory (default: the embedded one) -> `model.Model`, its `report` the
    LoadReport.

    numerics: a `Numerics`, the only arithmetic option (default `Numerics()`, the
    released runtime's arithmetic; `Numerics.parity()` for a prefill that equals token-by-token
    decoding until a top-k cuts; `Numerics(pad_f32_rows=True)` and the like for one field).
    The attention caches (see `CacheOptions`): max_seq_len, max_batch_size, undo_calls,
    cache_format. Where the routed experts and the Engram tables live (see `Placement`):
    expert_device, expert_cache, expert_parallel, resident_engram, memory, expert_policy,
    read_ahead. Under expert_parallel the group is joined, or started from torchrun's environment,
    the rank computes the routed experts e with e % world_size == rank (`dsv41.runtime.distributed`; a
    plain "cuda" expert_device then means the rank's own GPU) and the logits equal one process's
    bit for bit; without a usable GPU one line on stderr says so and the CPU's fused path runs the
    experts. threads: torch's intra-op threads for the whole process, which the native expert
    kernel uses too: "auto" (default, `threads.auto_threads`), a whole number, or None to leave
    torch as it is (the report's summary says which). dspark: build the DSpark draft stack
    (`Model.draft`, speculative generation) when the checkpoint has `mtp.*` stages and
    dspark_block_size > 0 (False leaves them on disk, "not run"). quiet: no progress bar (drawn
    only on a terminal) or report on stderr.

    Raises LoadError (one sentence) on a bad checkpoint or a bad argument, and
    `distributed.ExpertParallelError` when the expert-parallel group cannot start."""
    caches = CacheOptions(
        max_seq_len=max_seq_len, max_batch_size=max_batch_size, undo_calls=undo_calls, cache_format=cache_format
    )
    placement = Placement(
        expert_device=expert_device,
        expert_cache=expert_cache,
        expert_parallel=expert_parallel,
        resident_engram=resident_engram,
        memory=memory,
        expert_policy=expert_policy,
        read_ahead=read_ahead,
    )
    began = time.perf_counter()
    numerics = _checked_numerics(numerics)
    _check_threads(threads)
    caches.check()
    _check_placement(placement)
    ranks = start_expert_parallel() if placement.expert_parallel else None
    devices = expert_placement(placement.expert_device, ranks)  # prints the one fallback line when CUDA is absent
    path = checkpoint_path(path, progress=not quiet, ranks=ranks)
    cfg = read_config(path)
    max_seq_len = cache_length(caches.max_seq_len, cfg)  # before any cache is sized
    ckpt = Checkpoint(path)
    buckets = check_tensors(cfg, ckpt)
    budget = None
    if placement.memory is None:
        experts = _expert_cache(ckpt, placement.expert_cache, devices, cfg)
    else:
        budget, experts = _slot_cache(ckpt, placement, devices, cfg, caches, max_seq_len, dspark)
    tokenizer, tok_meta = load_tokenizer(path, cfg)
    hasher = _hasher(cfg, tokenizer, path)
    n_threads, threads_choice = apply_threads(threads, cfg)  # once the checkpoint checks out; before the fill
    report = LoadReport(
        checkpoint=ckpt.path, threads=n_threads, threads_choice=threads_choice, embedded=describe_embedded(path)
    )
    if budget is not None:
        report.budget = (
            f"{budget.line()}; expert policy {experts.policy}, misses read with {experts.reader} "
            f"on {experts.io_threads} threads, {experts.page_cache}"
        )
        report.budget_plan = budget.as_dict()
    sizing = dict(
        numerics=numerics,
        max_batch_size=caches.max_batch_size,
        max_seq_len=max_seq_len,
        cache_format=caches.cache_format,
    )
    with torch.no_grad():
        model = Model(
            cfg, **sizing, tokenizer=tokenizer, tokenizer_meta=tok_meta, hasher=hasher, undo_calls=caches.undo_calls
        )
        read = fill_parameters(model.backbone, ckpt, report, quiet)
        stack = None
        if dspark and cfg.n_mtp_layers and cfg.dspark_block_size:
            stack, draft_read = _draft_stack(model, ckpt, report, quiet, sizing)
            read |= draft_read
    if stack is not None:
        _attach_draft(model, stack, experts, buckets)
    tables = engram_tables(ckpt, cfg, placement.resident_engram, report)
    store, routed = (experts, None) if ranks is None else _expert_parallel(experts, ranks, buckets, ckpt, report)
    model.attach(store, tables, routed)
    _measure(report, model, stack, settle_buckets(buckets, read), read, began)
    model.report, model.checkpoint = report, ckpt
    if not quiet:
        print(report.summary(), file=sys.stderr)
    return model


def sibling(model: Model, numerics: Optional[Numerics] = None) -> Model:
    """The same loaded checkpoint under other numerics (e.g. `Numerics.parity()`), holding no copy
    of it: the new model's parameters are `model`'s own tensors, and it reads the same expert store
    and Engram tables; only its attention caches and sequence are its own. For comparing two
    arithmetics where two loads would not fit (the released dense weights are 12.6 GB). The two
    take turns: one model's forward at a time, as everything in a notebook runs."""
    from ..model.layers import parameters_on_meta

    numerics = _checked_numerics(numerics)
    if not isinstance(model, Model) or model.experts is None:
        raise LoadError(f"sibling() takes a model dsv41.load returned, got {brief(model)}")
    if isinstance(model.experts, OwnedExpertStore):
        raise LoadError("sibling() cannot share an expert-parallel rank's store; load the model again instead")
    bb = model.backbone
    sizing = dict(
        numerics=numerics, max_batch_size=bb.max_batch_size, max_seq_len=bb.max_seq_len, cache_format=bb.cache_format
    )
    with torch.no_grad():
        with parameters_on_meta():  # built without weights: they are assigned from `model` below
            twin = Model(
                model.cfg,
                **sizing,
                tokenizer=model.tokenizer,
                tokenizer_meta=model.tokenizer_meta,
                hasher=model.hasher,
                undo_calls=model.undo_records.maxlen,
            )
        twin.backbone.load_state_dict(dict(bb.named_parameters()), strict=True, assign=True)
        if model.draft_stack is not None:
            from ..model.dspark import DraftStack

            with parameters_on_meta():
                stack = DraftStack(twin.cfg, twin.backbone.embed, twin.backbone.head, **sizing)
            stack.load_state_dict(dict(model.draft_stack.named_parameters()), strict=True, assign=True)
            _attach_draft(twin, stack, model.experts, {})
    twin.attach(model.experts, model.engram_tables)
    twin.report, twin.checkpoint = model.report, model.checkpoint
    return twin


# ---------------------------------------------------------------------- the steps, in order
def _checked_numerics(numerics) -> Numerics:
    if numerics is None:
        return Numerics()
    if not isinstance(numerics, Numerics):
        raise LoadError(
            f"numerics must be a Numerics value (Numerics(), Numerics.parity(), Numerics(...)), got {brief(numerics)}"
        )
    return numerics


def _check_threads(threads) -> None:
    """The threads argument, checked before anything is read."""
    try:
        check_threads(threads)
    except ValueError as exc:
        raise LoadError(str(exc)) from None


def _check_placement(placement: Placement) -> None:
    """What a placement asks for that no checkpoint can make right, refused before anything is read:
    an expert policy it does not know (with or without a budget), a budget that is not a size, or
    one above the memory this machine has (`budget.check_machine`)."""
    policy = placement.expert_policy
    if not isinstance(policy, str) or policy not in EXPERT_POLICIES:
        raise LoadError(f"expert_policy must be one of {', '.join(EXPERT_POLICIES)}, got {brief(policy)}")
    if placement.memory is not None:
        check_machine(budget_bytes(placement.memory))


def start_expert_parallel():
    """This process's `distributed.RankView`: the group already joined, else one started from
    torchrun's environment. Every way it fails is one ExpertParallelError."""
    from . import distributed

    try:
        return distributed.init()
    except distributed.ExpertParallelError:
        raise
    except (RuntimeError, ValueError) as exc:  # the group could not start (rendezvous, backend)
        raise distributed.ExpertParallelError(
            f"the expert-parallel group did not start: {distributed.one_line(exc)}"
        ) from None


def expert_placement(expert_device, ranks=None, *, option: str = "expert_device") -> list[torch.device]:
    """The devices routed experts are held on (`kernels.experts.expert_devices`); under expert
    parallelism a plain "cuda" means the rank's own GPU. LoadError for a device that names nothing
    or cannot be used, naming `option` (the CLI's flag, or load's keyword)."""
    if ranks is not None and isinstance(expert_device, str) and expert_device == "cuda" and torch.cuda.is_available():
        # each rank computes its experts on its own GPU (ranks share them round-robin past the count)
        expert_device = f"cuda:{ranks.local_rank % torch.cuda.device_count()}"
    try:
        return expert_devices(expert_device)
    except RuntimeError:  # torch.device's own refusal of the string
        raise LoadError(
            f"{option} {expert_device!r} is not a torch device name (try cpu, cuda or cuda:0,cuda:1)"
        ) from None
    except ValueError as exc:
        raise LoadError(f"{option} {expert_device!r} is not usable: {exc}") from None


def checkpoint_path(path: Optional[str], *, progress: bool = True, ranks=None) -> str:
    """`path`, or the embedded default checkpoint (`miniature.embedded_checkpoint`: the packaged
    trained miniature, else the random tiny one, built into the cache folder on first use; under
    expert parallelism rank 0 builds it once and the other ranks then find it). LoadError when
    the cache folder cannot hold it, or when a folder's miniature manifest claims sizes and sha256s
    its files do not have (`miniature.verify`)."""
    from ..checkpoint.miniature import MiniatureError, embedded_checkpoint, verify
    from ..core.cachedir import CacheError

    try:
        if path is not None:
            verify(path)
            return path
        if ranks is None:
            return embedded_checkpoint(progress=progress)
        from . import distributed

        return distributed.main_first(lambda: embedded_checkpoint(progress=progress and ranks.is_main))
    except (CacheError, MiniatureError) as exc:
        raise LoadError(str(exc)) from None


def read_config(path: str) -> Config:
    """The checkpoint's config, read and verified; LoadError naming the file otherwise."""
    if not os.path.isdir(path):
        raise LoadError(f"{path}: not a checkpoint directory")
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        raise LoadError(str(exc)) from None
    problems = cfg.verify()
    if problems:
        raise LoadError(
            named(str(cfg.source), problems[0])
            + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
        )
    return cfg


def cache_length(max_seq_len: Optional[int], cfg: Config) -> int:
    """The positions the attention caches are sized for: `max_seq_len`, at most the config's
    (a length past it would allocate for nothing), by default min(config, DEFAULT_MAX_SEQ_LEN)."""
    if max_seq_len is not None and not (is_whole(max_seq_len) and 1 <= max_seq_len <= cfg.max_seq_len):
        raise LoadError(
            f"max_seq_len must lie in [1, {cfg.max_seq_len}] (the config's max_position_embeddings), got {max_seq_len}"
        )
    return int(max_seq_len or min(cfg.max_seq_len, DEFAULT_MAX_SEQ_LEN))


def _expert_cache(ckpt: Checkpoint, capacity: int, devices, cfg: Config) -> ExpertCache:
    try:
        return ExpertCache(ckpt, capacity, devices, n_layers=cfg.n_layers)
    except (TypeError, ValueError) as exc:
        raise LoadError(str(exc)) from None


def _slot_cache(
    ckpt: Checkpoint, placement: Placement, devices, cfg: Config, caches: CacheOptions, max_seq_len: int, dspark: bool
):
    """(the budget plan, the SlotCache it sizes) for `placement.memory`."""
    if any(d.type != "cpu" for d in devices):
        raise LoadError(
            "memory= sizes a host-memory expert cache; use expert_device='cpu' with it, or "
            "expert_cache=N for experts on a GPU"
        )
    plan = plan_budget(
        cfg,
        placement.memory,
        max_seq_len=max_seq_len,
        max_batch_size=caches.max_batch_size,
        dspark=dspark,
        cache_format=caches.cache_format,
    )
    if not isinstance(placement.read_ahead, bool):
        raise LoadError(f"read_ahead must be True or False, got {placement.read_ahead!r}")
    return plan, SlotCache(
        ckpt, plan.slots, policy=placement.expert_policy, n_layers=cfg.n_layers, read_ahead=placement.read_ahead
    )


def _hasher(cfg: Config, tokenizer, path: str):
    """The Engram n-gram hasher over the checkpoint's tokenizer (None without Engram layers)."""
    from ..checkpoint.engram import EngramError, NgramHasher

    try:
        return NgramHasher.from_tokenizer(cfg, tokenizer) if cfg.engram_layer_ids else None
    except EngramError as exc:
        raise LoadError(named(path, str(exc))) from None


def check_tensors(cfg: Config, ckpt: Checkpoint) -> dict[str, str]:
    """Compare every header against the inventory; returns name -> bucket for the checkpoint's
    tensors (UNEXPECTED for names the inventory does not list). Missing, mis-typed or mis-shaped
    tensors raise LoadError naming them."""
    try:
        specs = expected_tensors(cfg)
    except ValueError as exc:
        raise LoadError(named(str(cfg.source), str(exc))) from None
    problems = []
    for spec in specs:
        if spec.name not in ckpt:
            problems.append(f"tensor {spec.name} is missing (expected in {spec.shard})")
        elif ckpt.shape(spec.name) != spec.shape or ckpt.dtype(spec.name) != spec.dtype:
            problems.append(
                f"tensor {spec.name} is {ckpt.dtype(spec.name)} {list(ckpt.shape(spec.name))}, "
                f"the config implies {spec.dtype} {list(spec.shape)}"
            )
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise LoadError(f"{ckpt.path}: " + "; ".join(problems[:3]) + more)
    expected = {spec.name for spec in specs}
    return {name: (disposition(name) if name in expected else UNEXPECTED) for name in ckpt.names()}


def load_tokenizer(path: str, cfg: Config):
    """The checkpoint's tokenizer.json (and tokenizer_config.json), checked against the config."""
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise LoadError(
            f"{path}: no tokenizer.json beside the shards; the Engram hash needs the checkpoint's tokenizer"
        )
    try:
        tok = Tokenizer.from_file(file)
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise LoadError(f"{file}: not a tokenizer this tokenizers version can read ({exc})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise LoadError(
            f"{file}: the tokenizer has {size} ids but the config's vocab_size is {cfg.vocab_size}; "
            f"they belong to different models"
        )
    meta = {}
    meta_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(meta_file):
        meta = read_json(meta_file)
        if not isinstance(meta, dict):
            raise LoadError(
                f"{meta_file}: holds {json_kind(meta)}, not an object of tokenizer settings; download it again"
            )
    for role in ("bos", "eos", "pad"):
        key = f"{role}_token"
        text, want = meta.get(key), getattr(cfg, f"{role}_token_id")
        if isinstance(text, dict):
            text = text.get("content")
        if text is not None and not isinstance(text, str):
            raise LoadError(
                f"{meta_file}: {key} is {json_kind(text)} ({brief(text)}), not the token's "
                f'text; write it as a string (or {{"content": string}}) as tokenizer.json spells it'
            )
        if text is None or want is None:
            continue
        got = tok.token_to_id(text)
        if got != want:
            raise LoadError(
                f"{meta_file}: the {role} token {text!r} has id {got} in tokenizer.json but the config "
                f"says {role}_token_id {want}; the tokenizer and the config disagree"
            )
    return tok, meta


def fill_parameters(backbone, ckpt: Checkpoint, report: LoadReport, quiet: bool) -> set[str]:
    """Copy every parameter of `backbone` from the checkpoint tensor of the same name, converting
    to the dtype the model holds it in; returns the names read (scales consumed included)."""
    params = dict(backbone.named_parameters())
    read: set[str] = set()
    with _progress(len(params), quiet) as bar:
        for name, param in params.items():
            _fill_one(name, param, params, ckpt, report, read)
            bar.update(1)
    return read


def _progress(total: int, quiet: bool):
    """A bar over `total` tensors on stderr, cleared when it closes, drawn only on a terminal: a
    captured or redirected stderr would keep its first frame ("0%| 0/287") as text. No bar over
    nothing. Use it as a context manager, so a load that fails closes it too."""
    from tqdm import tqdm

    shown = not quiet and total > 0 and _is_terminal(sys.stderr)
    return tqdm(total=total, desc="loading", unit="tensor", file=sys.stderr, disable=not shown, leave=False)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _fill_one(name: str, param, params: dict, ckpt: Checkpoint, report: LoadReport, read: set[str]) -> None:
    """Copy checkpoint tensor `name` into `param` (see `fill_parameters`), adding what it read to `read`."""
    if name not in ckpt:
        raise LoadError(f"{ckpt.path}: the model needs tensor {name}, which the checkpoint does not hold")
    if _copy_in_slabs(ckpt, name, param):  # a large tensor never exists twice in full
        read.add(name)
        report.bytes_read += ckpt.nbytes(name)
        report.parameters_filled += 1
        if ckpt.dtype(name) != DTYPE_NAMES[param.dtype]:
            report.dequantized.append((name, ckpt.dtype(name), DTYPE_NAMES[param.dtype]))
        return
    stored = ckpt.read(name)
    read.add(name)
    report.bytes_read += ckpt.nbytes(name)
    if stored.dtype in (torch.int8, torch.uint8) and param.dtype == torch.float4_e2m1fn_x2:
        stored = stored.view(torch.float4_e2m1fn_x2)
    if stored.dtype != param.dtype:
        scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        if stored.dtype == torch.float8_e4m3fn and scale_name in ckpt and scale_name not in params:
            stored = dequantize(stored, ckpt.read(scale_name), dtype=param.dtype)
            read.add(scale_name)
            report.bytes_read += ckpt.nbytes(scale_name)
            report.dequantized.append((name, ckpt.dtype(name), DTYPE_NAMES[param.dtype]))
        elif stored.is_floating_point() and stored.element_size() >= 2 and param.is_floating_point():
            stored = stored.to(param.dtype)  # a promotion (bf16 -> float32), exact
            report.dequantized.append((name, ckpt.dtype(name), DTYPE_NAMES[param.dtype]))
        else:
            raise LoadError(
                f"{ckpt.path}: tensor {name} is {ckpt.dtype(name)} but the model holds it as "
                f"{param.dtype}, and there is no conversion between them"
            )
    if tuple(stored.shape) != tuple(param.shape):
        raise LoadError(
            f"{ckpt.path}: tensor {name} has shape {list(stored.shape)}, the model expects {list(param.shape)}"
        )
    param.copy_(stored)
    report.parameters_filled += 1


# A tensor larger than this is read into its parameter a slab of rows at a time, so the embedding
# and the FP32 head never exist twice in full (a stored copy beside the parameter).
SLAB_BYTES = 128 << 20


def _copy_in_slabs(ckpt: Checkpoint, name: str, param) -> bool:
    """Fill `param` from tensor `name` slab by slab when it is large, 2-D, of the same shape and
    either the same dtype or a floating promotion (bf16 -> float32); False leaves it to the plain path."""
    stored = SAFETENSORS_DTYPES.get(ckpt.dtype(name))
    promotion = stored in (torch.bfloat16, torch.float16) and param.dtype == torch.float32
    if (
        ckpt.nbytes(name) <= SLAB_BYTES
        or len(ckpt.shape(name)) != 2
        or tuple(ckpt.shape(name)) != tuple(param.shape)
        or not (stored == param.dtype or promotion)
    ):
        return False
    rows = max(1, SLAB_BYTES // max(1, ckpt.nbytes(name) // param.shape[0]))
    for r0 in range(0, param.shape[0], rows):
        param[r0 : r0 + rows].copy_(ckpt.read_slab(name, r0, min(param.shape[0], r0 + rows)))  # exact: same or wider
    return True


def _draft_stack(model: Model, ckpt: Checkpoint, report: LoadReport, quiet: bool, sizing: dict):
    """(the DSpark draft stack over the model's embedding and head, the `mtp.*` names its fill read)."""
    from ..model.dspark import DraftStack

    stack = DraftStack(model.cfg, model.backbone.embed, model.backbone.head, **sizing)
    return stack, fill_parameters(stack, ckpt, report, quiet)


def _attach_draft(model: Model, stack, experts: ExpertCache, buckets: dict[str, str]) -> None:
    """The draft's own experts (mtp.N.ffn.experts.*) are read through the same store, so they are
    routed experts now, no longer stages left on disk."""
    stack.attach_store(experts)
    model.attach_draft(stack)
    for name, bucket in buckets.items():
        if bucket == MTP and ".ffn.experts." in name:
            buckets[name] = ROUTED


def engram_tables(ckpt: Checkpoint, cfg: Config, resident: bool, report: LoadReport) -> dict:
    """Each Engram layer's table: left in its shard and read row by row, or copied into RAM (`resident`)."""
    tables = {}
    for layer in cfg.verified().engram_layer_ids:  # read_config verified it: () without Engram
        if not resident:
            tables[layer] = OnDiskEngramTable(ckpt, layer)
            continue
        table = tables[layer] = ResidentEngramTable(ckpt, layer)
        report.resident_engram_bytes += table.nbytes
        for suffix in ("weight", "scale"):
            report.bytes_read += ckpt.nbytes(f"layers.{layer}.engram.embed.{suffix}")
    return tables


def _expert_parallel(experts: ExpertCache, ranks, buckets: dict[str, str], ckpt: Checkpoint, report: LoadReport):
    """(store, routed) for one rank of the group: a store of the experts it owns, and the MoE
    layers' routed half that exchanges pair outputs (one set of counters for every layer)."""
    import functools

    from . import distributed

    report.count_routed_share(ranks, buckets, ckpt.nbytes)
    routed = functools.partial(distributed.ExpertParallelExperts, ranks=ranks, counters=distributed.ExchangeCounters())
    return OwnedExpertStore(experts, ranks), routed


def _measure(report: LoadReport, model: Model, stack, buckets: dict[str, str], read: set[str], began: float) -> None:
    """The report's buckets and what the built model holds, beside the inventory's predictions."""
    cfg = model.cfg
    report.tensors = buckets
    report.tensors_read = len(read)
    report.bytes_retained = unique_bytes(model.backbone.parameters())
    report.vision_bytes_retained = unique_bytes(
        p for name, p in model.backbone.named_parameters() if is_vision_name(name)
    )
    report.draft_bytes_retained = 0 if stack is None else unique_bytes(stack.parameters())
    report.predicted_draft_bytes = 0 if stack is None else predict_draft_bytes(cfg)
    report.predicted_bytes_retained = predict_retained_bytes(cfg)["bytes"]
    report.state_bytes = unique_bytes(model.backbone.buffers())
    report.seconds = time.perf_counter() - began
