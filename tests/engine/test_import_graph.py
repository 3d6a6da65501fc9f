"""No import cycle anywhere in minispeed (every package and the engine, package faces included),
and the engine's core never imports a DeepSpeed adapter.

docs/architecture.md: "No cycle" and "the core never imports them". A cycle hidden by an import
inside a function still makes each module need the other to be read (`tune` -> `tune_memory`
-> `tune` was the engine's), and so does a module that uses its own package's face while the
face imports it (`engine/comm.py` -> `minispeed.engine` -> `engine/comm.py` was). What counts as
an edge: `minispeed.core.import_graph`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from minispeed.core.import_graph import find_cycle, import_graph
from minispeed.engine import deepspeed_paths

ENGINE = "minispeed.engine"
# DeepSpeed's import paths: the engine modules of the one table of them (every module under
# each, for the packages `pipe/`, `moe/`, `runtime/`, `utils/`, `ops/`, ...), the face aside.
ADAPTERS = tuple(sorted(set(deepspeed_paths.ADAPTERS.values()) - {ENGINE}))


def _packages() -> list[str]:
    """Every distribution's package in the minispeed namespace, the engine's included."""
    spec = importlib.util.find_spec("minispeed")
    assert spec is not None and spec.submodule_search_locations
    names = {
        f"minispeed.{p.name}"
        for root in spec.submodule_search_locations
        for p in Path(root).iterdir()
        if (p / "__init__.py").is_file()
    }
    return sorted(names)


def _is_adapter(module: str) -> bool:
    return any(module == a or module.startswith(f"{a}.") for a in ADAPTERS)


def test_no_import_cycle_in_any_package_or_the_engine() -> None:
    packages = _packages()
    assert {"minispeed.core", "minispeed.zero", ENGINE} <= set(packages)
    graph = import_graph(packages)
    assert "minispeed.engine.tune.search" in graph and "minispeed.comm.call" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_engine_core_imports_no_adapter() -> None:
    graph = import_graph([ENGINE])
    wrong = {
        module: sorted(t for t in targets if _is_adapter(t))
        for module, targets in graph.items()
        if not _is_adapter(module) and module != ENGINE
    }
    wrong = {m: t for m, t in wrong.items() if t}
    assert not wrong, f"core modules importing DeepSpeed adapters: {wrong}"
    # The face re-exports DeepSpeed's module attributes (`deepspeed.comm`, `deepspeed.zero`):
    # it may import adapters, and no adapter may import it back.
    assert {f"{ENGINE}.comm", f"{ENGINE}.zero"} <= graph[ENGINE]
    back = sorted(m for m, targets in graph.items() if _is_adapter(m) and ENGINE in targets)
    assert not back, f"adapters importing the engine's face: {back}"


def test_a_cycle_through_a_face_is_found() -> None:
    """The check itself: an adapter importing the engine's face closes a cycle."""
    graph = import_graph([ENGINE])
    graph[ADAPTERS[0]].add(ENGINE)
    assert find_cycle(graph) is not None
