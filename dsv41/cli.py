"""The `dsv41` command. Each subcommand lives in the module that owns its subject and is imported
only when called, so `dsv41 audit` and `dsv41 config` run without importing torch."""

import importlib
import sys

# name -> (module, entry function taking argv and returning an exit code, one-line help)
COMMANDS = {
    "config": ("dsv41.config", "cli_main", "read a config (either released layout), print its shape and verify it"),
    "audit": ("dsv41.audit", "cli_main", "header-only audit of a checkpoint directory (never reads a payload)"),
    "make-tiny": ("dsv41.tiny", "cli_main", "write the embedded tiny checkpoint in the exact release format"),
    "make-headers": ("dsv41.headers", "cli_main", "synthesize the released checkpoint's 48 shard headers (no payload)"),
    "engram": ("dsv41.engram", "cli_main", "Engram layout, multipliers and hash ids for a config (and tokenizer)"),
    "generate": ("dsv41.generate", "cli_main", "generate text from a checkpoint (default: the embedded tiny one)"),
    "notebooks": ("dsv41.notebooks", "cli_main", "execute every notebook with papermill into a new outputs/run-NNN (figures, sidecars, summary)"),
    "bench": ("dsv41.bench", "cli_main", "time the fused packed-FP4 expert path against expanding experts to BF16"),
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


if __name__ == "__main__":
    sys.exit(main())
