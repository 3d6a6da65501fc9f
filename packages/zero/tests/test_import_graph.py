"""No import cycle among minispeed.zero's modules, counting imports inside functions too.

ARCHITECTURE.md: "Cycles are bugs." A cycle hidden by an import inside a function still makes
each module need the other to be read (issue 21 §1: offload_bridge -> stage3.offloaded /
stage3.infinity -> offload_bridge was one). The graph is read from the source with `ast`: an
edge for every `import minispeed.zero.x` / `from minispeed.zero.x import y` anywhere in a
module (a module importing its own package's ``__init__`` is not counted: that is how a
package re-exports its parts).
"""

from __future__ import annotations

import ast
import pathlib

import minispeed.zero as zero

ROOT = pathlib.Path(zero.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = ("minispeed", "zero", *f.relative_to(ROOT).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("minispeed.zero") else None
                if target and target != m and not m.startswith(target + "."):
                    edges[m].add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path that returns to its start, or None."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        colour[v] = 1
        stack.append(v)
        for w in sorted(edges[v]):
            if colour.get(w) == 1:
                return [*stack[stack.index(w) :], w]
            if w not in colour and (found := visit(w)):
                return found
        stack.pop()
        colour[v] = 2
        return None

    for v in sorted(edges):
        if v not in colour and (found := visit(v)):
            return found
    return None


def test_zero_modules_import_no_cycle() -> None:
    mods = _modules()
    assert "minispeed.zero.stage3.params" in mods  # the walk found the package
    cycle = _cycle(_edges(mods))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
