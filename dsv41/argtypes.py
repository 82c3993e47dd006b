"""Command-line value types shared by the subcommands (standard library only)."""

from __future__ import annotations

import argparse
from typing import Callable


def whole_number(low: int, high: int, unit: str) -> Callable[[str], int]:
    """An argparse `type=`: a whole number of `unit` from `low` to `high`; anything else (a
    fraction, nan, a word, out of range) is a usage error naming the rule."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number of {unit} from {low} to {high:,}, got {text!r}")
        return value

    return parse
