"""No import cycles between the files of neorec/.

Every import statement counts: top-level ones and those inside functions, absolute and relative. An
import names the file it loads: `import a.b.c` the longest of a.b.c, a.b, a that is a file of the
package; `from x import y` the module x.y when y is one (a submodule), else x (a package's x is its
__init__.py). Any strongly connected component of more than one file is a cycle; the failure prints
one loop of each, with the lines that import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "neorec"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of its first import}


def module_files(package: Path) -> dict[str, Path]:
    """{dotted module name: file} of every .py file under `package` (a package's name is its folder's)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The modules of `modules` that an import statement loads (none for other statements)."""

    def file_of(name: str) -> str | None:  # the longest prefix of `name` that is a file
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the module's package, one level up per extra dot
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    else:
        return []
    found = (file_of(name) for name in names)
    return [f for f in found if f is not None and f != module]


def _statements(body: list) -> Iterator[ast.AST]:
    """Every statement of a body and, recursively, of the bodies inside it (functions, classes, if,
    try, with, loops, match): wherever an import can stand; expressions are not entered."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _statements(getattr(node, field, ()))


def import_graph(package: Path) -> Graph:
    """Every file of `package` and the files of the same package that it imports."""
    modules = module_files(package)
    graph: Graph = {m: {} for m in modules}
    for module, path in modules.items():
        for node in _statements(ast.parse(path.read_text(encoding="utf-8"), str(path)).body):
            for target in _imported(node, module, path.name == "__init__.py", modules):
                line = graph[module].get(target, node.lineno)
                graph[module][target] = min(line, node.lineno)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's algorithm,
    with an explicit stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
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
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def loop(graph: Graph, component: list[str]) -> list[str]:
    """One closed path through a component's first module: `a` -> `b` (line) -> ... -> `a`."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first, inside the component, until an edge returns to `start`
        following = []
        for node in frontier:
            for target in graph[node]:
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    path.reverse()
                    return [f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(path, [*path[1:], start], strict=True)]
                if target in members and target not in came_from and target != start:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no loop through {start}")  # pragma: no cover - a component always has one


def import_cycles(package: Path) -> list[list[str]]:
    """The import cycles of the package in folder `package`, each as the sorted modules in it."""
    return cycles(import_graph(package))


def describe(package: Path) -> str:
    graph = import_graph(package)
    return "\n".join(
        f"cycle: {' <-> '.join(c)}\n  " + "\n  ".join(loop(graph, c)) for c in cycles(graph)
    )


def test_neorec_has_no_import_cycle() -> None:
    assert import_cycles(PACKAGE) == [], "import cycles between files of neorec/:\n" + describe(PACKAGE)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("lazy", [False, True])
def test_a_cycle_is_found_whatever_the_form_of_its_imports(tmp_path: Path, lazy: bool) -> None:
    b_imports_c = "def f():\n    from .c import g\n" if lazy else "from .c import g\n"
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import os\nfrom pkg import b\n",  # an absolute from-import of a submodule
            "pkg/b.py": b_imports_c,  # relative, inside a function when lazy
            "pkg/c.py": "import pkg.a\ng = 1\n",  # a plain import
            "pkg/d.py": "from pkg.c import g\n",  # imports into the cycle, outside of it
            "pkg/sub/__init__.py": "",
            "pkg/sub/e.py": "from .. import d\nfrom ..sub import f\n",  # two levels up; a sibling
            "pkg/sub/f.py": "from pkg.sub import e\n",
        },
    )
    assert import_cycles(package) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub.e", "pkg.sub.f"]]
    text = describe(package)
    assert "cycle: pkg.a <-> pkg.b <-> pkg.c" in text
    assert "pkg.a -> pkg.b (line 2)" in text and "pkg.c -> pkg.a (line 1)" in text


def test_imports_name_the_files_they_load_and_no_loop_is_no_cycle(tmp_path: Path) -> None:
    package = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import x\n",  # a package re-exporting its module
            "pkg/a.py": "from pkg.b import y\nx = y\n",
            "pkg/b.py": "import json\nfrom pkg.sub.e import z\ny = z\n",  # other packages do not count
            "pkg/c.py": "from pkg import x\nimport pkg.a\nfrom pkg import a\n",  # x: a name of __init__.py
            "pkg/sub/__init__.py": "",
            "pkg/sub/e.py": "z = 1\n",
        },
    )
    assert import_graph(package) == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.b": 1},
        "pkg.b": {"pkg.sub.e": 2},
        "pkg.c": {"pkg": 1, "pkg.a": 2},
        "pkg.sub": {},
        "pkg.sub.e": {},
    }
    assert import_cycles(package) == []
