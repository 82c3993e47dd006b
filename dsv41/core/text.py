"""Untrusted values: their short renderings for one-sentence error messages, and the guard
against the integers of thousands of digits a damaged JSON file can hold.

A damaged file can hold a megabyte-long string, an array nested a thousand deep, a lone surrogate
or a 10,000-digit number; every message that quotes such a value goes through these, so it stays
one short line that any terminal can print, and every JSON reader of the package (config, shard
headers, trace manifests) refuses long integers through `bounded_ints`. Standard library only."""

from __future__ import annotations

import json
import math
import numbers


def brief(value, limit: int = 60, *, as_json: bool = False) -> str:
    """A value for a message, kept short and never recursive: a short flat list is shown, anything
    longer or nested is counted. `as_json`: scalars as a JSON file spells them (true, null, "text",
    numbers by `number_text`) for messages about a config's values; otherwise Python's repr."""
    if isinstance(value, (list, tuple)):
        if len(value) <= 8 and not any(isinstance(v, (list, tuple, dict)) for v in value):
            return "[" + ", ".join(brief(v, 24, as_json=as_json) for v in value) + "]"
        return f"a list of {len(value):,} items"
    if isinstance(value, dict):
        return f"an object of {len(value):,} keys" if value else "{}"
    if as_json and (isinstance(value, bool) or value is None):
        return json.dumps(value)
    if as_json and isinstance(value, (int, float)):
        return number_text(value)
    text = json.dumps(value) if as_json and isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def number_text(value) -> str:
    """A number for a message: huge integers by their size (str() refuses past 4,300 digits),
    non-finite floats as JSON spells them, 10,000 and up with thousands separators."""
    if is_whole(value) and int(value).bit_length() > 64:
        return f"an integer of about {int(int(value).bit_length() * 0.30103) + 1:,} digits"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if is_whole(value):
        return f"{int(value):,}" if abs(value) >= 10_000 else repr(int(value))
    return repr(value)


def is_whole(value) -> bool:
    """Whether a value is a whole number: an int or numpy integer, never a bool (which Python
    counts as an int, so True would pass for 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class LongInteger(ValueError):
    """A JSON integer with more digits than its reader allows; `digits` says how many."""

    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def bounded_ints(max_digits: int):
    """A `json.loads(parse_int=...)` hook that raises LongInteger for an integer of more than
    `max_digits` digits: json would otherwise convert up to 4,300 digits (quadratic time), or any
    number of them where that limit is lifted."""

    def parse_int(text: str) -> int:
        digits = len(text) - text.startswith("-")
        if digits > max_digits:
            raise LongInteger(digits)
        return int(text)

    return parse_int


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "a boolean"
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def is_unicode(text: str) -> bool:
    """False for a string JSON decoded from an unpaired surrogate escape ("\\ud800"), which no file
    name, report or terminal can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def named(path: str, message: str) -> str:
    """`message` as one sentence naming `path` once: messages from headers, config or engram often
    start with the file already, and prefixing it again would name it twice."""
    return message if message.startswith(path) else f"{path}: {message}"
