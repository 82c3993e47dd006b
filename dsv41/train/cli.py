"""`dsv41 train`: train the miniature, then measure it and write it in the release format.

After the last step: held-out bits per byte of the master weights and of the release rounding (the
checkpoint as `dsv41.load` reads it: the training model under `Numerics()`), of the random initialization, and of
gzip -9 / zstd -19 on the same text; the loss curve as PNG, SVG and a JSON sidecar; the checkpoint
with its manifest in OUT/checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from typing import Iterator

from ..core.errors import Dsv41Error


def finish(trainer, *, progress: bool, windows: int | None = None) -> dict:
    """Measure the trained state and write OUT/checkpoint; returns the facts (also in the manifest)."""
    import os

    import torch

    from ..core.numerics import Numerics
    from ..core.outdir import write_json
    from .data import compressor_bits_per_byte
    from .masters import initialized_params, trainable_model
    from .release import write_miniature
    from .workdir import CHECKPOINT_NAME, FACTS_NAME, LOSS_CURVE_STEM

    state, settings = trainer.state, trainer.settings
    say = (lambda m: print(f"dsv41 train: {m}", file=sys.stderr)) if progress else (lambda m: None)
    say("measuring the held-out loss (master weights, release rounding, random initialization)")
    # the release rounding through the released runtime's arithmetic: the loaded checkpoint's logits
    exact = trainable_model(trainer.cfg, numerics=Numerics(), batch=settings.batch, seq_len=settings.seq_len)
    master = trainer.held_out_loss(qat=False, limit=windows)
    release = trainer.held_out_loss(qat=True, limit=windows, model=exact)
    random = trainer.held_out_loss(initialized_params(trainer.cfg, settings.seed), qat=False, limit=windows)
    compressors = compressor_bits_per_byte(trainer.streams.held_out_text)
    draft_log = [r for r in state.log if r["phase"] == "draft"]
    facts = {
        "corpus": trainer.corpus.manifest(),
        "seed": settings.seed,
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__},
        "steps": state.step,
        "training_seconds": round(state.seconds, 1),
        "tokens_seen": settings.batch * settings.seq_len * min(state.step, settings.backbone_steps),
        "held_out": {
            "master_weights": master,
            "release_format": release,
            "random_initialization": random,
            "compressors_bits_per_byte": compressors,
        },
        "final_train_loss": final_backbone_loss(state, settings, trainer.continued_from),
        "draft_agreement_by_row": (
            [
                sum(r["agreement_by_row"][i] for r in draft_log[-20:]) / len(draft_log[-20:])
                for i in range(len(draft_log[-1]["agreement_by_row"]))
            ]
            if draft_log
            else None
        ),
        "parameters": {
            "total": sum(v.numel() for v in state.params.values()),
            "draft": sum(v.numel() for k, v in state.params.items() if k.startswith("mtp.")),
        },
        "torch": torch.__version__,
    }
    if trainer.continued_from is not None:
        # the backbone steps ran in the source's run: its tokens, and the draft phase went on here
        facts["tokens_seen"] = trainer.continued_from["tokens_seen"]
        carried = trainer.continued_from
        facts["draft_continued_from"] = {
            k: v for k, v in carried.items() if k not in ("path", "initialized_from", "run_training_seconds")
        }
        if carried.get("initialized_from") is not None:
            # the source's run began from another checkpoint: this one goes on with that run, so its
            # lineage stays, and the run's own time is the source run's plus this draft phase's
            facts["initialized_from"] = carried["initialized_from"]
            own = float(carried.get("run_training_seconds") or 0) + state.seconds - carried["training_seconds"]
            facts["run_training_seconds"] = round(own, 1)
    if trainer.initialized_from is not None:
        # the weights began as the source's: its time and tokens count toward these, and its
        # facts (recipe, held-out loss, its own source) are kept beside this run's
        source = trainer.initialized_from["facts"]
        facts["run_training_seconds"] = facts["training_seconds"]
        facts["training_seconds"] = round(facts["training_seconds"] + float(source.get("training_seconds") or 0), 1)
        facts["tokens_seen"] += int(source.get("tokens_seen") or 0)
        facts["initialized_from"] = {"manifest_sha256": trainer.initialized_from["manifest_sha256"], **source}
    write_loss_curve(os.path.join(trainer.folder, LOSS_CURVE_STEM), state, facts)
    out = write_miniature(
        os.path.join(trainer.folder, CHECKPOINT_NAME), trainer.cfg, trainer.tokenizer, state.params, facts
    )
    write_json(os.path.join(trainer.folder, FACTS_NAME), facts)
    say(f"wrote {out}")
    return facts


def final_backbone_loss(state, settings, continued_from: dict | None):
    """Mean training loss of the backbone's last 20 steps: from this run's log, or from the source
    a --draft-from run continued (whose backbone steps it did not run)."""
    last = [r["loss"] for r in state.log if settings.backbone_steps - 20 <= r["step"] < settings.backbone_steps]
    if len(last) == 20:
        return sum(last) / 20
    return continued_from.get("final_train_loss") if continued_from else None


def write_loss_curve(stem: str, state, facts: dict) -> None:
    """The per-step training loss (and its 25-step mean), the held-out evaluations and the
    compressors' bits per byte, as stem.png / .svg / .json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..core.outdir import replace_file, write_json

    backbone = [r for r in state.log if r["phase"] != "draft"]
    steps = [r["step"] for r in backbone]
    loss = [r["loss"] for r in backbone]
    window = 25
    smooth = [sum(loss[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1) for i in range(len(loss))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, loss, lw=0.5, alpha=0.4, label="train loss (nats/token)")
    left.plot(steps, smooth, lw=1.5, label=f"{window}-step mean")
    qat_from = next((r["step"] for r in backbone if r["phase"] == "qat"), None)
    if qat_from is not None:
        left.axvline(qat_from, color="grey", ls=":", label="quantization-aware from here")
    left.set_xlabel("step")
    left.set_ylabel("nats / token")
    left.legend()
    evals = state.evals
    right.plot(
        [e["step"] for e in evals], [e["bits_per_byte"] for e in evals], "o-", label="held-out (periodic subset)"
    )
    for name, value in facts["held_out"]["compressors_bits_per_byte"].items():
        if value is not None:
            right.axhline(value, ls="--", lw=1, label=f"{name}: {value:.3f}")
    right.axhline(
        facts["held_out"]["release_format"]["bits_per_byte"],
        color="k",
        lw=1,
        label=f"release format, all held-out: {facts['held_out']['release_format']['bits_per_byte']:.3f}",
    )
    right.set_xlabel("step")
    right.set_ylabel("bits / byte")
    right.legend(fontsize=8)
    fig.suptitle("dsv41 train: the miniature on the Python standard library")
    fig.tight_layout()
    replace_file(stem + ".png", lambda tmp: fig.savefig(tmp, format="png", dpi=110, metadata={"Software": None}))
    replace_file(stem + ".svg", lambda tmp: fig.savefig(tmp, format="svg", metadata={"Date": None, "Creator": None}))
    plt.close(fig)
    write_json(stem + ".json", {"steps": steps, "loss": loss, "evals": evals, "held_out": facts["held_out"]})


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's stop): the run stops as on Ctrl-C, at once, its checkpoints kept."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises Terminated in the main thread. A run started in the background by
    a shell without job control ignores SIGINT, so `kill` is how such a run is stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cli_main(argv: list[str]) -> int:
    from ..core.argtypes import whole_number
    from ..core.text import brief
    from ..core.threads import machine_cores
    from .state import FLAGS, INT_BOUNDS, MAX_RATE, MAX_STEPS, MAX_WINDOWS, TrainSettings

    defaults = TrainSettings()

    def bounded(name: str, unit: str):
        return whole_number(*INT_BOUNDS[name], unit)

    def rate(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not 0 < value <= MAX_RATE:
            raise argparse.ArgumentTypeError(f"must be a number above 0 and at most {MAX_RATE}, got {brief(text)}")
        return value

    parser = argparse.ArgumentParser(
        prog="dsv41 train",
        description=(
            "Train the miniature V4.1 on the running Python's standard library, from scratch or (--init-from) "
            "from a miniature checkpoint, then write it in the release format to OUT/checkpoint. With no flags "
            "it is the first of the shipped miniature's three runs: about 2 h 20 min on an idle two-core AMD EPYC "
            "with AVX-512 BF16 (4,080 backbone steps at about 1.07 s, 720 quantization-aware ones at 1.6 s, the "
            "greedy pool in about 3 min, 1,600 draft steps at 1.47 s, 3.4 min of final measurement); the second "
            "is --init-from that checkpoint with --steps 2000 --draft-steps 800 --lr 1e-3, the third --init-from the "
            "second's with --steps 3600 --draft-steps 1000 --lr 1e-3, each one's draft stack then taken on with "
            "--draft-from and --draft-steps 1600, the third's again with --draft-steps 4000 and then with "
            "--draft-steps 5600 --pool-sequences 1024 (README: the trained miniature). "
            "OUT must be new, empty or a folder dsv41 train wrote; "
            "--resume goes on with the settings the run was started with; Ctrl-C or SIGTERM stops a run at once, "
            "its last checkpoint (every 25 steps) kept."
        ),
    )
    parser.add_argument(
        "--out",
        default="outputs/train",
        help="work folder: state, tokenizer, figures, checkpoint (default outputs/train)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="go on from OUT's last checkpoint, with the run's own settings"
    )
    parser.add_argument(
        "--steps",
        type=bounded("backbone_steps", "steps"),
        default=None,
        help=f"backbone steps (default {defaults.backbone_steps})",
    )
    parser.add_argument(
        "--draft-steps",
        type=bounded("draft_steps", "steps"),
        default=None,
        help=f"DSpark draft steps after them (default {defaults.draft_steps})",
    )
    parser.add_argument(
        "--pool-sequences",
        type=bounded("pool_sequences", "sequences"),
        default=None,
        metavar="N",
        help=f"sequences of the target's own greedy continuations the draft phase reads every other step, "
        f"decoded at its start (default {defaults.pool_sequences}: about 2.5 minutes here; each run on one seed "
        "draws the same prompts, the first N of a larger pool alike, so a --draft-from run that goes on with "
        "the same N reads the continuations its source read)",
    )
    parser.add_argument(
        "--seed",
        type=bounded("seed", "the seed"),
        default=None,
        help=f"seed of the initial weights and the batches (default {defaults.seed})",
    )
    parser.add_argument(
        "--batch",
        type=bounded("batch", "sequences"),
        default=None,
        help=f"sequences a step (default {defaults.batch}; at most what this machine's memory holds)",
    )
    parser.add_argument(
        "--seq-len",
        type=bounded("seq_len", "tokens"),
        default=None,
        help=f"tokens a sequence (default {defaults.seq_len})",
    )
    parser.add_argument(
        "--draft-from",
        default=None,
        metavar="CHECKPOINT",
        help="go on with the draft phase of a miniature checkpoint (OUT/checkpoint of a finished run, or "
        "the packaged one; its files held to its manifest's sha256s), its backbone frozen as released "
        "and its settings (--steps, --seed, --batch, --seq-len, --lr) kept, up to --draft-steps draft steps in all "
        "(new optimizer moments, the draft schedule's cosine over them all taken up where it stands: no warm-up)",
    )
    parser.add_argument(
        "--init-from",
        default=None,
        metavar="CHECKPOINT",
        help="start from the weights of a miniature checkpoint (backbone and draft, as released; its files held "
        "to its manifest's sha256s) instead of random ones: a new run of --steps and --draft-steps more, with its "
        "own warm-up and schedule, its seed the source's plus one unless given; the checkpoint's manifest counts "
        "the source's time and tokens and keeps its facts",
    )
    parser.add_argument(
        "--lr",
        type=rate,
        default=None,
        help=f"the backbone's peak learning rate (default {defaults.lr:g})",
    )
    parser.add_argument(
        "--stop-at",
        type=whole_number(1, 2 * MAX_STEPS, "steps"),
        default=None,
        metavar="STEP",
        help="stop after STEP steps with a checkpoint, to go on later with --resume",
    )
    parser.add_argument(
        "--held-out-windows",
        type=whole_number(1, MAX_WINDOWS, "windows"),
        default=None,
        metavar="N",
        help="measure the final held-out loss on the first N windows only (default: all of them)",
    )
    parser.add_argument("--no-compile", action="store_true", help="run the Sinkhorn split eagerly (no torch.compile)")
    parser.add_argument(
        "--threads",
        type=whole_number(1, machine_cores(), "threads"),
        default=None,
        help="torch threads (default: every CPU)",
    )
    args = parser.parse_args(argv)
    given = {
        name: getattr(args, flag[2:].replace("-", "_"))
        for name, flag in FLAGS.items()
        if getattr(args, flag[2:].replace("-", "_")) is not None
    }
    import torch

    from .loop import Trainer
    from .state import TrainError, saved_step

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    trainer = None
    try:
        with sigterm_as_interrupt():
            trainer = Trainer(
                args.out,
                given,
                resume=args.resume,
                compile=not args.no_compile,
                progress=None,
                draft_from=args.draft_from,
                init_from=args.init_from,
            )
            trainer.run(stop_at=args.stop_at)
            if trainer.state.step < trainer.settings.steps:
                print(
                    f"dsv41 train: stopped at step {trainer.state.step} of {trainer.settings.steps}; "
                    f"`dsv41 train --out {args.out} --resume` goes on",
                    file=sys.stderr,
                )
                return 0
            facts = finish(trainer, progress=True, windows=args.held_out_windows)
    except KeyboardInterrupt as exc:
        step = saved_step(trainer.folder if trainer is not None else args.out)
        if step is None:
            print(
                "dsv41 train: interrupted before the run's first checkpoint, so there is nothing to resume; "
                f"`dsv41 train --out {args.out}` starts it again",
                file=sys.stderr,
            )
        else:
            print(
                f"dsv41 train: interrupted; `dsv41 train --out {args.out} --resume` goes on from the checkpoint "
                f"at step {step}",
                file=sys.stderr,
            )
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    except (TrainError, Dsv41Error) as exc:
        print(f"dsv41 train: {exc}", file=sys.stderr)
        return 1
    held = facts["held_out"]
    print(
        f"{args.out}/checkpoint: {facts['steps']} steps in {facts['training_seconds'] / 60:.1f} min of training "
        f"({(time.perf_counter() - started) / 60:.1f} min this run); held-out bits/byte: "
        f"{held['release_format']['bits_per_byte']:.3f} release format, {held['master_weights']['bits_per_byte']:.3f} "
        f"before quantization, {held['random_initialization']['bits_per_byte']:.3f} random; "
        + ", ".join(
            f"{k} {v:.3f}" if v is not None else f"{k} not measured (no zstd)"
            for k, v in held["compressors_bits_per_byte"].items()
        )
    )
    return 0
