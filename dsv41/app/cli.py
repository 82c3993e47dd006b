"""The `dsv41` command. Each subcommand lives in the module that owns its subject and is imported
only when called, so `dsv41 audit` and `dsv41 config` run without importing torch; `generate`,
which joins the loader and the generation loop, lives here, above both."""

import argparse
import importlib
import sys
from typing import Optional

# name -> (module, entry function taking argv and returning an exit code, one-line help)
COMMANDS = {
    "config": (
        "dsv41.core.config",
        "cli_main",
        "read a config (either released layout), print its shape and verify it",
    ),
    "audit": (
        "dsv41.checkpoint.audit",
        "cli_main",
        "header-only audit of a checkpoint directory (never reads a payload)",
    ),
    "make-tiny": ("dsv41.checkpoint.tiny", "cli_main", "write the random tiny checkpoint in the exact release format"),
    "train": (
        "dsv41.train.cli",
        "cli_main",
        "train the miniature V4.1 on the standard library, resumable, and write it in the release format",
    ),
    "parse-rate": (
        "dsv41.observe.parse_rate",
        "cli_main",
        "the share of greedy continuations of held-out function headers that parse once their blocks are closed",
    ),
    "make-headers": (
        "dsv41.checkpoint.headers",
        "cli_main",
        "synthesize the released checkpoint's 48 shard headers (no payload)",
    ),
    "make-synthetic": (
        "dsv41.checkpoint.released_synthetic",
        "cli_main",
        "write the whole released geometry (475 GiB apparent) in about 11 GiB: random dense weights, "
        "experts and Engram as holes",
    ),
    "engram": (
        "dsv41.checkpoint.engram",
        "cli_main",
        "Engram layout, multipliers and hash ids for a config (and tokenizer)",
    ),
    "generate": ("dsv41.app.cli", "generate_main", "generate text from a checkpoint (default: the embedded miniature)"),
    "chat": (
        "dsv41.app.cli",
        "chat_main",
        "chat with a checkpoint on the terminal, one message per line (default: the embedded miniature)",
    ),
    "notebooks": (
        "dsv41.app.notebooks",
        "cli_main",
        "execute every notebook with papermill into a new outputs/run-NNN (figures, sidecars, summary)",
    ),
    "replay": (
        "dsv41.observe.cache_policy",
        "cli_main",
        "replay a saved trace's routing through expert-cache policies (LRU, LFU, static, Belady): "
        "hit rates and disk bytes per token",
    ),
    "bench": (
        "dsv41.bench",
        "cli_main",
        "benchmarks as ratios measured in one run: experts (fused vs expanded, vs "
        "copy bandwidth and BF16 GEMM), decode (end to end, the released geometry "
        "against its floor, speculative), prefill, vision, threads",
    ),
    "ablate": (
        "dsv41.observe.experiments",
        "cli_main",
        "what each mechanism is worth on held-out text: bits per byte with Engram, the indexer's top-k, each "
        "routed expert or the hyper-connections taken away, with bootstrap intervals, and activation patching",
    ),
    "lab": (
        "dsv41.app.lab",
        "cli_main",
        "copy the notebooks into outputs/lab (edited copies kept) and start JupyterLab there",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: dsv41 COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "`dsv41 COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dsv41: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    entry = getattr(importlib.import_module(module_name), function_name)
    return entry(rest)


# ---------------------------------------------------------------------- dsv41 generate
def generate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 generate",
        description=(
            "Generate from a checkpoint (default: the embedded miniature, trained on the Python standard library, "
            "so it continues Python code and prose about Python). The generated text goes to stdout; "
            "the load report, timings and errors to stderr."
        ),
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded miniature)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image to read (repeatable, in order): each takes the place of the next image "
        "placeholder <｜deepseek_image｜> in the prompt; a prompt without one gets its "
        "images first, before the text",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N", help="tokens to generate (default 16)")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="positions the caches are sized for (default: the model's maximum, at most 4096)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (temperature > 0)")
    parser.add_argument("--expert-cache", type=int, default=None, metavar="N", help="packed experts kept per layer")
    _memory_args(parser)
    parser.add_argument("--resident-engram", action="store_true", help="copy the Engram tables into RAM first")
    parser.add_argument(
        "--expert-device",
        default="cpu",
        metavar="DEV",
        help="where routed experts run: cpu (default), cuda, cuda:1 or a comma-separated list; "
        "without CUDA the CPU runs them, with one line on stderr",
    )
    parser.add_argument(
        "--numerics",
        choices=("reference", "parity"),
        default="reference",
        help="reference (default): the released runtime's arithmetic; parity: a prefill, the same "
        "tokens decoded one at a time and any chunking agree bit for bit (uniform window "
        "layout, padded float32 GEMMs, ties to the lower position, fresh index keys)",
    )
    parser.add_argument(
        "--fix-stale-index-keys",
        action="store_true",
        help="republish a Full layer's own index keys every step (the Transformers port's fix)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="prefill the prompt N tokens per forward, with a progress bar (default: one forward)",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="decode with the DSpark draft stack: each step drafts a block, verifies it in one "
        "forward and keeps what the model agrees with (greedy: the same tokens as plain greedy "
        "decoding under --numerics parity; with --temperature the rejection rule keeps plain "
        "sampling's distribution)",
    )
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with --speculative: proposals per step, 1 to the draft block (default: the block, 5)",
    )
    parser.add_argument(
        "--min-confidence",
        type=float,
        default=None,
        metavar="C",
        help="with --speculative: drop the proposals from the first whose confidence is below C "
        "(default 0.5; 0 keeps them all)",
    )
    parser.add_argument(
        "--threads",
        type=_threads_arg,
        default="auto",
        metavar="auto|N",
        help="torch intra-op threads, which the native expert kernel uses too: auto (default) is one "
        "thread for a model with small expert matrices (the embedded checkpoint), every core "
        "otherwise (the released geometry); N sets N; the load report says which",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="run as one rank of a torchrun group (torchrun --nproc-per-node N -m dsv41 generate "
        "--expert-parallel ...): each rank holds and computes the routed experts e with "
        "e %% world_size == rank, the rest runs on every rank; rank 0 prints the generation "
        "and any rank's error",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or report on stderr")
    args = parser.parse_args(argv)
    if not args.speculative:
        given = [
            flag
            for flag, value in (("--draft-tokens", args.draft_tokens), ("--min-confidence", args.min_confidence))
            if value is not None
        ]
        if given:
            parser.error(
                f"{' and '.join(given)} only {'work' if len(given) > 1 else 'works'} with --speculative: add "
                f"--speculative or leave {'them' if len(given) > 1 else 'it'} out"
            )
    if args.min_confidence is None:
        args.min_confidence = 0.5
    try:
        return _generate(args)
    except KeyboardInterrupt:  # before any token (loading, the prefill): nothing to keep
        print("dsv41 generate: interrupted", file=sys.stderr)
        return 130


class _Failed(Exception):
    """A step of `dsv41 generate` failed and said so; `code` is the exit status."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Process:
    """One `dsv41 generate` process: its place in the expert-parallel group (`ranks`, None when it
    runs alone), how it fails, and how a step runs (alone, or on every rank at once)."""

    def __init__(self):
        self.ranks = None

    def fail(self, message: str, agreed: bool = True) -> _Failed:
        # the other ranks' errors reach rank 0 through `distributed.agree`; a rank speaks for itself
        # only when the group broke before the ranks could agree
        if self.ranks is None or self.ranks.is_main or not agreed:
            print(f"dsv41 generate: {message}", file=sys.stderr)
        if self.ranks is not None:
            from ..runtime import distributed

            distributed.shutdown()  # leave the group before exit (a second call is a no-op)
        return _Failed(1)

    def step(self, run, what: str, errors: tuple = ()):
        """run()'s value; `errors` it raises alone are one sentence, and under the group any rank's
        failure is one ExpertParallelError on every rank (`distributed.agree`)."""
        try:
            if self.ranks is None:
                return run()
            from ..runtime import distributed

            return distributed.agree(run, what)
        except errors as exc:
            raise self.fail(str(exc)) from None
        except RuntimeError as exc:  # ExpertParallelError: any rank's failure, already one line
            if self.ranks is None:
                raise
            raise self.fail(str(exc), getattr(exc, "agreed", True)) from None


def _generate(args) -> int:
    from ..generation.generate import NonFiniteLogits, generate
    from ..model.vision import ImageError

    process = _Process()
    try:
        _check_generate_args(args, process)
        model = _generate_model(args, process)
        prompt = process.step(lambda: _prompt(args, model), "preparing the prompt", (ImageError, ValueError))
        if process.ranks is not None:
            from ..runtime import distributed

            try:  # before the first exchange: a rank asked for something else would abort the exchange in gloo
                distributed.agree_on_request(_expert_parallel_request(args, model, prompt))
            except distributed.ExpertParallelError as exc:
                raise process.fail(str(exc), exc.agreed) from None
        if not args.quiet:
            print(
                f"prompt: {len(prompt)} tokens; generating {args.max_new_tokens} "
                f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}, seed {args.seed}'})",
                file=sys.stderr,
            )
        generated: list[int] = []  # what Ctrl-C must not lose

        def run():
            return generate(
                model,
                prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                seed=args.seed,
                prefill_chunk=args.prefill_chunk,
                progress=not args.quiet,
                speculative=args.speculative,
                draft_tokens=args.draft_tokens,
                min_confidence=args.min_confidence,
                callback=lambda step, token, logits: generated.append(token),
            )

        try:  # ValueError: a speculative request this model refuses
            result = process.step(run, "generating", (NonFiniteLogits, ValueError))
        except KeyboardInterrupt:
            if process.ranks is None or process.ranks.is_main:
                print(model.decode(generated), flush=True)
                print(
                    f"dsv41 generate: interrupted after {len(generated)} of {args.max_new_tokens} tokens "
                    f"(the text so far is above)",
                    file=sys.stderr,
                )
            return 130
        except _Failed:  # e.g. a shard changed on disk mid-run: the error is said, the text so far kept
            if generated and (process.ranks is None or process.ranks.is_main):
                print(model.decode(generated), flush=True)
                print(
                    f"dsv41 generate: stopped after {len(generated)} of {args.max_new_tokens} tokens "
                    f"(the text so far is above)",
                    file=sys.stderr,
                )
            raise
        finally:
            if process.ranks is not None:
                from ..runtime import distributed

                distributed.shutdown()
    except _Failed as failed:
        return failed.code
    if process.ranks is None or process.ranks.is_main:  # only rank 0 prints the generation
        _print_generation(args, model, result)
    return 0


def _check_generate_args(args, process: _Process) -> None:
    """The arguments generate() and load() would refuse, refused before anything is loaded."""
    from ..generation.generate import check_prefill_chunk, check_prompt, check_sampling

    try:  # the same sentences a Python caller of generate() gets
        check_prompt(args.prompt)
        check_sampling(args.max_new_tokens, args.temperature, args.seed)
    except ValueError as exc:
        raise process.fail(f"{exc} (see --help)") from None
    try:
        check_prefill_chunk(args.prefill_chunk)
    except ValueError as exc:
        raise process.fail(f"{exc} (--prefill-chunk)") from None
    if args.expert_cache is not None and args.expert_cache < 0:
        raise process.fail(f"--expert-cache must be >= 0, got {args.expert_cache}")
    if args.max_seq_len is not None and args.max_seq_len <= 0:
        raise process.fail(f"--max-seq-len must be > 0, got {args.max_seq_len}")


def _generate_model(args, process: _Process):
    """The loader's own steps, in its order: the group (with --expert-parallel), the expert
    devices, the checkpoint path; then the header audit and `load`, on every rank at once."""
    from ..checkpoint.checkpoint import LoadError
    from ..checkpoint.stores import DEFAULT_EXPERT_CACHE
    from ..core.errors import Dsv41Error
    from ..core.numerics import Numerics
    from ..runtime.loader import checkpoint_path, expert_placement, load, start_expert_parallel

    numerics = Numerics.named(args.numerics).with_options(fix_stale_index_keys=args.fix_stale_index_keys or None)
    devices = [d.strip() for d in args.expert_device.split(",")]  # one device or a comma-separated list
    devices = devices if len(devices) > 1 else devices[0]
    options = dict(
        max_seq_len=args.max_seq_len,
        expert_device=devices,
        expert_parallel=args.expert_parallel,
        expert_cache=DEFAULT_EXPERT_CACHE if args.expert_cache is None else args.expert_cache,
        resident_engram=args.resident_engram,
        memory=args.memory,
        expert_policy=args.expert_policy,
        read_ahead=args.read_ahead,
    )
    try:
        if args.expert_parallel:
            process.ranks = start_expert_parallel()
            args.quiet = args.quiet or not process.ranks.is_main
        expert_placement(devices, process.ranks, option="--expert-device")  # refused before anything is built
        path = checkpoint_path(args.checkpoint, progress=not args.quiet, ranks=process.ranks)
    except Dsv41Error as exc:  # LoadError, ExpertParallelError: one sentence each
        raise process.fail(str(exc)) from None

    def audited_load():
        problem = _audit_problem(path)
        if problem:
            raise LoadError(problem)
        return load(path, numerics=numerics, threads=args.threads, quiet=args.quiet, **options)

    return process.step(audited_load, "loading", (LoadError,))


def _prompt(args, model):
    """The prompt as generation will run it (`generate.as_prompt`: every image read and checked),
    refused here, before any exchange, when it and the new tokens do not fit."""
    from ..generation.generate import as_prompt, check_length

    prompt = as_prompt(model, args.prompt, args.image)
    check_length(
        len(prompt),
        args.max_new_tokens,
        model.backbone.max_seq_len,
        model_limit=model.cfg.max_seq_len,
        hint=" (raise --max-seq-len)",
    )
    return prompt


def _print_generation(args, model, result) -> None:
    print(result.text)
    if args.quiet:
        return
    t = result.timings
    rate = f", {t['tokens_per_s']:.2f} tokens/s decoding" if t["tokens_per_s"] else ""
    hits = sum(model.experts.counters.hits.values())
    misses = sum(model.experts.counters.misses.values())
    read = model.experts.counters.bytes_read
    steps = max(1, len(model.experts.counters.steps))
    disk = f", {read / 1e6 / steps:.2f} MB read per call from disk" if read else ""
    vision = f"vision tower {t['vision_s']:.2f} s, " if t.get("vision_s") else ""
    print(
        f"{len(result.ids)} tokens ({result.finish_reason}); {vision}prefill {t['prefill_s']:.2f} s, decode "
        f"{t['decode_s']:.2f} s{rate}; expert cache {hits} hits / {misses} misses{disk}",
        file=sys.stderr,
    )
    if result.speculation is not None:
        s = result.speculation
        per_forward = f"{s.tokens_per_forward:.2f}" if s.tokens_per_forward else "-"
        print(
            f"speculative: {len(s.steps)} steps, {s.mean_accepted or 0:.2f} proposals accepted per step, "
            f"{s.target_forwards} target forwards for {s.tokens} tokens ({per_forward} per forward); "
            f"acceptance by draft position "
            + ", ".join("-" if a is None else f"{a:.0%}" for a in s.acceptance_by_position()),
            file=sys.stderr,
        )


def _expert_parallel_request(args, model, prompt) -> dict:
    """What every rank of `generate --expert-parallel` must agree on: the prompt (a `vision.Prompt`)
    and the options that change what is computed (a sampling seed only when sampling, the draft's
    options only with --speculative), each as a short text; not the devices, threads or cache sizes."""
    import dataclasses

    from ..runtime.distributed import fingerprint

    images = prompt.images
    digest = fingerprint(
        list(prompt.ids),
        list(prompt.token_types) if images else [],
        *(part for image in images for part in (image.start, image.patches)),
    )
    config = [(f.name, getattr(model.cfg, f.name)) for f in dataclasses.fields(model.cfg) if f.compare]
    request = {
        "--checkpoint": f"config {fingerprint(config)}",
        "--numerics": args.numerics,
        "--fix-stale-index-keys": str(args.fix_stale_index_keys),
        "--prompt": f"{len(prompt)} tokens{f' with {len(images)} images' if images else ''}, {digest}",
        "--max-new-tokens": str(args.max_new_tokens),
        "--temperature": repr(args.temperature),
        "--prefill-chunk": str(args.prefill_chunk),
        "--speculative": str(args.speculative),
    }
    if args.temperature > 0:
        request["--seed"] = str(args.seed)
    if args.speculative:
        request["--draft-tokens"] = str(args.draft_tokens)
        request["--min-confidence"] = repr(args.min_confidence)
    return request


# ---------------------------------------------------------------------- dsv41 chat
def chat_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsv41 chat",
        description=(
            "Chat with a checkpoint in the V4.1 chat format (default: the embedded miniature, which learned Python "
            "source, not conversation, so its replies read like code). One message per line; "
            "/reset forgets the conversation, /save FILE writes it as "
            "JSON (never over an existing file; /save! FILE replaces one), Ctrl-D quits. "
            "Each reply is printed as text, "
            "its line breaks kept (piped, it follows 'assistant: '). Each turn continues from the positions the "
            "previous one left in the caches."
        ),
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded miniature)")
    parser.add_argument("--thinking", action="store_true", help="the model reasons before it answers (shown dimmed)")
    parser.add_argument(
        "--reasoning-effort",
        default=None,
        metavar="N|low|high|max",
        help="with --thinking: 1-100, or low (50), high (75, the default), max (100)",
    )
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message to start the conversation")
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, metavar="N", help="most tokens per reply (default 256)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (temperature > 0)")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="positions the caches are sized for: the whole conversation (default: the model's maximum, at most 4096)",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="decode each reply with the DSpark draft stack (see dsv41 generate --help)",
    )
    _memory_args(parser, otherwise="without it each layer keeps a fixed number of its most recently used experts")
    parser.add_argument("--quiet", action="store_true", help="no load report or per-turn token counts on stderr")
    args = parser.parse_args(argv)

    def fail(message: str, code: int = 1) -> int:
        print(f"dsv41 chat: {message}", file=sys.stderr)
        return code

    if args.system is not None:
        try:
            args.system.encode("utf-8")
        except UnicodeEncodeError as exc:  # a byte of a non-UTF-8 argv, escaped by Python
            return fail(f"--system is not UTF-8 text (character {exc.start + 1}); pass UTF-8")
    try:  # importing torch and loading take a while: Ctrl-C there is one line, exit 130
        model_or_code = _chat_model(args, fail)
    except KeyboardInterrupt:
        return fail("interrupted while loading the checkpoint", 130)
    if isinstance(model_or_code, int):
        return model_or_code

    try:
        from ..generation.conversation import run_terminal

        return run_terminal(
            model_or_code,
            sys.stdin,
            sys.stdout,
            system=args.system,
            thinking=args.thinking,
            reasoning_effort=args.reasoning_effort,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            status=False if args.quiet else None,
            speculative=args.speculative,
        )
    except KeyboardInterrupt:  # outside a read or a reply, which handle their own
        print(file=sys.stdout)
        return 130


def _chat_model(args, fail):
    """The checked arguments' model for `dsv41 chat`, or the exit code of a failed check or load."""
    from ..generation.chat import ChatFormatError, reasoning_budget, render
    from ..generation.generate import check_sampling

    if args.reasoning_effort is not None and args.reasoning_effort.strip().isdigit():
        args.reasoning_effort = int(args.reasoning_effort)
    try:
        reasoning_budget(args.reasoning_effort)
        check_sampling(args.max_new_tokens, args.temperature, args.seed)
        if args.system is not None:
            render([{"role": "system", "content": args.system}])  # what the format refuses in it
    except (ChatFormatError, ValueError) as exc:
        return fail(f"{exc} (see --help)")
    if args.max_seq_len is not None and args.max_seq_len <= 0:
        return fail(f"--max-seq-len must be > 0, got {args.max_seq_len}")

    from ..checkpoint.checkpoint import LoadError
    from ..runtime.loader import checkpoint_path, load

    try:
        path = checkpoint_path(args.checkpoint, progress=not args.quiet)
        problem = _audit_problem(path)
        if problem:
            raise LoadError(problem)
        return load(
            path,
            quiet=args.quiet,
            max_seq_len=args.max_seq_len,
            memory=args.memory,
            expert_policy=args.expert_policy,
            read_ahead=args.read_ahead,
        )
    except LoadError as exc:
        return fail(str(exc))


def _memory_args(parser, otherwise: str = "replaces --expert-cache") -> None:
    """--memory, --expert-policy and --read-ahead, as generate, chat and the benches take them; `otherwise`: what
    the command does without a budget, for the help (chat has no --expert-cache to replace)."""
    from ..checkpoint.eviction import DEFAULT_POLICY, EXPERT_POLICIES
    from ..core.argtypes import memory_size

    parser.add_argument(
        "--memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="a memory budget (e.g. 16GiB), at most this machine's memory: what the dense part, "
        f"the caches and the process leave holds routed experts read from disk ({otherwise}; "
        "the load report says how it was spent)",
    )
    parser.add_argument(
        "--expert-policy",
        choices=EXPERT_POLICIES,
        default=DEFAULT_POLICY,
        help=f"which expert gives up its slot under --memory (default {DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--read-ahead",
        action="store_true",
        help="under --memory, read the experts the next layer will probably use while this layer "
        "computes (off by default: on few cores the reads slow the compute more than they "
        "save; `dsv41 bench whole` measures both)",
    )


def _threads_arg(text: str):
    """A --threads value: "auto" or a whole number from 1 to the CPUs this process may run on."""
    from ..core.threads import check_threads

    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes auto or a whole number of threads >= 1, got {text!r}")
    try:
        check_threads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _audit_problem(path: str) -> Optional[str]:
    """The header audit's verdict on `path` as one sentence when it fails (or cannot start), else None."""
    from ..checkpoint.audit import AuditError, run_audit

    try:
        report = run_audit(path, require_complete=True)
    except AuditError as exc:  # its fix names the audit's own options; --checkpoint is ours
        return f"{exc.problem}; pass --checkpoint a checkpoint folder (its shards and config.json)"
    if report.unreadable:
        file, why = report.unreadable[0]
        return why if why.startswith(file) else f"{file}: {why}"  # header errors already name the shard
    failed = [c for c in report.checks if c.status == "fail"]
    if failed:
        first = failed[0]
        more = (
            f" ({len(failed) - 1} more checks fail; run `dsv41 audit --checkpoint-dir {path}`)"
            if len(failed) > 1
            else ""
        )
        return f"{path}: the checkpoint audit fails {first.id} ({first.title}): {first.detail}{more}"
    return None


if __name__ == "__main__":
    sys.exit(main())
