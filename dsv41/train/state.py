"""A training run's settings and its state on disk, without pickle.

The state is two files in the work folder: `state.json` (the settings, the step, the per-step log,
the evaluations, the seconds trained, which optimizer the moments belong to) and the safetensors
file it names with its size and sha256 (`state-NNNNNNN.safetensors`: the float32 master weights
`param.NAME` and the AdamW moments `adam.NAME.exp_avg` / `.exp_avg_sq` / `.step`). A save writes
the tensors first, then replaces `state.json` whole, then removes the older tensors file, so an
interruption anywhere leaves a complete earlier state.

Loading checks it as a checkpoint is checked, before a run uses any of it: the JSON's size, kinds
and ranges (unknown or missing keys, a step outside the run, a log that is not one record per step
run), the tensors file's name, size and sha256, each tensor's name, dtype and shape against the
geometry and the optimizer's parameters, and every value finite. Each problem is a TrainStateError,
one sentence naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..core.errors import Dsv41Error
from ..core.outdir import replace_file
from ..core.text import bounded_ints, brief, is_whole, json_kind, number_text

STATE_NAME = "state.json"
STATE_FORMAT = "dsv41-train-state"
STATE_VERSION = 1
TENSORS_FILE = re.compile(r"state-[0-9]{7}\.safetensors")
# The pickled state of earlier versions: never read (unpickling runs whatever the file names).
PICKLED_STATE_NAME = "state.pt"
# 100,000 steps of its log are about 25 MB of JSON; a state.json ten times that is not one.
MAX_STATE_JSON_BYTES = 256 << 20
PARAM, MOMENT = "param.", "adam."
MOMENT_KINDS = ("exp_avg", "exp_avg_sq", "step")
OPTIMIZER_PHASES = ("backbone", "draft")

# The bounds of each whole-number setting (the command's flags and a saved state share them).
# Steps: a step takes about a second here; 100,000 are a day or more of training.
MAX_STEPS = 100_000
MAX_SEED = 2**32 - 1  # seed * 7,000,003 + step stays a valid torch generator seed
MIN_SEQ_LEN, MAX_SEQ_LEN = 16, 4096
MAX_WINDOWS = 10**7
# The greedy pool's sequences: about 0.6 s each to decode here (192 greedy tokens), so 100,000 take most of a day.
MAX_POOL_SEQUENCES = 100_000
INT_BOUNDS = {
    "backbone_steps": (1, MAX_STEPS),
    "draft_steps": (0, MAX_STEPS),
    "batch": (1, 10**6),
    "seq_len": (MIN_SEQ_LEN, MAX_SEQ_LEN),
    "warmup": (0, MAX_STEPS),
    "draft_anchors": (1, MAX_SEQ_LEN),
    "pool_sequences": (1, MAX_POOL_SEQUENCES),
    "seed": (0, MAX_SEED),
    "checkpoint_every": (1, MAX_STEPS),
    "eval_every": (1, MAX_STEPS),
    "eval_windows": (1, MAX_WINDOWS),
}
# The rates and weights (lr, decay, loss weights): non-negative, and 10 is far past any that trains;
# the fractions at most 1.
MAX_RATE = 10
# The settings a run is started with from the command line, and the flag of each.
FLAGS = {
    "backbone_steps": "--steps",
    "draft_steps": "--draft-steps",
    "seed": "--seed",
    "batch": "--batch",
    "seq_len": "--seq-len",
    "lr": "--lr",
    "pool_sequences": "--pool-sequences",
}

# Memory of one training step, measured on the miniature's geometry (peak resident growth over
# the first steps of a run): about 0.59 MiB a token plus 560 bytes a token per position of the
# sequence (the masked attention's scores), beside a fixed 1 GiB (the weights, their moments, the
# corpus and torch). Through the model's own forward 8 x 256 tokens grew 1.45 GiB (the bf16
# activations it keeps between sublayers, and the modules' own copies); the earlier separate
# training forward grew 1.02 GiB for 8 x 256 and 0.91 GiB for 1 x 1024, whose per-position part
# is kept.
STEP_BYTES_PER_TOKEN = 600 << 10
STEP_BYTES_PER_TOKEN_POSITION = 560
STEP_FIXED_BYTES = 1 << 30


class TrainError(Dsv41Error, ValueError):
    """A run that cannot start or go on; the message is one sentence naming the file or flag."""


class TrainStateError(TrainError):
    """A training state that cannot be resumed from; one sentence naming the file."""


@dataclass(frozen=True)
class TrainSettings:
    # the shipped miniature's first run: `dsv41 train` with no flags rebuilds it
    backbone_steps: int = 4800
    draft_steps: int = 1600
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.01
    qat_fraction: float = 0.15  # the backbone's last steps train on the storage grid
    index_loss_weight: float = 1.0
    balance_rate: float = 1e-3  # routing bias step per unit of load imbalance sign
    draft_lr: float = 2e-3
    draft_anchors: int = 32  # anchor positions drawn per sequence for the draft
    # sequences of the target's greedy continuations the draft phase reads every other step
    # (`draft.greedy_pool`); every run on one seed draws the same prompts, the first of them alike
    pool_sequences: int = 256
    seed: int = 0
    checkpoint_every: int = 25
    eval_every: int = 100
    eval_windows: int = 32  # held-out windows in the periodic evaluation (all of them at the end)

    @property
    def steps(self) -> int:
        return self.backbone_steps + self.draft_steps

    def phase(self, step: int) -> str:
        if step >= self.backbone_steps:
            return "draft"
        return "qat" if step >= self.backbone_steps * (1 - self.qat_fraction) else "backbone"


FIELDS = {f.name: f.type for f in dataclasses.fields(TrainSettings)}


def settings_from(values: dict, where: str) -> TrainSettings:
    """TrainSettings from `values` (a state's "settings", or the flags given), every value checked
    for its kind and range; TrainError naming `where` and the setting otherwise. Missing keys take
    the defaults."""
    unknown = sorted(set(values) - set(FIELDS), key=str)
    if unknown:
        raise TrainError(f"{where}: {brief(unknown[0])} is not a training setting (they are {', '.join(FIELDS)})")
    for name, value in values.items():
        if FIELDS[name] == "int":
            low, high = INT_BOUNDS[name]
            if not (is_whole(value) and low <= value <= high):
                raise TrainError(
                    f"{where}: {name} must be a whole number from {low} to {high:,}, got "
                    f"{number_text(value) if is_whole(value) else brief(value)}"
                )
        elif not (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and 0 <= value <= (1 if name.endswith("fraction") else MAX_RATE)
        ):
            raise TrainError(
                f"{where}: {name} must be a finite number from 0 to "
                f"{1 if name.endswith('fraction') else MAX_RATE}, got {brief(value)}"
            )
    return TrainSettings(**{k: float(v) if FIELDS[k] == "float" else v for k, v in values.items()})


def step_bytes(batch: int, seq_len: int) -> int:
    """About the memory a training step of `batch` sequences of `seq_len` tokens needs (the
    measured constants above)."""
    return STEP_FIXED_BYTES + batch * seq_len * (STEP_BYTES_PER_TOKEN + STEP_BYTES_PER_TOKEN_POSITION * seq_len)


def check_memory(settings: TrainSettings) -> None:
    """TrainError when a step of `settings` would need more memory than this machine has."""
    from ..runtime.budget import gib_text, machine_memory

    have = machine_memory()
    need = step_bytes(settings.batch, settings.seq_len)
    if have is None or need <= have[0]:
        return
    limit, what = have
    per_sequence = step_bytes(1, settings.seq_len) - STEP_FIXED_BYTES
    most = max(0, (limit - STEP_FIXED_BYTES) // per_sequence)
    fix = f"give at most --batch {most:,}" if most else "give a shorter --seq-len"
    raise TrainError(
        f"--batch {settings.batch:,} at --seq-len {settings.seq_len:,} needs about "
        f"{gib_text(need, up=True)} GiB for a training step, more than the {gib_text(limit, up=False)} "
        f"GiB {what}; {fix}"
    )


# ---------------------------------------------------------------------- the state
@dataclass
class TrainState:
    settings: TrainSettings
    params: dict  # name -> float32 master weight, logical shape
    step: int = 0
    # None, or the optimizer of the phase running: {"phase": "backbone" | "draft", "moments":
    # {parameter name -> {"exp_avg", "exp_avg_sq", "step"}}} (parameters never updated have none)
    optimizer: dict | None = None
    log: list = field(default_factory=list)  # one dict per step
    evals: list = field(default_factory=list)
    seconds: float = 0.0  # training time over all sessions
    # a --draft-from run: what it carries from its source's manifest (`CONTINUED_KEYS`)
    continued_from: dict | None = None
    # a --init-from run: its source's path, manifest sha256 and facts (`loop.initialized_record`)
    initialized_from: dict | None = None

    def save(self, folder: str) -> None:
        """Write the state into `folder`: the tensors file, then state.json naming it, then the
        older tensors file removed."""
        tensors = {PARAM + k: v.detach().contiguous() for k, v in self.params.items()}
        if self.optimizer is not None:
            for name, moments in self.optimizer["moments"].items():
                for kind in MOMENT_KINDS:
                    tensors[f"{MOMENT}{name}.{kind}"] = moments[kind].detach().float().contiguous()
        from safetensors.torch import save

        data = save(tensors)
        name = f"state-{self.step:07d}.safetensors"

        def write_tensors(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(data)

        replace_file(os.path.join(folder, name), write_tensors)
        document = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "tensors": {"file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()},
            "settings": dataclasses.asdict(self.settings),
            "step": self.step,
            "seconds": self.seconds,
            "optimizer": None if self.optimizer is None else self.optimizer["phase"],
            "log": self.log,
            "evals": self.evals,
            "continued_from": self.continued_from,
            "initialized_from": self.initialized_from,
        }
        text = json.dumps(document, indent=None, sort_keys=True)

        def write_json(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)

        replace_file(os.path.join(folder, STATE_NAME), write_json)
        for old in os.listdir(folder):
            if TENSORS_FILE.fullmatch(old) and old != name:
                os.remove(os.path.join(folder, old))

    @classmethod
    def load(cls, folder: str, shapes: dict[str, tuple], optimizer_names: dict[str, list[str]]) -> "TrainState":
        """The state in `folder`, checked against the geometry (`shapes`: parameter name -> logical
        shape) and the parameters each phase's optimizer updates; TrainStateError otherwise."""
        document = read_state_json(folder)
        path = os.path.join(folder, STATE_NAME)
        settings, step = check_document(document, path)
        tensors = read_tensors(folder, document["tensors"], path)
        params, moments = check_tensors(
            tensors, shapes, optimizer_names.get(document["optimizer"], []), document["tensors"]["file"], folder
        )
        phase = document["optimizer"]
        return cls(
            settings,
            params,
            step,
            None if phase is None else {"phase": phase, "moments": moments},
            document["log"],
            document["evals"],
            float(document["seconds"]),
            document["continued_from"],
            document.get("initialized_from"),
        )


def saved_step(folder: str) -> int | None:
    """The step of the state in `folder`, None when it holds none (or none that can be read)."""
    try:
        document = read_state_json(folder)
    except TrainStateError:
        return None
    step = document.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def read_state_json(folder: str) -> dict:
    """state.json's object, read within MAX_STATE_JSON_BYTES; TrainStateError when it cannot be."""
    path = os.path.join(folder, STATE_NAME)
    if os.path.isdir(path):
        raise TrainStateError(f"{path} is a folder, not the training state file; remove it, or give another --out")
    if os.path.lexists(path) and not os.path.isfile(path):  # a FIFO or device would block or never end
        raise TrainStateError(
            f"{path} is not a regular file, so not a training state; remove it, or give another --out"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATE_JSON_BYTES + 1)
    except OSError as exc:
        raise TrainStateError(
            f"{path} cannot be read ({exc.strerror or exc}); start the run again in a new folder"
        ) from None
    if len(raw) > MAX_STATE_JSON_BYTES:
        raise TrainStateError(f"{path} is over {MAX_STATE_JSON_BYTES >> 20} MiB, which no training state is")
    try:
        document = json.loads(raw.decode("utf-8"), parse_int=bounded_ints(30))
    except (ValueError, RecursionError):
        what = "is empty" if not raw.strip() else "is not readable JSON (truncated or damaged)"
        raise TrainStateError(f"{path} {what}; the run cannot go on from it: start it again in a new folder") from None
    if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
        found = brief(document.get("format")) if isinstance(document, dict) else json_kind(document)
        raise TrainStateError(f"{path} is not a dsv41 training state (format {STATE_FORMAT!r} expected, got {found})")
    return document


_KEYS = ("continued_from", "evals", "format", "log", "optimizer", "seconds", "settings", "step", "tensors", "version")
# Written since --init-from came; a state written before has none (its run started from random weights).
_LATER_KEYS = ("initialized_from",)
# Settings added since states were first written: a state without one resumes with its default,
# the value every run before it used.
LATER_SETTINGS = ("pool_sequences",)
# What a --draft-from run carries from its source, and the kind of each.
CONTINUED_KEYS = {
    "path": "a path",
    "manifest_sha256": "a sha256",
    "steps": "a whole number",
    "training_seconds": "a number",
    "final_train_loss": "a number or null",
    "tokens_seen": "a whole number or null",
}
# Keys a --draft-from state gained later (optional on read, so older states resume): the source's
# own lineage, when it was a --init-from run, for the manifest to keep.
CONTINUED_LATER_KEYS = {
    "initialized_from": "null or an object",
    "run_training_seconds": "a number or null",
}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_document(document: dict, path: str) -> tuple[TrainSettings, int]:
    """The settings and step of a state.json object whose every field is checked."""

    def bad(message: str):
        return TrainStateError(f"{path}: {message}; the run cannot go on from it")

    keys = set(document) - {k for k in _LATER_KEYS if k in document}
    if keys != set(_KEYS):
        extra, missing = sorted(keys - set(_KEYS), key=str), sorted(set(_KEYS) - keys)
        raise bad(f"{brief(extra[0])} is not a field of a training state" if extra else f"{missing[0]} is missing")
    if document["version"] != STATE_VERSION:
        raise bad(f"version {brief(document['version'])} is not {STATE_VERSION}, the one this dsv41 reads")
    if not isinstance(document["settings"], dict):
        raise bad(f"settings must be an object, got {json_kind(document['settings'])}")
    missing = sorted(set(FIELDS) - set(document["settings"]) - set(LATER_SETTINGS))
    if missing:
        raise bad(f"settings lacks {missing[0]}")
    try:
        settings = settings_from(document["settings"], f"{path}: settings")
    except TrainError as exc:
        raise TrainStateError(f"{exc}; the run cannot go on from it") from None
    step = document["step"]
    if not (is_whole(step) and 0 <= step <= settings.steps):
        raise bad(
            f"step must be a whole number from 0 to the run's {settings.steps:,} steps, got "
            f"{number_text(step) if is_whole(step) else brief(step)}"
        )
    seconds = document["seconds"]
    if not (_number(seconds) and math.isfinite(seconds) and seconds >= 0):
        raise bad(f"seconds must be a finite number of seconds, got {brief(seconds)}")
    phase = document["optimizer"]
    if phase is not None and phase not in OPTIMIZER_PHASES:
        raise bad(f"optimizer must be null or one of {', '.join(OPTIMIZER_PHASES)}, got {brief(phase)}")
    if (
        phase == "backbone"
        and not step < settings.backbone_steps
        or phase == "draft"
        and not step > settings.backbone_steps
    ):
        raise bad(f"a {phase} optimizer at step {step} of {settings.backbone_steps} backbone steps")
    tensors = document["tensors"]
    if not (
        isinstance(tensors, dict)
        and set(tensors) == {"file", "size", "sha256"}
        and isinstance(tensors["file"], str)
        and TENSORS_FILE.fullmatch(tensors["file"])
        and is_whole(tensors["size"])
        and tensors["size"] > 0
        and isinstance(tensors["sha256"], str)
        and re.fullmatch(r"[0-9a-f]{64}", tensors["sha256"])
    ):
        raise bad(
            "tensors must name a state-NNNNNNN.safetensors file in the same folder with its size and sha256, "
            f"got {brief(tensors)}"
        )
    problem = (
        _log_problem(document["log"], settings, step)
        or _evals_problem(document["evals"], step)
        or continued_problem(document["continued_from"], allow_none=True)
        or initialized_problem(document.get("initialized_from"))
    )
    if problem:
        raise bad(problem)
    return settings, step


# A draft step's per-row records: the agreement with the target's greedy token on every row, and on
# the rows whose context inference gives them (`draft.greedy_context`), and that share of the rows.
BY_ROW_KEYS = ("agreement_by_row", "agreement_in_greedy_context_by_row", "greedy_context_by_row")


def _log_problem(log, settings: TrainSettings, step: int) -> str | None:
    """What is wrong with the log: one record per step run, the last one step - 1, each with its
    phase, a loss and the seconds it took; draft records with their agreement by row."""
    if not isinstance(log, list):
        return f"log must be an array of one record per step, got {json_kind(log)}"
    first = step - len(log)
    if first < 0:
        return f"log holds {len(log):,} records for {step:,} steps"
    rows = None
    for i, record in enumerate(log):
        where = f"log[{i}]"
        if not isinstance(record, dict):
            return f"{where} must be an object, got {json_kind(record)}"
        if record.get("step") != first + i or not is_whole(record.get("step")):
            return f"{where} must be the record of step {first + i}, got step {brief(record.get('step'))}"
        if record.get("phase") != settings.phase(first + i):
            return f"{where} must be of phase {settings.phase(first + i)}, got {brief(record.get('phase'))}"
        for key in ("loss", "seconds"):
            if not _number(record.get(key)):
                return f"{where}.{key} must be a number, got {brief(record.get(key))}"
        for key, value in record.items():
            if key == "phase" or _number(value):
                continue
            if key in BY_ROW_KEYS and isinstance(value, list) and all(_number(v) for v in value):
                continue
            return f"{where}.{key} must be a number, got {brief(value)}"
        if record["phase"] == "draft":
            row = record.get("agreement_by_row")
            if not isinstance(row, list) or not row or rows not in (None, len(row)):
                return f"{where}.agreement_by_row must be the draft's agreement by row like the other records'"
            rows = len(row)
    return None


def continued_problem(continued, *, allow_none: bool = False) -> str | None:
    """What is wrong with what a --draft-from run carries from its source (None: nothing)."""
    if continued is None and allow_none:
        return None
    if not isinstance(continued, dict) or not set(CONTINUED_KEYS) <= set(continued) <= {
        *CONTINUED_KEYS,
        *CONTINUED_LATER_KEYS,
    }:
        return f"continued_from must be null or an object of {', '.join(CONTINUED_KEYS)}, got {brief(continued)}"
    later = continued.get("run_training_seconds")
    ok = {
        "path": isinstance(continued["path"], str),
        "manifest_sha256": isinstance(continued["manifest_sha256"], str)
        and re.fullmatch(r"[0-9a-f]{64}", continued["manifest_sha256"]),
        "steps": is_whole(continued["steps"]) and 0 <= continued["steps"] <= 2 * MAX_STEPS,
        "training_seconds": _number(continued["training_seconds"])
        and math.isfinite(continued["training_seconds"])
        and continued["training_seconds"] >= 0,
        "final_train_loss": continued["final_train_loss"] is None or _number(continued["final_train_loss"]),
        "tokens_seen": continued["tokens_seen"] is None
        or is_whole(continued["tokens_seen"])
        and continued["tokens_seen"] >= 0,
        "initialized_from": continued.get("initialized_from") is None
        or isinstance(continued["initialized_from"], dict),
        "run_training_seconds": later is None or _number(later) and math.isfinite(later) and later >= 0,
    }
    wrong = next((key for key, good in ok.items() if not good), None)
    kind = {**CONTINUED_KEYS, **CONTINUED_LATER_KEYS}
    return f"continued_from.{wrong} must be {kind[wrong]}, got {brief(continued.get(wrong))}" if wrong else None


def initialized_problem(initialized) -> str | None:
    """What is wrong with what a --init-from run keeps of its source (None: nothing)."""
    if initialized is None:
        return None
    if not (
        isinstance(initialized, dict)
        and set(initialized) == {"path", "manifest_sha256", "facts"}
        and isinstance(initialized["path"], str)
        and isinstance(initialized["manifest_sha256"], str)
        and re.fullmatch(r"[0-9a-f]{64}", initialized["manifest_sha256"])
        and isinstance(initialized["facts"], dict)
    ):
        return (
            "initialized_from must be null or an object of path, manifest_sha256 (64 hex digits) and facts "
            f"(an object), got {brief(initialized)}"
        )
    return None


def _evals_problem(evals, step: int) -> str | None:
    if not isinstance(evals, list):
        return f"evals must be an array, got {json_kind(evals)}"
    for i, record in enumerate(evals):
        if not (
            isinstance(record, dict)
            and set(record) == {"step", "bits_per_byte", "nats_per_token", "tokens", "bytes"}
            and is_whole(record["step"])
            and 0 < record["step"] <= step
            and all(_number(record[k]) for k in ("bits_per_byte", "nats_per_token"))
            and all(is_whole(record[k]) and record[k] >= 0 for k in ("tokens", "bytes"))
        ):
            return (
                f"evals[{i}] must be an evaluation (step, bits_per_byte, nats_per_token, tokens, bytes) of a step run"
            )
    return None


def read_tensors(folder: str, entry: dict, path: str) -> list:
    """The tensors file state.json names, held to its size and sha256, as safetensors' (name,
    {dtype, shape, data}) list; nothing is turned into a tensor yet."""
    from safetensors import deserialize

    tensors_path = os.path.join(folder, entry["file"])
    where = f"{tensors_path}, which {STATE_NAME} names,"
    try:
        if not os.path.isfile(tensors_path):
            raise TrainStateError(f"{where} is missing or not a file; the run cannot go on from this state")
        if os.path.getsize(tensors_path) != entry["size"]:
            raise TrainStateError(
                f"{where} is {os.path.getsize(tensors_path):,} bytes, not the {entry['size']:,} "
                f"it was written with (cut short or replaced); the run cannot go on from it"
            )
        with open(tensors_path, "rb") as f:
            data = f.read(entry["size"] + 1)
    except OSError as exc:
        raise TrainStateError(f"{tensors_path} cannot be read ({exc.strerror or exc})") from None
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise TrainStateError(
            f"{where} does not match its sha256 there (changed after it was written); the run cannot go on from it"
        )
    try:
        return deserialize(data)
    except Exception as exc:  # noqa: BLE001 (safetensors' own error type: any of them is a damaged file)
        raise TrainStateError(f"{tensors_path} is not a readable safetensors file ({brief(str(exc), 80)})") from None


def check_tensors(entries: list, shapes: dict[str, tuple], trained: list[str], file: str, folder: str):
    """(params, moments) from the tensors file's entries: every parameter of `shapes` once, float32
    of its shape, moments only of `trained` parameters and each with its three parts, all finite."""
    where = os.path.join(folder, file)

    def bad(message: str):
        return TrainStateError(f"{where}: {message}; the run cannot go on from this state")

    params, moments = {}, {}
    trained = set(trained)
    for name, info in entries:
        if name.startswith(PARAM) and name[len(PARAM) :] in shapes:
            expected = shapes[name[len(PARAM) :]]
        elif name.startswith(MOMENT) and name.rsplit(".", 1)[-1] in MOMENT_KINDS:
            owner = name[len(MOMENT) :].rsplit(".", 1)[0]
            if owner not in trained:
                raise bad(f"{brief(name)} is a moment of a parameter this optimizer does not update")
            expected = () if name.endswith(".step") else shapes[owner]
        else:
            raise bad(f"{brief(name)} is not a tensor of the training state")
        if info["dtype"] != "F32" or tuple(info["shape"]) != tuple(expected):
            raise bad(f"{name} is {info['dtype']} {list(info['shape'])}, not F32 {list(expected)}")
        data = info["data"] if isinstance(info["data"], bytearray) else bytearray(info["data"])  # writable
        value = torch.frombuffer(data, dtype=torch.float32).reshape(expected)  # [shape], [] for a step
        if not torch.isfinite(value).all():
            raise bad(f"{name} holds NaN or infinite values")
        if name.startswith(PARAM):
            params[name[len(PARAM) :]] = value
        else:
            owner, kind = name[len(MOMENT) :].rsplit(".", 1)
            moments.setdefault(owner, {})[kind] = value
    missing = sorted(set(shapes) - set(params))
    if missing:
        raise bad(f"{PARAM}{missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for owner, parts in sorted(moments.items()):
        if set(parts) != set(MOMENT_KINDS):
            lacking = sorted(set(MOMENT_KINDS) - set(parts))[0]
            raise bad(f"{MOMENT}{owner}.{lacking} is missing beside the parameter's other moments")
        if (parts["exp_avg_sq"] < 0).any() or parts["step"] < 0:
            raise bad(f"{MOMENT}{owner} has a negative second moment or step")
    # in the geometry's order, as a new run holds them: the gradient clipping sums their norms in it
    return {name: params[name] for name in shapes}, moments


def optimizer_moments(opt: torch.optim.Optimizer, names_of: dict[int, str]) -> dict:
    """AdamW's per-parameter state by parameter name (`names_of`: id(tensor) -> name)."""
    ordered = [names_of[id(p)] for group in opt.param_groups for p in group["params"]]
    state = opt.state_dict()["state"]
    return {ordered[index]: {kind: entry[kind] for kind in MOMENT_KINDS} for index, entry in state.items()}


def restore_moments(opt: torch.optim.Optimizer, names_of: dict[int, str], moments: dict) -> None:
    """Load moments by parameter name (as `optimizer_moments` gives them) into `opt`."""
    index = {names_of[id(p)]: i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    current = opt.state_dict()
    opt.load_state_dict(
        {
            "state": {index[name]: dict(parts) for name, parts in moments.items()},
            "param_groups": current["param_groups"],
        }
    )
