"""The `dsv41` command. Each subcommand lives in the module that owns its subject and is imported
only when called, so `dsv41 audit` and `dsv41 config` run without importing torch; `generate`,
which joins the loader and the generation loop, lives here, above both."""

import argparse
import importlib
import sys
from typing import Optional

# name -> (module, entry function taking argv and returning an exit code, one-line help)
COMMANDS = {
    "config": ("dsv41.config", "cli_main", "read a config (either released layout), print its shape and verify it"),
    "audit": ("dsv41.audit", "cli_main", "header-only audit of a checkpoint directory (never reads a payload)"),
    "make-tiny": ("dsv41.tiny", "cli_main", "write the embedded tiny checkpoint in the exact release format"),
    "make-headers": ("dsv41.headers", "cli_main", "synthesize the released checkpoint's 48 shard headers (no payload)"),
    "engram": ("dsv41.engram", "cli_main", "Engram layout, multipliers and hash ids for a config (and tokenizer)"),
    "generate": ("dsv41.cli", "generate_main", "generate text from a checkpoint (default: the embedded tiny one)"),
    "notebooks": ("dsv41.notebooks", "cli_main", "execute every notebook with papermill into a new outputs/run-NNN (figures, sidecars, summary)"),
    "replay": ("dsv41.cache_policy", "cli_main", "replay a saved trace's routing through expert-cache policies (LRU, LFU, static, Belady): hit rates and disk bytes per token"),
    "bench": ("dsv41.bench", "cli_main", "time the fused packed-FP4 expert path against expanding experts to BF16, "
                                         "decode end to end, and torch threads on the embedded checkpoint"),
    "lab": ("dsv41.lab", "cli_main", "copy the notebooks into outputs/lab (edited copies kept) and start JupyterLab there"),
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
    parser = argparse.ArgumentParser(prog="dsv41 generate", description=(
        "Generate from a checkpoint (default: the embedded tiny one, random-weighted, so its text is not "
        "meaningful). The generated text goes to stdout; the load report, timings and errors to stderr."))
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded tiny one)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N", help="tokens to generate (default 16)")
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help="positions the caches are sized for (default: the model's maximum, at most 4096)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (temperature > 0)")
    parser.add_argument("--expert-cache", type=int, default=None, metavar="N", help="packed experts kept per layer")
    parser.add_argument("--resident-engram", action="store_true", help="copy the Engram tables into RAM first")
    parser.add_argument("--expert-device", default="cpu", metavar="DEV",
                        help="where routed experts run: cpu (default), cuda, cuda:1 or a comma-separated list; "
                             "without CUDA the CPU runs them, with one line on stderr")
    parser.add_argument("--numerics", choices=("reference", "parity"), default="reference",
                        help="reference (default): the released runtime's arithmetic; parity: a prefill, the same "
                             "tokens decoded one at a time and any chunking agree bit for bit (uniform window "
                             "layout, padded float32 GEMMs, ties to the lower position, fresh index keys)")
    parser.add_argument("--fix-stale-index-keys", action="store_true",
                        help="republish a Full layer's own index keys every step (the Transformers port's fix)")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                        help="prefill the prompt N tokens per forward, with a progress bar (default: one forward)")
    parser.add_argument("--threads", type=_threads_arg, default="auto", metavar="auto|N",
                        help="torch intra-op threads, which the native expert kernel uses too: auto (default) is one "
                             "thread for a model with small expert matrices (the embedded checkpoint), every core "
                             "otherwise (the released geometry); N sets N; the load report says which")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or report on stderr")
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"dsv41 generate: {message}", file=sys.stderr)
        return 1

    from .generate import NonFiniteLogits, check_prompt, check_sampling, generate

    try:  # the same sentences a Python caller of generate() gets
        check_prompt(args.prompt)
        check_sampling(args.max_new_tokens, args.temperature, args.seed)
    except ValueError as exc:
        return fail(f"{exc} (see --help)")
    if args.expert_cache is not None and args.expert_cache < 0:
        return fail(f"--expert-cache must be >= 0, got {args.expert_cache}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        return fail(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.max_seq_len is not None and args.max_seq_len <= 0:
        return fail(f"--max-seq-len must be > 0, got {args.max_seq_len}")

    from .kernels.experts import expert_devices
    from .loader import DEFAULT_EXPERT_CACHE, LoadError, load
    from .numerics import Numerics

    try:  # one device or a comma-separated list, resolved once (without CUDA: one line, the CPU)
        devices = expert_devices([d.strip() for d in args.expert_device.split(",")])
    except RuntimeError:
        return fail(f"--expert-device {args.expert_device!r} is not a torch device name (try cpu, cuda or cuda:0,cuda:1)")
    except ValueError as exc:
        return fail(f"--expert-device {args.expert_device!r} is not usable: {exc}")
    numerics = Numerics.named(args.numerics).with_options(fix_stale_index_keys=args.fix_stale_index_keys or None)

    path = args.checkpoint
    if path is None:
        from .cachedir import CacheError
        from .tiny import default_checkpoint

        try:
            path = default_checkpoint(progress=not args.quiet)
        except CacheError as exc:
            return fail(str(exc))
    problem = _audit_problem(path)
    if problem:
        return fail(problem)
    try:
        model = load(path, numerics=numerics, expert_device=devices, resident_engram=args.resident_engram,
                     expert_cache=DEFAULT_EXPERT_CACHE if args.expert_cache is None else args.expert_cache,
                     quiet=args.quiet, max_seq_len=args.max_seq_len, threads=args.threads)
    except (LoadError, ValueError) as exc:
        return fail(str(exc))

    ids = model.encode(args.prompt)
    if len(ids) > model.cfg.max_seq_len:
        return fail(f"the prompt is {len(ids)} tokens, longer than the model's {model.cfg.max_seq_len}-token maximum")
    if len(ids) + args.max_new_tokens - 1 > model.max_seq_len:
        return fail(f"{len(ids)} prompt tokens + {args.max_new_tokens} new ones exceed the {model.max_seq_len} "
                    f"positions the caches were sized for (raise --max-seq-len)")

    if not args.quiet:
        print(f"prompt: {len(ids)} tokens; generating {args.max_new_tokens} "
              f"({'greedy' if args.temperature == 0 else f'temperature {args.temperature}, seed {args.seed}'})",
              file=sys.stderr)
    try:
        result = generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          seed=args.seed, prefill_chunk=args.prefill_chunk, progress=not args.quiet)
    except NonFiniteLogits as exc:
        return fail(str(exc))
    print(result.text)
    if not args.quiet:
        t = result.timings
        rate = f", {t['tokens_per_s']:.2f} tokens/s decoding" if t["tokens_per_s"] else ""
        hits = sum(model.experts.counters.hits.values())
        misses = sum(model.experts.counters.misses.values())
        print(f"{len(result.ids)} tokens ({result.finish_reason}); prefill {t['prefill_s']:.2f} s, decode "
              f"{t['decode_s']:.2f} s{rate}; expert cache {hits} hits / {misses} misses", file=sys.stderr)
    return 0


def _threads_arg(text: str):
    """A --threads value: "auto" or a whole number >= 1."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes auto or a whole number of threads >= 1, got {text!r}")
    return value


def _audit_problem(path: str) -> Optional[str]:
    """The header audit's verdict on `path` as one sentence when it fails (or cannot start), else None."""
    from .audit import AuditError, run_audit

    try:
        report = run_audit(path, require_complete=True)
    except AuditError as exc:
        return str(exc)
    if report.unreadable:
        file, why = report.unreadable[0]
        return why if why.startswith(file) else f"{file}: {why}"  # header errors already name the shard
    failed = [c for c in report.checks if c.status == "fail"]
    if failed:
        first = failed[0]
        more = f" ({len(failed) - 1} more checks fail; run `dsv41 audit --checkpoint-dir {path}`)" if len(failed) > 1 else ""
        return f"{path}: the checkpoint audit fails {first.id} ({first.title}): {first.detail}{more}"
    return None


if __name__ == "__main__":
    sys.exit(main())
