"""No import cycles between the project's modules, nor between its folders, and no module over 600 lines.

A function-level import hides a cycle from the interpreter, and an ``if TYPE_CHECKING:`` import
never runs, but neither hides it from a reader: the two modules still depend on each other, and
neither knows which of them is the lower. Every import counts. ``import a.b.c`` is an edge to
``a.b.c`` alone (not to the ``__init__`` of ``a`` or ``a.b``), and ``from a.b import c`` is an
edge to ``a.b.c`` when that is a module, else to ``a.b``.

Folders stand on floors too: ``engine/core/`` is one unit, ``engine/worker/`` another, and a
module of one folder that imports a folder which imports it back runs up a floor.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "sdk", "integrations")

MAX_LINES = 600  # a module longer than this has a second owner to give away (C kernels aside)

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


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``node`` at any depth: functions and ``if TYPE_CHECKING:`` bodies included."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        for child in ast.iter_child_nodes(node):
            yield from _imports(child)


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
        for stmt in _imports(tree):
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


def describe(component: list[str], edges: Graph, lines: dict[tuple[str, str], int] | dict[tuple[str, str], str]) -> str:
    cycle = _shortest_cycle(component[0], set(component), edges)
    steps = "".join(f"{a} (line {lines[a, b]}) -> " for a, b in zip(cycle, cycle[1:]))
    return f"{{{', '.join(component)}}}: {steps}{cycle[-1]}"


def cycles(edges: Graph) -> list[list[str]]:
    """The components of more than one module: each a set of modules that import one another."""
    return [c for c in strongly_connected(edges) if len(c) > 1]


def folder_of(module: str) -> str:
    """The unit a module stands in on the folders' floors: its folder below a top package (``engine.core``), or
    itself for a top package's own modules (``engine.config``) and the top packages."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def folder_graph(edges: Graph, lines: dict[tuple[str, str], int]) -> tuple[Graph, dict[tuple[str, str], str]]:
    """The edges between folders (``folder_of``), each with where one module's import makes it (for ``describe``)."""
    folders: Graph = {folder_of(m): set() for m in edges}
    where: dict[tuple[str, str], str] = {}
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            a, b = folder_of(module), folder_of(target)
            if a != b:
                folders[a].add(b)
                where.setdefault((a, b), f"{lines[module, target]} of {module}, importing {target}")
    return folders, where


def test_no_import_cycles() -> None:
    """The project's modules import one another without cycles, lazy and type-only imports included."""
    edges, lines = import_graph(ROOT, PACKAGES)
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(describe(c, edges, lines) for c in found)


def test_no_import_runs_up_a_folder() -> None:
    """No folder imports a folder that imports it back: every import runs down the floors."""
    folders, where = folder_graph(*import_graph(ROOT, PACKAGES))
    found = cycles(folders)
    assert not found, "folders importing each other:\n" + "\n".join(describe(c, folders, where) for c in found)


def test_no_module_over_max_lines() -> None:
    """Every Python module of the packages stays under ``MAX_LINES`` lines."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in _module_files(ROOT, PACKAGES).values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_checker_sees_lazy_relative_type_only_and_from_imports(tmp_path: Path) -> None:
    """The checker follows function-level, relative, ``TYPE_CHECKING`` and ``from pkg import module`` imports."""
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
        "pkg.a": {"pkg.c"},
        "pkg.b": {"pkg.a", "pkg.sub.d"},
        "pkg.c": {"pkg.b"},
        "pkg.sub": set(),
        "pkg.sub.d": {"pkg.c"},
    }
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]
    assert describe(["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"], edges, lines) == (
        "{pkg.a, pkg.b, pkg.c, pkg.sub.d}: pkg.a (line 3) -> pkg.c (line 1) -> pkg.b (line 2) -> pkg.a"
    )
    folders, where = folder_graph(edges, lines)
    assert where["pkg.b", "pkg.sub"] == "3 of pkg.b, importing pkg.sub.d"
    assert folders == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.c"}, "pkg.b": {"pkg.a", "pkg.sub"}, "pkg.c": {"pkg.b"},
                       "pkg.sub": {"pkg.c"}}
    assert cycles(folders) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub"]]
