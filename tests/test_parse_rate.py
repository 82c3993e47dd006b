"""The parse rate's definition (dsv41.observe.parse_rate) on hand-made continuations: where a body ends,
what is judged of it, how open blocks are closed, what parses and what does not; the logical lines
against Python's own tokenizer; the rule on the held-out files' own code; and the measure on the
miniature at a smoke size, its early stop against a full greedy run, and `dsv41 parse-rate`."""

import io
import json
import math
import tokenize

import pytest

from dsv41.app.cli import main
from dsv41.observe import parse_rate as pr


# ---------------------------------------------------------------------- step 4: the body's end
def test_the_body_ends_at_the_first_code_line_no_deeper_than_the_header():
    text = "\n    a = 1\n\n    # note\n# a comment at column 0 ends nothing\n    b = 2\n\ndef g():\n    pass\n"
    assert pr.body_end(text, "") == text.index("def g")
    # a method: the next method at the header's indentation ends it, a deeper line does not
    method = "\n        return 1\n    def h(self):\n"
    assert pr.body_end(method, "    ") == method.index("    def h")
    assert pr.body_end("\n        x = 1\n            y = 2\n", "    ") is None


def test_the_first_code_line_always_belongs_to_the_body():
    # a continuation that dedents at once keeps that line in its body (and fails to parse below)
    assert pr.body_end("\nx = 1\ny = 2\n", "") == len("\nx = 1\n")
    assert pr.body_end("no newline yet", "") is None


def test_a_longer_continuation_never_moves_the_end():
    text = "  # tail\n    if a:\n        b = [1,\n  2]\n\n    return b\nclass C:\n    pass\n"
    full = pr.body_end(text, "")
    for cut in range(len(text) + 1):
        found = pr.body_end(text[:cut], "")
        assert found is None or found == full, cut


# ---------------------------------------------------------------------- steps 4-6: judging
def judged(continuation: str, stopped: str = "limit", header: str = "def f(x):") -> pr.Judged:
    return pr.judge(header, continuation, stopped)


def test_a_whole_function_parses_with_nothing_closed():
    out = judged("\n    y = x + 1\n    return y\n\ndef g():\n")
    assert (out.parses, out.ended, out.closers) == (True, "dedent", "")
    assert "def g" not in out.source


def test_a_method_is_judged_dedented():
    out = judged("\n        return self.x\n\n    def g(self):\n", header="    def f(self):")
    assert out.parses and out.source.startswith("def f(self):\n    return self.x")


def test_the_limit_drops_the_unfinished_statement():
    out = judged("\n    a = 1\n    b = foo(a,\n            2")
    assert out.parses and out.ended == "limit"
    assert "foo" not in out.source


def test_a_docstring_in_progress_at_the_limit_is_closed():
    out = judged('\n    """Explain f.\n\n    More about it')
    assert out.parses and out.source.count('"""') == 2 and "More about it" not in out.source
    out = judged('\n    """Explain f.\n    More about it\n')
    assert out.parses and "More about it" in out.source


def test_an_open_block_gets_a_pass():
    out = judged("\n    if x:\n        for y in x:\n")
    assert out.parses and out.closers == "            pass\n"  # under the for, 4 deeper
    # at the end of text without a newline: the pass goes on a new line
    out = judged("\n    while x:", "end of text")
    assert out.parses and out.closers == "\n        pass\n"


def test_a_try_without_its_handler_gets_finally():
    out = judged("\n    try:\n        a = 1\n")
    assert out.parses and out.closers == "    finally:\n        pass\n"
    out = judged("\n    if x:\n        try:\n")
    assert out.parses
    assert out.closers == "            pass\n        finally:\n            pass\n"
    # a try whose handler came needs none; the handler's own empty suite gets its pass
    out = judged("\n    try:\n        a = 1\n    except ValueError:\n")
    assert out.parses and out.closers == "        pass\n"


@pytest.mark.parametrize(
    "continuation, stopped, error",
    [
        ("\nx = 1\n", "end of text", "IndentationError"),  # dedented at once
        ("\n    return x +\n", "limit", "SyntaxError"),  # a whole logical line that is not Python
        ("\n    x = foo(1,\n", "end of text", "SyntaxError"),  # the end of text inside brackets
        ("\n    x = 'abc\n    y = 1\n", "limit", "SyntaxError"),  # an unterminated one-line string
        ("\n    x = (1]\n", "limit", "SyntaxError"),  # a mismatched bracket
        ("\n    if x:\n    y = 1\n", "limit", "IndentationError"),  # a block with no suite mid-body
        ("\n\n   \n# only a comment\n", "end of text", "no body"),
        ("\n    return (1,\n            2", "limit", "no body"),  # nothing complete before the limit
    ],
)
def test_what_does_not_parse(continuation, stopped, error):
    out = judged(continuation, stopped)
    assert not out.parses and out.error.startswith(error)


def test_a_one_line_body_on_the_header_line_parses():
    assert judged(" return x + 1\n", "end of text").parses


def test_judge_refuses_an_unknown_stop():
    with pytest.raises(pr.ParseRateError, match="stopped must be"):
        judged("\n    pass\n", "dedent")


# ---------------------------------------------------------------------- logical lines
def test_logical_lines_join_brackets_strings_and_backslashes():
    text = 'a = (1,\n     2)\nb = """x\ny"""\nc = 1 + \\\n    2\n# comment\n\nd = {\n'
    lines = pr.logical_lines(text)
    assert [text[line.start : line.start + 1] for line in lines] == ["a", "b", "c", "d"]
    assert [line.complete for line in lines] == [True, True, True, False]
    assert lines[-1].open and lines[-1].quote == ""
    assert pr.logical_lines("x = '''abc\n")[-1].quote == "'''"


def test_logical_lines_end_where_pythons_tokenizer_ends_them():
    from dsv41.train.corpus import load_corpus

    held_out = load_corpus().held_out
    names = sorted(n for n in held_out if n.endswith(".py"))[::8]
    for name in names:
        text = held_out[name]
        ends = set()
        offsets = [0]
        for line in text.split("\n"):
            offsets.append(offsets[-1] + len(line) + 1)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NEWLINE and tok.string:  # a NEWLINE at the end of text has no character
                ends.add(offsets[tok.start[0] - 1] + tok.start[1] + 1)
        ours = pr.logical_lines(text)
        assert {line.end for line in ours if line.complete} == ends, name


# ---------------------------------------------------------------------- step 1: headers
def test_function_headers_are_the_single_line_ones():
    text = (
        "import os\n"
        "@decorator\n"
        "def one(a, b=1):\n    '''def fake(x):'''\n    return a\n"
        "async def two():  \n    pass\n"
        "def three(a,\n          b):\n    pass\n"
        "class C:\n    def four(self) -> int:\n        def five(): return 1\n        return 2\n"
    )
    headers, multi = pr.function_headers("m.py", text)
    assert [(h.lineno, h.line) for h in headers] == [
        (3, "def one(a, b=1):"),
        (6, "async def two():"),
        (12, "    def four(self) -> int:"),
    ]
    assert multi == 2  # three spans two lines; five's body is on its line
    assert all(text.startswith(h.before) and h.before.endswith(":") for h in headers)
    assert headers[2].indent == "    "


def test_a_held_out_file_that_does_not_parse_is_one_sentence():
    with pytest.raises(pr.ParseRateError, match="bad.py of the held-out split does not parse"):
        pr.function_headers("bad.py", "def f(:\n")


def test_pick_headers_spaces_them_evenly():
    headers = [pr.Header("m.py", i, f"def f{i}():") for i in range(10)]
    assert [h.lineno for h in pr.pick_headers(headers, 4)] == [0, 2, 5, 7]
    assert pr.pick_headers(headers, 50) == headers
    with pytest.raises(pr.ParseRateError, match="whole number >= 1"):
        pr.pick_headers(headers, 0)


# ---------------------------------------------------------------------- the interval
@pytest.mark.parametrize("parsed, total", [(0, 10), (3, 10), (10, 10), (57, 120), (1, 651)])
def test_wilson_interval_is_where_the_score_test_does_not_reject(parsed, total):
    lo, hi = pr.wilson_interval(parsed, total)

    def score(p: float) -> float:  # the binomial score statistic at p
        return abs(parsed - total * p) / math.sqrt(total * p * (1 - p))

    assert lo <= parsed / total <= hi
    for bound, inside in ((lo, 1), (hi, -1)):
        if 0 < bound < 1:
            assert score(bound) == pytest.approx(pr.Z_95, rel=1e-9)
            assert score(bound + inside * 1e-6) < pr.Z_95
    with pytest.raises(pr.ParseRateError):
        pr.wilson_interval(3, 0)


# ---------------------------------------------------------------------- on the held-out split
@pytest.fixture(scope="module")
def miniature(miniature_checkpoint, one_thread):
    import dsv41

    return dsv41.load(miniature_checkpoint, quiet=True)


@pytest.fixture(scope="module")
def held_out():
    from dsv41.train.corpus import load_corpus

    corpus = load_corpus()
    return corpus, pr.held_out_headers(corpus)


def test_the_files_own_code_fails_only_where_no_statement_fits_the_limit(miniature, held_out):
    corpus, found = held_out
    headers = pr.pick_headers(found.headers, 80)
    rate = pr.reference_rate(miniature, headers, corpus.held_out)
    for header, result in zip(headers, rate["results"]):
        text = corpus.held_out[header.name]
        assert text[len(header.before) :].startswith(result["continuation"])  # decoding gives the file back
        assert result["parses"] or (result["ended"], result["error"]) == ("limit", "no body"), result
    assert rate["parsed"] == sum(r["parses"] for r in rate["results"])


def test_the_measure_on_the_miniature_at_a_smoke_size(miniature, held_out):
    from dsv41.generation.generate import generate

    corpus, found = held_out
    headers = pr.pick_headers(found.headers, pr.SMOKE_HEADERS)
    rate = pr.parse_rate(miniature, headers, new_tokens=pr.SMOKE_NEW_TOKENS)
    assert rate["headers"] == len(headers) == pr.SMOKE_HEADERS
    assert sum(rate["ended"].values()) == rate["headers"]
    assert rate["interval_95"] == list(pr.wilson_interval(rate["parsed"], rate["headers"]))
    for header, result in zip(headers, rate["results"]):
        stopped = "end of text" if result["ended"] == "end of text" else "limit"
        again = pr.judge(header.line, result["continuation"], stopped)
        assert (again.parses, again.ended, again.error) == (result["parses"], result["ended"], result["error"])
    # the early stop gives what the whole greedy run gives up to the body's end (checked on one
    # header, one whose body ended before the limit where there is one)
    at = next((i for i, r in enumerate(rate["results"]) if r["ended"] == "dedent"), 0)
    header, result = headers[at], rate["results"][at]
    whole = generate(miniature, pr.header_prompt(miniature, header), max_new_tokens=pr.SMOKE_NEW_TOKENS).text
    assert whole.startswith(result["continuation"])
    stopped = "end of text" if result["ended"] == "end of text" else "limit"
    assert pr.judge(header.line, whole, stopped).parses == result["parses"]


def test_the_prompt_is_the_files_last_tokens_with_bos(miniature, held_out):
    header = held_out[1].headers[-1]
    ids = pr.header_prompt(miniature, header, 16)
    assert len(ids) == 16 and ids[0] == miniature.cfg.bos_token_id
    assert ids[1:] == miniature.encode(header.before)[-15:]
    with pytest.raises(pr.ParseRateError, match="context must be"):
        pr.header_prompt(miniature, header, 1)


# ---------------------------------------------------------------------- dsv41 parse-rate
def test_the_command_writes_the_numbers(tmp_path, capsys, miniature_checkpoint):
    out = tmp_path / "rate.json"
    assert main(["parse-rate", "--smoke", "--quiet", "--json", str(out), "--checkpoint", miniature_checkpoint]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["model"]["headers"] == data["reference"]["headers"] == pr.SMOKE_HEADERS
    assert f"{data['model']['headers']} headers parse" in printed
    for result in data["model"]["results"]:  # every verdict names its header
        assert result["file"].endswith(".py") and result["line"] >= 1


def test_the_command_refuses_in_one_line(tmp_path, capsys, tiny_checkpoint):
    assert main(["parse-rate", "--smoke", "--quiet", "--json", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv41 parse-rate: --json") and "\n" not in err
    # the random initialization is the trainer's, made for a miniature
    assert main(["parse-rate", "--smoke", "--quiet", "--random-init", "--checkpoint", tiny_checkpoint]) == 1
    err = capsys.readouterr().err.strip()
    assert "not a miniature checkpoint" in err and "\n" not in err
