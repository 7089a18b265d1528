"""gradzip's modules and the convergence harness's import each other without cycles (imports
inside functions included); the gradzip package holds the library alone."""

from __future__ import annotations

import importlib
import importlib.util

from package_source import PACKAGES, imports, modules


def known_prefix(name: str, known) -> str | None:
    """The longest dotted prefix of ``name`` that is one of the modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules (of gradzip and the harness) it imports. ``from pkg import x`` is an
    edge to pkg.x where that is a module, else to pkg."""
    mods = modules()
    graph = {name: set() for name in mods}
    for name, (path, tree) in mods.items():
        for base, names, _ in imports(name, path, tree):
            if base.partition(".")[0] not in PACKAGES:
                continue
            for target in [f"{base}.{n}" for n in names] if names else [base]:
                dst = target if target in mods else known_prefix(base, mods)
                if dst is not None and dst != name:
                    graph[name].add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state = {}  # absent: unvisited, 1: on the current path, 2: done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_graph_sees_lazy_and_relative_imports():
    g = import_graph()
    assert "gradzip_converge.training" in g["gradzip_converge.cli"]  # from .training import ...
    assert "gradzip.optim" in g["gradzip_converge.training"]  # from gradzip.optim import ...
    assert "gradzip.simulation" in g["gradzip_converge.compression"]  # inside a function
    assert "gradzip_converge.report" in g["gradzip_converge.output"]  # from . import report
    assert "gradzip.costmodel" in g["gradzip.costmodel_cli"]  # from gradzip import costmodel
    assert "gradzip_converge.zoo" in g["gradzip.costmodel_cli"]  # the harness's models


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_gradzip_package_is_the_library_alone():
    """The harness is a distribution of its own (bench/harness): `pip install gradzip` does not
    ship it, and it imports as gradzip_converge."""
    assert importlib.util.find_spec("gradzip.converge") is None
    assert importlib.import_module("gradzip_converge.cli").main
