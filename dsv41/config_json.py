"""Reading config JSON safely and walking its nesting: the guards a damaged file meets (nesting
past MAX_CONFIG_DEPTH, integers of thousands of digits, keys that are not strings, lone surrogates),
the short forms values take in messages, and the lookups between the nested and the flat layout.

Standard library only, like the schema it serves (`config_fields`, `config`).
"""

from __future__ import annotations

import json
import math

def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def number_text(value) -> str:
    """A number for a message: huge integers by their size (str() refuses past 4,300 digits)."""
    if is_int(value) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return f"{value:,}" if is_int(value) and abs(value) >= 10_000 else repr(value)


def brief(value, limit: int = 60) -> str:
    """A JSON value for a message, kept short and never recursive."""
    if isinstance(value, (list, tuple)):
        if len(value) <= 8 and not any(isinstance(v, (list, tuple, dict)) for v in value):
            return "[" + ", ".join(brief(v, 24) for v in value) + "]"
        return f"a list of {len(value):,} items"
    if isinstance(value, dict):
        return f"an object of {len(value):,} keys" if value else "{}"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return number_text(value)
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


# A config nests three levels (text_config.rope_scaling.factor); anything past this is damage, and
# the readers below recurse over the nesting.
MAX_CONFIG_DEPTH = 32
# No config value needs more digits than this (the largest, engram_num_embeddings, has 9); json
# would otherwise convert up to 4,300 digits, or any number of them where that limit is lifted.
MAX_CONFIG_INT_DIGITS = 40


class _LongInteger(ValueError):
    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def parse_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_CONFIG_INT_DIGITS:
        raise _LongInteger(digits)
    return int(text)


def shape_problem(data) -> str | None:
    """Why a parsed config cannot be one, judged without recursing: lists and objects nested past
    MAX_CONFIG_DEPTH (the readers below recurse over them), a key that is not a string, or a string
    holding an unpaired surrogate (json decodes "\\ud800" to one, and no terminal can print it)."""
    stack = [(data, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return f"holds the string {ascii(node)[:40]} with an unpaired surrogate escape, which is not Unicode text"
        elif isinstance(node, (dict, list, tuple)):
            if level > MAX_CONFIG_DEPTH:
                return f"nests more than {MAX_CONFIG_DEPTH} levels deep (a config nests three), so it is not a config"
            if isinstance(node, dict):
                if not all(isinstance(k, str) for k in node):
                    return "has a key that is not a string"
                stack.extend((k, level) for k in node)
                stack.extend((v, level + 1) for v in node.values())
            else:
                stack.extend((v, level + 1) for v in node)
    return None


def freeze(value):
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value):
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def lookup(data: dict, path: tuple[str, ...]):
    node = data
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def assign(out: dict, path: tuple[str, ...], value) -> None:
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def leaf_paths(data: dict, prefix: tuple[str, ...] = ()):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from leaf_paths(value, prefix + (key,))
        else:
            yield prefix + (key,)


def shown(value) -> str:
    return "(absent)" if value is None else json.dumps(thaw(value))
