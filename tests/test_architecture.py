"""docs/architecture.md stays true: every module of the package has one paragraph in its layer,
every module the page names exists, each paragraph's Imports line is what the module imports of
dsv41, and imports keep to the page's rule (a module imports from its own layer or below, with no
exception; the bottom layer loads without torch)."""

import ast
import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "dsv41"
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
                f"docs/architecture.md names {name} in the paragraph of {unit}, which does not exist"
            )
    outside = DOC.read_text()
    for _, paragraph in PARAGRAPHS.values():
        outside = outside.replace(paragraph, "")
    for name in set(_NAMED.findall(outside)):
        assert (PACKAGE / name).exists() or (ROOT / name).exists(), (
            f"docs/architecture.md names {name}, which does not exist"
        )
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
        said = (
            set()
            if line.group(1) == "nothing of dsv41"
            else set(re.findall(r"`([a-z_0-9]+)(?:\.py|/)`", line.group(1)))
        )
        assert said == imported[unit], (
            f"{unit}: the page says it imports {sorted(said)}, the code imports {sorted(imported[unit])}"
        )


def test_imports_flow_down_the_layers():
    upward = []
    for module, path in _modules().items():
        if module == "dsv41" or _unit(module) in OUTSIDE:
            continue  # the package's lazy facade (`dsv41.load`, ...) stands above everything
        for target, _ in _imports(module, path):
            if not target.startswith("dsv41.") or target == "dsv41":
                continue
            if _rank(target) > _rank(module):
                upward.append(f"{module} imports {target}")
    assert upward == []


def test_generation_knows_a_model_only_by_calling_it():
    imported = {
        t
        for t, _ in _imports("dsv41.generation.generate", PACKAGE / "generation/generate.py")
        if t.startswith("dsv41.")
    }
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


# ---------------------------------------------------------------------- one way per thing
def _from_source(path: Path) -> str:
    """A file's Python text; for a notebook, its code cells (IPython's % and ! lines left out)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    code = ("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n".join(line for cell in code for line in cell.splitlines() if not line.lstrip().startswith(("%", "!")))


@functools.cache
def _module_names() -> frozenset[str]:
    return frozenset(_modules())


def _imported(module: str, is_package: bool, tree: ast.AST):
    """(import node, dsv41 module it binds from, the names it takes) for every import statement,
    module level or inside a function: `from a.b import c` imports the module a.b.c where there is
    one, else the name c of a.b."""
    modules = _module_names()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "dsv41":
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                yield (node, child, None) if child in modules else (node, base, alias)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dsv41":
                    yield node, alias.name, None


def _lazy_names() -> dict[str, tuple[str, str]]:
    """The lazy facade's table (`dsv41/__init__.py`'s `_LAZY`): public name -> (module, name)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    table = next(
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in n.targets)
    )
    return ast.literal_eval(table)


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The nodes under `if TYPE_CHECKING:`, which never run (imports there serve annotations)."""
    guarded = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
        and (
            (isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
            or (isinstance(n.test, ast.Attribute) and n.test.attr == "TYPE_CHECKING")
        )
    ]
    return {inner for n in guarded for stmt in n.body for inner in ast.walk(stmt)}


def _import_graph() -> dict[str, set[str]]:
    """dsv41 module -> the dsv41 modules it imports when it runs (at module level or inside a
    function; not under `if TYPE_CHECKING:`); the facade `dsv41` imports the homes of its lazy
    names when first asked for one."""
    graph = {}
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        never_run = _type_checking_only(tree)
        graph[module] = {
            target for node, target, _ in _imported(module, path.name == "__init__.py", tree) if node not in never_run
        } - {module}
    graph["dsv41"] |= {home for home, _ in _lazy_names().values()}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str]:
    """A shortest import chain from start to goal (both in one circle, so there is one)."""
    came_from = {start: None}
    queue = [start]
    for node in queue:
        for target in sorted(graph.get(node, ())):
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    chain = [goal]
    while chain[-1] != start:
        chain.append(came_from[chain[-1]])
    return chain[::-1]


def test_the_circle_finder_finds_a_circle_through_function_local_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _path(graph, "a", "c") + _path(graph, "c", "a")[1:] == ["a", "b", "c", "a"]
    tree = ast.parse(
        "def later():\n    from .attention import layer\n    from . import hooks\n"
        "if TYPE_CHECKING:\n    from .model import Model\n"
    )
    never_run = _type_checking_only(tree)
    assert {t for n, t, _ in _imported("dsv41.model.sequence", False, tree) if n not in never_run} == {
        "dsv41.model.attention.layer",
        "dsv41.model.hooks",
    }


def test_no_module_imports_one_that_imports_it_back():
    """At module level or inside a function, directly or through others: the imports between
    dsv41's modules go one way (a package's `__init__` importing a name from its own package counts
    as much as any module: a module that imports its package's face is in a circle with it). Only
    an import under `if TYPE_CHECKING:` is left out: it never runs."""
    graph = _import_graph()
    circles = []
    for group in _circles(graph):
        first = group[0]
        back = next(m for m in group if first in graph[m])  # a member that imports the first one
        circles.append(" -> ".join(_path(graph, first, back) + [first]) + f" (the circle is {', '.join(group)})")
    assert not circles, "import circles:\n" + "\n".join(circles)


def _defines(module: str) -> set[str]:
    """The names `from module import name` finds at their home: what the module itself defines
    (def, class, assignment) and, for a package, the public names its `__init__` takes from its own
    modules, under the same names (the package's face)."""
    path = _modules()[module]
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    if is_package:
        for node, source, alias in _imported(module, True, tree):
            if (
                alias is not None
                and node in tree.body
                and source.startswith(module + ".")
                and alias.asname in (None, alias.name)
                and not alias.name.startswith("_")
            ):
                names.add(alias.name)
    if module == "dsv41":
        names |= set(_lazy_names())
    return names


def _importers() -> list[Path]:
    """Every file that imports dsv41: the package, the tests, the widgets, the scripts and the
    notebooks."""
    files = [
        *sorted(PACKAGE.rglob("*.py")),
        *sorted((ROOT / "tests").rglob("*.py")),
        *sorted((ROOT / "dsv41/widgets").rglob("*.py")),
        *sorted((ROOT / "notebooks").glob("*.ipynb")),
    ]
    scripts = ROOT / "scripts"
    files += (
        [
            p
            for p in sorted(scripts.iterdir())
            if p.is_file() and p.read_text(errors="replace").startswith("#!/usr/bin/env python")
        ]
        if scripts.is_dir()
        else []
    )
    return files


def test_every_name_is_imported_from_its_home():
    """No module keeps a name for an old import path: every `from dsv41.x import name` in the
    repository takes the name from the module that defines it, a package's face for its own
    modules' names, or the lazy facade's table."""
    modules = _modules()
    homes: dict[str, set[str]] = {}
    elsewhere = []
    for path in _importers():
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        importer = ".".join(parts[:-1] if is_package else parts)
        for _node, source, alias in _imported(importer, is_package, ast.parse(_from_source(path))):
            if alias is None or source not in modules:
                continue
            if source not in homes:
                homes[source] = _defines(source)
            if alias.name not in homes[source]:
                elsewhere.append(f"{rel}: {alias.name} from {source}")
    assert not elsewhere, (
        "names imported from a module that only imports them (import each from its home):\n" + "\n".join(elsewhere)
    )
    for name, (home, attribute) in _lazy_names().items():
        assert attribute in _defines(home), f"dsv41.{name}: the facade's table names {home}, which does not define it"


def test_no_module_keeps_a_re_export_shim():
    """The marks such a shim carries: an import of dsv41 names silenced with `noqa` (kept unused,
    or kept below the code, for an old import path), a package face re-exporting names from
    outside the package, under another name or private ones, and a module `__getattr__` that looks
    names up elsewhere (only the top-level lazy facade has one)."""
    shims = []
    for module, path in _modules().items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        is_package = path.name == "__init__.py"
        for node, source, alias in _imported(module, is_package, tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if any("noqa" in line for line in lines[node.lineno - 1 : node.end_lineno]):
                shims.append(f"{where}: a silenced import of {source}")
            if (
                is_package
                and node in tree.body
                and alias is not None
                and not (
                    source.startswith(module + ".")
                    and alias.asname in (None, alias.name)
                    and not alias.name.startswith("_")
                )
            ):
                shims.append(
                    f"{where}: the package's face takes {alias.name} from {source}"
                    + (f" as {alias.asname}" if alias.asname else "")
                )
        if module != "dsv41" and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            shims.append(f"{path.relative_to(ROOT)}: a module __getattr__")
    assert not shims, "re-export shims:\n" + "\n".join(sorted(set(shims)))
