"""The V4.1 chat format: OpenAI-style messages to the prompt text and ids the model reads (a
generated assistant turn back to its reasoning, content and tool calls is `chat_reply.parse`).

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

Text and ids. `encode` gives the release encoder's string whatever the messages hold, so a message
that spells a marker (`<｜Assistant｜>`, a DSML block, `</tool_result>`) reads in that string as
the marker would. `render` also keeps the string as segments, the template's own markup and the
messages' text, and `token_ids` builds from them the ids a model runs on: the template's markers
are control tokens and message text is text, whatever it spells, so no message can forge a turn,
a tool call or a tool result. Tool and parameter names are refused outside `SAFE_NAME`, and the
image placeholder anywhere but an image block.

Nothing here imports torch.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    CHAT_TOKENS,
    EOS_TOKEN,
    IMAGE_TOKEN,
    LATEST_REMINDER_TOKEN,
    SYSTEM_TOKEN,
    TASK_TOKENS,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
)
from ..core.errors import Dsv41Error
from .chat_reply import CALLS_TAG, INVOKE_TAG, PARAMETER_TAG, SAFE_NAME, SAFE_NAME_RULE, _json, _json_loads

ROLES = ("system", "user", "assistant", "tool", "latest_reminder")

REASONING_EFFORTS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"


class ChatFormatError(Dsv41Error, ValueError):
    """A conversation the format cannot render; the message says which message and why."""


# ---------------------------------------------------------------------- rendering
# A rendered prompt is also kept as segments: MARKUP is the template's own text, in which the
# format's markers are control tokens; CONTENT is text from a message, which is never one.
MARKUP, CONTENT = "markup", "content"
FORMAT_MARKERS = (BOS_TOKEN, EOS_TOKEN, IMAGE_TOKEN, *CHAT_TOKENS)
_MARKER = re.compile("|".join(re.escape(m) for m in sorted(FORMAT_MARKERS, key=len, reverse=True)))


@dataclass
class ChatPrompt:
    text: str
    images: list[dict] = field(default_factory=list)  # {"type": "image", "url" | "source" | "data": ...}, prompt order
    keeps_reasoning: bool = False  # earlier turns' reasoning is rendered (drop_thinking off, or tools defined)
    segments: list[tuple[str, str]] = field(default_factory=list)  # (text, MARKUP | CONTENT), joining to `text`


class _Pieces:
    """Text being rendered, each piece tagged MARKUP or CONTENT."""

    def __init__(self):
        self.parts: list[tuple[str, str]] = []

    def markup(self, text: str) -> "_Pieces":
        if text:
            self.parts.append((text, MARKUP))
        return self

    def content(self, text: str) -> "_Pieces":
        if text:
            self.parts.append((text, CONTENT))
        return self

    def add(self, value) -> "_Pieces":
        """A message's text (a str), or pieces rendered earlier (its blocks, with their placeholders)."""
        if isinstance(value, _Pieces):
            self.parts.extend(value.parts)
        elif value:
            self.content(value)
        return self

    def text(self) -> str:
        return "".join(text for text, _ in self.parts)

    def segments(self) -> list[tuple[str, str]]:
        merged: list[tuple[str, str]] = []
        for text, kind in self.parts:
            if merged and merged[-1][1] == kind:
                merged[-1] = (merged[-1][0] + text, kind)
            else:
                merged.append((text, kind))
        return merged


def encode(
    messages,
    *,
    tools=None,
    thinking: bool = False,
    reasoning_effort=None,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> str:
    """The prompt text for `messages` (OpenAI-style dicts), ending in the generation header when the
    last message expects an answer. See `render` for the arguments; this drops the image list.
    The text is the release's; the ids a model should run on are `token_ids(render(...), tokenizer)`."""
    return render(
        messages,
        tools=tools,
        thinking=thinking,
        reasoning_effort=reasoning_effort,
        drop_thinking=drop_thinking,
        add_bos=add_bos,
    ).text


def render(
    messages,
    *,
    tools=None,
    thinking: bool = False,
    reasoning_effort=None,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> ChatPrompt:
    """The prompt text, the image records and the segments of `messages`.

    `tools`: OpenAI tool definitions (`{"type": "function", "function": {...}}`), placed on the first
    system message (an empty one is put first when the conversation has none); a system message may
    also carry its own `tools` and `response_format`. `thinking`: the reply starts by reasoning;
    `reasoning_effort` (thinking only): 1-100, "low", "high" (the default) or "max". `drop_thinking`:
    earlier turns' reasoning is left out (kept anyway when any message defines tools). Messages may
    carry the format's own keys: `reasoning_content`, `tool_calls`, `tool_call_id`, `task` (one of
    `TASK_TOKENS`), `wo_eos` (an assistant turn left open). A conversation the format cannot
    render is a ChatFormatError naming the message."""
    budget = reasoning_budget(reasoning_effort)
    turns, images = _normalize(messages, tools)
    turns = _fold_tool_results(turns)
    _order_tool_results(turns)
    keep_reasoning = not drop_thinking or any(t.get("tools") for t in turns)
    last_user = _last_user_index(turns)
    out = _Pieces()
    if add_bos:
        out.markup(BOS_TOKEN)
    for index in range(len(turns)):
        _render_turn(
            out, index, turns, thinking=thinking, keep_reasoning=keep_reasoning, budget=budget, last_user=last_user
        )
    text = out.text()
    _check_utf8(text, "the rendered conversation")  # what the per-message checks cannot reach (tool schemas)
    return ChatPrompt(text, images, keep_reasoning, out.segments())


def token_ids(prompt: ChatPrompt, tokenizer) -> list[int]:
    """The ids a model runs on for a rendered prompt (its text holds the begin-of-sentence token, so
    none is added): each of the template's markers is its control token, and message text is
    tokenized as text whatever it spells. For a conversation whose text spells no token of the
    tokenizer's added vocabulary these are the ids of tokenizing `prompt.text` whole. A ChatPrompt
    made by hand, without segments, is read as markup throughout."""
    controls = set(tokenizer.get_added_tokens_decoder())
    ids: list[int] = []
    run: list[str] = []  # text between two markers, tokenized in one piece as the whole text would be

    def flush():
        if run:
            ids.extend(_text_ids(tokenizer, "".join(run), controls))
            run.clear()

    for text, kind in prompt.segments or [(prompt.text, MARKUP)]:
        if kind == CONTENT:
            run.append(text)
            continue
        at = 0
        for marker in _MARKER.finditer(text):
            run.append(text[at : marker.start()])
            flush()
            ids.extend(_marker_ids(tokenizer, marker.group()))
            at = marker.end()
        run.append(text[at:])
    flush()
    return ids


def _marker_ids(tokenizer, marker: str) -> list[int]:
    token_id = tokenizer.token_to_id(marker)
    return [token_id] if token_id is not None else tokenizer.encode(marker, add_special_tokens=False).ids


def _text_ids(tokenizer, text: str, controls: set) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if controls.isdisjoint(ids):
        return ids  # no added token matched: the tokenizer's own ids
    # The text spells an added token, which the tokenizer matches before anything else. Below that
    # matching (normalizer, pre-tokenizer, model) it is text like any other.
    if tokenizer.normalizer is not None:
        text = tokenizer.normalizer.normalize_str(text)
    words = tokenizer.pre_tokenizer.pre_tokenize_str(text) if tokenizer.pre_tokenizer is not None else [(text, None)]
    ids = []
    for word, _ in words:
        pieces = [token.id for token in tokenizer.model.tokenize(word)]
        if not controls.isdisjoint(pieces):  # the model's vocabulary spells a control token too: split it up
            pieces = [token.id for char in word for token in tokenizer.model.tokenize(char)]
        ids.extend(pieces)
    return ids


def reasoning_budget(effort) -> int:
    """The reasoning-effort number (1-100) for an int or one of "low", "high", "max"; None is "high"."""
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    if type(effort) is int and 1 <= effort <= 100:  # bool is no effort, though it is an int
        return effort
    if isinstance(effort, str) and effort in REASONING_EFFORTS:
        return REASONING_EFFORTS[effort]
    raise ChatFormatError(
        f"reasoning_effort must be a whole number from 1 to 100 or one of "
        f"{', '.join(map(repr, REASONING_EFFORTS))}, got {_shown(effort)}"
    )


def tools_section(functions: list[dict]) -> str:
    """The system prompt's tool section for these function definitions (one JSON line each)."""
    return _tools_pieces(functions).text()


def _tools_pieces(functions: list[dict]) -> _Pieces:
    calls, invoke, parameter = CALLS_TAG, INVOKE_TAG, PARAMETER_TAG
    schemas = "\n".join(_json_text(f, f"the tool definition {f.get('name')!r}") for f in functions)
    return (
        _Pieces()
        .markup(
            "## Tools\n\n"
            "You have access to a set of tools to help answer the user's question. You can invoke tools by "
            f'writing a "<{calls}>" block like the following:\n\n'
            f"<{calls}>\n"
            f'<{invoke} name="$TOOL_NAME">\n'
            f'<{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{parameter}>\n'
            "...\n"
            f"</{invoke}>\n"
            f'<{invoke} name="$TOOL_NAME2">\n'
            "...\n"
            f"</{invoke}>\n"
            f"</{calls}>\n\n"
            'String parameters should be specified as is and set `string="true"`. For all other types '
            '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
            f"If thinking_mode is enabled (triggered by {THINK_START_TOKEN}), you MUST output your complete "
            f"reasoning inside {THINK_START_TOKEN}...{THINK_END_TOKEN} BEFORE any tool calls or final response.\n\n"
            f"Otherwise, output directly after {THINK_END_TOKEN} with tool calls or final response.\n\n"
            "### Available Tool Schemas\n\n"
        )
        .content(schemas)
        .markup(
            "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
        )
    )


def tool_calls_block(calls: list[dict]) -> str:
    """An assistant turn's DSML block (with the blank line before it) for OpenAI-style tool calls."""
    return _calls_pieces(_written_calls(calls, "the tool calls")).text()


# a call as the block writes it: its name and (parameter name, string flag, written value) triples
WrittenCall = tuple[str, list[tuple[str, str, str]]]


def _written_calls(calls, where: str) -> list[WrittenCall]:
    if not isinstance(calls, (list, tuple)):
        raise ChatFormatError(f"{where}: tool_calls must be a list of calls, got {_shown(calls)}")
    written = []
    for call in calls:
        name, arguments = _call_parts(call, where)
        params = []
        for key, value in _arguments_dict(arguments).items():
            if not isinstance(key, str) or not SAFE_NAME.fullmatch(key):
                raise ChatFormatError(
                    f"{where}: the tool call {name!r} has the parameter name {_shown(key)}; "
                    f"parameter names are {SAFE_NAME_RULE}"
                )
            flag, text = (
                ("true", value)
                if isinstance(value, str)
                else ("false", _json_text(value, f"{where}: the tool call {name!r} argument {key!r}"))
            )
            if IMAGE_TOKEN in text:
                raise ChatFormatError(
                    f"{where}: the tool call {name!r} argument {key!r} contains the image "
                    f"placeholder {IMAGE_TOKEN}; images go in image content blocks"
                )
            _check_utf8(text, f"{where}: the tool call {name!r} argument {key!r}")
            params.append((key, flag, text))
        written.append((name, params))
    return written


def _calls_pieces(calls: list[WrittenCall]) -> _Pieces:
    out = _Pieces().markup(f"\n\n<{CALLS_TAG}>\n")
    for number, (name, params) in enumerate(calls):
        out.markup("\n" if number else "").markup(f'<{INVOKE_TAG} name="').content(name).markup('">\n')
        for index, (key, flag, text) in enumerate(params):
            out.markup("\n" if index else "").markup(f'<{PARAMETER_TAG} name="').content(key)
            out.markup(f'" string="{flag}">').content(text).markup(f"</{PARAMETER_TAG}>")
        out.markup(f"\n</{INVOKE_TAG}>")
    return out.markup(f"\n</{CALLS_TAG}>")


def _json_text(value, what: str) -> str:
    """`value` as the format writes JSON; a value JSON cannot hold is a ChatFormatError about `what`."""
    try:
        return _json(value)
    except (TypeError, ValueError, RecursionError) as exc:  # a set, a cycle, nesting past the encoder
        reason = "it nests too deeply" if isinstance(exc, RecursionError) else _first_line(exc)
        raise ChatFormatError(f"{what} cannot be written as JSON ({reason})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


def _shown(value) -> str:
    """A short description of a given value for an error sentence."""
    try:
        text = repr(value)
    except Exception:  # a repr that fails or recurses too deeply
        text = "…"
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}" if not isinstance(value, str) else text


def _check_utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: a byte escaped from input that was not UTF-8
        raise ChatFormatError(
            f"{what} is not UTF-8 text (a lone surrogate {text[exc.start]!r} at character "
            f"{exc.start + 1}); decode its input as UTF-8"
        ) from None


def _checked_text(value, what: str) -> str:
    if not isinstance(value, str):
        raise ChatFormatError(f"{what} must be a string, got {_shown(value)}")
    _check_utf8(value, what)
    if IMAGE_TOKEN in value:
        raise ChatFormatError(
            f"{what} contains the image placeholder {IMAGE_TOKEN}; pass images as image content blocks"
        )
    return value


def _call_parts(call, where: str = "a tool call") -> tuple[str, Any]:
    if not isinstance(call, dict):
        raise ChatFormatError(
            f"{where}: a tool call must be a dict with a function name and arguments, got {_shown(call)}"
        )
    function = call.get("function", call)  # OpenAI's {"function": {...}} or the bare pair
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ChatFormatError(f"{where}: a tool call needs a function name (a string), got {_shown(call)}")
    if not SAFE_NAME.fullmatch(name):
        raise ChatFormatError(f"{where}: the tool call name {name!r} is not {SAFE_NAME_RULE}")
    call_id = call.get("id", function.get("id"))
    if call_id is not None and not isinstance(call_id, str):
        raise ChatFormatError(f"{where}: the tool call {name!r} has the id {_shown(call_id)}; ids are text")
    return name, function.get("arguments")


def _arguments_dict(arguments) -> dict:
    """Arguments as the format writes them: a dict, a JSON text of one (even JSON-encoded twice),
    or, failing both, one parameter named "arguments" holding what was given."""
    given = arguments
    for _ in range(2):
        if not isinstance(arguments, str):
            break
        try:
            arguments = _json_loads(arguments)
        except ValueError:
            break
    return arguments if isinstance(arguments, dict) else {"arguments": given}


def _normalize(messages, tools) -> tuple[list[dict], list[dict]]:
    """Checked deep copies with tools placed, list content turned into blocks, images replaced by
    their placeholder, tool calls written; and the image records in prompt order."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    turns, images = [], []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            got = message.get("role") if isinstance(message, dict) else message
            raise ChatFormatError(
                f"message {number} must be a dict whose role is one of {', '.join(ROLES)}, got {_shown(got)}"
            )
        if message.get("tools") and message["role"] != "system":
            raise ChatFormatError(
                f"message {number} ({message['role']}) defines tools; tools belong to a system message"
            )
        task = message.get("task")
        if task is not None and (not isinstance(task, str) or task not in TASK_TOKENS):
            raise ChatFormatError(
                f"message {number} has task {_shown(task)}; the format knows {', '.join(TASK_TOKENS)}"
            )
        try:
            turn = copy.deepcopy(message)
        except (TypeError, ValueError, RecursionError, copy.Error) as exc:
            reason = _first_line(exc)
            raise ChatFormatError(f"message {number} holds a value that cannot be copied ({reason})") from None
        _check_message(turn, number, images)
        turns.append(turn)
    if tools:
        if not isinstance(tools, (list, tuple)):
            raise ChatFormatError(f"tools must be a list of tool definitions, got {_shown(tools)}")
        if turns[0]["role"] == "system":
            if turns[0].get("tools"):
                raise ChatFormatError("tools are given twice: as the tools argument and on the first system message")
            turns[0]["tools"] = list(tools)
        else:
            turns.insert(0, {"role": "system", "content": "", "tools": list(tools)})
    for turn in turns:
        if turn.get("tools"):
            if not isinstance(turn["tools"], (list, tuple)):
                raise ChatFormatError(
                    f"a system message's tools must be a list of tool definitions, got {_shown(turn['tools'])}"
                )
            turn["tools"] = [_function_of(tool) for tool in turn["tools"]]
    return turns, images


def _check_message(turn: dict, number: int, images: list[dict]) -> None:
    """Check one message's values and bring it into the form the renderer reads, in place."""
    role = turn["role"]
    where = f"message {number} ({role})"
    if role == "latest_reminder" and not isinstance(turn.get("content"), str):
        raise ChatFormatError(f"{where} needs its content as text, got {_shown(turn.get('content'))}")
    if isinstance(turn.get("content"), list) and "content_blocks" not in turn:
        turn["content_blocks"] = turn.pop("content")
    blocks = turn.get("content_blocks")
    if blocks is not None:
        if not isinstance(blocks, list):
            raise ChatFormatError(f"{where}'s content_blocks must be a list of content blocks, got {_shown(blocks)}")
        turn["content_blocks"] = _replace_images(blocks, images, where)

    content = turn.get("content")
    if isinstance(content, str):
        _checked_text(content, f"{where}'s content")
    elif blocks is not None and (content is None or isinstance(content, list)):  # the text blocks stand for it
        turn["content"] = _text_blocks(turn["content_blocks"])
    elif role == "tool" and "content" not in turn:
        turn["content"] = ""
    elif content is not None or role in ("user", "tool", "latest_reminder"):
        needs = "its result as text or text blocks" if role == "tool" else "its content as text or content blocks"
        raise ChatFormatError(f"{where} needs {needs}, got {_shown(content)}")

    if turn.get("reasoning_content") is not None:
        _checked_text(turn["reasoning_content"], f"{where}'s reasoning_content")
    if turn.get("response_format"):
        _json_text(turn["response_format"], f"{where}'s response_format")
    if role == "assistant" and turn.get("tool_calls"):
        turn["_calls"] = _written_calls(turn["tool_calls"], where)
    if role == "tool" and turn.get("tool_call_id") is not None and not isinstance(turn["tool_call_id"], str):
        raise ChatFormatError(f"{where}'s tool_call_id must be text, got {_shown(turn['tool_call_id'])}")


def _function_of(tool) -> dict:
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatFormatError(
            f"a tool must be {{'type': 'function', 'function': {{'name': ..., ...}}}}, got {_shown(tool)}"
        )
    if not SAFE_NAME.fullmatch(function["name"]):
        raise ChatFormatError(f"the tool definition name {function['name']!r} is not {SAFE_NAME_RULE}")
    return function


def _is_placeholder(block: dict) -> bool:
    # text blocks holding the placeholder are refused on the way in, so one here is an image's
    return block.get("type") == "text" and block.get("text") == IMAGE_TOKEN


def _replace_images(blocks, images: list[dict], where: str) -> list[dict]:
    """Checked blocks with each image block turned into a placeholder text block (nested tool
    results too), its record appended to `images`."""
    out = []
    for block in blocks:
        if not isinstance(block, dict):
            raise ChatFormatError(f"{where} has a content block that is not a dict: {_shown(block)}")
        kind = block.get("type")
        if kind in ("image", "image_url"):
            images.append(_image_record(block, where))
            out.append({"type": "text", "text": IMAGE_TOKEN})
        elif kind == "tool_result":
            result = block.get("content", "")
            if isinstance(result, list):
                block = dict(block, content=_replace_images(result, images, where))
            else:
                _checked_text(result, f"{where}'s tool_result block")
            if block.get("tool_use_id") is not None and not isinstance(block["tool_use_id"], str):
                raise ChatFormatError(
                    f"{where} has a tool_result block whose tool_use_id is {_shown(block['tool_use_id'])}; ids are text"
                )
            out.append(block)
        else:
            if kind == "text":
                _checked_text(block.get("text"), f"the text of a text block of {where}")
            out.append(block)
    return out


def _image_record(block: dict, where: str) -> dict:
    record = {"type": "image"}
    if block["type"] == "image_url":
        url = block.get("image_url")
        url = url.get("url", "") if isinstance(url, dict) else url
        if url is not None and not isinstance(url, str):
            raise ChatFormatError(f"{where} has an image_url block whose url is {_shown(url)}, not text")
        record["url"] = url or ""
    else:
        record.update({key: block[key] for key in ("source", "url", "data") if key in block})
        data, url, source = record.get("data"), record.get("url"), record.get("source")
        if data is not None and not isinstance(data, (str, bytes, bytearray)):
            raise ChatFormatError(f"{where} has an image block whose data is {_shown(data)}, not base64 text or bytes")
        if url is not None and not isinstance(url, str):
            raise ChatFormatError(f"{where} has an image block whose url is {_shown(url)}, not text")
        if isinstance(source, dict):
            inner = source.get("data") if source.get("type") == "base64" else source.get("url") or source.get("path")
            if not isinstance(inner, (str, bytes, bytearray)) or not inner:
                raise ChatFormatError(
                    f"{where} has an image block whose source is {_shown(source)}; a source is a "
                    f"path or URL, or {{'type': 'base64', 'data': ...}}"
                )
        elif source is not None and not isinstance(source, str):
            raise ChatFormatError(
                f"{where} has an image block whose source is {_shown(source)}, not a path, URL or base64 record"
            )
    if not any(record.get(key) for key in ("source", "url", "data")):
        raise ChatFormatError(f"{where} has an image block without a url, source or data")
    return record


def _text_blocks(blocks: list[dict]) -> _Pieces:
    """The text blocks of a system, assistant or tool message joined as its content (other blocks dropped)."""
    out = _Pieces()
    for index, block in enumerate(b for b in blocks if b.get("type") == "text"):
        out.markup("\n\n" if index else "")
        _block_pieces(out, block)
    return out


def _fold_tool_results(turns: list[dict]) -> list[dict]:
    """Tool messages become tool-result blocks of the user message before them (or of a new one);
    consecutive user messages become one, unless the earlier one carries a task."""
    folded: list[dict] = []
    for turn in turns:
        role = turn["role"]
        previous_user = folded and folded[-1]["role"] == "user" and "content_blocks" in folded[-1]
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": turn.get("tool_call_id") or "", "content": turn["content"]}
            if previous_user:
                folded[-1]["content_blocks"].append(block)
            else:
                folded.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = turn.get("content_blocks")
            if blocks is None:
                blocks = [{"type": "text", "text": turn["content"]}]
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
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id") or "", 0)))
                turn["content_blocks"] = [
                    next(ranked) if b.get("type") == "tool_result" else b for b in turn["content_blocks"]
                ]


def _last_user_index(turns: list[dict]) -> int:
    """The last message that expects an answer: a user message, or a system message after the first."""
    for index in range(len(turns) - 1, -1, -1):
        if turns[index]["role"] == "user" or (turns[index]["role"] == "system" and index > 0):
            return index
    return -1


def _render_turn(
    out: _Pieces, index: int, turns: list[dict], *, thinking: bool, keep_reasoning: bool, budget: int, last_user: int
) -> None:
    turn = turns[index]
    role, content = turn["role"], turn.get("content")
    if index == 0 and (thinking or role == "system"):
        out.markup(SYSTEM_TOKEN)
    if index == 0 and thinking:
        out.markup(
            f"Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
        )

    if role == "system":
        if index > 0:
            out.markup(SYSTEM_TOKEN)
        out.add(content)
        if turn.get("tools"):
            out.markup("\n\n").add(_tools_pieces(turn["tools"]))
        if turn.get("response_format"):
            out.markup("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n")
            out.content(_json_text(turn["response_format"], "the response_format"))
    elif role == "user":
        out.markup(USER_TOKEN)
        blocks = turn.get("content_blocks")
        if blocks:
            for number, block in enumerate(blocks):
                out.markup("\n\n" if number else "")
                _block_pieces(out, block)
        else:
            out.add(content)
    elif role == "latest_reminder":
        out.markup(LATEST_REMINDER_TOKEN).add(content)
    else:  # assistant
        after_task = index > 0 and turns[index - 1].get("task") is not None  # a task's answer has no reasoning
        if thinking and not after_task and (keep_reasoning or index > last_user):
            out.add(turn.get("reasoning_content")).markup(THINK_END_TOKEN)
        out.add(content)
        if turn.get("_calls"):
            out.add(_calls_pieces(turn["_calls"]))
        if not turn.get("wo_eos", False):
            out.markup(EOS_TOKEN)

    # what follows a message the next one does not continue: a task token or the generation header
    following = turns[index + 1]["role"] if index + 1 < len(turns) else None
    if following in (None, "assistant", "latest_reminder"):
        task = turn.get("task")
        if task == "action":
            out.markup(ASSISTANT_TOKEN + (THINK_START_TOKEN if thinking else THINK_END_TOKEN) + TASK_TOKENS[task])
        elif task is not None:
            out.markup(TASK_TOKENS[task])
        elif role == "user" or (role == "system" and index > 0):
            opens_thinking = thinking and (keep_reasoning or index >= last_user)
            out.markup(ASSISTANT_TOKEN + (THINK_START_TOKEN if opens_thinking else THINK_END_TOKEN))


def _block_pieces(out: _Pieces, block: dict) -> None:
    kind = block.get("type")
    if kind == "text":
        if _is_placeholder(block):
            out.markup(IMAGE_TOKEN)
        else:
            out.content(block.get("text") or "")
    elif kind == "tool_result":
        result = block.get("content", "")
        out.markup("<tool_result>")
        if isinstance(result, list):
            for number, inner in enumerate(result):
                out.markup("\n\n" if number else "")
                if inner.get("type") == "text":
                    _block_pieces(out, inner)
                else:
                    out.markup("[Unsupported ").content(f"{inner.get('type')}").markup("]")
        else:
            out.add(result)
        out.markup("</tool_result>")
    else:
        out.markup("[Unsupported ").content(f"{kind}").markup("]")
