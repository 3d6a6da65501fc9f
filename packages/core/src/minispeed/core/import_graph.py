"""The import graph of Python packages, read from their source, and its cycles.

```python
graph = import_graph(["minispeed.zero"])          # {module: {modules it imports}}
assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
```

Each package's cycle test and the engine's call this (docs/architecture.md: "No cycle", package
faces included). The source is parsed with `ast`, nothing is imported, and every import counts:
at the top, inside functions and under `TYPE_CHECKING`, since a cycle hidden in a function
still makes each module need the other to be read. The edges:

- `import a.b.c` (with or without `as`): an edge to `a.b.c`, or to its longest prefix that is a
  module of the graph;
- `from a.b import x`: an edge to `a.b.x` when that is a module (a submodule imported by name),
  else to `a.b` (a name the module or package face `a.b` defines or re-exports);
- relative imports resolve against the importing module's package.

Not an edge: the package faces (`__init__.py`) Python runs on the way to a submodule. Importing
`a.b.c` runs `a/__init__` and `a/b/__init__` first, so counting those would put every submodule
in a cycle with any face that imports it. A module that uses a name its own package's face
re-exports (`import minispeed.comm as comm` inside comm, while comm's face imports that module)
is counted, and is a cycle. Cost: one parse per file (the engine's whole graph, every package
included, reads in about a second).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable
from pathlib import Path

__all__ = ["find_cycle", "import_graph", "package_modules"]


def package_modules(package: str) -> dict[str, Path]:
    """`{module name: source file}` of every module in `package` and its subpackages, found
    without running the package (`importlib.util.find_spec` of its folder)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package!r} is not an importable package")
    modules: dict[str, Path] = {}
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imported(tree: ast.AST, module: str, is_face: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `module`'s source `tree` imports (the rules above)."""

    def longest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if is_face else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(longest(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..y import z`
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in known else longest(base))
    return {m for m in found if m is not None and m != module}


def import_graph(packages: Iterable[str]) -> dict[str, set[str]]:
    """Every module of `packages` and the modules of `packages` it imports (see the module
    docstring for what is an edge)."""
    files: dict[str, Path] = {}
    for package in packages:
        files.update(package_modules(package))
    known = set(files)
    return {
        module: _imported(ast.parse(path.read_text()), module, path.name == "__init__.py", known)
        for module, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that returns to its start (`[a, b, a]`), or None."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        colour[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if colour.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in colour and (found := visit(w)):
                return found
        path.pop()
        colour[v] = 2
        return None

    for v in sorted(graph):
        if v not in colour and (found := visit(v)):
            return found
    return None
