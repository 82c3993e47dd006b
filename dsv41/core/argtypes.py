"""Command-line value types shared by the subcommands, and the one reading of a memory size."""

from __future__ import annotations

import argparse
import re
from typing import Callable

from .errors import Dsv41Error
from .text import brief, is_whole, number_text


def whole_number(low: int, high: int, unit: str) -> Callable[[str], int]:
    """An argparse `type=`: a whole number of `unit` from `low` to `high`; anything else (a
    fraction, nan, a word, out of range) is a usage error naming the rule."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a whole number of {unit} from {low} to {high:,}, got {brief(text)}"
            )
        return value

    return parse


# binary and decimal byte units a memory size may end with (case-insensitive)
_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
# The largest size read: 1 EiB, far past any machine's memory and within the 64-bit sizes torch and
# the operating system take. Larger sizes are refused here, before any arithmetic converts them.
MAX_BYTES = 1 << 60
# a decimal number as written: ASCII digits, an optional fraction and exponent
_NUMBER = re.compile(r"(?P<sign>[+-]?)(?P<whole>[0-9]*)(?:\.(?P<frac>[0-9]*))?(?:e(?P<exp>[+-]?[0-9]+))?")
# Significant digits kept of a number's mantissa: for a size up to MAX_BYTES in any unit, the
# digits past them are worth less than 1e-27 of a byte.
_KEPT_DIGITS = 60


class MemorySizeError(Dsv41Error, ValueError):
    """A memory size that is not a number of bytes, or not one from 1 to MAX_BYTES."""


def byte_size(text) -> int:
    """A memory size as bytes: a whole number of bytes, or a number with a unit ("16GiB", "12GB",
    "512 MiB", "1.5TiB", "1e3MiB"), rounded down to whole bytes, from 1 to MAX_BYTES.
    MemorySizeError (a ValueError) naming the accepted forms or the range otherwise."""
    if is_whole(text):
        value = int(text)
    elif isinstance(text, (str, float)):
        value = _scaled(text)
    else:
        raise MemorySizeError(f'a memory size is a number of bytes or a text such as "16GiB", got {brief(text)}')
    if value <= 0:
        raise MemorySizeError(f"a memory size must be at least 1 byte, got {_shown(text)}")
    if value > MAX_BYTES:
        raise MemorySizeError(f"a memory size must be at most {MAX_BYTES:,} bytes (1,048,576 TiB), got {_shown(text)}")
    return value


def _shown(text) -> str:
    """A size as given, for a message (an integer of thousands of digits by its length)."""
    return number_text(text) if is_whole(text) else brief(text)


def _scaled(text) -> int:
    """The bytes a number with an optional unit spells, rounded down, computed on integers (a float
    would overflow at 1e308GiB and round large sizes); past MAX_BYTES any value above it."""
    s = (repr(float(text)) if isinstance(text, float) else text).strip().lower().replace(" ", "")  # numpy: 5.0
    number = s.rstrip("kmgtib")
    unit = s[len(number) :]
    parts = _NUMBER.fullmatch(number) if unit in _UNITS else None
    if parts is None or not (parts["whole"] or parts["frac"]):
        raise MemorySizeError(
            f"a memory size is a number of bytes or a number with a unit (KiB, MiB, GiB, TiB, "
            f"KB, MB, GB, TB), e.g. 16GiB; got {brief(text)}"
        )
    frac = parts["frac"] or ""
    digits = (parts["whole"] + frac).lstrip("0")
    if not digits:
        return 0
    if parts["sign"] == "-":
        return -1  # below zero: the size of it does not matter
    exp_text = (parts["exp"] or "0").lstrip("+")
    sign, exp_digits = (-1, exp_text[1:]) if exp_text.startswith("-") else (1, exp_text)
    exp_digits = exp_digits.lstrip("0") or "0"
    # an exponent of more than 6 digits outweighs any mantissa written beside it (and int() would
    # refuse one of 4,300): it stands for one larger than the text is long
    exponent = sign * (int(exp_digits) if len(exp_digits) <= 6 else 10**7 + len(number)) - len(frac)
    magnitude = len(digits) + exponent  # 10**(magnitude - 1) <= the number < 10**magnitude
    if magnitude > 20:  # at least 10**20 bytes, past MAX_BYTES in any unit
        return MAX_BYTES + 1
    if magnitude < -13:  # under 10**-13 of a unit: less than a byte even in TiB
        return 0
    kept = digits[:_KEPT_DIGITS]
    shift = exponent + len(digits) - len(kept)
    scaled = int(kept) * _UNITS[unit]
    return scaled * 10**shift if shift >= 0 else scaled // 10**-shift


def memory_size(text: str) -> int:
    """An argparse `type=` for `byte_size`."""
    try:
        return byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
