"""The runtime library's modules import one another without cycles (module level; an import
inside a function or under ``TYPE_CHECKING`` is a deliberate late binding and does not count):
a cycle makes import order matter and had come back twice (manifest <-> safetensors_file, over
the safe file readers, now in ``layouts/safe_files.py``)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "layouts"


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: pathlib.Path, name: str) -> set[str]:
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
                found.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists()
                          or (ROOT.parent / sub.replace(".", "/")).is_dir() else target)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layouts"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("layouts")}
    return {m for m in found if m != name}


def test_the_runtime_library_has_no_import_cycle():
    graph = {_module(p): None for p in ROOT.rglob("*.py")}
    for p in ROOT.rglob("*.py"):
        name = _module(p)
        # A package's __init__ importing its own submodules is how a package is built: not a cycle.
        graph[name] = {m for m in _top_level_imports(p, name) if m in graph and not m.startswith(name + ".")}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert "layouts.manifest" not in graph["layouts.safetensors_file"]
    assert graph["layouts.safe_files"] <= {"layouts.errors"}


def test_the_runtime_librarys_packages_and_modules_import_one_another_without_cycles():
    # The same graph with each package taken as one node (its modules and its __init__: the modules
    # of layouts/engines/atom/ count as layouts.engines.atom, layouts/engines/compat.py as
    # layouts.engines; the library's top-level modules stay nodes of their own): a module that
    # imports a package whose modules import it back is a cycle as well (layouts/compat.py and
    # layouts/engines/ were, until compat moved into engines/).
    packages = {_module(p) for p in ROOT.rglob("__init__.py")}

    def unit(name: str) -> str:
        if name in packages:
            return name
        parent = name.rsplit(".", 1)[0]
        return name if parent == "layouts" else parent

    graph: dict[str, set[str]] = {}
    for p in ROOT.rglob("*.py"):
        name = _module(p)
        graph.setdefault(unit(name), set()).update(
            unit(m) for m in _top_level_imports(p, name) if m.startswith("layouts.") and unit(m) != unit(name))
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle between packages: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
