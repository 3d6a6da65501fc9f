"""No import cycle among minispeed.engine's modules, counting imports inside functions and under
`TYPE_CHECKING` too.

ARCHITECTURE.md: "Cycles are bugs." A cycle hidden by an import inside a function still makes
each module need the other to be read (`tune` -> `tune_memory` -> `tune` was the engine's). The
graph is read from the source with `ast`: an edge for every `import minispeed.engine.x` /
`from minispeed.engine.x import y` anywhere in a module, to the longest module name it names
(an import of an enclosing package's ``__init__`` is not counted: that is how a package
re-exports its parts). `graphlib` finds a cycle and names it.
"""

from __future__ import annotations

import ast
import graphlib
import importlib.util
from pathlib import Path

# The package's folder, found without running its __init__ (which imports torch and more).
ROOT = Path(importlib.util.find_spec("minispeed.engine").submodule_search_locations[0])


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("minispeed", "engine", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n == "minispeed.engine" or n.startswith("minispeed.engine.")}


def import_graph() -> dict[str, set[str]]:
    """Each engine module and the engine modules it imports."""
    files = {_module_name(f): f for f in ROOT.rglob("*.py")}

    def owner(name: str) -> str:  # `from minispeed.engine.x import y`: y may be a name in x
        while name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in files.items():
        targets = {owner(n) for n in _imported(ast.parse(path.read_text()))}
        graph[module] = {t for t in targets if t != module and not module.startswith(t + ".")}
    return graph


def test_engine_modules_import_no_cycle() -> None:
    graph = import_graph()
    assert "minispeed.engine.tune" in graph and "minispeed.engine.moe.engine" in graph
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError("import cycle: " + " -> ".join(reversed(e.args[1]))) from None


def test_a_cycle_is_found() -> None:
    """The check itself: a cycle through a function-level import is reported."""
    graph = import_graph()
    graph["minispeed.engine.sizing"].add("minispeed.engine.cli")  # cli imports sizing
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError:
        return
    raise AssertionError("the cycle cli -> sizing -> cli was not found")
