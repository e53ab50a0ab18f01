"""Fail on any import circle among jaxmem's modules, counting imports placed inside functions; on any import
that runs up the package floors; and on a function-level import of jaxmem without a reason.

Reads every module of the package with `ast` (nothing is imported), records each `import jaxmem.x`,
`from jaxmem.x import y`, `from jaxmem import x` and relative import wherever it sits (module level, inside a
function, under `if TYPE_CHECKING:` included), then looks for strongly connected components of the graph.
Each circle is printed as one line, `a -> b -> ... -> a`, and the exit status is 1; a clean tree prints one
line and exits 0.

An import of a package (`jaxmem.plan`) counts as an edge to its `__init__`; `from jaxmem.plan import bill`
counts as an edge to `jaxmem.plan.bill` when that is a module, else to the package's `__init__`. Importing
`jaxmem.plan.bill` also runs `jaxmem/plan/__init__.py`, but that edge is left out: a package's `__init__`
re-exporting its own submodules would otherwise make every package a circle.

The floors (FLOORS, bottom first) are the package layering: a package imports only packages on lower floors,
and the feature packages, which share a floor, import none of each other (the registry, jaxmem.registry,
composes them). UP_ALLOWED names the imports that may run up, each with its reason. The core and the planner
(FEATURE_BLIND) import no feature package at all, though the planner sits above them: they are handed the
active features by the registry and call their hooks (jaxmem.core.plugins.Feature). A function-level import of
a jaxmem module must say why on its line (`# lazy: ...`): an import kept out of the module's import time.

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


# Bottom first. "<root>" is the package's __init__ (its lazy public surface); "version", "registry", "loader" and
# "api" are the root modules jaxmem/version.py, jaxmem/registry.py (the features), jaxmem/loader.py (loading and
# checking a config) and jaxmem/api.py (the library surface).
FLOORS = (("config", "version"), ("runtime",), ("mesh",), ("kernels",), ("model",), ("io",), ("optim",),
          ("core",), ("generation",), ("lora", "moe", "pipeline", "inbackward", "preference", "rl"), ("registry",),
          ("loader",), ("plan",),
          ("train",), ("cli",), ("api",), ("<root>",))
# (importing package, imported package) -> why it may run up a floor or across the feature floor
UP_ALLOWED: dict[tuple[str, str], str] = {}
FEATURE_PACKAGES = next(floor for floor in FLOORS if "lora" in floor)
# packages that never name a feature: they reach the features through the registry's hooks
FEATURE_BLIND = ("core", "loader", "plan")


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def floor_violations(graph: dict[str, dict[str, int]], known: dict[str, Path]) -> list[str]:
    """One line per import that runs up the floors (or from one feature package into another)."""
    level = {name: i for i, names in enumerate(FLOORS) for name in names}
    out = []
    for module, deps in sorted(graph.items()):
        a = package_of(module)
        for dep, line in sorted(deps.items()):
            b = package_of(dep)
            if a == b or (a, b) in UP_ALLOWED or a not in level or b not in level:
                continue
            if level[b] >= level[a]:
                where = "a feature on the same floor" if level[b] == level[a] else f"floor {level[b]} > {level[a]}"
                out.append(f"{module} ({known[module].name}:{line}) imports {dep}: {where}")
    return out


def feature_imports(graph: dict[str, dict[str, int]], known: dict[str, Path]) -> list[str]:
    """One line per import of a feature package by a package that must not name one (FEATURE_BLIND)."""
    return [f"{module} ({known[module].name}:{line}) imports {dep}: {package_of(module)}/ imports no feature "
            f"package (ask the registry's features for a hook)"
            for module, deps in sorted(graph.items()) if package_of(module) in FEATURE_BLIND
            for dep, line in sorted(deps.items()) if package_of(dep) in FEATURE_PACKAGES]


def unexplained_lazy_imports(package_dir: Path, known: dict[str, Path]) -> list[str]:
    """Function-level imports of the package with no `#` comment on their line (the reason)."""
    top = package_dir.name
    out = []
    for module, path in sorted(known.items()):
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                internal = (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == top)
                            or isinstance(node, ast.Import) and any(a.name.split(".")[0] == top for a in node.names))
                if internal and "#" not in lines[node.end_lineno - 1]:
                    out.append(f"{module} ({path.name}:{node.lineno}): a function-level import without its reason")
    return out


def count_lazy_imports(package_dir: Path, known: dict[str, Path]) -> int:
    """Function-level imports of the package."""
    top = package_dir.name
    count = 0
    for path in known.values():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count += sum(1 for node in ast.walk(fn) if isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").split(".")[0] == top) or isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == top for a in node.names))
    return count


def main(argv: list[str]) -> int:
    package_dir = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "jaxmem"
    graph, known = import_graph(package_dir)
    components = strongly_connected(graph)
    problems = (floor_violations(graph, known) + feature_imports(graph, known)
                + unexplained_lazy_imports(package_dir, known))
    if not components and not problems:
        edges = sum(len(v) for v in graph.values())
        print(f"check_imports: no import circles among {len(graph)} modules ({edges} imports, function-level included)")
        floored = {package_of(m) for m in graph} & {name for names in FLOORS[:-1] for name in names}
        if floored:
            print(f"check_imports: the package floors hold ({len(floored)} packages; {len(UP_ALLOWED)} imports "
                  f"allowed to run up; {count_lazy_imports(package_dir, known)} function-level imports, each with "
                  f"its reason); {', '.join(FEATURE_BLIND)} import no feature package")
        return 0
    for component in components:
        print(f"import circle among {len(component)} modules: {', '.join(component)}")
        print("  e.g. " + describe(graph, known, one_cycle(graph, component)))
    for line in problems:
        print(line)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
