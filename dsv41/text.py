"""Short renderings of untrusted values for one-sentence error messages.

A damaged file can hold a megabyte-long string, an array nested a thousand deep or a lone
surrogate; every message that quotes such a value goes through these, so it stays one short line
that any terminal can print. Standard library only."""

from __future__ import annotations


def brief(value, limit: int = 60) -> str:
    """A value for a message, kept short and never recursive: a short flat list is shown, anything
    longer or nested is counted."""
    if isinstance(value, (list, tuple)):
        if len(value) <= 8 and not any(isinstance(v, (list, tuple, dict)) for v in value):
            return "[" + ", ".join(brief(v, 24) for v in value) + "]"
        return f"a list of {len(value):,} items"
    if isinstance(value, dict):
        return f"an object of {len(value):,} keys" if value else "{}"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


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
