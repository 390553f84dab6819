"""No import cycles between the project's modules, counting imports inside functions too.

A function-level import hides a cycle from the interpreter but not from a reader: the two
modules still depend on each other. Only ``if TYPE_CHECKING:`` imports are left out, since
they never run. ``import a.b.c`` is an edge to ``a.b.c`` alone (not to the ``__init__`` of
``a`` or ``a.b``), and ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
else to ``a.b``.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "sdk", "integrations")

# NOTE: cycles in sdk/ and integrations/ that are being removed in a change of their own.
# A cycle among some of the modules of one entry is tolerated; any other cycle fails,
# including one that joins an entry's modules to another module. Delete an entry once its
# cycle is gone.
KNOWN_CYCLES_BEING_FIXED: set[frozenset[str]] = set()

Graph = dict[str, set[str]]


def _module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """``{module name: file}`` of every module under ``packages``; a package is its ``__init__.py``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``node`` at any depth (functions included) but in ``if TYPE_CHECKING:`` bodies."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
        for stmt in node.orelse:
            yield from _runtime_imports(stmt)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _runtime_imports(child)


def _targets(stmt: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> Iterator[str]:
    """The project modules that one import statement of ``module`` depends on."""
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            parts = alias.name.split(".")
            candidates = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
            target = next((name for name in candidates if name in modules), None)
            if target is not None:
                yield target
        return
    if stmt.level:  # relative: level 1 is the importing module's package, 2 its parent, ...
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - stmt.level + 1] + ([stmt.module] if stmt.module else []))
    else:
        base = stmt.module or ""
    for alias in stmt.names:
        if f"{base}.{alias.name}" in modules:
            yield f"{base}.{alias.name}"
        elif base in modules:
            yield base


def import_graph(root: Path, packages: tuple[str, ...]) -> tuple[Graph, dict[tuple[str, str], int]]:
    """``(edges, lines)``: each module's imported project modules, and the first line of each edge."""
    files = _module_files(root, packages)
    names = set(files)
    edges: Graph = {name: set() for name in files}
    lines: dict[tuple[str, str], int] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for stmt in _runtime_imports(tree):
            for target in _targets(stmt, name, path.name == "__init__.py", names):
                if target != name:
                    edges[name].add(target)
                    lines.setdefault((name, target), stmt.lineno)
    return edges, lines


def strongly_connected(edges: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted; iterative, so no recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(edges[root])))]
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:  # every successor done: close node
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
    return components


def _shortest_cycle(start: str, members: set[str], edges: Graph) -> list[str]:
    """``[start, ..., start]``: a shortest way back to ``start`` through ``members`` (breadth first)."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(edges[node] & members):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if succ not in previous:
                previous[succ] = node
                queue.append(succ)
    raise AssertionError(f"{start} is on no cycle")


def describe(component: list[str], edges: Graph, lines: dict[tuple[str, str], int]) -> str:
    cycle = _shortest_cycle(component[0], set(component), edges)
    steps = "".join(f"{a} (line {lines[a, b]}) -> " for a, b in zip(cycle, cycle[1:]))
    return f"{{{', '.join(component)}}}: {steps}{cycle[-1]}"


def new_cycles(edges: Graph, known: set[frozenset[str]]) -> list[list[str]]:
    """Components of more than one module that lie within no entry of ``known``."""
    cycles = [c for c in strongly_connected(edges) if len(c) > 1]
    return [c for c in cycles if not any(set(c) <= entry for entry in known)]


def test_no_import_cycles() -> None:
    """The project's modules import one another without cycles, lazy imports included (known ones aside)."""
    edges, lines = import_graph(ROOT, PACKAGES)
    cycles = new_cycles(edges, KNOWN_CYCLES_BEING_FIXED)
    assert not cycles, "import cycles:\n" + "\n".join(describe(c, edges, lines) for c in cycles)


def test_checker_sees_lazy_relative_and_from_imports(tmp_path: Path) -> None:
    """The checker follows function-level, relative and ``from pkg import module`` imports, and skips TYPE_CHECKING."""
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nA = 1\n",
        "pkg/b.py": "def f():\n    from . import a\n    from .sub import d\n",
        "pkg/c.py": "import pkg.b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from ..c import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges, lines = import_graph(tmp_path, ("pkg",))
    assert edges == {
        "pkg": {"pkg.a"},
        "pkg.a": set(),
        "pkg.b": {"pkg.a", "pkg.sub.d"},
        "pkg.c": {"pkg.b"},
        "pkg.sub": set(),
        "pkg.sub.d": {"pkg.c"},
    }
    assert new_cycles(edges, set()) == [["pkg.b", "pkg.c", "pkg.sub.d"]]
    assert new_cycles(edges, {frozenset({"pkg.b", "pkg.c", "pkg.sub.d", "pkg.a"})}) == []
    assert describe(["pkg.b", "pkg.c", "pkg.sub.d"], edges, lines) == (
        "{pkg.b, pkg.c, pkg.sub.d}: pkg.b (line 3) -> pkg.sub.d (line 1) -> pkg.c (line 1) -> pkg.b"
    )
