"""No import cycle in ``evinfra``: between its packages, nor between its modules.

Components depend on ``core`` and on the layers below them, never on each other in a circle
(DESIGN.md): a cycle is how internals start leaking between components. Every import counts,
those under ``TYPE_CHECKING`` and inside functions too, since each names a dependency.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import evinfra

ROOT = Path(evinfra.__file__).parent


def module_imports() -> dict[str, set[str]]:
    """Each ``evinfra`` module and the ``evinfra`` modules it imports."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("evinfra",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base in names:
                    deps.add(base)
                deps.update(f"{base}.{a.name}" for a in node.names
                            if f"{base}.{a.name}" in names)
        deps.discard(name)
    return graph


def package_of(module: str) -> str:
    """``evinfra.router.ttft`` -> ``evinfra.router``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def package_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        mine = package_of(module)
        out.setdefault(mine, set()).update(package_of(d) for d in deps if package_of(d) != mine)
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_the_finder_sees_a_cycle():
    """Control: a graph with a cycle, at either level, is caught."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    graph = {"evinfra.router.router": {"evinfra.planner.planner"},
             "evinfra.planner.planner": {"evinfra.router.ttft"}, "evinfra.router.ttft": set()}
    assert cycle(graph) is None
    assert cycle(package_imports(graph)) is not None


def test_the_finder_reads_every_kind_of_import():
    graph = module_imports()
    assert "evinfra.core.contracts" in graph["evinfra.drivers.base"]  # from-import
    assert "evinfra.drivers.sglang" in graph["evinfra.control.service"]  # inside a function
    assert "evinfra.drivers.fake.records" in graph["evinfra.drivers.fake.decode"]


@pytest.mark.parametrize("level", ["modules", "packages"])
def test_no_import_cycle(level):
    graph = module_imports()
    if level == "packages":
        graph = package_imports(graph)
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph))}"
