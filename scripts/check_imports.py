"""Fail on any import circle among jaxmem's modules, counting imports placed inside functions.

Reads every module of the package with `ast` (nothing is imported), records each `import jaxmem.x`,
`from jaxmem.x import y`, `from jaxmem import x` and relative import wherever it sits (module level, inside a
function, under `if TYPE_CHECKING:` included), then looks for strongly connected components of the graph.
Each circle is printed as one line, `a -> b -> ... -> a`, and the exit status is 1; a clean tree prints one
line and exits 0.

An import of a package (`jaxmem.plan`) counts as an edge to its `__init__`; `from jaxmem.plan import bill`
counts as an edge to `jaxmem.plan.bill` when that is a module, else to the package's `__init__`. Importing
`jaxmem.plan.bill` also runs `jaxmem/plan/__init__.py`, but that edge is left out: a package's `__init__`
re-exporting its own submodules would otherwise make every package a circle.

Usage: python scripts/check_imports.py [package_dir]   (default: jaxmem beside this script's parent)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (packages named by their __init__)."""
    root = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """Modules of the package that `module` imports -> the line of the first such import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = module.split(".")[0]
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        while name and name not in known:  # `jaxmem.plan.bill.compute_bill` -> `jaxmem.plan.bill`
            name = name.rpartition(".")[0]
        if name and name != module:
            found.setdefault(name, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == top or alias.name.startswith(top + "."):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                source = _resolve_relative(module, is_package, node.level, node.module)
            else:
                source = node.module or ""
            if not (source == top or source.startswith(top + ".")):
                continue
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                add(candidate if candidate in known else source, node.lineno)
    return found


def import_graph(package_dir: Path) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    known = module_names(package_dir)
    return {name: imports_of(name, path, known) for name, path in known.items()}, known


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in graph:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return components


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first inside the component)."""
    members = set(component)
    start = component[0]
    parents = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if succ in members and succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    return component


def describe(graph: dict[str, dict[str, int]], known: dict[str, Path], cycle: list[str]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        steps.append(f"{a} ({known[a].name}:{graph[a][b]})")
    return " -> ".join(steps + [cycle[-1]])


def main(argv: list[str]) -> int:
    package_dir = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "jaxmem"
    graph, known = import_graph(package_dir)
    components = strongly_connected(graph)
    if not components:
        edges = sum(len(v) for v in graph.values())
        print(f"check_imports: no import circles among {len(graph)} modules ({edges} imports, function-level included)")
        return 0
    for component in components:
        print(f"import circle among {len(component)} modules: {', '.join(component)}")
        print("  e.g. " + describe(graph, known, one_cycle(graph, component)))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
