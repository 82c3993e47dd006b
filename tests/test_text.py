"""dsv41.core.text's one test for a whole number, and the modules that use it instead of their own."""

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from dsv41.core.text import is_whole, number_text

PACKAGE = Path(__file__).resolve().parents[1] / "dsv41"


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int64(7), np.uint8(255)])
def test_whole_numbers_are_ints_of_any_integer_type(value):
    assert is_whole(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, float("nan"), "1", None, [1]])
def test_a_bool_a_float_or_a_text_is_not_a_whole_number(value):
    assert not is_whole(value)


def test_number_text_reads_a_numpy_integer_as_the_int_it_is():
    assert number_text(np.int64(123_456)) == number_text(123_456) == "123,456"
    assert number_text(np.int64(12)) == "12"


# as ast.unparse spells it
_CHECK = re.compile(r"isinstance\((\w+), (numbers\.Integral|int)\) and \(not isinstance\(\1, bool\)\)")


def _whole_number_checks(path: Path) -> list[str]:
    """Functions that only return `isinstance(x, <int type>) and not isinstance(x, bool)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], ast.Return) and _CHECK.fullmatch(ast.unparse(body[0].value)):
            found.append(node.name)
    return found


def test_the_whole_number_check_has_one_home():
    homes = {
        str(p.relative_to(PACKAGE)): names for p in sorted(PACKAGE.rglob("*.py")) if (names := _whole_number_checks(p))
    }
    # config_json.is_int is unused since config.py reads text.is_whole; it goes with config.py's
    # re-export line, which another change removes
    assert set(homes) - {"core/config_json.py"} == {"core/text.py"}, homes
    assert homes["core/text.py"] == ["is_whole"]
