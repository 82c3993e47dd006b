"""`dsv41 bench`: the subcommands' parsers, in the order `--help` lists them, and the dispatch."""

from __future__ import annotations

from . import decode, experts, prefill, stream, threads, vision, whole

# subcommand -> its module (each has add_parser(sub) and main(args))
SUBCOMMANDS = {
    "experts": experts,
    "decode": decode,
    "prefill": prefill,
    "vision": vision,
    "threads": threads,
    "stream": stream,
    "whole": whole,
}


def cli_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="dsv41 bench",
        description=(
            "Benchmarks. `experts`: one MoE layer's expert work (6 routed FP4 experts per token plus the "
            "shared FP8 expert) at the released sizes, fused from packed bytes against expanding to BF16."
        ),
    )
    sub = parser.add_subparsers(dest="what", required=True)
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    return SUBCOMMANDS[args.what].main(args)
