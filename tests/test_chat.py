"""The V4.1 chat format, checked against its own rules: every expected prompt below is assembled in
the test from the format's markers and small templates (the message kinds, thinking and reasoning
effort, tools and DSML calls, tool results in call order, mid-conversation system messages, images,
tasks), then parsing generated turns back, whole, cut off and malformed."""

import json

import pytest

from dsv41.generation import chat_reply
from dsv41.generation.chat import ChatFormatError, encode, render
from dsv41.generation.chat_reply import parse

# the format's markers, spelled out
B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, S, R = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<｜latest_reminder｜>"
T0, T1 = "<think>", "</think>"
D = "｜DSML｜"
IMG = "<｜deepseek_image｜>"


def effort_line(n: int) -> str:
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def parameter(name: str, flag: str, value: str) -> str:
    return f'<{D} parameter name="{name}" string="{flag}">{value}</{D} parameter>'


def invoke(name: str, *parameters: str) -> str:
    return f'<{D} invoke name="{name}">\n' + "\n".join(parameters) + f"\n</{D} invoke>"


def calls(*invokes: str) -> str:
    return f"\n\n<{D} calls>\n" + "\n".join(invokes) + f"\n</{D} calls>"


def call(name: str, arguments, call_id: str = "") -> dict:
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return dict(out, id=call_id) if call_id else out


# ---------------------------------------------------------------------- message kinds
def test_a_user_message_gets_the_generation_header():
    assert encode([{"role": "user", "content": "hi"}]) == B + U + "hi" + A + T1
    assert encode([{"role": "user", "content": "hi"}], add_bos=False) == U + "hi" + A + T1


def test_a_first_system_message_opens_with_the_system_token():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert encode(messages) == B + S + "be brief" + U + "hi" + A + T1


def test_earlier_turns_end_with_the_end_token_and_no_reasoning_without_thinking():
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    assert encode(messages) == B + U + "q1" + A + T1 + "a1" + E + U + "q2" + A + T1


def test_a_conversation_ending_in_an_assistant_turn_has_no_header():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert encode(messages) == B + U + "q" + A + T1 + "a" + E
    open_turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "wo_eos": True}]
    assert encode(open_turn) == B + U + "q" + A + T1 + "a"


def test_a_mid_conversation_system_message_is_answered_like_a_user_message():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "system", "content": "now in French"},
    ]
    assert encode(messages) == B + U + "q" + A + T1 + "a" + E + S + "now in French" + A + T1
    # thinking: it is the last message expecting an answer, so the header opens the reasoning
    assert encode(messages, thinking=True) == (
        B + S + effort_line(75) + U + "q" + A + T1 + "a" + E + S + "now in French" + A + T0
    )


def test_latest_reminder_and_response_format():
    messages = [
        {"role": "system", "content": "sys", "response_format": {"type": "json_object"}},
        {"role": "user", "content": "q"},
        {"role": "latest_reminder", "content": "today is Monday"},
    ]
    schema = (
        '## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{"type": "json_object"}'
    )
    # the reminder follows the header the user message already opened
    assert encode(messages) == B + S + "sys\n\n" + schema + U + "q" + A + T1 + R + "today is Monday"


def test_task_tokens_replace_the_header():
    assert encode([{"role": "user", "content": "q", "task": "query"}]) == B + U + "q" + "<｜query｜>"
    assert encode([{"role": "user", "content": "q", "task": "action"}]) == B + U + "q" + A + T1 + "<｜action｜>"
    with pytest.raises(ChatFormatError, match="task 'guess'"):
        encode([{"role": "user", "content": "q", "task": "guess"}])


# ---------------------------------------------------------------------- thinking and reasoning effort
def test_thinking_opens_with_the_effort_and_drops_earlier_reasoning():
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    assert encode(messages, thinking=True) == (
        B + S + effort_line(75) + U + "q1" + A + T1 + "a1" + E + U + "q2" + A + T0
    )
    kept = encode(messages, thinking=True, drop_thinking=False)
    assert kept == B + S + effort_line(75) + U + "q1" + A + T0 + "r1" + T1 + "a1" + E + U + "q2" + A + T0


def test_the_turn_after_the_last_user_message_keeps_its_reasoning():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert encode(messages, thinking=True) == B + S + effort_line(75) + U + "q" + A + T0 + "r" + T1 + "a" + E


def test_the_effort_line_follows_a_first_system_message_token():
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    assert encode(messages, thinking=True, reasoning_effort=10) == B + S + effort_line(10) + "sys" + U + "q" + A + T0


@pytest.mark.parametrize(
    "effort, budget", [(None, 75), (1, 1), (42, 42), (100, 100), ("low", 50), ("high", 75), ("max", 100)]
)
def test_reasoning_effort_values(effort, budget):
    text = encode([{"role": "user", "content": "q"}], thinking=True, reasoning_effort=effort)
    assert text == B + S + effort_line(budget) + U + "q" + A + T0
    # without thinking there is no effort line, but the value is still checked
    assert encode([{"role": "user", "content": "q"}], reasoning_effort=effort) == B + U + "q" + A + T1


@pytest.mark.parametrize("effort", [0, 101, -3, "medium", "LOW", True, 3.5, "50"])
def test_an_invalid_reasoning_effort_is_one_clear_error(effort):
    for thinking in (True, False):
        with pytest.raises(ChatFormatError, match="reasoning_effort must be a whole number from 1 to 100"):
            encode([{"role": "user", "content": "q"}], thinking=thinking, reasoning_effort=effort)


# ---------------------------------------------------------------------- tools
WEATHER = {
    "name": "get_weather",
    "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
}
CLOCK = {"name": "clock", "parameters": {"type": "object", "properties": {}}}


def tool_section(*functions) -> str:
    example = "\n".join(
        [
            f"<{D} calls>",
            f'<{D} invoke name="$TOOL_NAME">',
            parameter("$PARAMETER_NAME", "true|false", "$PARAMETER_VALUE"),
            "...",
            f"</{D} invoke>",
            f'<{D} invoke name="$TOOL_NAME2">',
            "...",
            f"</{D} invoke>",
            f"</{D} calls>",
        ]
    )
    return (
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke "
        f'tools by writing a "<{D} calls>" block like the following:\n\n' + example + "\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {T0}), you MUST output your complete reasoning inside "
        f"{T0}...{T1} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {T1} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        + "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        + "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def test_tools_go_after_the_system_message_with_a_blank_line():
    tools = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    assert encode(messages, tools=tools) == B + S + "sys\n\n" + tool_section(WEATHER, CLOCK) + U + "q" + A + T1
    # the same tools carried by the system message itself
    on_message = [dict(messages[0], tools=tools), messages[1]]
    assert encode(on_message) == encode(messages, tools=tools)


def test_tools_without_a_system_message_get_an_empty_one():
    text = encode([{"role": "user", "content": "q"}], tools=[{"type": "function", "function": CLOCK}])
    assert text == B + S + "\n\n" + tool_section(CLOCK) + U + "q" + A + T1
    assert f"<{D}calls>" not in text  # the tag names have a leading space


def test_tools_keep_earlier_reasoning_under_thinking():
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    text = encode(messages, tools=[{"type": "function", "function": CLOCK}], thinking=True)
    assert text.endswith(U + "q1" + A + T0 + "r1" + T1 + "a1" + E + U + "q2" + A + T0)


def test_tool_calls_write_strings_as_is_and_everything_else_as_json():
    arguments = {"city": "北京", "days": 3, "metric": True, "tags": ["a", "b"], "where": {"lat": 1.5}, "note": None}
    block = calls(
        invoke(
            "get_weather",
            parameter("city", "true", "北京"),
            parameter("days", "false", "3"),
            parameter("metric", "false", "true"),
            parameter("tags", "false", '["a", "b"]'),
            parameter("where", "false", '{"lat": 1.5}'),
            parameter("note", "false", "null"),
        )
    )
    for given in (arguments, json.dumps(arguments), json.dumps(json.dumps(arguments))):  # dict, JSON, JSON twice
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "let me look", "tool_calls": [call("get_weather", given)]},
        ]
        assert encode(messages) == B + U + "q" + A + T1 + "let me look" + block + E
    # arguments that are no JSON object become one string parameter named "arguments"
    odd = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call("clock", "now")]}]
    assert encode(odd).endswith(calls(invoke("clock", parameter("arguments", "true", "now"))) + E)
    empty = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call("clock", {})]}]
    assert encode(empty).endswith(calls(invoke("clock")) + E)


def test_tool_results_join_the_user_message_in_call_order():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("get_weather", {"city": "Oslo"}, "c1"), call("clock", {}, "c2")],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    block = calls(invoke("get_weather", parameter("city", "true", "Oslo")), invoke("clock"))
    results = "<tool_result>rain</tool_result>\n\n<tool_result>12:00</tool_result>"
    assert encode(messages) == B + U + "q" + A + T1 + block + E + U + results + A + T1


def test_a_tool_result_after_a_user_message_joins_it():
    messages = [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "x", "content": "r"}]
    assert encode(messages) == B + U + "q\n\n<tool_result>r</tool_result>" + A + T1


# ---------------------------------------------------------------------- images
def test_image_blocks_become_placeholders_and_records_in_prompt_order():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": "a.png"}},
                {"type": "image_url", "image_url": "b.png"},
            ],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "tool_call_id": "t", "content": [{"type": "image", "data": "QUJD"}]},
    ]
    prompt = render(messages)
    assert prompt.text == (
        B
        + U
        + "compare\n\n"
        + IMG
        + "\n\n"
        + IMG
        + A
        + T1
        + "ok"
        + E
        + U
        + "<tool_result>"
        + IMG
        + "</tool_result>"
        + A
        + T1
    )
    assert prompt.images == [
        {"type": "image", "url": "a.png"},
        {"type": "image", "url": "b.png"},
        {"type": "image", "data": "QUJD"},
    ]


def test_image_mistakes_are_one_clear_error():
    with pytest.raises(ChatFormatError, match="image placeholder"):
        encode([{"role": "user", "content": f"see {IMG}"}])
    with pytest.raises(ChatFormatError, match="image placeholder"):
        encode([{"role": "user", "content": [{"type": "text", "text": IMG}]}])
    with pytest.raises(ChatFormatError, match="without a url, source or data"):
        encode([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ([{"role": "developer", "content": "x"}], "role is one of"),
        (["hello"], "must be a dict"),
        ([{"role": "user", "content": "q", "tools": [{"type": "function", "function": CLOCK}]}], "belong to a system"),
        ([{"role": "tool", "content": None}], "needs its result as text"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}],
            "needs a function name",
        ),
    ],
)
def test_bad_conversations_are_one_clear_error(messages, match):
    with pytest.raises(ChatFormatError, match=match):
        encode(messages)


def test_tools_given_twice_is_an_error():
    system = {"role": "system", "content": "", "tools": [{"type": "function", "function": CLOCK}]}
    with pytest.raises(ChatFormatError, match="given twice"):
        encode([system, {"role": "user", "content": "q"}], tools=[{"type": "function", "function": CLOCK}])


def test_rendering_leaves_the_messages_as_they_were():
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": "a.png"}]},
        {"role": "tool", "tool_call_id": "1", "content": "r"},
    ]
    before = json.dumps(messages)
    render(messages, tools=[{"type": "function", "function": CLOCK}])
    assert json.dumps(messages) == before


# ---------------------------------------------------------------------- parsing replies
def generated(messages, **options) -> str:
    """The part of an encoded conversation an assistant turn generated: after the header before it."""
    return encode(messages, **options)[len(encode(messages[:-1], **options)) :]


TURNS = [
    {"role": "assistant", "content": "plain answer"},
    {"role": "assistant", "content": "", "tool_calls": [call("clock", {})]},
    {
        "role": "assistant",
        "content": "two calls",
        "tool_calls": [
            call("get_weather", {"city": "Oslo\nNorway", "days": 3, "ok": False}),
            call("lookup", {"q": "a < b", "filters": {"x": [1, 2.5, None]}}),
        ],
    },
]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("turn", range(len(TURNS)))
def test_encode_then_parse_gives_the_turn_back(turn, thinking):
    message = dict(TURNS[turn], reasoning_content="step by step\n\nthen done") if thinking else TURNS[turn]
    text = generated([{"role": "user", "content": "q"}, message], thinking=thinking)
    reply = parse(text, thinking=thinking)
    assert reply.ok and reply.finished and reply.incomplete is None
    assert reply.content == message["content"]
    assert reply.reasoning == (message.get("reasoning_content", "") if thinking else "")
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c.name, c.arguments) for c in reply.tool_calls] == expected  # typed as the string flag says
    assert [json.loads(c.arguments_json) for c in reply.tool_calls] == [a for _, a in expected]
    # the parsed reply renders back to the same turn
    assert generated([{"role": "user", "content": "q"}, reply.message()], thinking=thinking) == text
    assert parse(text).reasoning == reply.reasoning  # thinking inferred from the text when not given


def test_a_reply_cut_anywhere_never_raises_and_keeps_only_whole_calls():
    message = dict(TURNS[2], reasoning_content="hmm")
    text = generated([{"role": "user", "content": "q"}, message], thinking=True)
    whole = parse(text, thinking=True).tool_calls
    seen = set()
    for cut in range(len(text)):
        reply = parse(text[:cut], thinking=True)
        assert not reply.finished and reply.incomplete in ("reasoning", "content", "tool_calls")
        assert reply.tool_calls == whole[: len(reply.tool_calls)]
        assert D not in reply.content and not reply.problems, (cut, reply)
        seen.add(reply.incomplete)
    assert seen == {"reasoning", "content", "tool_calls"}


def test_malformed_replies_say_what_was_wrong():
    bad_parameter = (
        calls(
            invoke("clock", '<｜DSML｜ parameter name="x">1</｜DSML｜ parameter>'),
            invoke("lookup", parameter("q", "true", "fine")),
        )
        + E
    )
    reply = parse("text" + bad_parameter)
    assert reply.finished and [c.name for c in reply.tool_calls] == ["lookup"]
    assert "malformed" in reply.problems[0] and not reply.ok

    reply = parse("answer" + E + "more")
    assert reply.content == "answer" and "follows the end-of-sentence token" in reply.problems[0]

    reply = parse("no close" + E, thinking=True)
    assert reply.reasoning == "no close" and reply.finished and "without closing its reasoning" in reply.problems[0]

    reply = parse(calls(invoke("f", parameter("n", "false", "not json"))) + E)
    assert reply.tool_calls[0].arguments == {"n": "not json"} and "is not JSON" in reply.problems[0]

    reply = parse(calls(invoke("f", parameter("n", "true", "1"), parameter("n", "true", "2"))) + E)
    assert reply.tool_calls == [] and "repeats its parameter 'n'" in reply.problems[0]

    reply = parse("a " + T0 + " b" + E, thinking=False)
    assert "marker <think>" in reply.problems[0]

    with pytest.raises(TypeError, match="as a str"):
        parse(b"bytes")


def test_a_reply_cut_inside_the_opening_tag_is_incomplete_tool_calls():
    reply = parse("let me check\n\n<" + D + " ca")
    assert reply.content == "let me check" and reply.incomplete == "tool_calls"
    assert parse("a line\n\n").incomplete == "content"


# ---------------------------------------------------------------------- the tokenizer
def test_the_embedded_tokenizer_has_every_marker_as_one_id():
    from dsv41.checkpoint import tokenizer

    tok = tokenizer.build_tiny_tokenizer()
    markers = [B, E, U, A, S, R, T0, T1, D, IMG, *tokenizer.TASK_TOKENS.values()]
    ids = [tok.token_to_id(m) for m in markers]
    assert None not in ids and len(set(ids)) == len(markers)
    for marker, token_id in zip(markers, ids):
        assert tok.encode(marker, add_special_tokens=False).ids == [token_id]
    # a whole prompt with tools and calls: each marker stays one id, and the text comes back
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "rain"},
    ]
    text = encode(messages, tools=[{"type": "function", "function": WEATHER}], thinking=True)
    encoded = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(encoded, skip_special_tokens=False) == text
    assert encoded.count(tok.token_to_id(D)) == text.count(D)
    assert encoded.count(tok.token_to_id(A)) == text.count(A)
    assert chat_reply.CALLS_TAG == D + " calls"
