"""The layout's rules, read from the source (no import runs): no import cycle among paratune's
modules, counting the imports inside functions too (a lazy import hides a cycle from Python, not
from a reader), and no module past the size a newcomer can read in one sitting."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "paratune"
MAX_LINES = 620  # issue 27: "no module over ~600 lines"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The paratune modules `name` imports anywhere in its file (module level or in a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from its package up
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from paratune import placement`: the submodule itself
                if f"{target}.{alias.name}" in known:
                    out.add(f"{target}.{alias.name}")
                elif target in known:
                    out.add(target)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_and_a_clean_graph_has_none():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_lazy_and_package_imports():
    graph = import_graph()
    assert "paratune.config.plan" in graph["paratune.cli"]  # a module-level import
    assert "paratune.trial.placement" in graph["paratune.cluster.trial"]  # `from paratune.trial import placement`
    assert "paratune.config.home" in graph["paratune.costs.activations"]  # an import inside a function
    assert len(graph) > 30


def test_no_import_cycle_among_paratunes_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (each: modules importing one another, in functions too): " + \
        "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_module_says_its_one_job_and_stays_readable(name):
    path = _modules()[name]
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)}: {lines} lines, over {MAX_LINES}: split it by job"
    doc = ast.get_docstring(ast.parse(text))
    if text.strip():  # an empty package marker says nothing
        assert doc and doc.strip().splitlines()[0].strip(), f"{name}: no docstring saying its job"


# Issue 42: folders by stage, bottom to top; each imports only from the folders below it (and itself).
# The root (cli.py, __main__.py, __init__.py) sits on top of them all: the commands and the public API.
FOLDERS = ["levers", "config", "model", "parallel", "checks", "costs", "trial", "cluster", "out", "sweep", "train",
           "commands"]


def _folder(module: str) -> int:
    parts = module.split(".")
    return FOLDERS.index(parts[1]) if len(parts) > 1 and parts[1] in FOLDERS else len(FOLDERS)


def test_every_folder_imports_only_from_folders_below_it():
    graph = import_graph()
    # the root package is a lazy facade (its public names load by string); tracking reads its __version__
    up = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                if b != "paratune" and _folder(b) > _folder(a))
    assert not up, "imports up the folder order " + " < ".join(FOLDERS) + ": " + "; ".join(up)


def test_every_module_sits_in_a_folder_but_the_entry_points():
    loose = sorted(m for m in _modules() if _folder(m) == len(FOLDERS))
    assert loose == ["paratune", "paratune.__main__", "paratune.cli"], loose
