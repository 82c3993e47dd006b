"""Reading config JSON safely and walking its nesting: the guards a damaged file meets (nesting
past MAX_CONFIG_DEPTH, integers of thousands of digits, keys that are not strings, lone surrogates),
and the lookups between the nested and the flat layout.

Standard library only, like the schema it serves (`config_fields`, `config`).
"""

from __future__ import annotations

import json
import math

from dsv41.core.text import bounded_ints


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


# A config nests three levels (text_config.rope_scaling.factor); anything past this is damage, and
# the readers below recurse over the nesting.
MAX_CONFIG_DEPTH = 32
# No config value needs more digits than this (the largest, engram_num_embeddings, has 9); json
# would otherwise convert up to 4,300 digits, or any number of them where that limit is lifted.
MAX_CONFIG_INT_DIGITS = 40


# json.loads' parse_int hook for config files (LongInteger past the limit)
parse_int = bounded_ints(MAX_CONFIG_INT_DIGITS)


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
                return (
                    f"holds the string {ascii(node)[:40]} with an unpaired surrogate escape, which is not Unicode text"
                )
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
