"""The V4.1 chat format: OpenAI-style messages to the prompt text the model reads, and a generated
assistant turn back to its reasoning, content and tool calls.

The release ships no template: its own encoder is the only definition of the format, and `render`
produces the string it produces for the same conversation. What the format says:

- A conversation starts with the begin-of-sentence token. A system message is `<｜System｜>` and its
  text (then its tool definitions and response schema, each after a blank line); one later in the
  conversation is rendered the same way and, like a user message, is answered. A user message is
  `<｜User｜>` and its text blocks (`\\n\\n` between blocks). There is no tool role: each tool result
  becomes a `<tool_result>…</tool_result>` block of the user message before it (or of a new one),
  sorted into the order of the calls that asked for them.
- After the last message that expects an answer comes the generation header: `<｜Assistant｜>` and
  `<think>` (thinking) or `</think>` (not thinking, or an earlier turn whose reasoning is dropped).
  An assistant turn is its reasoning and `</think>` (thinking mode, turns after the last user message,
  or every turn when reasoning is kept), its content, its tool calls as a DSML block (after a blank
  line) and the end-of-sentence token.
- DSML: `<｜DSML｜ calls>` holds one `<｜DSML｜ invoke name="…">` per call, which holds one
  `<｜DSML｜ parameter name="…" string="true|false">value</｜DSML｜ parameter>` per argument, a line
  each; a string argument is written as is, anything else as JSON. The tag names have a leading space.
- Thinking mode opens the conversation with `<｜System｜>Reasoning Effort: N (…)` where N is 1-100 (or
  "low" 50, "high" 75, the default, "max" 100); reasoning of turns before the last user message is
  dropped unless any message defines tools or `drop_thinking=False`.
- Images in content blocks become `<｜deepseek_image｜>` placeholders, and their records are returned
  in prompt order for the vision path.

Nothing here imports torch; `parse` never raises on model output (it says what was cut off and
what was malformed instead).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .tokenizer import (ASSISTANT_TOKEN, BOS_TOKEN, DSML_TOKEN, EOS_TOKEN, IMAGE_TOKEN,
                        LATEST_REMINDER_TOKEN, SYSTEM_TOKEN, TASK_TOKENS, THINK_END_TOKEN,
                        THINK_START_TOKEN, USER_TOKEN)

ROLES = ("system", "user", "assistant", "tool", "latest_reminder")

# DSML tag names as the format spells them: the markup token, then a space
CALLS_TAG = DSML_TOKEN + " calls"
INVOKE_TAG = DSML_TOKEN + " invoke"
PARAMETER_TAG = DSML_TOKEN + " parameter"
# a reply's tool-call block starts after a blank line; the blank line belongs to the markup
CALLS_OPENING = "\n\n<" + CALLS_TAG

REASONING_EFFORTS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"

# what a parsed reasoning or content must not contain (the release's decoder refuses them)
_MARKERS = (BOS_TOKEN, EOS_TOKEN, THINK_START_TOKEN, THINK_END_TOKEN, DSML_TOKEN)


class ChatFormatError(ValueError):
    """A conversation the format cannot render; the message says which message and why."""


# ---------------------------------------------------------------------- rendering
@dataclass
class ChatPrompt:
    text: str
    images: list[dict] = field(default_factory=list)  # {"type": "image", "url" | "source" | "data": ...}, prompt order
    keeps_reasoning: bool = False  # earlier turns' reasoning is rendered (drop_thinking off, or tools defined)


def encode(messages, *, tools=None, thinking: bool = False, reasoning_effort=None, drop_thinking: bool = True,
           add_bos: bool = True) -> str:
    """The prompt text for `messages` (OpenAI-style dicts), ending in the generation header when the
    last message expects an answer. See `render` for the arguments; this drops the image list."""
    return render(messages, tools=tools, thinking=thinking, reasoning_effort=reasoning_effort,
                  drop_thinking=drop_thinking, add_bos=add_bos).text


def render(messages, *, tools=None, thinking: bool = False, reasoning_effort=None, drop_thinking: bool = True,
           add_bos: bool = True) -> ChatPrompt:
    """The prompt text and the image records of `messages`.

    `tools`: OpenAI tool definitions (`{"type": "function", "function": {...}}`), placed on the first
    system message (an empty one is put first when the conversation has none); a system message may
    also carry its own `tools` and `response_format`. `thinking`: the reply starts by reasoning;
    `reasoning_effort` (thinking only): 1-100, "low", "high" (the default) or "max". `drop_thinking`:
    earlier turns' reasoning is left out (kept anyway when any message defines tools). Messages may
    carry the format's own keys: `reasoning_content`, `tool_calls`, `tool_call_id`, `task` (one of
    `TASK_TOKENS`), `wo_eos` (an assistant turn left open)."""
    budget = reasoning_budget(reasoning_effort)
    turns, images = _normalize(messages, tools)
    turns = _fold_tool_results(turns)
    _order_tool_results(turns)
    keep_reasoning = not drop_thinking or any(t.get("tools") for t in turns)
    last_user = _last_user_index(turns)
    text = [BOS_TOKEN] if add_bos else []
    for index in range(len(turns)):
        text.append(_render_turn(index, turns, thinking=thinking, keep_reasoning=keep_reasoning, budget=budget,
                                 last_user=last_user))
    return ChatPrompt("".join(text), images, keep_reasoning)


def reasoning_budget(effort) -> int:
    """The reasoning-effort number (1-100) for an int or one of "low", "high", "max"; None is "high"."""
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    if type(effort) is int and 1 <= effort <= 100:  # bool is no effort, though it is an int
        return effort
    if isinstance(effort, str) and effort in REASONING_EFFORTS:
        return REASONING_EFFORTS[effort]
    raise ChatFormatError(f"reasoning_effort must be a whole number from 1 to 100 or one of "
                          f"{', '.join(map(repr, REASONING_EFFORTS))}, got {effort!r}")


def tools_section(functions: list[dict]) -> str:
    """The system prompt's tool section for these function definitions (one JSON line each)."""
    calls, invoke, parameter = CALLS_TAG, INVOKE_TAG, PARAMETER_TAG
    schemas = "\n".join(_json(f) for f in functions)
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by "
        f"writing a \"<{calls}>\" block like the following:\n\n"
        f"<{calls}>\n"
        f"<{invoke} name=\"$TOOL_NAME\">\n"
        f"<{parameter} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{parameter}>\n"
        "...\n"
        f"</{invoke}>\n"
        f"<{invoke} name=\"$TOOL_NAME2\">\n"
        "...\n"
        f"</{invoke}>\n"
        f"</{calls}>\n\n"
        "String parameters should be specified as is and set `string=\"true\"`. For all other types "
        "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
        f"If thinking_mode is enabled (triggered by {THINK_START_TOKEN}), you MUST output your complete "
        f"reasoning inside {THINK_START_TOKEN}...{THINK_END_TOKEN} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {THINK_END_TOKEN} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        f"{schemas}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def tool_calls_block(calls: list[dict]) -> str:
    """An assistant turn's DSML block (with the blank line before it) for OpenAI-style tool calls."""
    invokes = []
    for call in calls:
        name, arguments = _call_parts(call)
        params = []
        for key, value in _arguments_dict(arguments).items():
            flag, written = ("true", value) if isinstance(value, str) else ("false", _json(value))
            params.append(f'<{PARAMETER_TAG} name="{key}" string="{flag}">{written}</{PARAMETER_TAG}>')
        invokes.append(f'<{INVOKE_TAG} name="{name}">\n' + "\n".join(params) + f"\n</{INVOKE_TAG}>")
    return f"\n\n<{CALLS_TAG}>\n" + "\n".join(invokes) + f"\n</{CALLS_TAG}>"


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_parts(call) -> tuple[str, Any]:
    if not isinstance(call, dict):
        raise ChatFormatError(f"a tool call must be a dict with a function name and arguments, got {call!r}")
    function = call.get("function", call)  # OpenAI's {"function": {...}} or the bare pair
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ChatFormatError(f"a tool call needs a function name (a string), got {call!r}")
    return name, function.get("arguments")


def _arguments_dict(arguments) -> dict:
    """Arguments as the format writes them: a dict, a JSON text of one (even JSON-encoded twice),
    or, failing both, one parameter named "arguments" holding what was given."""
    given = arguments
    for _ in range(2):
        if not isinstance(arguments, str):
            break
        try:
            arguments = json.loads(arguments)
        except ValueError:
            break
    return arguments if isinstance(arguments, dict) else {"arguments": given}


def _normalize(messages, tools) -> tuple[list[dict], list[dict]]:
    """Checked deep copies with tools placed, list content turned into blocks, images replaced by
    their placeholder; and the image records in prompt order."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    turns = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            got = message.get("role") if isinstance(message, dict) else message
            raise ChatFormatError(f"message {number} must be a dict whose role is one of {', '.join(ROLES)}, "
                                  f"got {got!r}")
        if message.get("tools") and message["role"] != "system":
            raise ChatFormatError(f"message {number} ({message['role']}) defines tools; tools belong to a "
                                  f"system message")
        task = message.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ChatFormatError(f"message {number} has task {task!r}; the format knows {', '.join(TASK_TOKENS)}")
        turns.append(copy.deepcopy(message))
        if message["role"] == "latest_reminder" and not isinstance(message.get("content"), str):
            raise ChatFormatError(f"message {number} (latest_reminder) needs its content as text")
    if tools:
        if turns[0]["role"] == "system":
            if turns[0].get("tools"):
                raise ChatFormatError("tools are given twice: as the tools argument and on the first system message")
            turns[0]["tools"] = list(tools)
        else:
            turns.insert(0, {"role": "system", "content": "", "tools": list(tools)})
    for turn in turns:
        if turn.get("tools"):
            turn["tools"] = [_function_of(tool) for tool in turn["tools"]]

    images: list[dict] = []
    for number, turn in enumerate(turns):
        for key in ("content", "reasoning_content"):
            if isinstance(turn.get(key), str) and IMAGE_TOKEN in turn[key]:
                raise ChatFormatError(f"message {number}'s {key} contains the image placeholder {IMAGE_TOKEN}; "
                                      f"pass images as image content blocks")
        if isinstance(turn.get("content"), list) and "content_blocks" not in turn:
            turn["content_blocks"] = turn.pop("content")
        if turn.get("content_blocks"):
            turn["content_blocks"] = _replace_images(turn["content_blocks"], images, number)
            if not isinstance(turn.get("content"), str):
                texts = [b.get("text") or "" for b in turn["content_blocks"] if b.get("type") == "text"]
                turn["content"] = "\n\n".join(texts)
    return turns, images


def _function_of(tool) -> dict:
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatFormatError(f"a tool must be {{'type': 'function', 'function': {{'name': ..., ...}}}}, got {tool!r}")
    return function


def _replace_images(blocks, images: list[dict], number: int) -> list[dict]:
    """Blocks with each image block turned into a placeholder text block (nested tool results too),
    its record appended to `images`."""
    out = []
    for block in blocks:
        if not isinstance(block, dict):
            raise ChatFormatError(f"message {number} has a content block that is not a dict: {block!r}")
        kind = block.get("type")
        if kind in ("image", "image_url"):
            images.append(_image_record(block, number))
            out.append({"type": "text", "text": IMAGE_TOKEN})
        elif kind == "tool_result" and isinstance(block.get("content"), list):
            out.append(dict(block, content=_replace_images(block["content"], images, number)))
        else:
            if kind == "text" and IMAGE_TOKEN in (block.get("text") or ""):
                raise ChatFormatError(f"message {number} has a text block containing the image placeholder "
                                      f"{IMAGE_TOKEN}; pass images as separate image blocks")
            out.append(block)
    return out


def _image_record(block: dict, number: int) -> dict:
    record = {"type": "image"}
    if block["type"] == "image_url":
        url = block.get("image_url")
        record["url"] = url if isinstance(url, str) else (url or {}).get("url", "")
    else:
        record.update({key: block[key] for key in ("source", "url", "data") if key in block})
    if not any(record.get(key) for key in ("source", "url", "data")):
        raise ChatFormatError(f"message {number} has an image block without a url, source or data")
    return record


def _fold_tool_results(turns: list[dict]) -> list[dict]:
    """Tool messages become tool-result blocks of the user message before them (or of a new one);
    consecutive user messages become one, unless the earlier one carries a task."""
    folded: list[dict] = []
    for number, turn in enumerate(turns):
        role = turn["role"]
        previous_user = folded and folded[-1]["role"] == "user" and "content_blocks" in folded[-1]
        if role == "tool":
            content = turn.get("content", "")
            if not isinstance(content, str):
                raise ChatFormatError(f"message {number} (tool) needs its result as text or text blocks, "
                                      f"got {content!r}")
            block = {"type": "tool_result", "tool_use_id": turn.get("tool_call_id", ""), "content": content}
            if previous_user:
                folded[-1]["content_blocks"].append(block)
            else:
                folded.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = turn.get("content_blocks")
            if blocks is None:
                content = turn.get("content")
                blocks = [{"type": "text", "text": content if isinstance(content, str) else ""}]
            if previous_user and folded[-1].get("task") is None:
                folded[-1]["content_blocks"].extend(blocks)
            else:
                turn["content_blocks"] = blocks
                folded.append(turn)
        else:
            folded.append(turn)
    return folded


def _order_tool_results(turns: list[dict]) -> None:
    """Sort each user message's tool results into the order of the latest assistant calls (by id;
    a result whose id is not among them counts as the first call). Other blocks keep their places."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            order = {}
            for index, call in enumerate(turn["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = index
        elif turn["role"] == "user" and turn.get("content_blocks") and order:
            results = [b for b in turn["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                turn["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b
                                          for b in turn["content_blocks"]]


def _last_user_index(turns: list[dict]) -> int:
    """The last message that expects an answer: a user message, or a system message after the first."""
    for index in range(len(turns) - 1, -1, -1):
        if turns[index]["role"] == "user" or (turns[index]["role"] == "system" and index > 0):
            return index
    return -1


def _render_turn(index: int, turns: list[dict], *, thinking: bool, keep_reasoning: bool, budget: int,
                 last_user: int) -> str:
    turn = turns[index]
    role, content = turn["role"], turn.get("content")
    out = []
    if index == 0 and (thinking or role == "system"):
        out.append(SYSTEM_TOKEN)
    if index == 0 and thinking:
        out.append(f"Reasoning Effort: {budget} "
                   "(range 1-100, the higher the value, the more thorough the reasoning)\n\n")

    if role == "system":
        if index > 0:
            out.append(SYSTEM_TOKEN)
        out.append(content or "")
        if turn.get("tools"):
            out.append("\n\n" + tools_section(turn["tools"]))
        if turn.get("response_format"):
            out.append("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                       + _json(turn["response_format"]))
    elif role == "user":
        out.append(USER_TOKEN)
        blocks = turn.get("content_blocks")
        out.append("\n\n".join(_block_text(b) for b in blocks) if blocks else content or "")
    elif role == "latest_reminder":
        out.append(LATEST_REMINDER_TOKEN + (content or ""))
    else:  # assistant
        after_task = index > 0 and turns[index - 1].get("task") is not None  # a task's answer has no reasoning
        if thinking and not after_task and (keep_reasoning or index > last_user):
            out.append((turn.get("reasoning_content") or "") + THINK_END_TOKEN)
        out.append(content or "")
        if turn.get("tool_calls"):
            out.append(tool_calls_block(turn["tool_calls"]))
        if not turn.get("wo_eos", False):
            out.append(EOS_TOKEN)

    # what follows a message the next one does not continue: a task token or the generation header
    following = turns[index + 1]["role"] if index + 1 < len(turns) else None
    if following in (None, "assistant", "latest_reminder"):
        task = turn.get("task")
        if task == "action":
            out.append(ASSISTANT_TOKEN + (THINK_START_TOKEN if thinking else THINK_END_TOKEN) + TASK_TOKENS[task])
        elif task is not None:
            out.append(TASK_TOKENS[task])
        elif role == "user" or (role == "system" and index > 0):
            opens_thinking = thinking and (keep_reasoning or index >= last_user)
            out.append(ASSISTANT_TOKEN + (THINK_START_TOKEN if opens_thinking else THINK_END_TOKEN))
    return "".join(out)


def _block_text(block: dict) -> str:
    kind = block.get("type")
    if kind == "text":
        return block.get("text") or ""
    if kind == "tool_result":
        result = block.get("content", "")
        if isinstance(result, list):
            result = "\n\n".join(b.get("text") or "" if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                                 for b in result)
        return f"<tool_result>{result}</tool_result>"
    return f"[Unsupported {kind}]"


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
        rest = rest[len(THINK_START_TOKEN):] if rest.startswith(THINK_START_TOKEN) else rest
        close, end = rest.find(THINK_END_TOKEN), rest.find(EOS_TOKEN)
        if close >= 0 and (end < 0 or close < end):
            reply.reasoning, rest = rest[:close], rest[close + len(THINK_END_TOKEN):]
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
        _finish(reply, rest[end + len(EOS_TOKEN):])
    elif opening >= 0:
        reply.content = rest[:opening]
        _parse_calls(reply, rest[opening + len(CALLS_OPENING):])
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

    def read_until(pos: int, *stops: str) -> tuple[str, str, int]:
        """(text before the nearest stop, the stop, the position after it); _Cut when none follows."""
        found = [(body.find(stop, pos), stop) for stop in stops]
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
            while stop == parameter_open:
                parameter_text, _, pos = read_until(pos, parameter_close)
                parameter = _PARAMETER.fullmatch(parameter_text)
                if parameter is None:
                    problem = problem or f"a tool call parameter is malformed: {parameter_text[:40]!r}"
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
        _finish(reply, after[end + len(EOS_TOKEN):])


def _tool_call(name: str, raw: dict[str, tuple[str, str]], problems: list[str]) -> ToolCall:
    typed, written = {}, []
    for key, (value, flag) in raw.items():
        if flag == "true":
            typed[key] = value
            written.append(f"{_json(key)}: {_json(value)}")
        else:
            try:
                typed[key] = json.loads(value)
            except ValueError:
                typed[key] = value
                problems.append(f"parameter {key!r} of {name!r} is marked string=\"false\" but is not JSON")
            written.append(f"{_json(key)}: {value}")  # the value's own spelling, as the release writes it
    return ToolCall(name, typed, "{" + ", ".join(written) + "}")
