"""Chat over the embedded checkpoint: the reply parsed from the raw generation, a second turn that
runs only its new tokens (and equals a fresh prefill of the whole conversation bit for bit under
Numerics.parity()), the snapshot a turn keeps, images through the vision path, and `dsv41 chat`
with piped input and on a pseudo-terminal. The replies are noise: the model is random-weighted."""

import io
import json
import os
import select
import subprocess
import sys
import time

import pytest

from dsv41.core.numerics import Numerics
from dsv41.generation import chat as chat_format
from dsv41.generation import chat_reply
from dsv41.generation.conversation import ChatResult, Conversation, chat, image_source, run_terminal
from dsv41.generation.generate import generate
from dsv41.runtime.loader import load

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())


@pytest.fixture(scope="module")
def fresh(tiny_checkpoint):
    """A second model for from-scratch runs to compare with."""
    return load(tiny_checkpoint, quiet=True, numerics=Numerics.parity())


def held(model) -> list[int]:
    return model.token_ids[0].tolist() if model.token_ids.size(0) == 1 else []


def shared(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def first_call(result: ChatResult) -> tuple[int, int]:
    """(start_pos, seqlen) of the first forward the reply's run made."""
    step = result.generation.trace.cache[0]
    return step["start_pos"], step["seqlen"]


def test_a_reply_is_parsed_from_the_raw_generation(model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    result = chat(model, messages, max_new_tokens=6)
    assert result.prompt == chat_format.encode(messages)
    assert result.prompt_ids == model.tokenizer.encode(result.prompt, add_special_tokens=False).ids
    assert result.prompt_ids.count(model.cfg.bos_token_id) == 1 and result.prompt_ids[0] == model.cfg.bos_token_id
    assert result.raw == model.tokenizer.decode(result.generation.ids, skip_special_tokens=False)
    assert result.reply == chat_reply.parse(result.raw, thinking=False)
    assert result.message == result.reply.message() and result.message["role"] == "assistant"
    assert result.timings["prompt_tokens"] == len(result.prompt_ids)
    assert result.timings["prefilled"] == len(result.prompt_ids) - result.reused_positions


def test_the_model_verb_is_the_same_call(model, fresh):
    messages = [{"role": "user", "content": "hi"}]
    assert (
        chat(model, messages, max_new_tokens=4, reuse_prefix=False).generation.ids
        == chat(fresh, messages, max_new_tokens=4, reuse_prefix=False).generation.ids
    )


def test_a_second_turn_runs_only_its_new_tokens(model, fresh):
    model.reset()
    conversation = Conversation(model, system="terse", max_new_tokens=1)
    first = conversation.send("first question")
    assert held(model) == first.prompt_ids  # one new token: sampled, never fed back
    second = conversation.send("second question", trace=True)
    assert second.reused_positions == len(first.prompt_ids)
    assert second.timings["prefilled"] == len(second.prompt_ids) - len(first.prompt_ids)
    assert first_call(second) == (len(first.prompt_ids), second.timings["prefilled"])
    # the same bits as prefilling the whole conversation from nothing
    again = chat(fresh, conversation.messages[:-1], max_new_tokens=1, reuse_prefix=False, trace=True)
    assert again.prompt_ids == second.prompt_ids and again.reused_positions == 0
    assert again.generation.ids == second.generation.ids
    assert again.generation.trace.steps[0].margin == second.generation.trace.steps[0].margin


def test_longer_replies_reuse_what_retokenizes_the_same(model, fresh):
    model.reset()
    conversation = Conversation(model, max_new_tokens=8)
    first = conversation.send("tell me a story")
    before = held(model)
    second = conversation.send("go on", trace=True)
    # everything the model held that the new prompt starts with (the previous prompt at least:
    # its last marker ends a pre-tokenizer piece, so the reply cannot change how it tokenizes)
    expected = shared(before, second.prompt_ids[:-1])
    assert second.reused_positions == expected >= len(first.prompt_ids)
    assert first_call(second)[0] == expected
    again = chat(fresh, conversation.messages[:-1], max_new_tokens=8, reuse_prefix=False)
    assert again.generation.ids == second.generation.ids


def test_thinking_turns_continue_from_before_the_think_token(model, fresh):
    model.reset()
    conversation = Conversation(model, thinking=True, reasoning_effort="low", max_new_tokens=5)
    first = conversation.send("think first")
    assert first.prompt.endswith("<｜Assistant｜><think>") and first.reply.incomplete == "reasoning"
    assert first.resume.position == len(first.prompt_ids) - 1
    # prefilled as two calls, the same bits as one under parity
    one_call = chat(
        fresh, conversation.messages[:-1], thinking=True, reasoning_effort="low", max_new_tokens=5, reuse_prefix=False
    )
    assert one_call.generation.ids == first.generation.ids
    second = conversation.send("then answer", trace=True)
    # the second turn renders the first without its reasoning: the two part at the `<think>`
    assert shared(first.prompt_ids, second.prompt_ids) == len(first.prompt_ids) - 1
    assert second.reused_positions == len(first.prompt_ids) - 1
    again = chat(
        fresh, conversation.messages[:-1], thinking=True, reasoning_effort="low", max_new_tokens=5, reuse_prefix=False
    )
    assert again.generation.ids == second.generation.ids


def test_a_turn_resumes_from_its_snapshot_after_other_work(model, fresh):
    model.reset()
    conversation = Conversation(model, max_new_tokens=3)
    first = conversation.send("remember this")
    generate(model, "something else entirely", max_new_tokens=2)  # the caches now hold another sequence
    second = conversation.send("and now?")
    assert second.reused_positions >= len(first.prompt_ids)
    again = chat(fresh, conversation.messages[:-1], max_new_tokens=3, reuse_prefix=False)
    assert again.generation.ids == second.generation.ids
    # without the snapshot the other sequence shares only the begin token
    generate(model, "something else entirely", max_new_tokens=2)
    third = chat(model, conversation.messages + [{"role": "user", "content": "x"}], max_new_tokens=2)
    assert third.reused_positions == 1


def test_a_failed_turn_leaves_the_conversation_as_it_was(model):
    conversation = Conversation(model, max_new_tokens=2)
    conversation.send("one")
    before = list(conversation.messages)
    with pytest.raises(ValueError, match="max_seq_len"):
        conversation.send("two", max_new_tokens=model.backbone.max_seq_len + 1)
    assert conversation.messages == before
    conversation.reset()
    assert conversation.messages == [] and model.position == 0


def test_images_go_through_the_vision_path(model, tmp_path):
    from PIL import Image

    path = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(path)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": str(path)}},
            ],
        }
    ]
    result = chat(model, messages, max_new_tokens=3)
    assert result.images == [{"type": "image", "url": str(path)}]
    spans = model.prepare(chat_format.encode(messages, add_bos=False), [str(path)])
    assert result.prompt_ids == list(spans.ids)  # the placeholder became the image's span
    assert result.prompt_ids.count(model.cfg.image_token_id) > 1


def test_an_unreadable_image_is_named_by_its_number(model, tmp_path):
    from PIL import Image

    good, bad = tmp_path / "red.png", tmp_path / "broken.png"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(good)
    bad.write_bytes(b"not an image")
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": str(good)}},
        {"type": "image_url", "image_url": {"url": str(bad)}},
    ]
    # the source is quoted up to 80 characters (a test worker's temporary path may be longer)
    with pytest.raises(
        chat_format.ChatFormatError,
        match=r"^image 2 of the conversation \('[^']*'\) cannot be "
        r"read as an image file$",
    ) as refused:
        chat(model, [{"role": "user", "content": content}], max_new_tokens=1)
    assert str(bad)[:80] in str(refused.value)
    inline = dict(content[2], image_url={"url": "data:image/png;base64,QUJD"})
    with pytest.raises(
        chat_format.ChatFormatError, match="^image 2 of the conversation cannot be used: .*not an image"
    ):
        chat(model, [{"role": "user", "content": content[:2] + [inline]}], max_new_tokens=1)


def test_image_records_become_what_the_vision_path_reads():
    assert image_source({"type": "image", "url": "file:///x/a.png"}) == "/x/a.png"
    assert image_source({"type": "image", "url": "a.png"}) == "a.png"
    assert image_source({"type": "image", "url": "data:image/png;base64,QUJD"}) == b"ABC"
    assert image_source({"type": "image", "data": "QUJD"}) == b"ABC"
    assert image_source({"type": "image", "source": {"type": "base64", "data": "QUJD"}}) == b"ABC"
    with pytest.raises(chat_format.ChatFormatError, match="web address"):
        image_source({"type": "image", "url": "https://example.com/a.png"})


def test_the_prompt_probe_chat_mode_shows_the_parsed_reply_and_the_routing(model):
    widgets = pytest.importorskip("dsv41.widgets")

    probe = widgets.PromptProbe(
        model, "hello", 3, compare=False, background=False, chat=True, messages=[{"role": "system", "content": "sys"}]
    )
    sent = chat_format.encode([{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}])
    assert probe.chat_result.prompt == sent
    assert probe.result is probe.chat_result.generation and probe.result.trace is not None
    assert "<i>reply:</i>" in probe.status.value and "cut off in the content" in probe.status.value
    routed = probe.views["routing"].data  # the whole rendered conversation was prefilled, then decoded
    assert routed["n_tokens"]["prefill"] == len(probe.chat_result.prompt_ids)
    assert routed["n_tokens"]["decode"] == len(probe.result.ids) - 1
    # a JSON list of messages in the text box is the whole conversation
    probe.text.value = json.dumps([{"role": "user", "content": "only this"}])
    probe.on_run()
    assert probe.chat_result.prompt == chat_format.encode([{"role": "user", "content": "only this"}])
    assert probe.runs == 1


# ---------------------------------------------------------------------- the terminal loop
def test_piped_lines_are_messages_and_commands_work(model, tmp_path):
    saved = tmp_path / "chat.json"
    stdin = io.StringIO(f"hello\n\n/save {saved}\n/unknown\nagain\n/reset\n/save {tmp_path / 'empty.json'}\n")
    stdout, status = io.StringIO(), io.StringIO()
    assert run_terminal(model, stdin, stdout, system="sys", max_new_tokens=4, status=status) == 0
    lines = stdout.getvalue().splitlines()
    replies = [line for line in lines if line.startswith("assistant: ")]
    assert len(replies) == 2  # one line per reply, whatever the noise holds
    assert f"(saved 3 messages to {saved})" in lines
    assert f"(saved 1 message to {tmp_path / 'empty.json'})" in lines  # the system message stays
    assert any(line.startswith("unknown command /unknown") for line in lines)
    assert "(conversation cleared)" in lines
    kept = json.loads(saved.read_text())
    assert [m["role"] for m in kept["messages"]] == ["system", "user", "assistant"]
    assert kept["messages"][1]["content"] == "hello" and kept["thinking"] is False
    assert len(status.getvalue().splitlines()) == 2 and "reused" in status.getvalue()


def test_reasoning_and_tool_calls_are_shown(model):
    block = chat_format.tool_calls_block([{"function": {"name": "clock", "arguments": {"tz": "UTC", "n": 2}}}])
    reply = chat_reply.parse("let me see" + "</think>" + "ok" + block + "<｜end▁of▁sentence｜>", thinking=True)
    result = ChatResult(reply, "", type("Run", (), {"ids": [1, 2]})(), "", [], 0, {})
    from dsv41.generation.conversation import _show

    plain, terminal = io.StringIO(), io.StringIO()
    _show(result, plain, interactive=False)
    _show(result, terminal, interactive=True)
    assert plain.getvalue().splitlines() == [
        "thinking: let me see",
        "assistant: ok",
        'tool call: {"name": "clock", "arguments": {"tz": "UTC", "n": 2}}',
    ]
    assert terminal.getvalue().splitlines()[0] == "\x1b[2mlet me see\x1b[0m"  # dimmed


CHAT = [sys.executable, "-m", "dsv41", "chat", "--max-new-tokens", "3"]


def test_the_command_reads_one_message_per_line_from_a_pipe(tiny_checkpoint, tmp_path):
    saved = tmp_path / "out.json"
    done = subprocess.run(
        CHAT + ["--checkpoint", tiny_checkpoint, "--quiet", "--system", "sys"],
        input=f"first\nsecond\n/save {saved}\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr
    assert sum(line.startswith("assistant: ") for line in done.stdout.splitlines()) == 2
    assert done.stderr == ""
    assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]


def test_the_command_rejects_a_bad_reasoning_effort(tiny_checkpoint):
    done = subprocess.run(
        CHAT + ["--checkpoint", tiny_checkpoint, "--thinking", "--reasoning-effort", "200"],
        input="",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "reasoning_effort must be a whole number from 1 to 100" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def _read_until(fd, marker: bytes, timeout: float = 120.0) -> bytes:
    out, deadline = b"", time.monotonic() + timeout
    while marker not in out:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {marker!r} after {timeout} s; got {out[-400:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            out += chunk
    return out


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_the_command_on_a_terminal_prompts_dims_and_quits_on_ctrl_d(tiny_checkpoint):
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        CHAT + ["--checkpoint", tiny_checkpoint, "--quiet", "--thinking"],
        stdin=follower,
        stdout=follower,
        stderr=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    os.close(follower)
    try:
        banner = _read_until(leader, b"you> ")
        assert b"\x1b[2mchat with" in banner and b"Ctrl-D quits" in banner
        os.write(leader, b"hello\n")
        reply = _read_until(leader, b"you> ")
        assert b"\x1b[2m" in reply.split(b"hello", 1)[1]  # the reasoning (or the cut-off note), dimmed
        os.write(leader, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
        os.close(leader)
