"""No import cycle in the package, `TYPE_CHECKING` imports and imports inside functions
included: the folders are layers (pyproject.toml's import-linter contracts say which may import
which), and within a folder a module that needs another's type names a Protocol instead."""

from __future__ import annotations

import grimp


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (each sorted)."""
    groups = set()
    for module in graph.modules:
        around = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        if around:
            groups.add(tuple(sorted({module, *around})))
    return [list(group) for group in sorted(groups)]


def test_the_package_has_no_import_cycle() -> None:
    graph = grimp.build_graph("dedupworker", exclude_type_checking_imports=False)
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert cycles(graph) == [["p.a", "p.b"]]
