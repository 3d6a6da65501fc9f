"""No import cycle among minispeed.zero's modules, package faces included, counting imports
inside functions too.

docs/architecture.md: "No cycle". A cycle hidden by an import inside a function still makes
each module need the other to be read (issue 21 §1: offload_bridge -> stage3.offloaded /
stage3.infinity -> offload_bridge was one), and so does a module that uses a name its own
package's face re-exports while the face imports it. What counts as an edge:
`minispeed.core.import_graph`.
"""

from __future__ import annotations

from minispeed.core.import_graph import find_cycle, import_graph


def test_zero_modules_import_no_cycle() -> None:
    graph = import_graph(["minispeed.zero"])
    assert "minispeed.zero.stage3.params" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_face_cycle_is_found() -> None:
    """The check itself: a module that imports zero's face, which imports it, is reported."""
    graph = import_graph(["minispeed.zero"])
    graph["minispeed.zero.stage3.params"].add("minispeed.zero")
    assert find_cycle(graph) is not None
