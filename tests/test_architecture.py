"""docs/architecture.md stays true: every module it names exists, and imports keep to its rule
(a module imports from its own layer or below; the model's generation verbs are the one upward
lookup; the bottom layer loads without torch)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "dsv41"

# the table's layers, as module-name prefixes (a package stands for everything in it)
LAYERS = [
    ["numerics", "errors", "text", "threads", "cachedir", "argtypes", "config", "config_fields", "config_json",
     "inventory", "headers", "engram", "tokenizer", "chat_reply", "chat", "audit"],
    ["kernels"],
    ["formats", "synthetic", "tiny", "checkpoint", "stores"],
    ["layers", "hooks", "trace", "trace_file", "sampling", "token_ids"],
    ["attention"],
    ["model", "moe", "sequence", "vision", "dspark", "distributed"],
    ["generate", "speculative", "conversation"],
    ["loader", "report"],
    ["csa2_stats", "csa2_stack", "cache_policy", "viz", "bench", "notebooks", "lab", "cli", "__main__"],
]
# (importer, imported): the upward lookups the rule allows, each named in the document
ALLOWED_UPWARD = {("model", "generate"), ("model", "conversation")}


def _rank(module: str) -> int:
    head = module.split(".")[1]
    for rank, names in enumerate(LAYERS):
        if head in names:
            return rank
    raise AssertionError(f"dsv41.{head} is in no layer of docs/architecture.md")


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
    text = DOC.read_text()
    named = set(re.findall(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+(?:\.py|\.c|/))`", text))
    assert len(named) > 25, named  # the table lists the whole package
    for name in sorted(named):
        candidates = [PACKAGE / name, ROOT / name, PACKAGE / "kernels" / name, PACKAGE / "audit" / name]
        assert any(c.exists() for c in candidates), f"docs/architecture.md names {name}, which does not exist"


def test_every_module_sits_in_a_layer_of_the_document():
    for module in _modules():
        if module != "dsv41":
            _rank(module)


def test_imports_flow_down_the_layers():
    upward = []
    for module, path in _modules().items():
        if module == "dsv41":
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
        if module != "dsv41" and _rank(module) == 0:
            assert not [t for t, top in _imports(module, path) if top and t.split(".")[0] == "torch"], module
