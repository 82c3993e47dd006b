"""The parse rate: a code-quality number beside bits per byte, the share of greedy continuations of
held-out function headers that parse with Python's `ast` after their open blocks are closed.

Definition, step by step (each step a function here, held by tests on hand-made continuations):

1. Headers (`held_out_headers`): every `def` / `async def` of the held-out split's Python files
   (`train.corpus`: split by file name), found with `ast` in file-name then line order, whose
   header is one line: the line, right-stripped, ends with `:` and parses alone with a `pass`
   body. Headers over several lines are counted and left out. A run of n headers takes n evenly
   spaced ones (`pick_headers`: index floor(i * H / n) of the H in order).
2. Prompt (`header_prompt`): the file up to and including the header's colon, tokenized, cut to
   its last `context` tokens (BOS first, where the model adds one): 128 by default, so a prompt
   and its 128 new tokens fit the 256-token windows the miniature was trained on. The colon is a
   boundary of the byte-level pre-tokenizer, so the prompt's tokens are the file's own.
3. Continuation (`continue_header`): greedy `generate` of up to `new_tokens` tokens (default 128),
   the model's arithmetic as loaded; it stops early once the body has ended (below), which gives
   the same text as generating all of them and cutting.
4. The body (`body_end`, `complete_part`): the continuation's first line is the rest of the
   header line; the body is the lines after it, up to (not including) the first line that is code
   (neither blank nor a comment) and is not indented deeper than the header (its leading
   whitespace starts with the header's and is longer), after at least one code line: the first
   code line always belongs to the body, so a continuation that dedents at once fails. Where no
   line ends the body, generation ended it: at the end-of-text token ("end of text"), or at the
   token limit ("limit"). Header and body are dedented by the header's indentation. After a
   dedent or at the limit, what is judged is: the text without its unfinished last line (after
   the last newline), a triple-quoted string left open closed (a docstring in progress), then up
   to the end of its last complete logical line (Python's joining of physical lines inside
   brackets and strings and after a backslash), so a statement the cut left unfinished is not
   judged. At the end of text, the text is judged whole. A body with no code after the header's
   colon fails ("no body"); the first complete logical line is the header, so a continuation
   that never completes one fails so too.
5. Closing open blocks (`closing`): where the last logical line ends with `:` (outside strings
   and comments), a line `pass` 4 spaces deeper than it; then, innermost first, `finally:` and a
   `pass` under it at the column of each `try:` whose handlers have not come (no line at its
   column since). Nothing else is repaired: an unterminated one-line string, a mismatched
   bracket, a bad indentation, a statement the end of text left open stay as they are.
6. It parses (`judge`) when `ast.parse` accepts the result (SyntaxError, which includes
   IndentationError, and ValueError are failures).

The rate is parsed / headers, with a 95% Wilson score interval (`wilson_interval`; the headers of
one file are not independent, so the interval is if anything too narrow); beside it, the share
among the bodies that ended before the limit (whole functions). `reference_rate` runs the same
steps on each file's own next tokens: the ceiling that the cut and the closing leave at this
length (647 of the 651 headers of Python 3.11's split at 128 tokens: the other four's first
statement runs past the limit), as the random initialization is the floor.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ..core.errors import Dsv41Error
from ..core.text import brief

if TYPE_CHECKING:  # annotations only
    from ..model.model import Model
    from ..train.corpus import Corpus

NEW_TOKENS = 128
CONTEXT_TOKENS = 128
HEADERS = 120
# a run the tests can afford: a few headers, short continuations
SMOKE_HEADERS = 3
SMOKE_NEW_TOKENS = 24
INDENT_STEP = "    "
Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile
_CLOSER = {"(": ")", "[": "]", "{": "}"}
# how generation stopped where no line ended the body
ENDED = ("dedent", "end of text", "limit")


class ParseRateError(Dsv41Error, ValueError):
    """The parse rate was asked of input it cannot measure; the message says which and why."""


@dataclass(frozen=True)
class Header:
    """One single-line function header of a held-out file."""

    name: str  # the file, as the corpus names it
    lineno: int  # 1-based
    before: str  # the file up to and including the header's colon

    @property
    def line(self) -> str:
        """The header line, from its indentation to its colon."""
        return self.before[self.before.rfind("\n") + 1 :]

    @property
    def indent(self) -> str:
        return _leading(self.line)


@dataclass(frozen=True)
class HeaderSet:
    headers: list[Header]  # in file-name then line order
    multi_line: int  # headers over several lines, left out
    files: int  # Python files read


@dataclass(frozen=True)
class Judged:
    parses: bool
    ended: str  # one of ENDED
    source: str  # what ast.parse read: header and body dedented, then the closers
    closers: str  # what step 5 appended ("" when nothing)
    error: Optional[str]  # why it did not parse (None when it did)


def _leading(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _is_code(line: str) -> bool:
    content = line.strip()
    return bool(content) and not content.startswith("#")


# ---------------------------------------------------------------------- 1. headers
def function_headers(name: str, text: str) -> tuple[list[Header], int]:
    """(the single-line function headers of one file in line order, how many headers span several
    lines). The corpus reads files with universal newlines, so lines end with "\\n" alone."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        raise ParseRateError(
            f"{name} of the held-out split does not parse on this Python ({exc}); the parse rate "
            "needs the standard library of the Python it runs on"
        ) from None
    starts = [0]
    for i, c in enumerate(text):
        if c == "\n":
            starts.append(i + 1)
    headers, multi_line = [], 0
    linenos = sorted(
        {node.lineno for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    )
    for lineno in linenos:
        start = starts[lineno - 1]
        stop = text.find("\n", start)
        line = text[start : len(text) if stop < 0 else stop].rstrip()
        if line.endswith(":") and _header_alone(line):
            headers.append(Header(name, lineno, text[: start + len(line)]))
        else:
            multi_line += 1
    return headers, multi_line


def _header_alone(line: str) -> bool:
    """Whether `line` is a whole function header: with a `pass` body it parses as one function."""
    try:
        body = ast.parse(line.lstrip(" \t") + "\n" + INDENT_STEP + "pass\n").body
    except (SyntaxError, ValueError):
        return False
    return len(body) == 1 and isinstance(body[0], (ast.FunctionDef, ast.AsyncFunctionDef))


def held_out_headers(corpus: Optional[Corpus] = None) -> HeaderSet:
    """Every single-line function header of the held-out split's Python files (step 1)."""
    from ..train.corpus import load_corpus

    corpus = corpus or load_corpus()
    names = sorted(name for name in corpus.held_out if name.endswith(".py"))
    headers, multi_line = [], 0
    for name in names:
        found, more = function_headers(name, corpus.held_out[name])
        headers += found
        multi_line += more
    if not headers:
        raise ParseRateError(
            f"the held-out split's {len(names)} Python file(s) hold no single-line function header to measure"
        )
    return HeaderSet(headers, multi_line, len(names))


def pick_headers(headers: Sequence[Header], n: int) -> list[Header]:
    """`n` evenly spaced headers (all of them when there are no more than `n`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParseRateError(f"the number of headers must be a whole number >= 1, got {brief(n)}")
    if not headers:
        raise ParseRateError("there are no headers to pick from")
    n = min(n, len(headers))
    return [headers[(i * len(headers)) // n] for i in range(n)]


# ---------------------------------------------------------------------- 2-3. prompt and continuation
def header_prompt(model: Model, header: Header, context: int = CONTEXT_TOKENS) -> list[int]:
    """The prompt ids of a header: the file up to its colon, its last `context` tokens (BOS first
    where the model adds one, counted in `context`)."""
    least = 2 if model.add_bos else 1
    if isinstance(context, bool) or not isinstance(context, int) or context < least:
        raise ParseRateError(f"the context must be a whole number of tokens >= {least}, got {brief(context)}")
    ids = model.encode(header.before)
    if model.add_bos:
        return ids[:1] + ids[1:][-(context - 1) :]
    return ids[-context:]


def continue_header(
    model: Model, header: Header, new_tokens: int = NEW_TOKENS, context: int = CONTEXT_TOKENS
) -> tuple[str, str]:
    """(the greedy continuation's text, "end of text" or "limit": how generation stopped where the
    body has not ended): `generate` stops once `body_end` finds the end, the same text it would
    have had up to there."""
    from ..generation.generate import generate

    generated: list[int] = []

    def until_body_ends(step: int, token: int, logits) -> bool:
        generated.append(token)
        return body_end(model.decode(generated), header.indent) is None

    result = generate(model, header_prompt(model, header, context), max_new_tokens=new_tokens, callback=until_body_ends)
    return result.text, "end of text" if result.finish_reason == "eos" else "limit"


def reference_continuation(model: Model, header: Header, text: str, new_tokens: int = NEW_TOKENS) -> tuple[str, str]:
    """The file's own next `new_tokens` tokens after the header's colon, as `continue_header` gives
    a model's ("end of text" where the file ends sooner: its stream has EOS there)."""
    if not text.startswith(header.before):
        raise ParseRateError(
            f"the text given for {header.name} is not the file the header at line {header.lineno} is in"
        )
    ids = model.encode(text[len(header.before) :])[1 if model.add_bos else 0 :]
    return model.decode(ids[:new_tokens]), "end of text" if len(ids) < new_tokens else "limit"


# ---------------------------------------------------------------------- 4-6. the body, closing, the parse
def body_end(continuation: str, indent: str) -> Optional[int]:
    """Where the body ends in `continuation` (the offset of the line that ends it), or None when no
    line does yet (step 4). A line's verdict is fixed once its first character other than a space or
    tab is there, so a longer continuation never moves it."""
    first = continuation.find("\n")
    if first < 0:
        return None
    seen_code = False
    at = first + 1
    for line in continuation[at:].split("\n"):
        if _is_code(line):
            lead = _leading(line)
            if seen_code and not (lead.startswith(indent) and len(lead) > len(indent)):
                return at
            seen_code = True
        at += len(line) + 1
    return None


@dataclass(frozen=True)
class LogicalLine:
    start: int  # offset of its first character that is not whitespace
    end: int  # offset just past the newline that ends it (the text's end where none does)
    complete: bool  # ended by a newline outside brackets and strings, not after a backslash
    open: bool  # the text ends inside it, within brackets or a string (an unfinished statement)
    quote: str  # the quote of the string the text ends inside ("" where it ends outside one)
    indent: str  # the leading whitespace of its first physical line
    last: str  # its last character outside comments (a string's is its opening quote)


def logical_lines(source: str) -> list[LogicalLine]:
    """The logical lines of `source` that hold code, joined as Python's tokenizer joins physical
    lines: inside brackets and strings, and after a backslash. Blank and comment-only lines hold
    none. A bracket closed by another kind counts as closed and a one-line string left open ends at
    its newline: the parse rejects both anyway."""
    out: list[LogicalLine] = []
    stack: list[str] = []  # open brackets, innermost last
    quote = ""  # the open string's quote: one or three of ' or "
    begun: Optional[int] = None  # where the logical line being read began
    last = ""
    i, n = 0, len(source)

    def close(end: int, complete: bool) -> None:
        line_start = source.rfind("\n", 0, begun) + 1
        unfinished = not complete and bool(stack or quote)
        out.append(LogicalLine(begun, end, complete, unfinished, quote, source[line_start:begun], last))

    while i < n:
        c = source[i]
        if quote:
            if c == "\\":  # an escaped character (raw strings too): it never ends the string
                i += 2
            elif source.startswith(quote, i):
                i += len(quote)
                quote = ""
            elif c == "\n" and len(quote) == 1:
                quote = ""  # the newline is read again, outside the string
            else:
                i += 1
            continue
        if c == "#":
            stop = source.find("\n", i)
            i = n if stop < 0 else stop
        elif c == "\\" and source.startswith("\n", i + 1):
            i += 2
        elif c == "\n":
            if begun is not None and not stack:
                close(i + 1, True)
                begun = None
            i += 1
        elif c in " \t\f\r":
            i += 1
        else:
            if begun is None:
                begun = i
            last = c
            if c in "'\"":
                quote = c * 3 if source.startswith(c * 3, i) else c
                i += len(quote)
                continue
            if c in _CLOSER:
                stack.append(c)
            elif c in ")]}" and stack:
                stack.pop()
            i += 1
    if begun is not None:
        close(n, False)
    return out


def complete_part(source: str) -> str:
    """What step 4 judges of a body that a dedent or the token limit ended: `source` without its
    unfinished last line (after the last newline), a triple-quoted string left open then closed (a
    docstring in progress), and up to the end of its last complete logical line ("" where none is)."""
    source = source[: source.rfind("\n") + 1]
    lines = logical_lines(source)
    if lines and len(lines[-1].quote) == 3:
        source += lines[-1].quote + "\n"
        lines = logical_lines(source)
    ends = [line.end for line in lines if line.complete]
    return source[: ends[-1]] if ends else ""


def _keyword(source: str, line: LogicalLine) -> str:
    """The statement's first word when it is one that `closing` reads (try, except, finally)."""
    word = source[line.start : line.start + 9]
    for kw in ("try", "except", "finally"):
        after = word[len(kw) : len(kw) + 1]
        if word.startswith(kw) and not (after.isalnum() or after == "_"):
            return kw
    return ""


def closing(source: str) -> str:
    """What step 5 appends to `source` (dedented header and body): a `pass` under a last logical
    line that opens a block (ends with a colon), then `finally: pass` under each `try` left without
    a handler, innermost first; nothing where the text ends inside a statement."""
    lines = logical_lines(source)
    if not lines or lines[-1].open:
        return ""
    openers: list[tuple[int, str, str]] = []  # (column, indentation, keyword) of lines ending with ":"
    for line in lines:
        column = len(line.indent.expandtabs(8))
        while openers and openers[-1][0] > column:
            openers.pop()
        if openers and openers[-1][0] == column:
            openers.pop()  # a clause at its column takes its place: an except or finally ends a try's wait
        if line.last == ":":
            openers.append((column, line.indent, _keyword(source, line)))
    out = ""
    if lines[-1].last == ":":
        out += lines[-1].indent + INDENT_STEP + "pass\n"
    for _, indent, keyword in reversed(openers):
        if keyword == "try":
            out += indent + "finally:\n" + indent + INDENT_STEP + "pass\n"
    if out and not source.endswith("\n"):
        out = "\n" + out
    return out


def judge(header_line: str, continuation: str, stopped: str) -> Judged:
    """Steps 4 to 6 on one continuation of `header_line` (from its indentation to its colon);
    `stopped`: how generation stopped ("end of text" or "limit") where no line ended the body."""
    if stopped not in ENDED[1:]:
        raise ParseRateError(f"stopped must be 'end of text' or 'limit', got {brief(stopped)}")
    indent = _leading(header_line)
    cut = body_end(continuation, indent)
    ended = "dedent" if cut is not None else stopped
    lines = (header_line + (continuation if cut is None else continuation[:cut])).split("\n")
    source = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines)
    if ended != "end of text":
        source = complete_part(source)
    header = header_line[len(indent) :]
    if not any(_is_code(line) for line in source[len(header) :].split("\n")):
        return Judged(False, ended, source, "", "no body")
    closers = closing(source)
    try:
        with warnings.catch_warnings():  # an invalid escape in a string warns; only the parse counts
            warnings.simplefilter("ignore")
            ast.parse(source + closers)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        message = getattr(exc, "msg", None) or str(exc) or type(exc).__name__
        return Judged(False, ended, source + closers, closers, f"{type(exc).__name__}: {message}")
    return Judged(True, ended, source + closers, closers, None)


# ---------------------------------------------------------------------- the rate
def wilson_interval(parsed: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial share parsed / total."""
    if total < 1 or not 0 <= parsed <= total:
        raise ParseRateError(f"a share needs 0 <= parsed <= total and total >= 1, got {parsed} of {total}")
    p = parsed / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z / (1 + z * z / total) * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    # at 0 or all the bound is exactly 0 or 1; the float sum would land a rounding away
    return (0.0 if parsed == 0 else centre - half), (1.0 if parsed == total else centre + half)


def measure(
    headers: Sequence[Header],
    continuation: Callable[[Header], tuple[str, str]],
    *,
    progress: bool = False,
    label: str = "parse rate",
) -> dict:
    """The rate over `headers` of the continuations `continuation(header)` gives (steps 4-6 on
    each): counts, the share, its 95% interval, how bodies ended, and each header's verdict."""
    from tqdm import tqdm

    if not headers:
        raise ParseRateError("the parse rate needs at least one header")
    results = []
    began = time.perf_counter()
    for header in tqdm(headers, desc=label, unit="header", file=sys.stderr, disable=not progress, leave=False):
        text, stopped = continuation(header)
        verdict = judge(header.line, text, stopped)
        results.append(
            {
                "file": header.name,
                "line": header.lineno,
                "parses": verdict.parses,
                "ended": verdict.ended,
                "error": verdict.error,
                "continuation": text,
            }
        )
    parsed = sum(r["parses"] for r in results)
    ended = Counter(r["ended"] for r in results)
    return {
        "headers": len(results),
        "parsed": parsed,
        "rate": parsed / len(results),
        "interval_95": list(wilson_interval(parsed, len(results))),
        "ended": {name: ended.get(name, 0) for name in ENDED},
        # whole functions: the bodies a dedent or the end of text ended before the limit
        "whole": {
            "headers": sum(r["ended"] != "limit" for r in results),
            "parsed": sum(r["parses"] for r in results if r["ended"] != "limit"),
        },
        "seconds": round(time.perf_counter() - began, 1),
        "results": results,
    }


def parse_rate(
    model: Model,
    headers: Sequence[Header],
    *,
    new_tokens: int = NEW_TOKENS,
    context: int = CONTEXT_TOKENS,
    progress: bool = False,
    label: str = "parse rate",
) -> dict:
    """The parse rate of `model`'s greedy continuations of `headers` (see the module's definition)."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ParseRateError(f"new_tokens must be a whole number >= 1, got {brief(new_tokens)}")
    out = measure(headers, lambda h: continue_header(model, h, new_tokens, context), progress=progress, label=label)
    return {"new_tokens": new_tokens, "context": context, **out}


def reference_rate(model: Model, headers: Sequence[Header], docs: dict[str, str], new_tokens: int = NEW_TOKENS) -> dict:
    """The same steps on each file's own next `new_tokens` tokens (`model` for its tokenizer only):
    the ceiling the cut and the closing leave."""
    for header in headers:
        if header.name not in docs:
            raise ParseRateError(f"the files given do not hold {header.name}, where header line {header.lineno} is")
    out = measure(headers, lambda h: reference_continuation(model, h, docs[h.name], new_tokens))
    return {"new_tokens": new_tokens, **out}


# ---------------------------------------------------------------------- dsv41 parse-rate
def summary_line(what: str, rate: dict) -> str:
    lo, hi = rate["interval_95"]
    ended = rate["ended"]
    return (
        f"{what}: {100 * rate['rate']:.1f}% of {rate['headers']} headers parse (95% interval "
        f"{100 * lo:.1f}-{100 * hi:.1f}%); bodies ended by a dedent {ended['dedent']}, at the end of "
        f"text {ended['end of text']}, at the {rate['new_tokens']}-token limit {ended['limit']}; whole functions "
        f"{rate['whole']['parsed']} of {rate['whole']['headers']} parse"
    )


def cli_main(argv: list[str]) -> int:
    from ..core.argtypes import whole_number

    parser = argparse.ArgumentParser(
        prog="dsv41 parse-rate",
        description=(
            "The share of greedy continuations of held-out function headers (the held-out split of "
            "dsv41 train's corpus) that parse with Python's ast once their open blocks are closed, with a "
            "95% interval, beside the same measure on the files' own code (the ceiling of the rule); "
            "the definition is in dsv41.observe.parse_rate's docstring. At most 128 tokens a header: up to 4 s each "
            "for the miniature on an idle two-core machine, several times that on a shared one."
        ),
    )
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: the embedded miniature)")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="also measure the trainer's random initialization for the checkpoint's tokenizer and seed "
        "(a miniature checkpoint: one with dsv41-miniature.json), written in the release format to a "
        "temporary folder",
    )
    parser.add_argument(
        "--headers",
        type=whole_number(1, 1_000_000, "headers"),
        default=HEADERS,
        metavar="N",
        help=f"evenly spaced headers to measure (default {HEADERS}; more than there are: all)",
    )
    parser.add_argument(
        "--new-tokens",
        type=whole_number(1, 4096, "tokens"),
        default=NEW_TOKENS,
        metavar="N",
        help=f"greedy tokens at most per header (default {NEW_TOKENS})",
    )
    parser.add_argument(
        "--context",
        type=whole_number(2, 4096, "tokens"),
        default=CONTEXT_TOKENS,
        metavar="N",
        help=f"prompt tokens: the file's last N up to the header's colon, BOS included (default {CONTEXT_TOKENS})",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"a quick check: {SMOKE_HEADERS} headers, {SMOKE_NEW_TOKENS} tokens (overrides --headers, --new-tokens)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the numbers and every header's verdict here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    args = parser.parse_args(argv)
    if args.smoke:
        args.headers, args.new_tokens = SMOKE_HEADERS, SMOKE_NEW_TOKENS
    try:
        return _run(args)
    except Dsv41Error as exc:
        print(f"dsv41 parse-rate: {str(exc).rstrip('.')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dsv41 parse-rate: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    from ..checkpoint.miniature import describe, embedded_checkpoint
    from ..core.outdir import write_json
    from ..runtime.loader import load
    from ..train.corpus import load_corpus

    if args.json and os.path.isdir(args.json):
        raise ParseRateError(f"--json {args.json} is a folder; name a file to write")
    checkpoint = args.checkpoint or embedded_checkpoint()
    with tempfile.TemporaryDirectory(prefix="dsv41-parse-rate-") as tmp:
        random_init = None
        if args.random_init:  # first: a checkpoint it cannot be made for is refused before any measuring
            from ..train.release import write_initialization

            random_init = write_initialization(os.path.join(tmp, "random"), checkpoint)
        corpus = load_corpus()
        found = held_out_headers(corpus)
        headers = pick_headers(found.headers, args.headers)
        model = load(checkpoint, quiet=True)
        print(
            f"{len(headers)} of {len(found.headers)} single-line function headers in {found.files} held-out Python "
            f"files ({found.multi_line} over several lines left out); prompts of {args.context} tokens, at most "
            f"{args.new_tokens} new",
            file=sys.stderr,
        )
        measured = dict(new_tokens=args.new_tokens, context=args.context, progress=not args.quiet)
        out = {
            "checkpoint": os.path.realpath(checkpoint),
            "python": corpus.python,
            "headers_found": len(found.headers),
            "multi_line_left_out": found.multi_line,
            "reference": reference_rate(model, headers, corpus.held_out, args.new_tokens),
        }
        print(summary_line("the files' own code (the rule's ceiling)", out["reference"]))
        out["model"] = parse_rate(model, headers, label="checkpoint", **measured)
        print(summary_line(describe(checkpoint) or checkpoint, out["model"]))
        if random_init is not None:
            folder, seed = random_init
            rate = parse_rate(load(folder, quiet=True), headers, label="random initialization", **measured)
            out["random_initialization"] = {"seed": seed, **rate}
            print(summary_line(f"the random initialization (seed {seed})", rate))
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
