"""The package's shape holds as it grows: no import cycle (lazy imports included), no module over 400 lines, and
the known touches of libraries' private internals only in ds_exp/compat.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds_exp"
MAX_LINES = 400
# uses (not mentions) of other libraries' private names that ds_exp relies on
PRIVATE = re.compile(
    r"hydra\._internal|\._zero3_consolidated\w*\(|import _parse_node_list|\._usr_sig\(|\._init_weights\("
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The ds_exp modules `path` imports, wherever the import statement is (lazy ones count: they still cycle)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        # a package's own __init__ importing its submodules is not a cycle with them
        graph[name] = {m for m in imports_of(path, set(files)) if m != name and not m.startswith(name + ".")}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():  # the test above must be able to fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_no_module_is_over_400_lines():
    long = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}


def test_private_internals_are_touched_only_in_compat():
    touching = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "compat.py" and PRIVATE.search(p.read_text())
    )
    assert touching == []
    assert PRIVATE.search((PACKAGE / "compat.py").read_text())
