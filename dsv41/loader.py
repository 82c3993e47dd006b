"""Loading a checkpoint: mapped shards, the dense tree filled, experts and Engram left where they are.

`dsv41.load(path)` reads the config, checks every tensor header against `dsv41.inventory` (a missing
or mis-shaped tensor is an error naming it), builds an empty `model.Model` and fills its dense
parameters by name, in the dtypes the released runtime holds them (`runtime_dtype`). Two families never enter
memory at load time: the routed experts, which an `ExpertCache` reads per layer on demand and keeps
packed (FP4 bytes and E8M0 scales, never expanded), and the Engram tables, whose rows are gathered
from the mapped shard on each forward (or from RAM with `resident_engram=True`). The vision tower
(`vision.*`, `aligner.*` and the span delimiters) is part of the dense tree, its RMSNorm weights
promoted to float32. The MTP / DSpark layers are left in the shards on purpose; nothing here runs them.

What the load did is returned as a `LoadReport`: every checkpoint tensor is accounted for as loaded,
left on disk on purpose, or unexpected, with the parameter count, the dequantizations and the bytes
retained, next to the bytes `predict_retained_bytes` derives from the inventory alone.

`threads=` sets torch's intra-op threads (process-wide; the native expert kernel runs on
`torch.get_num_threads()` too): "auto" (default) gives a model whose expert matrices are small
(`auto_threads`: under AUTO_THREADS_MIN_WEIGHTS weights each, as the embedded checkpoint's) one
thread, since their threads only hand tiny pieces of work back and forth, and anything larger
(the released geometry) every core; an int sets that many; None leaves torch alone. The report
says which it chose and why.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from .config import Config, ConfigError, load_config
from .formats import DTYPE_NAMES, SAFETENSORS_DTYPES, dequantize
from .headers import INDEX_NAME, HeaderError, read_header
from .inventory import DTYPE_SIZES, expected_tensors, is_vision_name
from .kernels.experts import PackedExpert, device_for, expert_devices
from .layers import activation_dtype
from .attention import check_cache_format
from .model import FetchedExperts, Model
from .numerics import Numerics
from .errors import Dsv41Error

# Default number of packed experts a layer keeps between forwards.
DEFAULT_EXPERT_CACHE = 16
# Attention caches are sized for this many positions unless asked otherwise (the released config
# allows a million, whose caches alone would not fit a host).
DEFAULT_MAX_SEQ_LEN = 4096
# The caches hold one row per sequence; generation here runs one (larger batches are for tests).
MAX_BATCH_SIZE = 64
# threads="auto": one intra-op thread below this many weights per expert matrix (dim x
# moe_inter_dim), every core at or above it. For the embedded checkpoint's 128 x 64 = 8,192,
# `dsv41 bench threads` on a shared two-core machine measured two threads at 0.14x-1.21x the
# tokens/s of one (a little faster with the second core idle, 7x slower with it busy): little to
# win, much to lose. The released 5,120 x 2,304 = 11,796,480 is far past it: a decode step's expert
# GEMVs are megabytes each, and the native kernel splits their rows over the threads (two threads
# measured up to 1.57x one there).
AUTO_THREADS_MIN_WEIGHTS = 1 << 22

LOADED, ROUTED, ENGRAM, MTP, UNEXPECTED = (
    "loaded", "routed experts (read on demand)", "Engram tables (rows gathered on demand)",
    "MTP / DSpark (not run)", "unexpected")
ON_DISK = (ROUTED, ENGRAM, MTP)


class LoadError(Dsv41Error, ValueError):
    """A checkpoint that cannot be loaded; the message is one sentence naming the file or tensor."""


# ---------------------------------------------------------------------- what stays where
def disposition(name: str) -> str:
    """Which report bucket a checkpoint tensor belongs to when the model is complete: LOADED or one
    of the on-disk reasons. (Whether it was actually read is checked separately.) The vision tower
    is loaded like the rest of the dense tree (`LoadReport.vision_bytes_retained` says its share)."""
    if name.startswith("mtp."):
        return MTP
    if ".ffn.experts." in name:
        return ROUTED
    if ".engram.embed." in name:
        return ENGRAM
    return LOADED


def runtime_dtype(name: str, stored: str, cfg: Config) -> Optional[str]:
    """The dtype (safetensors name) a loaded tensor is held in at runtime, or None when it is a
    scale consumed by dequantizing its weight. The released runtime dequantizes `attn.wo_a` to the
    activation dtype (it is applied by a grouped einsum, not a quantized GEMM), promotes the
    ratio > 1 compressor projections to float32 (the pooling runs in float32) and holds the head in
    float32 (so the logits come out float32). Everything else is held as stored."""
    act = DTYPE_NAMES[activation_dtype(cfg)]
    if name.endswith("attn.wo_a.scale"):
        return None
    if name.endswith("attn.wo_a.weight"):
        return act
    if ".attn.compressor.w" in name and name.endswith(".weight"):
        layer = int(name.split(".")[1])
        return "F32" if cfg.compress_ratios[layer] > 1 else stored
    if name == "head.weight" or name.endswith(("markov_head.head.weight", "confidence_head.proj.weight")):
        return "F32"  # logits and the draft's confidence come out in float32
    if name.startswith("vision.") and name.rsplit(".", 2)[-2].startswith("norm"):
        return "F32"  # the vision tower's RMSNorm weights: stored BF16, held float32 as the reference does
    return stored


def predict_retained_bytes(cfg: Config) -> dict:
    """What loading retains, from the inventory and `runtime_dtype` alone (no model is built):
    {'bytes', 'tensors' (parameters), 'by_category' {category: bytes}, 'on_disk_bytes'}."""
    total, count, by_category, on_disk = 0, 0, {}, 0
    for spec in expected_tensors(cfg):
        if disposition(spec.name) != LOADED:
            on_disk += spec.nbytes
            continue
        rt = runtime_dtype(spec.name, spec.dtype, cfg)
        if rt is None:
            continue
        nbytes = math.prod(spec.shape) * DTYPE_SIZES[rt]
        total += nbytes
        count += 1
        by_category[spec.category] = by_category.get(spec.category, 0) + nbytes
    return {"bytes": total, "tensors": count, "by_category": by_category, "on_disk_bytes": on_disk,
            "draft_bytes": predict_draft_bytes(cfg)}


def predict_draft_bytes(cfg: Config) -> int:
    """The DSpark draft stack's dense parameters as held (its experts are read on demand), from the
    inventory and `runtime_dtype`: what `LoadReport.draft_bytes_retained` measures."""
    total = 0
    for spec in expected_tensors(cfg):
        if spec.name.startswith("mtp.") and ".ffn.experts." not in spec.name:
            rt = runtime_dtype(spec.name, spec.dtype, cfg)
            total += 0 if rt is None else math.prod(spec.shape) * DTYPE_SIZES[rt]
    return total


def _named(path: str, message: str) -> str:
    """`message` as one sentence naming `path` once: messages from headers / config / engram often
    start with the file already, and prefixing it again would name it twice."""
    return message if message.startswith(path) else f"{path}: {message}"


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words (for messages)."""
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _brief(value, limit: int = 60) -> str:
    """A JSON value for a message: short, and never recursive (a damaged file can hold a megabyte
    string or an array nested a thousand deep)."""
    if isinstance(value, (list, dict)):
        return f"{_json_kind(value)} of {len(value):,} items" if value else ("[]" if isinstance(value, list) else "{}")
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def _read_json(path: str):
    """A JSON file's value, or LoadError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise LoadError(f"{path}: cannot be read ({exc.strerror}); check its permissions or download it "
                        "again") from None
    except UnicodeDecodeError:
        raise LoadError(f"{path}: not UTF-8 text, so not a JSON file; download it again") from None
    except json.JSONDecodeError as exc:
        raise LoadError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); download it again") from None
    except (ValueError, RecursionError) as exc:  # an integer too long to convert, nesting too deep
        raise LoadError(f"{path}: not JSON this reader accepts ({exc}); download it again") from None


def _plain_file_name(name: str) -> bool:
    """A file name inside the checkpoint directory: no separator, no '..', no absolute path."""
    return (bool(name) and "/" not in name and "\\" not in name and ".." not in name and "\0" not in name
            and os.sep not in name and (os.altsep is None or os.altsep not in name)
            and not os.path.isabs(name))


def _is_unicode(text: str) -> bool:
    """False for a string JSON decoded from an unpaired surrogate escape ("\\ud800"), which no file
    name or terminal can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _read_index(index: str) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> shard file name), checked."""
    doc = _read_json(index)
    if not isinstance(doc, dict):
        raise LoadError(f"{index}: holds {_json_kind(doc)}, not an object with a weight_map; download the index again")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        what = "no weight_map" if weight_map is None else f"a weight_map that is {_json_kind(weight_map)}"
        raise LoadError(f"{index}: has {what}, not an object of tensor name -> shard file; download the index again")
    for name, file in weight_map.items():
        if not isinstance(name, str) or not isinstance(file, str):
            raise LoadError(f"{index}: weight_map maps {_brief(name)} to {_json_kind(file)} ({_brief(file)}), not a "
                            "tensor name to a shard file name; download the index again")
        if not (_is_unicode(name) and _is_unicode(file)):
            raise LoadError(f"{index}: weight_map maps {_brief(name)} to {_brief(file)}, which holds an unpaired "
                            "surrogate escape and is not Unicode text; download the index again")
        if not _plain_file_name(file):
            shown = name if len(name) <= 120 else name[:116] + " ..."
            raise LoadError(f"{index}: tensor {shown} is listed in {_brief(file)}, which is not a file name in "
                            "the checkpoint directory (paths and '..' are refused); download the index again")
    return weight_map


def _read_shard_header(shard: str):
    """One shard's parsed header, or LoadError naming the shard once."""
    try:
        return read_header(shard)
    except HeaderError as exc:
        raise LoadError(_named(shard, str(exc))) from None
    except (ValueError, TypeError, RecursionError) as exc:  # read_header lets a few malformed headers through
        raise LoadError(f"{shard}: the header cannot be parsed ({type(exc).__name__}: {exc}); the file is damaged "
                        "or not a safetensors file, download it again") from None


def _extent_problem(shard: str, header) -> Optional[str]:
    """The first way a shard's tensors fail to tile its data area, as one sentence naming the shard
    and the tensor (None when they tile it): each tensor's span matches its dtype and shape, the
    spans follow each other without gap or overlap from byte 0, and nothing follows the last."""
    fix = "the shard is damaged, download it again"
    position, previous = 0, None
    for e in sorted(header.entries.values(), key=lambda e: (e.begin, e.end)):
        if e.nbytes != e.expected_nbytes:
            return (f"{shard}: tensor {e.name} is {e.dtype} {list(e.shape)} ({e.expected_nbytes:,} bytes) but its "
                    f"data_offsets span {e.nbytes:,} bytes; {fix}")
        if e.begin < position:
            return (f"{shard}: tensor {e.name} (data bytes {e.begin:,}-{e.end:,}) overlaps tensor {previous}, "
                    f"which ends at byte {position:,}; {fix}")
        if e.begin > position:
            where = f"after tensor {previous}" if previous is not None else "at the start of the data area"
            return (f"{shard}: tensor {e.name} starts at data byte {e.begin:,}, leaving a gap of "
                    f"{e.begin - position:,} unreferenced bytes {where}; {fix}")
        position, previous = e.end, e.name
    if position > header.data_size:
        return (f"{shard}: tensor {previous} runs past the end of the file (its data ends at byte {position:,}, the "
                f"file holds {max(header.data_size, 0):,}); the shard is truncated, download it again")
    if position < header.data_size:
        after = f"after the last tensor, {previous}," if previous is not None else "after the header"
        return (f"{shard}: {header.data_size - position:,} trailing bytes {after} belong to no tensor; {fix}")
    return None


# ---------------------------------------------------------------------- the mapped checkpoint
class Checkpoint:
    """The shards of a checkpoint directory, headers parsed, payloads mapped and read by name.

    `read(name)` copies one whole tensor out of the mapping; `rows(name, ids)` gathers rows of a 2-D
    tensor without touching the others. Nothing is read until asked for."""

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
        for file in files:
            shard = os.path.join(self.path, file)
            if not os.path.isfile(shard):
                raise LoadError(f"{shard}: listed in {INDEX_NAME} but missing; download it again")
            header = _read_shard_header(shard)
            problem = _extent_problem(shard, header)
            if problem:
                raise LoadError(problem)
            for name, entry in header.entries.items():
                earlier = self.entries.get(name)
                if earlier is not None:
                    raise LoadError(f"{self.path}: tensor {name} is stored in both {os.path.basename(earlier[0])} "
                                    f"and {file}; a tensor must live in one shard only, so remove the stray copy "
                                    "(or download the checkpoint again)")
                self.entries[name] = (shard, entry, header.data_start)
        if weight_map is not None:
            for name, file in weight_map.items():
                got = self.entries.get(name)
                if got is None or os.path.basename(got[0]) != file:
                    raise LoadError(f"{index}: tensor {name} is listed in {file}, but that shard does not hold it")
        self._open: dict[str, object] = {}
        self._maps: dict[str, np.memmap] = {}

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
        """One tensor, copied out of the mapping (packed FP4 comes back as int8, as stored)."""
        from safetensors import SafetensorError, safe_open

        shard = self.entries[name][0]
        try:
            handle = self._open.get(shard)
            if handle is None:
                handle = self._open[shard] = safe_open(shard, framework="pt")
            return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:  # e.g. the file changed on disk after its header was checked
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise LoadError(f"{shard}: tensor {name} cannot be read ({why}); the shard is damaged or changed "
                            "on disk, download it again") from None

    def rows(self, name: str, ids: np.ndarray) -> torch.Tensor:
        """Rows `ids` (any shape, int) of a 2-D tensor -> [*ids.shape, cols], read through a memory
        map: only the pages holding those rows are touched."""
        shard, entry, start = self.entries[name]
        table = self._maps.get(name)
        if table is None:
            row_bytes = math.prod(entry.shape[1:]) * DTYPE_SIZES[entry.dtype]
            try:
                table = np.memmap(shard, dtype=np.uint8, mode="r", offset=start + entry.begin,
                                  shape=(entry.shape[0], row_bytes))
            except (OSError, ValueError) as exc:  # the file shrank or vanished after its header was checked
                raise LoadError(f"{shard}: tensor {name} cannot be mapped ({exc}); the shard is damaged or "
                                "changed on disk, download it again") from None
            self._maps[name] = table
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= entry.shape[0]):
            raise IndexError(f"{name}: row ids must lie in [0, {entry.shape[0]}), got {flat.min()}..{flat.max()}")
        out = torch.from_numpy(np.ascontiguousarray(table[flat]))  # [n, row_bytes] uint8
        return out.view(SAFETENSORS_DTYPES[entry.dtype]).reshape(*np.shape(ids), *entry.shape[1:])


# ---------------------------------------------------------------------- routed experts
@dataclass
class CacheCounters:
    """Expert-cache hits and misses: totals per layer, and per step (one forward call)."""

    hits: dict[int, int] = field(default_factory=dict)
    misses: dict[int, int] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)  # {'start_pos', 'seqlen', 'layers': {layer: [hits, misses]}}

    def begin_step(self, start_pos: int, seqlen: int) -> None:
        self.steps.append({"start_pos": start_pos, "seqlen": seqlen, "layers": {}})

    def count(self, layer: int, hit: bool) -> None:
        bucket = self.hits if hit else self.misses
        bucket[layer] = bucket.get(layer, 0) + 1
        if self.steps:
            per = self.steps[-1]["layers"].setdefault(layer, [0, 0])
            per[0 if hit else 1] += 1

    def totals(self, layer: int) -> tuple[int, int]:
        return self.hits.get(layer, 0), self.misses.get(layer, 0)

    def reset(self) -> None:
        self.hits.clear()
        self.misses.clear()
        self.steps.clear()


class ExpertCache:
    """Routed experts read from the checkpoint on demand, with a bounded LRU window per layer.

    Experts are kept exactly as stored: packed FP4 weights (viewed as float4_e2m1fn_x2) and E8M0
    scales, about a quarter of their bf16 size; `capacity` experts per layer (0 keeps none).
    `device` is one device or a list (as resolved by `kernels.experts.expert_devices`), and each
    expert is placed by `kernels.experts.device_for`. Each requested expert counts as a hit or a miss
    for its layer and the current step, and `fetch` returns the call's own counts."""

    def __init__(self, checkpoint: Checkpoint, capacity: int = DEFAULT_EXPERT_CACHE, device="cpu",
                 n_layers: Optional[int] = None):
        if capacity < 0:
            raise ValueError(f"expert cache capacity must be >= 0, got {capacity}")
        specs = [device] if isinstance(device, (str, torch.device)) else list(device)
        if not specs:
            raise ValueError("the expert cache needs at least one device")
        self.checkpoint, self.capacity = checkpoint, int(capacity)
        self.n_layers = n_layers  # layers from n_layers on are the draft stages, stored as mtp.N
        self.devices = [torch.device(d) for d in specs]
        self.device = self.devices[0]
        self.counters = CacheCounters()
        self._lru: dict[int, OrderedDict] = {}

    def fetch(self, layer: int, expert_ids: Sequence[int]):
        """The packed experts `expert_ids` of `layer` (a `model.FetchedExperts`: a list, in the order
        asked, with this call's `hits` and `misses`)."""
        window = self._lru.setdefault(layer, OrderedDict())
        out = FetchedExperts()
        for e in expert_ids:
            packed = window.get(e)
            self.counters.count(layer, packed is not None)
            if packed is not None:
                out.hits += 1
                window.move_to_end(e)
            else:
                out.misses += 1
                packed = self._read(layer, e)
                if self.capacity:
                    window[e] = packed
                    while len(window) > self.capacity:
                        window.popitem(last=False)
            out.append(packed)
        return out

    def _read(self, layer: int, expert: int) -> PackedExpert:
        device = device_for(expert, self.devices)
        stage = layer - self.n_layers if self.n_layers is not None and layer >= self.n_layers else None
        prefix = f"layers.{layer}.ffn.experts.{expert}." if stage is None else f"mtp.{stage}.ffn.experts.{expert}."
        parts = []
        for w in ("w1", "w2", "w3"):
            weight, scale = self.checkpoint.read(prefix + w + ".weight"), self.checkpoint.read(prefix + w + ".scale")
            if weight.dtype in (torch.int8, torch.uint8):
                weight = weight.view(torch.float4_e2m1fn_x2)  # the stored bytes, two E2M1 values each
            parts += [weight.to(device), scale.to(device)]
        return PackedExpert(*parts)

    def cached(self, layer: int) -> list[int]:
        """Expert ids a layer currently holds, least recently used first."""
        return list(self._lru.get(layer, ()))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for window in self._lru.values() for p in window.values())

    def clear(self) -> None:
        self._lru.clear()


# ---------------------------------------------------------------------- Engram tables
class MappedEngramTable:
    """An Engram table left in its shard: each gather reads only the rows asked for."""

    def __init__(self, checkpoint: Checkpoint, layer: int):
        self.checkpoint = checkpoint
        self.weight_name = f"layers.{layer}.engram.embed.weight"
        self.scale_name = f"layers.{layer}.engram.embed.scale"
        self.rows_read = 0

    def gather(self, ids: torch.Tensor):
        idx = ids.detach().cpu().numpy()
        self.rows_read += idx.size
        return self.checkpoint.rows(self.weight_name, idx), self.checkpoint.rows(self.scale_name, idx)


class ResidentEngramTable:
    """An Engram table copied into RAM once (`resident_engram=True`); gathers are plain indexing."""

    def __init__(self, checkpoint: Checkpoint, layer: int):
        self.weight = checkpoint.read(f"layers.{layer}.engram.embed.weight")
        self.scale = checkpoint.read(f"layers.{layer}.engram.embed.scale")
        self.rows_read = 0

    def gather(self, ids: torch.Tensor):
        ids = ids.to(torch.long).cpu()
        self.rows_read += ids.numel()
        return self.weight[ids], self.scale[ids]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes


# ---------------------------------------------------------------------- torch threads
def all_cores() -> int:
    """The cores this process may run on ($OMP_NUM_THREADS when it is set to a positive number,
    as a cap the user chose; else `machine_cores()`)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return machine_cores()


def machine_cores() -> int:
    """The logical CPUs this process may be scheduled on: its affinity set, else os.cpu_count()."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def auto_threads(cfg: Config) -> tuple[int, str]:
    """(threads, why) for threads="auto": 1 when an expert matrix (dim x moe_inter_dim weights)
    is under AUTO_THREADS_MIN_WEIGHTS, else `all_cores()`."""
    weights = cfg.dim * cfg.moe_inter_dim
    shape = f"expert matrices {cfg.dim} x {cfg.moe_inter_dim} = {weights:,} weights"
    if weights < AUTO_THREADS_MIN_WEIGHTS:
        return 1, f"auto: {shape}, under {AUTO_THREADS_MIN_WEIGHTS:,}: one thread; more would only hand tiny work back and forth"
    cores = all_cores()
    return cores, f"auto: {shape}, at least {AUTO_THREADS_MIN_WEIGHTS:,}: all {cores} cores"


def check_threads(threads) -> None:
    """ValueError unless `threads` is "auto", None or a whole number from 1 to `machine_cores()`
    (torch starts every thread asked for, and thousands of them crash it)."""
    if threads is None or threads == "auto":
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f'threads must be "auto", None (leave torch alone) or a whole number >= 1, got {threads!r}')
    if threads > machine_cores():
        raise ValueError(f"threads={threads} is more than the {machine_cores()} CPUs this process may run on; "
                         f"ask for at most {machine_cores()} (or \"auto\")")


def apply_threads(threads, cfg: Config) -> tuple[int, str]:
    """Set torch's intra-op threads as `load(threads=...)` does; returns (threads now, why)."""
    check_threads(threads)
    if threads is None:
        return torch.get_num_threads(), "left alone (threads=None)"
    if threads == "auto":
        count, why = auto_threads(cfg)
    else:
        count, why = threads, f"threads={threads}"
    torch.set_num_threads(count)
    return torch.get_num_threads(), why


# ---------------------------------------------------------------------- the report
@dataclass
class LoadReport:
    """What a load did. `tensors` maps every checkpoint tensor to LOADED, an ON_DISK reason, or
    UNEXPECTED; `dequantized` lists (name, stored dtype, runtime dtype) for every conversion."""

    checkpoint: str
    parameters_filled: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    bytes_retained: int = 0  # dense parameters as held (measured on the built model)
    predicted_bytes_retained: int = 0  # from the inventory and runtime_dtype alone
    state_bytes: int = 0  # attention caches and RoPE tables (sized by max_seq_len; not weights)
    resident_engram_bytes: int = 0
    draft_bytes_retained: int = 0  # the DSpark draft stack's dense parameters (not in bytes_retained)
    predicted_draft_bytes: int = 0  # the same from the inventory alone (`predict_draft_bytes`)
    vision_bytes_retained: int = 0  # the vision tower, aligner and span delimiters (part of bytes_retained)
    dequantized: list[tuple[str, str, str]] = field(default_factory=list)
    tensors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    threads: Optional[int] = None  # torch's intra-op threads after the load
    threads_choice: str = ""  # why: "auto: ...", "threads=N" or "left alone (threads=None)"
    # expert_parallel=True: this rank of world_size, and the routed experts it holds (e % world_size
    # == rank; tensors and their bytes on disk, read on demand) out of all of them
    rank: Optional[int] = None
    world_size: int = 1
    routed_tensors_held: int = 0
    routed_tensors_total: int = 0
    routed_bytes_held: int = 0
    routed_bytes_total: int = 0

    def names(self, bucket: str) -> list[str]:
        return [n for n, b in self.tensors.items() if b == bucket]

    def counts(self) -> dict[str, int]:
        out = {}
        for bucket in self.tensors.values():
            out[bucket] = out.get(bucket, 0) + 1
        return out

    @property
    def unexpected(self) -> list[str]:
        return self.names(UNEXPECTED)

    def summary(self) -> str:
        gib = 2 ** 30
        lines = [f"{self.checkpoint}: {self.parameters_filled} parameters filled from {self.tensors_read} "
                 f"tensors ({self.bytes_read / gib:.3f} GiB read) in {self.seconds:.1f} s",
                 f"  retained {self.bytes_retained:,} bytes ({self.bytes_retained / gib:.3f} GiB); "
                 f"predicted {self.predicted_bytes_retained:,}; caches {self.state_bytes:,} bytes",
                 f"  {len(self.dequantized)} conversions at load: "
                 + _conversion_summary(self.dequantized)]
        if self.threads is not None:
            lines.append(f"  torch threads: {self.threads} ({self.threads_choice})")
        for bucket, n in self.counts().items():
            lines.append(f"  {bucket}: {n} tensors")
        if self.resident_engram_bytes:
            lines.append(f"  resident Engram tables: {self.resident_engram_bytes:,} bytes")
        if self.vision_bytes_retained:
            lines.append(f"  vision tower: {self.vision_bytes_retained:,} of the retained bytes (ViT, aligner, "
                         f"span delimiters)")
        if self.draft_bytes_retained:
            lines.append(f"  DSpark draft stack: {self.draft_bytes_retained:,} bytes of dense parameters "
                         f"(predicted {self.predicted_draft_bytes:,}; its routed experts read on demand like the "
                         f"backbone's)")
        if self.rank is not None:
            lines.append(f"  expert parallel: rank {self.rank} of {self.world_size} holds the routed experts e % "
                         f"{self.world_size} == {self.rank}: {self.routed_tensors_held} of "
                         f"{self.routed_tensors_total} tensors, {self.routed_bytes_held:,} of "
                         f"{self.routed_bytes_total:,} bytes; everything else (the dense part, router, shared "
                         f"experts, Engram tables, the draft stack and its experts) is replicated on every rank")
        return "\n".join(lines)


def _conversion_summary(items) -> str:
    kinds = {}
    for _, src, dst in items:
        kinds[(src, dst)] = kinds.get((src, dst), 0) + 1
    return ", ".join(f"{n} x {src} -> {dst}" for (src, dst), n in sorted(kinds.items())) or "none"


# ---------------------------------------------------------------------- loading
def check_tensors(cfg: Config, ckpt: Checkpoint) -> dict[str, str]:
    """Compare every header against the inventory; returns name -> bucket for the checkpoint's
    tensors (UNEXPECTED for names the inventory does not list). Missing, mis-typed or mis-shaped
    tensors raise LoadError naming them."""
    try:
        specs = expected_tensors(cfg)
    except ValueError as exc:
        raise LoadError(_named(str(cfg.source), str(exc))) from None
    problems = []
    for spec in specs:
        if spec.name not in ckpt:
            problems.append(f"tensor {spec.name} is missing (expected in {spec.shard})")
        elif ckpt.shape(spec.name) != spec.shape or ckpt.dtype(spec.name) != spec.dtype:
            problems.append(f"tensor {spec.name} is {ckpt.dtype(spec.name)} {list(ckpt.shape(spec.name))}, "
                            f"the config implies {spec.dtype} {list(spec.shape)}")
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
        raise LoadError(f"{path}: no tokenizer.json beside the shards; the Engram hash needs the checkpoint's tokenizer")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise LoadError(f"{file}: not a tokenizer this tokenizers version can read ({exc})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise LoadError(f"{file}: the tokenizer has {size} ids but the config's vocab_size is {cfg.vocab_size}; "
                        f"they belong to different models")
    meta = {}
    meta_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(meta_file):
        meta = _read_json(meta_file)
        if not isinstance(meta, dict):
            raise LoadError(f"{meta_file}: holds {_json_kind(meta)}, not an object of tokenizer settings; "
                            "download it again")
    for role in ("bos", "eos", "pad"):
        key = f"{role}_token"
        text, want = meta.get(key), getattr(cfg, f"{role}_token_id")
        if isinstance(text, dict):
            text = text.get("content")
        if text is not None and not isinstance(text, str):
            raise LoadError(f"{meta_file}: {key} is {_json_kind(text)} ({_brief(text)}), not the token's "
                            f"text; write it as a string (or {{\"content\": string}}) as tokenizer.json spells it")
        if text is None or want is None:
            continue
        got = tok.token_to_id(text)
        if got != want:
            raise LoadError(f"{meta_file}: the {role} token {text!r} has id {got} in tokenizer.json but the config "
                            f"says {role}_token_id {want}; the tokenizer and the config disagree")
    return tok, meta


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def load(path: Optional[str] = None, *, numerics: Optional[Numerics] = None,
         fix_stale_index_keys: Optional[bool] = None, window_layout: Optional[str] = None,
         pad_f32_rows: Optional[bool] = None, expert_cache: int = DEFAULT_EXPERT_CACHE, expert_device="cpu",
         expert_parallel: bool = False, resident_engram: bool = False, max_seq_len: Optional[int] = None,
         max_batch_size: int = 1,
         threads="auto", undo_calls: int = 64, cache_format: str = "packed", dspark: bool = True,
         quiet: bool = False) -> Model:
    """Load a checkpoint directory (default: the embedded tiny one) -> `model.Model`, its
    `report` the LoadReport.

    numerics: a `Numerics` (default `Numerics.reference()`, the released runtime's arithmetic;
    `Numerics.parity()` for a prefill that equals token-by-token decoding until a top-k cuts);
    fix_stale_index_keys / window_layout / pad_f32_rows override its fields one by one.
    expert_cache: packed experts kept per layer; expert_device: where routed experts are held and
    computed: "cpu" (default), "cuda", "cuda:1" or a list of CUDA devices (experts spread
    round-robin); without a usable GPU one line on stderr says so and the CPU's fused path runs
    them (a string that names no device raises ValueError); expert_parallel: this process is one
    rank of a torch.distributed group (joined, or started from torchrun's environment) and holds
    and computes only the routed experts e with e % world_size == rank (`dsv41.distributed`; a
    plain "cuda" expert_device then means the rank's own GPU), the logits equal one process's bit
    for bit; resident_engram: copy the Engram
    tables into RAM instead of gathering from the shards; max_seq_len (default min(config, 4096))
    and max_batch_size size the attention caches; threads: torch's intra-op threads for the whole
    process, which the native expert kernel uses too: "auto" (default; one thread for a model
    whose expert matrices are under AUTO_THREADS_MIN_WEIGHTS weights, as the embedded checkpoint's,
    every core otherwise, see `auto_threads`), a whole number, or None to leave torch as it is
    (the report's summary says which); undo_calls: how many calls `Model.rollback` can undo;
    cache_format: "packed" (default: the stored FP8 / FP4 formats with their scales) or "bf16" (the
    reference runtime's BF16 buffers), bit-identical logits either way (`Model.cache_bytes()`);
    dspark: build the DSpark draft stack (`Model.draft`, speculative generation) when the
    checkpoint has `mtp.*` stages and dspark_block_size > 0 (False leaves them on disk, "not run");
    quiet: no progress bar. Raises LoadError with one sentence
    on a bad checkpoint."""
    from tqdm import tqdm

    from .engram import EngramError, NgramHasher

    numerics = (numerics or Numerics()).with_options(fix_stale_index_keys=fix_stale_index_keys,
                                                     window_layout=window_layout, pad_f32_rows=pad_f32_rows)
    check_threads(threads)
    check_cache_format(cache_format)
    began = time.perf_counter()
    ranks = None
    if expert_parallel:
        from . import distributed

        ranks = distributed.init()
        if isinstance(expert_device, str) and expert_device == "cuda" and torch.cuda.is_available():
            # each rank computes its experts on its own GPU (ranks share them round-robin past the count)
            expert_device = f"cuda:{ranks.local_rank % torch.cuda.device_count()}"
    try:
        devices = expert_devices(expert_device)  # prints the one fallback line when CUDA is absent
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"expert_device {expert_device!r} is not usable: {exc}") from None
    if path is None:
        from .cachedir import CacheError
        from .tiny import default_checkpoint

        try:
            if ranks is not None:  # rank 0 builds the shared cache once, the others then find it
                path = distributed.main_first(lambda: default_checkpoint(progress=not quiet and ranks.is_main))
            else:
                path = default_checkpoint(progress=not quiet)
        except CacheError as exc:
            raise LoadError(str(exc)) from None
    if not os.path.isdir(path):
        raise LoadError(f"{path}: not a checkpoint directory")
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        raise LoadError(str(exc)) from None
    problems = cfg.verify()
    if problems:
        raise LoadError(_named(str(cfg.source), problems[0]) + (f" (and {len(problems) - 1} more problems)"
                                                                if len(problems) > 1 else ""))
    # checked before any cache is sized: a length past the config's would allocate for nothing
    if max_seq_len is not None and not 1 <= max_seq_len <= cfg.max_seq_len:
        raise ValueError(f"max_seq_len must lie in [1, {cfg.max_seq_len}] (the config's max_position_embeddings), "
                         f"got {max_seq_len}")
    if not 1 <= max_batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"max_batch_size must lie in [1, {MAX_BATCH_SIZE}], got {max_batch_size}")
    ckpt = Checkpoint(path)
    buckets = check_tensors(cfg, ckpt)
    tokenizer, tok_meta = load_tokenizer(path, cfg)
    try:
        hasher = NgramHasher.from_tokenizer(cfg, tokenizer) if cfg.engram_layer_ids else None
    except EngramError as exc:
        raise LoadError(_named(path, str(exc))) from None

    n_threads, threads_choice = apply_threads(threads, cfg)  # once the checkpoint checks out; before the fill
    max_seq_len = int(max_seq_len or min(cfg.max_seq_len, DEFAULT_MAX_SEQ_LEN))
    report = LoadReport(checkpoint=ckpt.path, threads=n_threads, threads_choice=threads_choice)
    with torch.no_grad():
        model = Model(cfg, numerics=numerics, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                      tokenizer=tokenizer, tokenizer_meta=tok_meta, hasher=hasher, undo_calls=undo_calls, cache_format=cache_format)
        read = _fill_parameters(model.backbone, ckpt, report, quiet, tqdm)
        stack = None
        if dspark and cfg.n_mtp_layers and cfg.dspark_block_size:
            from .dspark import DraftStack

            stack = DraftStack(cfg, model.backbone.embed, model.backbone.head, numerics=numerics,
                               max_batch_size=max_batch_size, max_seq_len=max_seq_len, cache_format=cache_format)
            read |= _fill_parameters(stack, ckpt, report, quiet, tqdm)

    expert_store = ExpertCache(ckpt, expert_cache, devices, n_layers=cfg.n_layers)
    if stack is not None:  # the draft's own experts (mtp.N.ffn.experts.*) through the same store
        stack.attach_store(expert_store)
        model.attach_draft(stack)
        for name, bucket in buckets.items():
            if bucket == MTP and ".ffn.experts." in name:
                buckets[name] = ROUTED
    tables = {}
    for layer in cfg.engram_layer_ids or ():
        table = tables[layer] = ResidentEngramTable(ckpt, layer) if resident_engram else MappedEngramTable(ckpt, layer)
        if resident_engram:
            report.resident_engram_bytes += table.nbytes
            for suffix in ("weight", "scale"):
                report.bytes_read += ckpt.nbytes(f"layers.{layer}.engram.embed.{suffix}")
    routed = None
    if ranks is not None:
        import functools

        expert_store = distributed.OwnedExpertStore(expert_store, ranks)
        routed = functools.partial(distributed.ExpertParallelExperts, ranks=ranks,
                                   counters=distributed.ExchangeCounters())  # one set for every layer
        report.rank, report.world_size = ranks.rank, ranks.world_size
        for name in (n for n, b in buckets.items() if b == ROUTED and n.startswith("layers.")):  # not the draft's
            expert = int(name.split(".ffn.experts.")[1].split(".")[0])  # layers.L.ffn.experts.E.w1.weight
            report.routed_tensors_total += 1
            report.routed_bytes_total += ckpt.nbytes(name)
            if ranks.owns(expert):
                report.routed_tensors_held += 1
                report.routed_bytes_held += ckpt.nbytes(name)
    model.attach(expert_store, tables, routed)

    for name in read:
        if buckets.get(name) != LOADED:
            buckets[name] = LOADED if name in buckets else UNEXPECTED
    for name, bucket in buckets.items():
        if bucket == LOADED and name not in read:
            buckets[name] = UNEXPECTED  # the inventory lists it as dense, yet the model has no use for it
    report.tensors = buckets
    report.tensors_read = len(read)
    report.bytes_retained = _unique_bytes(model.backbone.parameters())
    report.vision_bytes_retained = _unique_bytes(p for name, p in model.backbone.named_parameters()
                                                 if is_vision_name(name))
    report.draft_bytes_retained = 0 if stack is None else _unique_bytes(stack.parameters())
    report.predicted_draft_bytes = 0 if stack is None else predict_draft_bytes(cfg)
    report.predicted_bytes_retained = predict_retained_bytes(cfg)["bytes"]
    report.state_bytes = _unique_bytes(model.backbone.buffers())
    report.seconds = time.perf_counter() - began
    model.report, model.checkpoint = report, ckpt
    if not quiet:
        print(report.summary(), file=sys.stderr)
    return model


def _fill_parameters(backbone, ckpt: Checkpoint, report: LoadReport, quiet: bool, tqdm) -> set[str]:
    """Copy every parameter of `backbone` from the checkpoint tensor of the same name, converting
    to the dtype the model holds it in; returns the names read (scales consumed included)."""
    params = dict(backbone.named_parameters())
    read: set[str] = set()
    bar = tqdm(total=len(params), desc="loading", unit="tensor", file=sys.stderr, disable=quiet, leave=False)
    for name, param in params.items():
        if name not in ckpt:
            raise LoadError(f"{ckpt.path}: the model needs tensor {name}, which the checkpoint does not hold")
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
                raise LoadError(f"{ckpt.path}: tensor {name} is {ckpt.dtype(name)} but the model holds it as "
                                f"{param.dtype}, and there is no conversion between them")
        if tuple(stored.shape) != tuple(param.shape):
            raise LoadError(f"{ckpt.path}: tensor {name} has shape {list(stored.shape)}, the model "
                            f"expects {list(param.shape)}")
        param.copy_(stored)
        report.parameters_filled += 1
        bar.update(1)
    bar.close()
    return read
