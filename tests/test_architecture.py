"""docs/architecture.md stays true: every module of the package has one paragraph in its layer,
every module the page names exists, each paragraph's Imports line is what the module imports of
dsv41, and imports keep to the page's rule (a module imports from its own layer or below; the
model's generation verbs are the one upward lookup; the bottom layer loads without torch)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "dsv41"
# (importer, imported): the upward lookups the rule allows, each named in the document
ALLOWED_UPWARD = {("model", "generate"), ("model", "conversation")}
# the lazy facade and the command's entry stand outside the layers (the page says so)
OUTSIDE = {"__init__", "__main__"}

_LAYER = re.compile(r"^### Layer (\d+): ", re.M)
_PARAGRAPH = re.compile(r"^\*\*`([a-z_0-9]+)(\.py|/)`\*\*(.*?)(?=\n\n|\Z)", re.M | re.S)
_NAMED = re.compile(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+(?:\.py|\.c|/))`")
_IMPORTS = re.compile(r"Imports: (.*?)\.\s*$", re.S)


def _paragraphs() -> dict[str, tuple[int, str]]:
    """unit ("model", "attention") -> (its layer, its paragraph), as the page has them."""
    text = DOC.read_text()
    marks = [(m.start(), int(m.group(1))) for m in _LAYER.finditer(text)]
    assert [layer for _, layer in marks] == list(range(len(marks))), "the layers are numbered 0, 1, 2, ... in order"
    out: dict[str, tuple[int, str]] = {}
    for m in _PARAGRAPH.finditer(text):
        layer = max((layer for at, layer in marks if at < m.start()), default=None)
        assert layer is not None, f"{m.group(1)}: its paragraph comes before the first layer"
        assert m.group(1) not in out, f"{m.group(1)} has two paragraphs"
        out[m.group(1)] = (layer, m.group(0))
    return out


PARAGRAPHS = _paragraphs()


def _unit(module: str) -> str:
    return module.split(".")[1]


def _rank(module: str) -> int:
    head = _unit(module)
    if head not in PARAGRAPHS:
        raise AssertionError(f"dsv41.{head} has no paragraph in docs/architecture.md")
    return PARAGRAPHS[head][0]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path):
    """(imported dsv41 module, at module level?) for every import statement in the file."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        top = node in tree.body
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not node.module:  # `from . import x`: each name is a module
                for alias in node.names:
                    yield f"{target}.{alias.name}", top
            elif target.startswith("dsv41"):
                yield target, top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("dsv41", "torch"):
                    yield alias.name, top


def test_every_module_the_document_names_exists():
    """A file named in a package's paragraph is that package's; elsewhere a name is the package's
    own module or a path from the repository root."""
    found = 0
    for unit, (_, paragraph) in PARAGRAPHS.items():
        base = PACKAGE / unit if (PACKAGE / unit).is_dir() else PACKAGE
        for name in set(_NAMED.findall(paragraph)):
            found += 1
            assert any(c.exists() for c in (base / name, PACKAGE / name, ROOT / name)), (
                f"docs/architecture.md names {name} in the paragraph of {unit}, which does not exist")
    outside = DOC.read_text()
    for _, paragraph in PARAGRAPHS.values():
        outside = outside.replace(paragraph, "")
    for name in set(_NAMED.findall(outside)):
        assert (PACKAGE / name).exists() or (ROOT / name).exists(), f"docs/architecture.md names {name}, which does not exist"
    assert found > 50, found  # the paragraphs name the whole package


def test_every_module_has_one_paragraph_in_a_layer():
    units = {_unit(m) for m in _modules() if m != "dsv41"} - OUTSIDE
    assert sorted(units - set(PARAGRAPHS)) == [], "modules without a paragraph in docs/architecture.md"
    assert sorted(set(PARAGRAPHS) - units) == [], "paragraphs of modules that do not exist"
    for unit, (_, paragraph) in PARAGRAPHS.items():
        kind = "/" if (PACKAGE / unit).is_dir() else ".py"
        assert paragraph.startswith(f"**`{unit}{kind}`**"), f"{unit} is a {'package' if kind == '/' else 'module'}"


def test_each_paragraph_names_what_its_module_imports():
    imported: dict[str, set[str]] = {unit: set() for unit in PARAGRAPHS}
    for module, path in _modules().items():
        if module == "dsv41" or _unit(module) in OUTSIDE:
            continue
        for target, _ in _imports(module, path):
            if target.startswith("dsv41.") and _unit(target) != _unit(module):
                imported[_unit(module)].add(_unit(target))
    for unit, (_, paragraph) in PARAGRAPHS.items():
        line = _IMPORTS.search(paragraph)
        assert line, f"{unit}: its paragraph has no closing 'Imports: ...' line"
        said = set() if line.group(1) == "nothing of dsv41" else set(re.findall(r"`([a-z_0-9]+)(?:\.py|/)`", line.group(1)))
        assert said == imported[unit], (f"{unit}: the page says it imports {sorted(said)}, "
                                        f"the code imports {sorted(imported[unit])}")


def test_imports_flow_down_the_layers():
    upward = []
    for module, path in _modules().items():
        if module == "dsv41" or _unit(module) in OUTSIDE:
            continue  # the package's lazy facade (`dsv41.load`, ...) stands above everything
        for target, _ in _imports(module, path):
            if not target.startswith("dsv41.") or target == "dsv41":
                continue
            a, b = module.split(".")[1], target.split(".")[1]
            if _rank(target) > _rank(module) and (a, b) not in ALLOWED_UPWARD:
                upward.append(f"{module} imports {target}")
    assert upward == []


def test_generation_knows_a_model_only_by_its_methods():
    imported = {t for t, _ in _imports("dsv41.generate", PACKAGE / "generate.py") if t.startswith("dsv41.")}
    assert not {t for t in imported if t.split(".")[1] in ("model", "loader")}, imported


def test_no_import_cycle_at_module_level():
    graph = {m: {t for t, top in _imports(m, p) if top and t.startswith("dsv41.")} for m, p in _modules().items()}

    def resolve(target):  # `from dsv41.x import name` may name a module or an attribute of one
        return target if target in graph else target.rsplit(".", 1)[0]

    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(resolve(t) for t in graph.get(m, ())):
            if t == m or t not in graph or (m.startswith(t + ".") and t.count(".") < m.count(".")):
                continue  # a package's own __init__ importing its children is not a cycle
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack + [m, t]))
            if t not in state:
                visit(t, stack + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_the_bottom_layer_never_imports_torch_at_module_load():
    for module, path in _modules().items():
        if module != "dsv41" and _unit(module) not in OUTSIDE and _rank(module) == 0:
            assert not [t for t, top in _imports(module, path) if top and t.split(".")[0] == "torch"], module
