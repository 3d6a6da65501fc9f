"""`minispeed.core.import_graph`: the cycles it must find and the edges it must not invent, on
small packages written here; then core itself has no cycle."""

from __future__ import annotations

import sys
import textwrap

import pytest

from minispeed.core.import_graph import find_cycle, import_graph


@pytest.fixture
def make_package(tmp_path, monkeypatch):
    """Write `{relative path: source}` under a fresh folder on sys.path; returns the graph."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(files: dict[str, str], name: str = "pkg") -> dict[str, set[str]]:
        for rel, text in files.items():
            path = tmp_path / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        sys.modules.pop(name, None)
        return import_graph([name])

    return make


def test_a_module_using_its_own_face_is_a_cycle(make_package) -> None:
    graph = make_package(
        {
            "__init__.py": "from pkg.ops import add\n",
            "ops.py": "def add():\n    import pkg as p  # inside a function: still an edge\n",
        }
    )
    assert graph["pkg.ops"] == {"pkg"}
    assert find_cycle(graph) == ["pkg", "pkg.ops", "pkg"]


def test_a_submodule_imported_by_name_is_not_an_edge_to_the_face(make_package) -> None:
    graph = make_package(
        {
            "__init__.py": "from pkg.ops import add\nfrom pkg import costs\n",
            "costs.py": "X = 1\n",
            "ops.py": "from pkg import costs\nimport pkg.costs\n\ndef add():\n    return costs.X\n",
        }
    )
    assert graph["pkg.ops"] == {"pkg.costs"}
    assert find_cycle(graph) is None


def test_relative_and_nested_imports_resolve(make_package) -> None:
    graph = make_package(
        {
            "__init__.py": "",
            "sub/__init__.py": "from .leaf import f\n",
            "sub/leaf.py": "from ..top import g\n\ndef f():\n    pass\n",
            "top.py": "from pkg.sub import f\n\ndef g():\n    pass\n",
        }
    )
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}
    assert graph["pkg.sub.leaf"] == {"pkg.top"}
    assert graph["pkg.top"] == {"pkg.sub"}  # a name the face re-exports
    assert find_cycle(graph) == ["pkg.sub", "pkg.sub.leaf", "pkg.top", "pkg.sub"]


def test_core_imports_no_cycle() -> None:
    graph = import_graph(["minispeed.core"])
    assert "minispeed.core.op_builder.builder" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_not_a_package_is_refused() -> None:
    with pytest.raises(ValueError, match="not an importable package"):
        import_graph(["minispeed.core.import_graph"])
