"""Reading a generated V4.1 assistant turn back into its reasoning, content and typed tool calls
(`parse` -> `Reply`), and the DSML vocabulary and JSON rules that rendering (`dsv41.generation.chat`) shares.

`parse` never raises on model output: it says what was cut off and what was malformed instead, and
is linear in the text's length. Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from ..checkpoint.tokenizer import BOS_TOKEN, DSML_TOKEN, EOS_TOKEN, THINK_END_TOKEN, THINK_START_TOKEN

# DSML tag names as the format spells them: the markup token, then a space
CALLS_TAG = DSML_TOKEN + " calls"
INVOKE_TAG = DSML_TOKEN + " invoke"
PARAMETER_TAG = DSML_TOKEN + " parameter"
# a reply's tool-call block starts after a blank line; the blank line belongs to the markup
CALLS_OPENING = "\n\n<" + CALLS_TAG

# what a parsed reasoning or content must not contain (the release's decoder refuses them)
_MARKERS = (BOS_TOKEN, EOS_TOKEN, THINK_START_TOKEN, THINK_END_TOKEN, DSML_TOKEN)


# tool and parameter names the format writes inside `name="…"`: nothing that can close the quote,
# the tag or the line, and no marker
SAFE_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
SAFE_NAME_RULE = "1 to 128 of the characters A-Z a-z 0-9 _ . : -"


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# JSON text nested deeper than this is read as text, not decoded: far past any tool argument, and far
# enough below Python's recursion limit that what is decoded always writes back
MAX_JSON_NESTING = 256


class _TooDeep(ValueError):
    pass


def _json_loads(text: str):
    """json.loads, refusing (ValueError) text nested deeper than MAX_JSON_NESTING."""
    if text.count("[") + text.count("{") > MAX_JSON_NESTING and _nesting(text) > MAX_JSON_NESTING:
        raise _TooDeep(f"nested deeper than {MAX_JSON_NESTING} levels")
    try:
        return json.loads(text)
    except RecursionError:  # a deep stack at the call: the same answer
        raise _TooDeep(f"nested deeper than {MAX_JSON_NESTING} levels") from None


def _nesting(text: str) -> int:
    """The deepest bracket nesting of a JSON text, brackets inside strings not counted."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


# ---------------------------------------------------------------------- parsing a reply
@dataclass
class ToolCall:
    name: str
    arguments: dict  # typed: string="true" values as text, the others decoded from JSON
    arguments_json: str  # the arguments as the release's decoder writes them (an OpenAI `arguments` string)

    def message(self) -> dict:
        """The OpenAI-style call, as a conversation's assistant message holds it."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class Reply:
    """A generated assistant turn, parsed. `finished`: it ended with the end-of-sentence token;
    `incomplete`: the part the text stopped in ("reasoning", "content" or "tool_calls"; None when
    finished); `problems`: one sentence per piece of malformed markup that was skipped."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finished: bool = False
    incomplete: Optional[str] = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.finished and not self.problems

    def message(self) -> dict:
        """The assistant message that puts this reply into the conversation for the next turn."""
        message = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.message() for call in self.tool_calls]
        return message


def parse(text: str, *, thinking: Optional[bool] = None) -> Reply:
    """Parse a generated assistant turn (the text after the generation header, special tokens
    kept). `thinking`: the reply starts with reasoning; None decides from the text (a leading
    `<think>` or any `</think>`). Never raises on model output."""
    if not isinstance(text, str):
        raise TypeError(f"parse takes the generated text as a str, got {type(text).__name__}")
    reply = Reply()
    rest = text
    if thinking is None:
        thinking = rest.startswith(THINK_START_TOKEN) or THINK_END_TOKEN in rest
    if thinking:
        rest = rest[len(THINK_START_TOKEN) :] if rest.startswith(THINK_START_TOKEN) else rest
        close, end = rest.find(THINK_END_TOKEN), rest.find(EOS_TOKEN)
        if close >= 0 and (end < 0 or close < end):
            reply.reasoning, rest = rest[:close], rest[close + len(THINK_END_TOKEN) :]
        elif end >= 0:
            reply.reasoning, rest = rest[:end], rest[end:]
            reply.problems.append(f"the reply ended without closing its reasoning with {THINK_END_TOKEN}")
        else:
            reply.reasoning, reply.incomplete = rest, "reasoning"
            _check_markers(reply)
            return reply

    opening, end = rest.find(CALLS_OPENING), rest.find(EOS_TOKEN)
    if end >= 0 and (opening < 0 or end < opening):
        reply.content = rest[:end]
        _finish(reply, rest[end + len(EOS_TOKEN) :])
    elif opening >= 0:
        reply.content = rest[:opening]
        _parse_calls(reply, rest[opening + len(CALLS_OPENING) :])
    else:
        partial = _partial_suffix(rest, CALLS_OPENING)
        if len(partial) > len("\n\n<"):  # cut inside the block's opening tag
            reply.content, reply.incomplete = rest[: len(rest) - len(partial)], "tool_calls"
        else:
            reply.content, reply.incomplete = rest, "content"
    _check_markers(reply)
    return reply


def _finish(reply: Reply, after: str) -> None:
    reply.finished = True
    if after:
        reply.problems.append(f"text follows the end-of-sentence token: {after[:40]!r}")


def _check_markers(reply: Reply) -> None:
    for part in ("reasoning", "content"):
        found = [marker for marker in _MARKERS if marker in getattr(reply, part)]
        if found:
            reply.problems.append(f"the {part} contains the format's marker {found[0]}")


def _partial_suffix(text: str, tag: str) -> str:
    """The longest end of `text` that is a proper beginning of `tag` (a tag cut off mid-way)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return text[-length:]
    return ""


_INVOKE_NAME = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)
_PARAMETER = re.compile(r' name="(.*?)" string="(true|false)">(.*?)<\n?', re.DOTALL)


class _Cut(Exception):
    """The text ends inside the tool-call block."""


def _parse_calls(reply: Reply, body: str) -> None:
    """The DSML block after its opening `<｜DSML｜ calls`: every well-formed call into `reply.tool_calls`;
    a malformed one is skipped with a problem noted, a cut-off one ends the block as incomplete."""
    calls_end, invoke_open, invoke_close = f"</{CALLS_TAG}>", f"<{INVOKE_TAG}", f"</{INVOKE_TAG}"
    parameter_open, parameter_close = f"<{PARAMETER_TAG}", f"/{PARAMETER_TAG}"

    # each stop's next occurrence at or after the last position searched (-1: none left). Positions
    # only grow, so remembering them keeps the parse linear: the block's end is searched for once,
    # not once per call.
    next_at: dict[str, int] = {}

    def find(stop: str, pos: int) -> int:
        at = next_at.get(stop)
        if at is None or 0 <= at < pos:
            at = next_at[stop] = body.find(stop, pos)
        return at

    def read_until(pos: int, *stops: str) -> tuple[str, str, int]:
        """(text before the nearest stop, the stop, the position after it); _Cut when none follows."""
        found = [(find(stop, pos), stop) for stop in stops]
        found = [(at, stop) for at, stop in found if at >= 0]
        if not found:
            raise _Cut
        at, stop = min(found)
        return body[pos:at], stop, at + len(stop)

    pos = 0
    try:
        while True:
            between, stop, pos = read_until(pos, invoke_open, calls_end)
            if between != ">\n":
                reply.problems.append(f"expected a line break between DSML tags, found {between[:40]!r}")
            if stop == calls_end:
                break
            name_text, stop, pos = read_until(pos, parameter_open, invoke_close)
            name = _INVOKE_NAME.fullmatch(name_text)
            arguments: dict[str, tuple[str, str]] = {}
            problem = None if name else f"a tool call's name is malformed: {name_text[:40]!r}"
            if name and not SAFE_NAME.fullmatch(name[1]):  # rendering it back would be refused
                problem = f"a tool call's name {name[1][:40]!r} is not {SAFE_NAME_RULE}"
            while stop == parameter_open:
                parameter_text, _, pos = read_until(pos, parameter_close)
                parameter = _PARAMETER.fullmatch(parameter_text)
                if parameter is None:
                    problem = problem or f"a tool call parameter is malformed: {parameter_text[:40]!r}"
                elif not SAFE_NAME.fullmatch(parameter[1]):
                    problem = problem or f"a tool call parameter name {parameter[1][:40]!r} is not {SAFE_NAME_RULE}"
                elif parameter[1] in arguments:
                    problem = problem or f"a tool call repeats its parameter {parameter[1]!r}"
                else:
                    arguments[parameter[1]] = (parameter[3], parameter[2])
                after, stop, pos = read_until(pos, parameter_open, invoke_close)
                if after != ">\n":
                    problem = problem or f"expected a line break after a parameter, found {after[:40]!r}"
            if problem:
                reply.problems.append(problem + "; that call is skipped")
            else:
                reply.tool_calls.append(_tool_call(name[1], arguments, reply.problems))
    except _Cut:
        reply.incomplete = "tool_calls"
        return
    after = body[pos:]
    end = after.find(EOS_TOKEN)
    if after[: end if end >= 0 else len(after)] and not (end < 0 and EOS_TOKEN.startswith(after)):
        reply.problems.append(f"text follows the tool calls: {after[:40]!r}")
    if end < 0:
        reply.incomplete = "tool_calls"  # the block is whole, but the turn's end token never came
    else:
        _finish(reply, after[end + len(EOS_TOKEN) :])


def _tool_call(name: str, raw: dict[str, tuple[str, str]], problems: list[str]) -> ToolCall:
    typed, written = {}, []
    for key, (value, flag) in raw.items():
        if flag == "true":
            typed[key] = value
            written.append(f"{_json(key)}: {_json(value)}")
        else:
            try:
                typed[key] = _json_loads(value)
            except ValueError as exc:
                typed[key] = value
                why = f" ({exc})" if isinstance(exc, _TooDeep) else ""
                problems.append(f'parameter {key!r} of {name!r} is marked string="false" but is not JSON{why}')
            written.append(f"{_json(key)}: {value}")  # the value's own spelling, as the release writes it
    return ToolCall(name, typed, "{" + ", ".join(written) + "}")
