"""The runtime library's modules, and prep's, import one another without cycles (module level; an
import inside a function or under ``TYPE_CHECKING`` is a deliberate late binding and does not
count): a cycle makes import order matter and had come back twice (manifest <-> safetensors_file,
over the safe file readers, now in ``layouts/safe_files.py``). Packages taken as one node each
must not import each other in a circle either (``layouts/compat.py`` and ``layouts/engines/``
did, until compat moved into engines)."""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: pathlib.Path, name: str, top: str) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in tree.body:  # module level only
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from . import x` names a submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if (REPO / (sub.replace(".", "/") + ".py")).exists()
                          or (REPO / sub.replace(".", "/")).is_dir() else target)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == top:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == top}
    return {m for m in found if m != name}


def _graph(top: str) -> dict[str, set[str]]:
    """Module -> the modules of ``top`` it imports at module level (a package's __init__ importing
    its own submodules is how a package is built: not an edge)."""
    paths = {_module(p): p for p in (REPO / top).rglob("*.py")}
    return {name: {m for m in _top_level_imports(p, name, top) if m in paths and not m.startswith(name + ".")}
            for name, p in paths.items()}


def _assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle between {what}: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("top", ["layouts", "prep"])
def test_modules_import_one_another_without_cycles(top):
    _assert_acyclic(_graph(top), "modules")


@pytest.mark.parametrize("top", ["layouts", "prep"])
def test_packages_and_modules_import_one_another_without_cycles(top):
    # Each package one node (its modules and its __init__: layouts/engines/atom/*.py count as
    # layouts.engines.atom, layouts/engines/_compat.py as layouts.engines); the top package's own
    # modules stay nodes of their own.
    packages = {_module(p) for p in (REPO / top).rglob("__init__.py")}

    def unit(name: str) -> str:
        if name in packages:
            return name
        parent = name.rsplit(".", 1)[0]
        return name if parent == top else parent

    graph: dict[str, set[str]] = {}
    for name, deps in _graph(top).items():
        graph.setdefault(unit(name), set()).update(unit(m) for m in deps if unit(m) != unit(name))
    _assert_acyclic(graph, "packages")


def test_the_safe_file_readers_import_nothing_of_the_library_but_its_errors():
    graph = _graph("layouts")
    assert "layouts.manifest" not in graph["layouts.safetensors_file"]
    assert graph["layouts.safe_files"] <= {"layouts.errors"}
