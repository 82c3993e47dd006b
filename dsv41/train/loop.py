"""`dsv41 train`: the miniature trained from scratch on this machine, resumable.

Phases, by step: the backbone (language-model loss plus the indexers' KL loss, the routing biases
balanced without an auxiliary loss), its last `qat_fraction` quantization-aware (`Twin.weights(qat=True)`),
then the DSpark draft stack on the frozen, release-rounded target (`draft`). Everything random
comes from the seed and the step, so a run cut anywhere and resumed from its last checkpoint takes
the same batches. The work folder keeps `state.pt` (weights, optimizer, log), the tokenizer and the
token streams; the result is written in the release format by `release.write_miniature`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import Dsv41Error
from .data import build_streams, held_out_windows, nats_to_bits, train_batch, write_json
from .twin import Twin

STATE_NAME = "state.pt"
TOKENIZER_NAME = "tokenizer.json"
CONTINUED_NAME = "continued_from.json"  # a --draft-from run: what it carries from its source


class TrainError(Dsv41Error):
    pass


@dataclass(frozen=True)
class TrainSettings:
    backbone_steps: int = 1500
    draft_steps: int = 200
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


@dataclass
class TrainState:
    settings: TrainSettings
    params: dict
    step: int = 0
    optimizer: dict | None = None  # the backbone's, then the draft's
    log: list = field(default_factory=list)  # one dict per step
    evals: list = field(default_factory=list)
    seconds: float = 0.0  # training time over all sessions

    def save(self, folder: str) -> None:
        path = os.path.join(folder, STATE_NAME)
        tmp = path + ".partial"
        torch.save({"settings": dataclasses.asdict(self.settings), "params": {k: v.detach() for k, v in self.params.items()},
                    "step": self.step, "optimizer": self.optimizer, "log": self.log, "evals": self.evals,
                    "seconds": self.seconds}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, folder: str) -> "TrainState":
        saved = torch.load(os.path.join(folder, STATE_NAME), weights_only=False)
        return cls(TrainSettings(**saved["settings"]), saved["params"], saved["step"], saved["optimizer"],
                   saved["log"], saved["evals"], saved["seconds"])


def continued_from(path: str, settings: TrainSettings) -> dict:
    """What a run that goes on with the draft phase of the miniature checkpoint at `path` carries
    from its manifest (steps, seconds, the backbone's last training loss), checked against
    `settings`; TrainError in one sentence when it cannot."""
    from ..cachedir import file_sha256
    from ..miniature import MANIFEST_NAME, read_manifest

    manifest = read_manifest(path)
    if manifest is None:
        raise TrainError(f"{path} is not a miniature checkpoint (no dsv41-miniature.json); --draft-from takes "
                         f"what dsv41 train wrote (OUT/checkpoint) or the packaged one")
    before = manifest.get("settings", {})
    for name in ("backbone_steps", "seed", "batch", "seq_len"):
        if before.get(name) != getattr(settings, name):
            raise TrainError(f"{path} was trained with {name} {before.get(name)}; continue its draft phase with "
                             f"the same (--steps, --seed, --batch, --seq-len)")
    done = int(manifest["steps"]) - settings.backbone_steps
    if settings.draft_steps <= done:
        raise TrainError(f"{path} has had {done} draft steps already; --draft-steps counts them all, so ask for more")
    return {"manifest_sha256": file_sha256(os.path.join(path, MANIFEST_NAME)), "steps": int(manifest["steps"]), "training_seconds": float(manifest.get("training_seconds", 0.0)),
            "final_train_loss": manifest.get("final_train_loss"), "tokens_seen": manifest.get("tokens_seen")}


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warm-up, then cosine down to floor * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


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
    """One work folder's run: the corpus, tokenizer and streams, the twin and its state."""

    def __init__(self, folder: str, settings: TrainSettings, *, resume: bool, compile: bool = True,
                 progress: bool | None = None, draft_from: str | None = None):
        from ..engram import NgramHasher
        from ..tiny import tiny_config
        from ..tokenizer import build_tiny_tokenizer
        from .corpus import load_corpus

        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        state_path = os.path.join(folder, STATE_NAME)
        if os.path.exists(state_path) and not resume:
            raise TrainError(f"{folder} already holds a training run ({STATE_NAME}); pass --resume to go on "
                             f"with it, or give another --out")
        if resume and not os.path.exists(state_path):
            raise TrainError(f"{folder}: nothing to resume (no {STATE_NAME}); start without --resume")
        if draft_from is not None:
            if resume:
                raise TrainError("--draft-from starts a run; go on with it later with --resume alone")
            source = continued_from(draft_from, settings)
            shutil.copyfile(os.path.join(draft_from, TOKENIZER_NAME), os.path.join(folder, TOKENIZER_NAME))
            with open(os.path.join(folder, CONTINUED_NAME), "w", encoding="utf-8") as f:
                json.dump(source, f, indent=1, sort_keys=True)
        self.corpus = load_corpus()
        tok_path = os.path.join(folder, TOKENIZER_NAME)
        if os.path.exists(tok_path):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(tok_path)
        else:
            self.tokenizer = build_tiny_tokenizer(texts=list(self.corpus.train.values()))
            self.tokenizer.save(tok_path)
        self.cfg = tiny_config(self.tokenizer)
        self.streams = build_streams(self.corpus, self.tokenizer, int(self.cfg.eos_token_id),
                                     os.path.join(folder, "tokens.npz"))
        self.hasher = NgramHasher.from_tokenizer(self.cfg, self.tokenizer)
        if resume:
            self.state = TrainState.load(folder)
            if self.state.settings.seed != settings.seed or self.state.settings.batch != settings.batch \
                    or self.state.settings.seq_len != settings.seq_len:
                raise TrainError(f"{folder} was started with seed {self.state.settings.seed}, batch "
                                 f"{self.state.settings.batch}, seq_len {self.state.settings.seq_len}; resume with those")
            # the step counts may grow on resume (train longer); everything else is the run's own
            self.state.settings = dataclasses.replace(self.state.settings, backbone_steps=settings.backbone_steps,
                                                      draft_steps=settings.draft_steps)
        elif draft_from is not None:
            # the backbone as released, decoded: the draft phase freezes it on its storage grid again
            self.state = TrainState(settings, Twin.from_checkpoint(draft_from).params, step=source["steps"],
                                    seconds=source["training_seconds"])
        else:
            self.state = TrainState(settings, Twin.initialized(self.cfg, settings.seed).params)
        continued = os.path.join(folder, CONTINUED_NAME)
        self.continued_from = None
        if os.path.exists(continued):
            with open(continued, encoding="utf-8") as f:
                self.continued_from = json.load(f)
        self.settings = self.state.settings
        self.twin = Twin(self.cfg, self.state.params, exact=False, split=compiled_sinkhorn(compile))
        self.progress = sys.stderr.isatty() if progress is None else progress

    # ------------------------------------------------------------------ data
    def hash_ids(self, inputs: torch.Tensor) -> torch.Tensor:
        self.hasher.reset()
        return self.hasher(inputs)

    def batch(self, step: int):
        gen = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + step)
        return train_batch(self.streams.train, self.settings.batch, self.settings.seq_len,
                           int(self.cfg.bos_token_id), gen)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def held_out_loss(self, twin: Twin | None = None, *, qat: bool, limit: int | None) -> dict:
        """Mean next-token loss over held-out windows, in nats per token and bits per byte."""
        twin = twin or self.twin
        weights = twin.weights(qat)
        nats, tokens, n_bytes = 0.0, 0, 0
        batch_in, batch_out = [], []

        def flush():
            nonlocal nats, tokens, n_bytes
            inputs, targets = torch.cat(batch_in), torch.cat(batch_out)
            logits = twin.forward(inputs, self.hash_ids(inputs), qat=qat, index_loss=False, weights=weights).logits
            nats += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
            n_bytes += int(self.streams.token_bytes[targets.numpy()].sum())
            batch_in.clear(), batch_out.clear()

        for inputs, targets in held_out_windows(self.streams.held_out, self.settings.seq_len,
                                                int(self.cfg.bos_token_id), limit):
            batch_in.append(inputs), batch_out.append(targets)
            if len(batch_in) == self.settings.batch:
                flush()
        if batch_in:
            flush()
        return {"nats_per_token": nats / tokens, "bits_per_byte": nats_to_bits(nats) / n_bytes,
                "tokens": tokens, "bytes": n_bytes}

    # ------------------------------------------------------------------ backbone
    def optimizer_for(self, names: list[str], lr: float) -> torch.optim.Optimizer:
        for name in self.twin.params:
            self.twin.params[name].requires_grad_(name in names)
        decay = [self.twin.params[n] for n in names if self.twin.params[n].dim() >= 2]
        other = [self.twin.params[n] for n in names if self.twin.params[n].dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.settings.weight_decay},
                                 {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
        return opt

    def backbone_step(self, step: int, opt) -> dict:
        s = self.settings
        inputs, targets = self.batch(step)
        lr = lr_at(step, s.backbone_steps, s.lr, s.warmup, s.min_lr_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        out = self.twin.forward(inputs, self.hash_ids(inputs), qat=s.phase(step) == "qat")
        lm = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        kl = sum(out.index_kl.values()) / max(1, len(out.index_kl))
        loss = lm + s.index_loss_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        spread = self.balance(out.expert_load)
        return {"step": step, "phase": s.phase(step), "loss": lm.item(), "index_kl": float(kl.detach()) if torch.is_tensor(kl) else float(kl), "lr": lr,
                "grad_norm": float(grad_norm), "load_spread": spread}

    @torch.no_grad()
    def balance(self, loads: dict) -> float:
        """Auxiliary-loss-free balancing: each routing bias moves by balance_rate toward equal load
        (up for experts below the mean, down above). Returns the mean max/mean load ratio."""
        ratios = []
        for layer, load in loads.items():
            load = load.float()
            n_layers = self.cfg.n_layers
            prefix = f"layers.{layer}." if layer < n_layers else f"mtp.{layer - n_layers}."
            bias = self.twin.params[prefix + "ffn.gate.bias"]
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
        bar = tqdm(total=s.steps, initial=state.step, desc="train", unit="step", file=sys.stderr,
                   disable=not self.progress, dynamic_ncols=True)
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
                        opt = draft.optimizer(state.optimizer if state.optimizer and state.optimizer.get("phase") == "draft" else None)
                    record = draft.step(step, opt)
                else:
                    if opt is None:
                        opt = self.optimizer_for(self.twin.trainable(exclude=("mtp.",)), s.lr)
                        if state.optimizer and state.optimizer.get("phase") == "backbone":
                            opt.load_state_dict(state.optimizer["state"])
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
                    bar.write(f"step {state.step}: held-out {held['bits_per_byte']:.3f} bits/byte "
                              f"({held['nats_per_token']:.3f} nats/token)")
                if state.step == s.backbone_steps:
                    opt = None  # the draft phase builds its own
                    state.optimizer = None
                if state.step % s.checkpoint_every == 0 or state.step == end \
                        or time.perf_counter() - last_save > 300:
                    if opt is not None:
                        state.optimizer = {"phase": "draft" if phase == "draft" else "backbone", "state": opt.state_dict()}
                    state.save(self.folder)
                    last_save = time.perf_counter()
        except KeyboardInterrupt:
            # a step cut half way is not saved: the run resumes from its last checkpoint
            bar.close()
            raise
        bar.close()
        return state
