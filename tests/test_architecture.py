"""docs/architecture.md stays true: the package's folders are the page's sections, in the order of its
picture, and a module's folder is its layer; every module of a folder has one paragraph in its folder's
section, every module the page names exists, each paragraph's Imports line is what the module imports of
dsv41, and imports keep to the page's rule (a module imports from its own folder or the folders below it;
no upward lookup; the modules the page names load without torch)."""

import ast
import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "dsv41"
# (importer, imported): the upward lookups the rule allows, each named in the document's rule: none
ALLOWED_UPWARD: set = set()
# the lazy facade and the command's entry stand outside the folders (the page says so)
OUTSIDE = {"dsv41", "dsv41.__main__"}

_FOLDER = re.compile(r"^### `([a-z_0-9]+)/`\n", re.M)
_PARAGRAPH = re.compile(r"^\*\*`((?:[a-z_0-9]+/)*[a-z_0-9]+(?:\.py|/))`\*\*(.*?)(?=\n\n|\Z)", re.M | re.S)
_NAMED = re.compile(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+(?:\.py|\.c|/))`")
_IMPORTS = re.compile(r"Imports: (.*?)\.\s*$", re.S)
_UNIT_NAMED = re.compile(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+(?:\.py|/))`")
_PICTURE = re.compile(r"^## The folders\n\n```\n(.*?)^```", re.M | re.S)
_RULE = re.compile(r"^## The import rule\n(.*)", re.M | re.S)
_WITHOUT_TORCH = re.compile(r"^\*\*Without torch:\*\* (.*?)(?=\n\n|\Z)", re.M | re.S)


def _sections() -> list[tuple[str, str]]:
    """(folder, the text of its section), in the page's order: bottom up."""
    text = DOC.read_text()
    marks = list(_FOLDER.finditer(text))
    assert marks, "docs/architecture.md has no folder sections (### `folder/`)"
    end = text.find("\n## ", marks[-1].end())
    ends = [m.start() for m in marks[1:]] + [len(text) if end < 0 else end]
    return [(m.group(1), text[m.end() : stop]) for m, stop in zip(marks, ends)]


SECTIONS = _sections()
ORDER = [folder for folder, _ in SECTIONS]


def _paragraphs() -> dict[str, tuple[str, str]]:
    """unit ("core/config.py", "model/attention/", "kernels/") -> (the folder whose section holds
    its paragraph, the paragraph)."""
    out: dict[str, tuple[str, str]] = {}
    for folder, section in SECTIONS:
        for m in _PARAGRAPH.finditer(section):
            assert m.group(1) not in out, f"{m.group(1)} has two paragraphs"
            out[m.group(1)] = (folder, m.group(0))
    outside = DOC.read_text()
    for _, section in SECTIONS:
        outside = outside.replace(section, "")
    stray = [m.group(1) for m in _PARAGRAPH.finditer(outside)]
    assert stray == [], f"paragraphs outside the folders' sections: {stray}"
    return out


PARAGRAPHS = _paragraphs()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@functools.cache
def _module_names() -> frozenset[str]:
    return frozenset(_modules())


def _folder(module: str) -> str | None:
    return None if module in OUTSIDE else module.split(".")[1]


def _unit(module: str) -> str | None:
    """The paragraph a module belongs to: its folder where the folder is one paragraph, else the
    module or package right below its folder; None for a folder's face (its __init__) and for the
    modules outside the folders."""
    parts = module.split(".")[1:]
    if module in OUTSIDE:
        return None
    if f"{parts[0]}/" in PARAGRAPHS:
        return f"{parts[0]}/"
    if len(parts) == 1:
        return None
    return f"{parts[0]}/{parts[1]}/" if (PACKAGE / parts[0] / parts[1]).is_dir() else f"{parts[0]}/{parts[1]}.py"


def _rank(module: str) -> int:
    folder = _folder(module)
    if folder not in ORDER:
        raise AssertionError(f"dsv41/{folder} has no section in docs/architecture.md")
    return ORDER.index(folder)


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


def _run_at_load(tree: ast.Module) -> set[ast.AST]:
    """The nodes that run when the module loads: outside every function body and not under
    `if TYPE_CHECKING:` (class bodies run)."""
    later = _type_checking_only(tree)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            later |= {inner for stmt in ([n.body] if isinstance(n, ast.Lambda) else n.body) for inner in ast.walk(stmt)}
    return {n for n in ast.walk(tree)} - later


def _imports(module: str, path: Path):
    """(imported module, at module load?) for every import statement in the file: a dsv41 module
    (`from a.b import c` imports the module a.b.c where there is one, else a name of a.b) or torch."""
    tree = ast.parse(path.read_text())
    at_load = _run_at_load(tree)
    for node, target, _ in _imported(module, path.name == "__init__.py", tree):
        yield target, node in at_load
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "torch":
                yield name, node in at_load


def _names_in(paragraph: str) -> set[str]:
    """The units a paragraph's text names in backticks (paths below dsv41/)."""
    return set(_UNIT_NAMED.findall(paragraph))


def test_the_folders_are_the_sections_in_the_pictures_order():
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert sorted(ORDER) == folders, "the folders of dsv41/ and the sections of docs/architecture.md differ"
    loose = sorted(
        m for m in _modules() if m.count(".") == 1 and m not in OUTSIDE and not (PACKAGE / _folder(m)).is_dir()
    )
    assert loose == [], "modules at the top of dsv41/, in no folder"
    unpackaged = sorted(
        str(d.relative_to(ROOT))
        for d in PACKAGE.rglob("*")
        if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists()
    )
    assert unpackaged == [], "folders of Python files without an __init__.py"
    picture = _PICTURE.search(DOC.read_text())
    assert picture, "docs/architecture.md has no picture of the folders"
    rows = re.findall(r"^\s+([a-z_0-9]+)/\s", picture.group(1), re.M)
    drawn = [row for row in rows if row in ORDER]
    assert drawn[::-1] == ORDER, f"the picture draws the folders as {drawn[::-1]} bottom up; the sections are {ORDER}"


def test_every_module_has_one_paragraph_in_its_folder():
    units = {_unit(m) for m in _modules()} - {None}
    assert sorted(units - set(PARAGRAPHS)) == [], "modules without a paragraph in docs/architecture.md"
    assert sorted(set(PARAGRAPHS) - units) == [], "paragraphs of modules that do not exist"
    for unit, (folder, _) in PARAGRAPHS.items():
        assert unit.split("/")[0] == folder, f"{unit}'s paragraph stands in the section of {folder}/"
        kind = "package" if (PACKAGE / unit).is_dir() else "module"
        assert unit.endswith("/") == (kind == "package"), f"{unit} is a {kind}"


def test_a_folder_of_several_paragraphs_has_a_face_that_imports_nothing():
    """Its __init__.py says what the folder holds; names are imported from their modules."""
    for folder in ORDER:
        if f"{folder}/" in PARAGRAPHS:
            continue
        tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], folder
        assert ast.get_docstring(tree), f"dsv41/{folder}/__init__.py says nothing of what the folder holds"


def test_every_module_the_document_names_exists():
    """A file named in a package's paragraph is that package's; elsewhere a name is a path below
    dsv41/ or from the repository root."""
    found = 0
    for unit, (_, paragraph) in PARAGRAPHS.items():
        base = PACKAGE / unit if unit.endswith("/") else PACKAGE
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


def _imported_units() -> dict[str, set[str]]:
    imported: dict[str, set[str]] = {unit: set() for unit in PARAGRAPHS}
    for module, path in _modules().items():
        unit = _unit(module)
        if unit is None:
            continue
        for target, _ in _imports(module, path):
            if target.startswith("dsv41.") and _unit(target) not in (None, unit):
                imported[unit].add(_unit(target))
    return imported


def test_each_paragraph_names_what_its_module_imports():
    imported = _imported_units()
    for unit, (_, paragraph) in PARAGRAPHS.items():
        line = _IMPORTS.search(paragraph)
        assert line, f"{unit}: its paragraph has no closing 'Imports: ...' line"
        said = set() if line.group(1) == "nothing of dsv41" else _names_in(line.group(1))
        assert said == imported[unit], (
            f"{unit}: the page says it imports {sorted(said)}, the code imports {sorted(imported[unit])}"
        )


def test_imports_flow_down_the_folders():
    """Every import, at module load, inside a function or for annotations: its folder is the
    importer's or one below it."""
    upward = []
    for module, path in _modules().items():
        if module in OUTSIDE:
            continue  # the package's lazy facade (`dsv41.load`, ...) stands above everything
        for target, _ in _imports(module, path):
            if not target.startswith("dsv41.") or target in OUTSIDE:
                continue
            if _rank(target) > _rank(module) and (_unit(module), _unit(target)) not in ALLOWED_UPWARD:
                upward.append(f"{module} ({_folder(module)}/) imports {target} ({_folder(target)}/)")
    assert upward == []
    rule = _RULE.search(DOC.read_text()).group(1)
    for importer, imported in ALLOWED_UPWARD:
        assert importer.rsplit("/", 1)[-1] in rule or importer in rule, importer
        assert imported in rule, f"the allowed lookup {importer} -> {imported} is not named in the import rule"


def test_generation_knows_a_model_only_by_its_methods():
    """Nothing in generation/ imports the model or the loader when it runs (annotations aside)."""
    for module, path in _modules().items():
        if module in OUTSIDE or _folder(module) != "generation":
            continue
        tree = ast.parse(path.read_text())
        never_run = _type_checking_only(tree)
        runs = {t for n, t, _ in _imported(module, path.name == "__init__.py", tree) if n not in never_run}
        assert not {t for t in runs if t == "dsv41.model.model" or _folder(t) == "runtime"}, (module, runs)


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


def _without_torch() -> set[str]:
    """The modules the import rule's "Without torch" paragraph names (a folder or package: all of
    its modules)."""
    rule = _RULE.search(DOC.read_text()).group(1)
    paragraph = _WITHOUT_TORCH.search(rule)
    assert paragraph, "the import rule has no **Without torch:** paragraph"
    out = set()
    for name in _names_in(paragraph.group(1)):
        assert (PACKAGE / name).exists(), f"the Without torch paragraph names {name}, which does not exist"
        prefix = "dsv41." + name.removesuffix(".py").strip("/").replace("/", ".")
        out |= {m for m in _modules() if m == prefix or (name.endswith("/") and m.startswith(prefix + "."))}
    return out


def test_the_modules_the_rule_names_load_without_torch():
    """None of them imports torch when it loads, nor, when it loads, a module of dsv41 that does
    (importing a module runs its packages' __init__ too); the bottom folder is among them."""
    named = _without_torch()
    modules = _modules()
    bottom = {m for m in modules if m not in OUTSIDE and _folder(m) == ORDER[0]}
    assert bottom <= named, f"the Without torch paragraph leaves out {sorted(bottom - named)} of {ORDER[0]}/"

    @functools.cache
    def at_load(module: str) -> frozenset[str]:
        found = set()
        for target, top in _imports(module, modules[module]):
            if not top:
                continue
            if target.split(".")[0] == "torch":
                found.add("torch")
            elif target.startswith("dsv41."):
                parts = target.split(".")
                found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in modules}
        return frozenset(found)

    for start in sorted(named):
        chain, seen, queue = {start: None}, {start}, [start]
        for module in queue:
            for target in sorted(at_load(module)):
                if target == "torch":
                    path = [module]
                    while chain[path[-1]]:
                        path.append(chain[path[-1]])
                    pytest.fail(f"{start} imports torch when it loads: {' -> '.join(path[::-1])} -> torch")
                if target not in seen:
                    seen.add(target)
                    chain[target] = module
                    queue.append(target)


# ---------------------------------------------------------------------- one way per thing
def _from_source(path: Path) -> str:
    """A file's Python text; for a notebook, its code cells (IPython's % and ! lines left out)."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    code = ("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n".join(line for cell in code for line in cell.splitlines() if not line.lstrip().startswith(("%", "!")))


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
    """Every file that imports dsv41: the package (the widgets with it), the tests, the scripts and
    the notebooks."""
    files = [
        *sorted(PACKAGE.rglob("*.py")),
        *sorted((ROOT / "tests").rglob("*.py")),
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
