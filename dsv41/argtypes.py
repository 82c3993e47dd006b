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


# binary and decimal byte units a memory size may end with (case-insensitive)
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def byte_size(text) -> int:
    """A memory size as bytes: a whole number of bytes, or a number with a unit ("16GiB", "12GB",
    "512 MiB", "1.5TiB"). ValueError naming the accepted forms otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().lower().replace(" ", "")
        number = s.rstrip("kmgtib")
        unit = s[len(number):]
        try:
            amount = float(number) if unit in _UNITS and number else None
        except ValueError:
            amount = None
        if amount is None or amount != amount or amount in (float("inf"), float("-inf")):
            raise ValueError(f"a memory size is a number of bytes or a number with a unit (KiB, MiB, GiB, TiB, KB, "
                             f"MB, GB, TB), e.g. 16GiB; got {text!r}")
        value = int(amount * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a memory size must be more than 0 bytes, got {text!r}")
    return value


def memory_size(text: str) -> int:
    """An argparse `type=` for `byte_size`."""
    try:
        return byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
