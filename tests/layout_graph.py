"""fasttrain's module import graph, read with `ast`, and the import circles in it.

Run from the repository root: `python tests/layout_graph.py` (or `python -m tests.layout_graph`) prints
each circle as `a -> b -> a` and exits 1 if there is any, 0 with "no import circles" otherwise.
tests/test_layout.py asserts the same.

What counts as an import: every `import` and `from ... import` statement anywhere in a file, at module
level, inside a function, under `if TYPE_CHECKING:` or in a `try:` (a circle that only a function call
or a type checker closes is still one the reader has to keep in their head). `from x import y` imports
the module x.y when x/y.py exists, else the module x; relative imports are resolved against the
importing file's package. The implicit import of a parent package (importing x.y runs x/__init__.py
first) is not an edge: every package's __init__ that imports its own submodules would be a circle.
kernels/ is installed as fasttrain.kernels (setup.py's package_dir) and is read under that name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (source folder, the dotted name it is imported under)
PACKAGES = ((ROOT / "fasttrain", "fasttrain"), (ROOT / "kernels", "fasttrain.kernels"))


def module_files(packages=PACKAGES) -> dict[str, Path]:
    """Every module of `packages` ((folder, dotted name) pairs), by dotted name (a package by its
    __init__.py)."""
    files = {}
    for folder, dotted in packages:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([dotted, *parts])] = path
    return files


def _imported(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The fasttrain modules one import statement names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    found = set()
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:
            found.add(submodule)
        elif base in modules:
            found.add(base)
    return found


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports anywhere in its text."""
    files = module_files(packages)
    modules = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, module, is_package, modules)
        edges.discard(module)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest circle through the component's first module, as a path that ends where it starts."""
    start, members = component[0], set(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a component but on no circle")


def circles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """One circle per tangle of modules that import each other, shortest first within each."""
    graph = import_graph() if graph is None else graph
    return [shortest_circle(graph, component) for component in strongly_connected(graph)]


def main() -> int:
    graph = import_graph()
    components = strongly_connected(graph)
    if not components:
        print(f"no import circles among {len(graph)} fasttrain modules")
        return 0
    for component in components:
        inner = sum(len(graph[m] & set(component)) for m in component)
        print(f"{len(component)} modules, {inner} imports among them: {', '.join(component)}")
        print("   " + " -> ".join(shortest_circle(graph, component)))
    return 1


if __name__ == "__main__":
    sys.exit(main())
