"""`dsv41 train`: the miniature trained from scratch on this machine, resumable.

Phases, by step: the backbone (language-model loss plus the indexers' KL loss, the routing biases
balanced without an auxiliary loss), its last `qat_fraction` quantization-aware (`masters.weights(qat=True)`),
then the DSpark draft stack on the frozen, release-rounded target (`draft`). Everything random
comes from the seed and the step, so a run cut anywhere and resumed from its last checkpoint takes
the same batches. The work folder (`workdir`) keeps the state (`state`: safetensors and JSON, never
pickle), the tokenizer and the token streams; a resumed run goes on with the settings it was
started with. The result is written in the release format by `release.write_miniature`.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import torch
import torch.nn.functional as F

from ..core.numerics import Numerics
from ..core.outdir import replace_file
from ..model.model import Model
from .data import build_streams, held_out_windows, nats_to_bits, train_batch
from .masters import (
    checkpoint_params,
    holding,
    initialized_params,
    logical_shape,
    set_qat,
    trainable_model,
    trainable_names,
    weight_specs,
    weights,
)
from .masters import forward as run_forward
from .schedule import lr_at
from .state import (
    FLAGS,
    STATE_NAME,
    TrainError,
    TrainSettings,
    TrainState,
    check_document,
    check_memory,
    optimizer_moments,
    read_state_json,
    restore_moments,
    settings_from,
)
from .workdir import (
    TOKENIZER_NAME,
    TOKENS_NAME,
    claim,
    inspect,
    miniature_tokenizer,
    record_tokenizer,
    tokenizer_written,
)

# The settings a --draft-from run takes from its source (its backbone's), unless given alike: its
# manifest then records the recipe of the backbone it ships, the learning rate included.
SOURCE_SETTINGS = ("backbone_steps", "seed", "batch", "seq_len", "lr")


def optimizer_names(names) -> dict[str, list[str]]:
    """The parameters each phase's optimizer updates: the backbone's, then the draft stack's."""
    return {"backbone": trainable_names(names, exclude=("mtp.",)), "draft": trainable_names(names, prefix="mtp.")}


def new_settings(given: dict) -> TrainSettings:
    """A new run's settings: the defaults, replaced by those `given`; held-out evaluations at
    least once in a short run."""
    settings = settings_from(given, "the settings given")
    if "eval_every" not in given:
        settings = settings_from(
            {**given, "eval_every": max(1, min(TrainSettings.eval_every, settings.backbone_steps))},
            "the settings given",
        )
    return settings


def conflicting(given: dict, settings: TrainSettings, what: str) -> None:
    """TrainError naming the first setting `given` that differs from `settings` (those of `what`)."""
    for name, value in given.items():
        if getattr(settings, name) != value:
            flag = FLAGS.get(name, name)
            raise TrainError(
                f"{what} has {flag} {getattr(settings, name)}, not {value}; it goes on with its own "
                f"settings: leave {flag} out, or start a new run in another --out"
            )


def read_source(path: str, flag: str = "--draft-from") -> tuple[dict, dict, dict]:
    """(what the run carries from it, its settings, its manifest) of the miniature checkpoint at
    `path`, which `flag` (--draft-from or --init-from) names: its manifest's files held to their
    sha256s, its fields to their kinds, and a tokenizer there; TrainError in one sentence when it
    cannot."""
    from ..checkpoint.miniature import MANIFEST_NAME, MiniatureError, verify
    from ..core.cachedir import file_sha256

    if not os.path.isdir(path):
        raise TrainError(
            f"{flag} {path} is not a folder; it takes what dsv41 train wrote (OUT/checkpoint) or the packaged miniature"
        )
    try:
        manifest = verify(path)
    except MiniatureError as exc:
        raise TrainError(f"{flag}: {exc}") from None
    if manifest is None:
        raise TrainError(
            f"{flag} {path} is not a miniature checkpoint (no {MANIFEST_NAME}); it takes what "
            f"dsv41 train wrote (OUT/checkpoint) or the packaged miniature"
        )
    where = os.path.join(path, MANIFEST_NAME)
    for name in ("steps", "training_seconds", "settings"):
        if name not in manifest:
            raise TrainError(f"{flag}: {where} lacks {name}, which a run that goes on from it needs")
    before = manifest["settings"]
    source_settings = settings_from(before, f"{flag}: {where}: settings")
    missing = [name for name in SOURCE_SETTINGS if name not in before]
    if missing:
        raise TrainError(f"{flag}: {where}: settings lacks {missing[0]}")
    if not os.path.isfile(os.path.join(path, TOKENIZER_NAME)):
        raise TrainError(
            f"{flag} {path} holds no {TOKENIZER_NAME}, which the run goes on with; give the whole checkpoint folder"
        )
    from ..core.config import load_config

    _, cfg = miniature_tokenizer(os.path.join(path, TOKENIZER_NAME))
    ours = {name: logical_shape(spec) for name, (spec, _) in weight_specs(cfg).items()}
    theirs = {name: logical_shape(spec) for name, (spec, _) in weight_specs(load_config(path)).items()}
    wrong = next((n for n in sorted(set(ours) | set(theirs)) if theirs.get(n) != ours.get(n)), None)
    if wrong is not None:
        raise TrainError(
            f"{flag} {path} is not of the miniature's geometry ({wrong}: "
            f"{list(theirs[wrong]) if wrong in theirs else 'none'}, not "
            f"{list(ours[wrong]) if wrong in ours else 'none'})"
        )
    steps = manifest["steps"]
    if not source_settings.backbone_steps <= steps <= source_settings.steps:
        raise TrainError(
            f"{flag}: {where}: steps {steps:,} is not within its run of "
            f"{source_settings.backbone_steps:,} backbone and {source_settings.draft_steps:,} draft steps"
        )
    carried = {
        "path": os.path.realpath(path),
        "manifest_sha256": file_sha256(where),
        "steps": steps,
        "training_seconds": float(manifest["training_seconds"]),
        "final_train_loss": manifest.get("final_train_loss"),
        "tokens_seen": manifest.get("tokens_seen"),
        # a source that was itself a --init-from run: its lineage, for the new manifest to keep
        "initialized_from": manifest.get("initialized_from"),
        "run_training_seconds": manifest.get("run_training_seconds"),
    }
    return carried, {name: getattr(source_settings, name) for name in SOURCE_SETTINGS}, manifest


def draft_settings(given: dict, carried: dict, source: dict, path: str) -> TrainSettings:
    """The settings of a run that goes on with the draft phase of `path`: its backbone's (`source`),
    which flags given must equal, and the draft steps given (more than it has had)."""
    for name, value in source.items():
        if name in given and given[name] != value:
            flag = FLAGS[name]
            raise TrainError(
                f"--draft-from {path} was trained with {flag} {value}; leave {flag} out to go on "
                f"with it, or give {flag} {value}"
            )
    settings = new_settings({**given, **source})
    done = carried["steps"] - settings.backbone_steps
    if settings.draft_steps <= done:
        raise TrainError(
            f"--draft-from {path} has had {done} draft steps already; --draft-steps counts them all, "
            f"so ask for more than {done}"
        )
    return settings


def init_settings(given: dict, source_seed: int, path: str) -> TrainSettings:
    """The settings of a new run that starts from the weights of `path`: those given, its seed by
    default the source's plus one, never the source's own (the same seed draws the same batches,
    so the run would see again what the source was trained on, step for step)."""
    if given.get("seed", source_seed + 1) == source_seed:
        raise TrainError(
            f"--init-from {path} was trained with --seed {source_seed}, whose batches the run would draw "
            f"again; give another --seed, or leave it out for {source_seed + 1}"
        )
    return new_settings({"seed": source_seed + 1, **given})


def initialized_record(carried: dict, manifest: dict) -> dict:
    """What a run started with --init-from keeps of its source: where it was, the sha256 of its
    manifest, and the manifest's facts (its recipe, time, tokens and held-out loss; its own source,
    if it had one), without the file list."""
    return {
        "path": carried["path"],
        "manifest_sha256": carried["manifest_sha256"],
        "facts": {k: v for k, v in manifest.items() if k not in ("files", "format")},
    }


def compiled_sinkhorn(enabled: bool):
    """torch.compile of the Sinkhorn split (a long chain of small elementwise steps: several times
    faster fused), or None (eager) where disabled or the compiler is unavailable."""
    if not enabled:
        return None
    from ..kernels import hc_split_sinkhorn

    try:
        return torch.compile(hc_split_sinkhorn, dynamic=False)
    except Exception as exc:  # noqa: BLE001 (any compiler failure: train eagerly)
        print(f"dsv41 train: torch.compile is unavailable ({exc}); training without it", file=sys.stderr)
        return None


class Trainer:
    """One work folder's run: the corpus, tokenizer and streams, the model it trains through and its
    state (the float32 master weights `params`).

    `given`: the settings chosen (TrainSettings field -> value); the rest are the defaults for a
    new run, the source's backbone settings for one that goes on from `draft_from`, and, with
    `resume`, the run's own, which those given must equal. Everything about the folder, the
    source and the saved state's settings is checked before any work (TrainError otherwise).
    `init_from`: a miniature checkpoint whose weights (backbone and draft, as released) the run
    starts from instead of the seed's random ones; the run is otherwise new, with its own settings
    and schedule."""

    def __init__(
        self,
        folder: str,
        given: dict | None = None,
        *,
        resume: bool = False,
        compile: bool = True,
        progress: bool | None = None,
        draft_from: str | None = None,
        init_from: str | None = None,
    ):
        from ..checkpoint.engram import NgramHasher
        from .corpus import load_corpus

        given = dict(given or {})
        settings_from(given, "the settings given")  # kinds and ranges, before anything is read
        if draft_from is not None and init_from is not None:
            raise TrainError(
                "--draft-from and --init-from cannot be given together: --draft-from goes on with a "
                "checkpoint's draft phase, --init-from starts a new run from its weights"
            )
        carried = source = initialized = None
        if draft_from is not None and not resume:
            carried, source, _ = read_source(draft_from)
        if init_from is not None and not resume:
            found, source_settings, manifest = read_source(init_from, "--init-from")
            initialized = initialized_record(found, manifest)
        self.folder = str(inspect(folder))
        state_path = os.path.join(self.folder, STATE_NAME)
        if resume:
            if not os.path.lexists(state_path):
                raise TrainError(
                    f"{folder}: nothing to resume (no {STATE_NAME}: the run never reached its first "
                    f"checkpoint); start it without --resume"
                )
            document = read_state_json(self.folder)
            settings, _ = check_document(document, state_path)
            conflicting(given, settings, f"the run in {folder}")
            recorded = document["continued_from"]
            if draft_from is not None and (recorded is None or os.path.realpath(draft_from) != recorded["path"]):
                went_on = f"went on from {recorded['path']}" if recorded else "did not go on from a checkpoint"
                raise TrainError(f"the run in {folder} {went_on}; resume it without --draft-from")
            started = document.get("initialized_from")
            if init_from is not None and (started is None or os.path.realpath(init_from) != started["path"]):
                began = f"started from {started['path']}" if started else "started from random weights"
                raise TrainError(f"the run in {folder} {began}; resume it without --init-from")
            if not tokenizer_written(self.folder):
                raise TrainError(
                    f"{os.path.join(self.folder, TOKENIZER_NAME)} is missing or not the tokenizer the "
                    f"run started with; the run cannot go on: start it again in a new folder"
                )
        elif os.path.lexists(state_path):
            raise TrainError(
                f"{folder} already holds a training run ({STATE_NAME}); pass --resume to go on "
                f"with it, or give another --out"
            )
        elif carried:
            settings = draft_settings(given, carried, source, draft_from)
        elif initialized:
            settings = init_settings(given, source_settings["seed"], init_from)
        else:
            settings = new_settings(given)
        check_memory(settings)
        claim(folder)  # created and marked, now that the run can start

        tok_path = os.path.join(self.folder, TOKENIZER_NAME)
        if resume:  # the whole state checked before the corpus is read
            self.tokenizer, self.cfg = miniature_tokenizer(tok_path)
            self.state = TrainState.load(self.folder, self.shapes(), optimizer_names(self.shapes()))
            self.corpus = load_corpus()
        else:
            self.corpus = load_corpus()
            source_path = draft_from if carried is not None else init_from
            if source_path is not None:
                replace_file(tok_path, lambda tmp: shutil.copyfile(os.path.join(source_path, TOKENIZER_NAME), tmp))
                record_tokenizer(self.folder)
            elif not tokenizer_written(self.folder):  # else the one an interrupted start of this run wrote
                from ..checkpoint.tokenizer import build_tiny_tokenizer

                replace_file(tok_path, build_tiny_tokenizer(texts=list(self.corpus.train.values())).save)
                record_tokenizer(self.folder)
            self.tokenizer, self.cfg = miniature_tokenizer(tok_path)
            if carried is not None:
                # the backbone as released, decoded: the draft phase freezes it on its storage grid again
                self.state = TrainState(
                    settings,
                    checkpoint_params(draft_from),
                    step=carried["steps"],
                    seconds=carried["training_seconds"],
                    continued_from=carried,
                )
            elif initialized is not None:
                # the source's weights as released, decoded: the run trains on from them
                self.state = TrainState(settings, checkpoint_params(init_from), initialized_from=initialized)
            else:
                self.state = TrainState(settings, initialized_params(self.cfg, settings.seed))
        self.streams = build_streams(
            self.corpus, self.tokenizer, int(self.cfg.eos_token_id), os.path.join(self.folder, TOKENS_NAME)
        )
        self.hasher = NgramHasher.from_tokenizer(self.cfg, self.tokenizer)
        self.continued_from = self.state.continued_from
        self.initialized_from = self.state.initialized_from
        self.settings = self.state.settings
        self.params, self.specs = self.state.params, weight_specs(self.cfg)
        s = self.settings
        # the inference model, summing in training's order (Numerics(summation="fast"))
        self.model = trainable_model(
            self.cfg,
            numerics=Numerics(summation="fast"),
            batch=s.batch,
            seq_len=s.seq_len,
            split=compiled_sinkhorn(compile),
        )
        self.names_of = {id(p): n for n, p in self.params.items()}
        self.progress = sys.stderr.isatty() if progress is None else progress

    def shapes(self) -> dict[str, tuple]:
        """Parameter name -> logical shape, of the miniature's geometry for this tokenizer."""
        return {name: logical_shape(spec) for name, (spec, _) in weight_specs(self.cfg).items()}

    # ------------------------------------------------------------------ data
    def hash_ids(self, inputs: torch.Tensor) -> torch.Tensor:
        self.hasher.reset()
        return self.hasher(inputs)

    def batch(self, step: int):
        gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + step)
        return train_batch(
            self.streams.train, self.settings.batch, self.settings.seq_len, int(self.cfg.bos_token_id), gen
        )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def held_out_loss(
        self, params: dict | None = None, *, qat: bool, limit: int | None, model: Model | None = None
    ) -> dict:
        """Mean next-token loss over held-out windows, in nats per token and bits per byte, of
        `params` (the run's by default) through `model` (the training model by default; one built
        with `Numerics()` gives the loaded checkpoint's arithmetic)."""
        model = model or self.model
        values = weights(params if params is not None else self.params, self.specs, qat)
        set_qat(model, qat)
        nats, tokens, n_bytes = 0.0, 0, 0
        batch_in, batch_out = [], []

        def flush():
            nonlocal nats, tokens, n_bytes
            inputs, targets = torch.cat(batch_in), torch.cat(batch_out)
            with holding(model, values):
                logits = run_forward(model, inputs, self.hash_ids(inputs), index_loss=False).logits
            nats += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
            n_bytes += int(self.streams.token_bytes[targets.numpy()].sum())
            batch_in.clear(), batch_out.clear()

        for inputs, targets in held_out_windows(
            self.streams.held_out, self.settings.seq_len, int(self.cfg.bos_token_id), limit
        ):
            batch_in.append(inputs), batch_out.append(targets)
            if len(batch_in) == self.settings.batch:
                flush()
        if batch_in:
            flush()
        return {
            "nats_per_token": nats / tokens,
            "bits_per_byte": nats_to_bits(nats) / n_bytes,
            "tokens": tokens,
            "bytes": n_bytes,
        }

    # ------------------------------------------------------------------ backbone
    def optimizer_for(self, names: list[str], lr: float) -> torch.optim.Optimizer:
        for name in self.params:
            self.params[name].requires_grad_(name in names)
        decay = [self.params[n] for n in names if self.params[n].dim() >= 2]
        other = [self.params[n] for n in names if self.params[n].dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.settings.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.95),
        )
        return opt

    def backbone_step(self, step: int, opt) -> dict:
        s = self.settings
        inputs, targets = self.batch(step)
        lr = lr_at(step, s.backbone_steps, s.lr, s.warmup, s.min_lr_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        qat = s.phase(step) == "qat"
        set_qat(self.model, qat)
        with holding(self.model, weights(self.params, self.specs, qat)):
            out = run_forward(self.model, inputs, self.hash_ids(inputs))
            lm = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
            kl = sum(out.index_kl.values()) / max(1, len(out.index_kl))
            loss = lm + s.index_loss_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        spread = self.balance(out.expert_load)
        return {
            "step": step,
            "phase": s.phase(step),
            "loss": lm.item(),
            "index_kl": float(kl.detach()) if torch.is_tensor(kl) else float(kl),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "load_spread": spread,
        }

    @torch.no_grad()
    def balance(self, loads: dict) -> float:
        """Auxiliary-loss-free balancing: each routing bias moves by balance_rate toward equal load
        (up for experts below the mean, down above). Returns the mean max/mean load ratio."""
        ratios = []
        for layer, load in loads.items():
            load = load.float()
            n_layers = self.cfg.n_layers
            prefix = f"layers.{layer}." if layer < n_layers else f"mtp.{layer - n_layers}."
            bias = self.params[prefix + "ffn.gate.bias"]
            bias += self.settings.balance_rate * torch.sign(load.mean() - load)
            ratios.append((load.max() / load.mean()).item())
        return sum(ratios) / max(1, len(ratios))

    # ------------------------------------------------------------------ the run
    def run(self, stop_at: int | None = None) -> TrainState:
        """Train up to the last step (or `stop_at`), with a checkpoint at the end."""
        from tqdm import tqdm

        s, state = self.settings, self.state
        draft = None
        opt = None
        bar = tqdm(
            total=s.steps,
            initial=state.step,
            desc="train",
            unit="step",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        tokens_per_step = s.batch * s.seq_len
        last_save = time.perf_counter()
        try:
            end = s.steps if stop_at is None else min(s.steps, stop_at)
            while state.step < end:
                step, phase = state.step, s.phase(state.step)
                started = time.perf_counter()
                if phase == "draft":
                    if draft is None:
                        from .draft import DraftTrainer

                        draft = DraftTrainer(self)
                        opt = draft.optimizer(
                            state.optimizer if state.optimizer and state.optimizer["phase"] == "draft" else None
                        )
                    record = draft.step(step, opt)
                else:
                    if opt is None:
                        opt = self.optimizer_for(trainable_names(self.params, exclude=("mtp.",)), s.lr)
                        if state.optimizer and state.optimizer["phase"] == "backbone":
                            restore_moments(opt, self.names_of, state.optimizer["moments"])
                    record = self.backbone_step(step, opt)
                elapsed = time.perf_counter() - started
                state.seconds += elapsed
                record["seconds"] = elapsed
                state.log.append(record)
                state.step += 1
                bar.update(1)
                bar.set_postfix_str(f"{phase} loss {record['loss']:.3f} {tokens_per_step / elapsed:,.0f} tok/s")
                if phase != "draft" and (state.step % s.eval_every == 0 or state.step == s.backbone_steps):
                    held = self.held_out_loss(qat=phase == "qat", limit=s.eval_windows)
                    state.evals.append({"step": state.step, **held})
                    bar.write(
                        f"step {state.step}: held-out {held['bits_per_byte']:.3f} bits/byte "
                        f"({held['nats_per_token']:.3f} nats/token)"
                    )
                if state.step == s.backbone_steps:
                    opt = None  # the draft phase builds its own
                    state.optimizer = None
                if state.step % s.checkpoint_every == 0 or state.step == end or time.perf_counter() - last_save > 300:
                    if opt is not None:
                        state.optimizer = {
                            "phase": "draft" if phase == "draft" else "backbone",
                            "moments": optimizer_moments(opt, self.names_of),
                        }
                    state.save(self.folder)
                    last_save = time.perf_counter()
        except KeyboardInterrupt:
            # a step cut half way is not saved: the run resumes from its last checkpoint
            bar.close()
            raise
        bar.close()
        return state
