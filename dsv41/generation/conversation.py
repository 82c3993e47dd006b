"""Chat over a loaded model: a conversation rendered in the V4.1 format (`dsv41.generation.chat`), generated,
its reply parsed, and the positions the model already holds reused; the terminal loop behind
`dsv41 chat`.

Ids. A turn runs on `chat.token_ids` of the rendered conversation, never on its text tokenized
whole: the template's markers are control tokens and message text is text, so a message that
spells `<｜Assistant｜>` or a DSML block forges no turn and no tool call (what the text would
tokenize to, had it been typed into the prompt, is the release's string and nothing more).

Reuse. Each turn renders the whole conversation again and tokenizes it; `generate(...,
reuse_prefix=True)` keeps the part of the model's sequence the new prompt starts with and runs only
the rest. Without thinking, the previous turn rendered back (its reply, the end token, the new
message) extends what the model held, so the new turn runs only its new tokens. With thinking, the
next turn renders the previous reply without its reasoning, and the two part at the generation
header's `<think>`; so that the next turn can continue from just before it, the prompt is run as
two calls, everything before that last token and the token itself (`reuse_prefix=False` runs
every turn as one fresh prefill instead). A turn also keeps a snapshot of where the next turn can
continue (`ChatResult.resume`): when the model ran something else meanwhile, or the undo records
no longer reach that far back, `chat(..., resume=...)` restores it first.

Continuing is exact under `Numerics.parity()`: a reused turn gives the bits of one fresh prefill of
the whole conversation. Under the reference's arithmetic it is not, as with any prompt split into
calls (measured on the embedded checkpoint: max |Δlogit| 0.13 without thinking, 0.26 with, at a
second turn's first reply position; 1.08 for a thinking prompt run as two calls instead of one).
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..checkpoint.tokenizer import ASSISTANT_TOKEN, THINK_START_TOKEN
from ..model import sequence, vision
from . import chat as chat_format
from . import chat_reply
from .generate import GenerationResult, generate

if TYPE_CHECKING:  # annotations only
    from ..model.model import Model


@dataclass
class ChatResult:
    reply: chat_reply.Reply
    raw: str  # the generated text, special tokens kept: what `reply` was parsed from
    generation: GenerationResult  # the run that produced the reply, with its trace when asked
    prompt: str  # the rendered conversation
    prompt_ids: list[int]
    reused_positions: int  # leading prompt positions the model already held and did not run again
    timings: dict  # prompt_tokens, reused_positions, prefilled, prefill_s, decode_s, tokens_per_s
    images: list[dict] = field(default_factory=list)
    resume: Any = None  # a model snapshot where the next turn can continue (None: not kept)

    @property
    def message(self) -> dict:
        """The reply as the assistant message the conversation continues with."""
        return self.reply.message()


def prompt_ids(model: Model, prompt: chat_format.ChatPrompt) -> list[int]:
    """Token ids of a rendered prompt (`chat.token_ids`: only the template's markers are control
    tokens; its text already holds the begin-of-sentence token, so none is added)."""
    return chat_format.token_ids(prompt, model.tokenizer)


def reply_text(model: Model, ids) -> str:
    """Generated ids as text with the format's markers kept (the model's decode drops them)."""
    return model.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def chat(
    model: Model,
    messages,
    *,
    tools=None,
    thinking: bool = False,
    reasoning_effort=None,
    drop_thinking: bool = True,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    trace: bool = False,
    callback: Optional[Callable] = None,
    reuse_prefix: bool = True,
    resume=None,
    keep_resume: bool = True,
    prefill_chunk: Optional[int] = None,
    progress: bool = False,
    speculative: bool = False,
) -> ChatResult:
    """Answer `messages` (OpenAI-style; see `dsv41.generation.chat.render` for `tools`, `thinking`,
    `reasoning_effort`, `drop_thinking`) -> ChatResult with the parsed reply.

    Sampling, `trace`, `callback`, `prefill_chunk`, `progress` and `speculative` (DSpark
    speculative decoding of the reply) are `generate`'s. `reuse_prefix`:
    continue from the positions the model holds (see the module notes); `resume`: a previous
    turn's `ChatResult.resume`, restored first when the model's own sequence cannot get there;
    `keep_resume`: take this turn's snapshot (a copy of the caches). When the prompt is run as two
    calls (thinking), the trace and timings of `generation` cover its last token and the reply;
    `ChatResult.timings` covers both calls."""
    prompt = chat_format.render(
        messages, tools=tools, thinking=thinking, reasoning_effort=reasoning_effort, drop_thinking=drop_thinking
    )
    ids = prompt_ids(model, prompt)
    options = dict(
        temperature=temperature,
        seed=seed,
        trace=trace,
        callback=callback,
        prefill_chunk=prefill_chunk,
        progress=progress,
    )
    if speculative:
        options["speculative"] = True
    # the vision path puts each image's span at its placeholder; every image is read before anything runs
    feed = _with_images(model, ids, prompt.images) if prompt.images else ids
    if resume is not None and reuse_prefix:
        _resume(model, resume, ids)

    # the next turn renders this reply without its reasoning: it parts from this prompt at the `<think>`
    split = (
        reuse_prefix
        and thinking
        and not prompt.keeps_reasoning
        and not prompt.images
        and len(ids) > 1
        and _ends_with_markup(prompt, ASSISTANT_TOKEN + THINK_START_TOKEN)
        and ids[-1] == model.tokenizer.token_to_id(THINK_START_TOKEN)
        and len(ids) + max_new_tokens - 1 <= model.backbone.max_seq_len
    )  # else generate's own refusal, unsplit
    head = None
    if split:  # everything before `<think>` first: the next turn continues from there
        head = generate(
            model, ids[:-1], max_new_tokens=0, reuse_prefix=True, prefill_chunk=prefill_chunk, progress=progress
        )
        reused = head.timings["reused_positions"]
        snapshot = sequence.snapshot(model) if keep_resume else None
        options.pop("prefill_chunk")
        result = generate(model, ids, max_new_tokens=max_new_tokens, reuse_prefix=True, **options)
    else:
        result = generate(model, feed, max_new_tokens=max_new_tokens, reuse_prefix=reuse_prefix, **options)
        ids, reused = result.prompt_ids, result.timings["reused_positions"]
        snapshot = sequence.snapshot(model) if keep_resume else None
    prefill_s = result.timings["prefill_s"] + (head.timings["prefill_s"] if head is not None else 0.0)
    raw = reply_text(model, result.ids)
    reply = chat_reply.parse(raw, thinking=_ends_with_markup(prompt, THINK_START_TOKEN))
    timings = {
        "prompt_tokens": len(ids),
        "reused_positions": reused,
        "prefilled": len(ids) - reused,
        "prefill_s": prefill_s,
        "decode_s": result.timings["decode_s"],
        "tokens_per_s": result.timings["tokens_per_s"],
        "new_tokens": len(result.ids),
    }
    return ChatResult(reply, raw, result, prompt.text, ids, reused, timings, prompt.images, snapshot)


def _ends_with_markup(prompt: chat_format.ChatPrompt, marker: str) -> bool:
    """The prompt ends with the template's own `marker` (a message's text spelling it does not count)."""
    if not prompt.segments:
        return False
    text, kind = prompt.segments[-1]
    return kind == chat_format.MARKUP and text.endswith(marker)


def image_source(record: dict):
    """What the vision path reads for one of the format's image records: a path, or the bytes of a
    base64 `data:` URL, `data` field or base64 `source`. An image at a web address is refused:
    nothing here fetches from the network. A record that names no image, or data that is not
    base64, is a ChatFormatError."""
    source = record.get("source")
    if isinstance(source, dict):
        record = {"data": source["data"]} if source.get("type") == "base64" and "data" in source else source
    elif isinstance(source, str):
        record = {"url": source}
    if record.get("data") is not None:
        data = record["data"]
        if isinstance(data, (bytes, bytearray)):
            return bytes(data)
        return _base64(data, "an image block's data")
    url = record.get("url") or record.get("path") or ""
    if not isinstance(url, str) or not url:
        raise chat_format.ChatFormatError(
            "an image record needs a path, a url or base64 data, and this one has none of them as text"
        )
    if url.startswith("data:"):
        return _base64(url.partition(",")[2], "an image's data: URL")
    if url.startswith("file://"):
        return url[len("file://") :]
    if "://" in url:
        raise chat_format.ChatFormatError(f"the image {url[:80]!r} is a web address; download it and pass its path")
    return url


def _base64(text, what: str) -> bytes:
    import base64

    if not isinstance(text, str):
        raise chat_format.ChatFormatError(f"{what} is a {type(text).__name__}, not base64 text")
    try:  # line breaks are allowed (MIME wraps base64), any other stray character is not
        return base64.b64decode("".join(text.split()), validate=True)
    except ValueError as exc:  # binascii.Error, or text that is not ASCII
        raise chat_format.ChatFormatError(f"{what} is not base64 ({str(exc).rstrip('.') or 'bad padding'})") from None


def _with_images(model, ids: list[int], records: list[dict]) -> vision.Prompt:
    """The prompt ids with each image placeholder turned into its image's span (`vision.prepare`),
    every image read before anything runs. An image that cannot be read is one sentence naming it;
    for a path, the same sentence whether the file is missing, a folder, not an image or damaged,
    so that a message cannot probe which local paths exist."""
    cfg = model.cfg
    if not cfg.vision_n_layers:
        raise chat_format.ChatFormatError(
            "the conversation holds images, but this model's config has no vision tower (vision_n_layers is 0)"
        )
    sources = [image_source(record) for record in records]
    try:
        return vision.prepare(cfg, ids, sources)
    except vision.ImageError as exc:
        if exc.number is None:  # not one image's fault (the placeholders and the images disagree)
            raise chat_format.ChatFormatError(str(exc)) from None
        source = sources[exc.number - 1]
        if isinstance(source, str):
            raise chat_format.ChatFormatError(
                f"image {exc.number} of the conversation ({source[:80]!r}) cannot be read as an image file"
            ) from None
        raise chat_format.ChatFormatError(f"image {exc.number} of the conversation cannot be used: {exc}") from None


def _resume(model, snapshot, ids: list[int]) -> None:
    """Restore `snapshot` when it is a prefix of this prompt and the model's own sequence cannot
    continue from at least as far (it ran something else, or its undo records stop short)."""
    kept = snapshot.token_ids[0].tolist() if snapshot.token_ids is not None and snapshot.token_ids.size(0) == 1 else []
    if not kept or len(kept) >= len(ids) or ids[: len(kept)] != kept:
        return
    held = model.token_ids[0].tolist() if model.token_ids.size(0) == 1 else []
    if held[: len(kept)] == kept and len(kept) >= sequence.rollback_limit(model):
        return
    sequence.restore(model, snapshot)


# ---------------------------------------------------------------------- a conversation across turns
class Conversation:
    """The messages so far and the options of a chat over `model`; `send` adds a user message and
    the reply, continuing from the previous turn's positions."""

    def __init__(
        self,
        model: Model,
        *,
        system: Optional[str] = None,
        tools=None,
        thinking: bool = False,
        reasoning_effort=None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        speculative: bool = False,
    ):
        self.model, self.system, self.tools = model, system, tools
        self.speculative = speculative
        self.thinking, self.reasoning_effort = thinking, reasoning_effort
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.messages: list[dict] = []
        self.last: Optional[ChatResult] = None
        self.reset(model_too=False)

    def reset(self, model_too: bool = True) -> None:
        """Forget every turn (the system message stays); `model_too` also starts the model's sequence afresh."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last = None
        if model_too:
            self.model.reset()

    def send(self, content, **options) -> ChatResult:
        """Add a user message (text or content blocks), generate the reply, add it; `options` go to `chat`.
        A turn that fails leaves the messages as they were."""
        return self.add({"role": "user", "content": content}, **options)

    def add(self, message: dict, **options) -> ChatResult:
        """Add any message (a tool result, a mid-conversation system message) and answer it."""
        self.messages.append(message)
        settings = dict(
            tools=self.tools,
            thinking=self.thinking,
            reasoning_effort=self.reasoning_effort,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            speculative=self.speculative,
            resume=self.last.resume if self.last is not None else None,
        )
        try:
            result = chat(self.model, self.messages, **{**settings, **options})
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append(result.message)
        self.last = result
        return result

    def to_json(self) -> dict:
        return {
            "messages": self.messages,
            "tools": self.tools,
            "thinking": self.thinking,
            "reasoning_effort": self.reasoning_effort,
        }

    def save(self, path, *, overwrite: bool = False) -> None:
        """The conversation as JSON: its messages (OpenAI-style) and the options that render them.
        An existing file is kept (FileExistsError) unless `overwrite`; anything but a regular file
        (a folder, a FIFO, a device) is refused either way (OSError), never opened for writing."""
        text = json.dumps(self.to_json(), ensure_ascii=False, indent=1) + "\n"
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise OSError(f"{os.fspath(path)} is not a regular file")
        if mode is not None and not overwrite:
            raise FileExistsError(f"{os.fspath(path)} exists")
        # O_EXCL: a file that appeared since the check is kept; O_NONBLOCK: a FIFO put there since
        # cannot make the open wait for a reader
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path, flags, 0o666)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{os.fspath(path)} is not a regular file")
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                fd = None
                out.write(text)
        finally:
            if fd is not None:
                os.close(fd)


# ---------------------------------------------------------------------- the terminal
HELP = (
    "/reset forgets the conversation, /save FILE writes it as JSON (/save! FILE replaces an existing file), "
    "/help shows this, Ctrl-D quits"
)


def run_terminal(
    model: Model,
    stdin=None,
    stdout=None,
    *,
    system: Optional[str] = None,
    thinking: bool = False,
    reasoning_effort=None,
    tools=None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    status=None,
    speculative: bool = False,
) -> int:
    """Chat on a terminal: one message per line; replies on `stdout` as text, line breaks kept
    (reasoning dimmed, tool calls as JSON; piped, each reply after `assistant: `, its reasoning after
    `thinking: `, each call on a `tool call: ` line); `/reset`, `/save FILE`, Ctrl-D (end of
    input) quits. On a terminal, line editing and history come from readline. `status`: where a
    line per turn with token counts and reuse goes (None: stderr; False: nowhere). A line that is
    not UTF-8 is refused with one line and the session goes on. Returns the exit code."""
    stdin = sys.stdin if stdin is None else stdin
    _escape_undecodable(stdin)
    stdout = sys.stdout if stdout is None else stdout
    status = sys.stderr if status is None else status
    interactive = _isatty(stdin) and _isatty(stdout)
    if interactive and stdin is sys.stdin:
        try:
            import readline  # noqa: F401  (input() gains line editing and history)
        except ImportError:
            pass
    conversation = Conversation(
        model,
        system=system,
        tools=tools,
        thinking=thinking,
        reasoning_effort=reasoning_effort,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        speculative=speculative,
    )
    if interactive:
        print(_dim(f"chat with {getattr(model, 'checkpoint', None) or 'the model'}; {HELP}", True), file=stdout)
    number = 0
    while True:
        try:
            line = _read_line(stdin, stdout, interactive)
        except KeyboardInterrupt:
            print(file=stdout)
            return 130
        if line is None:  # Ctrl-D or the end of piped input
            if interactive:
                print(file=stdout)
            return 0
        number += 1
        text = line.strip()
        if not text:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # an undecodable byte, escaped by _escape_undecodable
            code = ord(text[exc.start])
            what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else "a lone surrogate"
            print(
                f"not sent: line {number} is not UTF-8 text ({what} at character {exc.start + 1}); nothing was added",
                file=stdout,
            )
            continue
        if text.startswith("/"):
            _command(text, conversation, stdout)
            continue
        try:
            result = conversation.send(text)
        except KeyboardInterrupt:
            print(_dim("(interrupted; the message was not added)", interactive), file=stdout)
            continue
        except (ValueError, RuntimeError) as exc:  # too long for the caches, NaN logits: one line, go on
            print(f"not sent: {exc}", file=stdout)
            continue
        _show(result, stdout, interactive)
        if status:
            t = result.timings
            rate = f", {t['tokens_per_s']:.1f} tokens/s" if t["tokens_per_s"] else ""
            print(
                f"({t['prompt_tokens']} prompt tokens, {t['reused_positions']} reused, {t['prefilled']} run; "
                f"{t['new_tokens']} generated{rate})",
                file=status,
            )


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _escape_undecodable(stdin) -> None:
    """Read bytes that are not UTF-8 as lone surrogates (so one bad line is refused and the rest of
    the input still read) rather than let the decoder raise out of the loop."""
    if getattr(stdin, "errors", None) == "strict" and hasattr(stdin, "reconfigure"):
        try:
            stdin.reconfigure(errors="surrogateescape")
        except (ValueError, OSError, io.UnsupportedOperation):  # a stream that cannot change now: left as it is
            pass


def _read_line(stdin, stdout, interactive: bool) -> Optional[str]:
    if interactive and stdin is sys.stdin and stdout is sys.stdout:
        try:
            return input("you> ")
        except EOFError:
            return None
    if interactive:
        stdout.write("you> ")
        stdout.flush()
    line = stdin.readline()
    return line if line else None


def _command(text: str, conversation: Conversation, stdout) -> None:
    name, _, argument = text.partition(" ")
    if name == "/reset":
        conversation.reset()
        print("(conversation cleared)", file=stdout)
    elif name in ("/save", "/save!"):
        path = argument.strip()
        if not path:
            print(f"{name} needs a file name: {name} FILE", file=stdout)
            return
        try:
            conversation.save(path, overwrite=name == "/save!")
        except FileExistsError:
            print(f"not saved: {path} exists and is kept; /save! {path} replaces it", file=stdout)
            return
        except OSError as exc:
            print(f"not saved: {f'{path}: {exc.strerror}' if exc.strerror else exc}", file=stdout)
            return
        count = len(conversation.messages)
        print(f"(saved {count} message{'' if count == 1 else 's'} to {path})", file=stdout)
    elif name == "/help":
        print(HELP, file=stdout)
    else:
        print(f"unknown command {name}; {HELP}", file=stdout)


def _show(result: ChatResult, stdout, interactive: bool) -> None:
    reply = result.reply
    # piped or typed, a reply is text as written: its line breaks are line breaks (code stays code)
    if reply.reasoning:
        if interactive:
            print(_dim(_printable(reply.reasoning), True), file=stdout)
        else:
            print("thinking: " + _printable(reply.reasoning), file=stdout)
    if reply.content or not reply.tool_calls:
        print(("" if interactive else "assistant: ") + _printable(reply.content), file=stdout)
    for call in reply.tool_calls:
        print(
            "tool call: " + json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False),
            file=stdout,
        )
    if reply.incomplete:
        print(
            _dim(
                f"(cut off in the {reply.incomplete.replace('_', ' ')} after {len(result.generation.ids)} tokens)",
                interactive,
            ),
            file=stdout,
        )


def _dim(text: str, on: bool) -> str:
    return f"\x1b[2m{text}\x1b[0m" if on else text


def _printable(text: str) -> str:
    """Control characters other than line breaks and tabs as escapes (a random-weighted model's text
    is full of them, and an escape sequence would drive the terminal)."""
    out = []
    for ch in text:
        if ch in "\n\t" or ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)
