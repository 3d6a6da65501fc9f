"""The zero-bubble backward in two passes: `b` (input gradients) now, `W` (weight gradients) later.

ZB-H1 (`schedules.ZeroBubbleH1`) sends the gradient of a chunk's input as soon as it has it and
computes the weight gradients later, in a bubble. Autograd has no "weights only" switch, so the
chunk's graph is cut into segments while the forward runs:

```
input ─cut─ layer 0 ─ fn ─cut─ layer 2 ─cut─ ... ─ layer n ─cut─ loss_fn (last stage)
      leaves₀  segment 0      leaves₁  segment 1         leaves_T  tail
```

A cut replaces the tensors that require grad by leaves (`detach().requires_grad_()`), before
every layer that has parameters (a parameter-free layer joins the segment before it) and after
the last layer. Then:

- `b` walks the segments from the tail to the front: `autograd.grad` of each segment's outputs
  with respect to its leaves, given the gradient of its outputs (the next segment's leaves'
  gradient). It keeps each segment's output gradient; the first segment's leaves' gradient is
  what the previous stage waits for.
- `W` runs one `autograd.backward` per segment from its outputs and kept gradients, with
  `inputs=` every parameter of the stage. The cut stops each call at its segment's leaves, so each
  use of each parameter is counted exactly once, whichever layer owns it.

Note [a weight pass counts each use once]
    The first version ran W per layer from that layer's output with `inputs=` its own parameters
    and no cut: autograd then followed the graph back into every earlier layer that used the
    same parameter (an ALBERT-style block repeated, a tied embedding and head on one stage) and
    counted those uses again, 0.3–0.8 relative error. With the cut, a segment's graph ends at
    its leaves, and asking every segment for every parameter also counts a parameter a layer
    reaches without owning it (a closure, a tied module's `forward_fn`).

Cost: the same FLOPs as one full backward, split; `b` computes activation gradients only, `W`
each segment's weight gradients plus the activation gradients inside the segment that lead to
them. Memory kept from `b` to `W`: one output gradient per segment (the size of its activations).
A layer that writes into its input in place cannot be cut (autograd refuses in-place writes into
a leaf); it raises, naming the layer, and runs under 1F1B as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Segment", "backward_input", "backward_weight", "forward_segmented"]


@dataclass
class Segment:
    """One piece of a chunk's graph: `leaves` (its inputs that require grad, cut from the graph
    before it) and `outputs` (its outputs that require grad, filled when the next cut is made)."""

    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]


def _cut(x: Any) -> tuple[Any, list[torch.Tensor]]:
    """`x` with every tensor that requires grad replaced by a fresh leaf; the leaves, in order."""
    if isinstance(x, torch.Tensor):
        if not x.requires_grad:
            return x, []
        leaf = x.detach().requires_grad_()
        return leaf, [leaf]
    if isinstance(x, tuple):
        parts = [_cut(t) for t in x]
        return tuple(p for p, _ in parts), [leaf for _, ls in parts for leaf in ls]
    return x, []


def _needs_grad(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.requires_grad else []
    if isinstance(x, tuple):
        return [t for part in x for t in _needs_grad(part)]
    return []


def forward_segmented(
    layers: Iterable[tuple[Any, list[torch.nn.Parameter], str]], x: Any, segments: list[Segment]
) -> Any:
    """Run `layers` (callable, its parameters, a name for errors) on `x`, cutting the graph as
    the module docstring draws; append the segments (the tail last) and return the cut output."""
    first = True
    for layer, params, name in layers:
        if first or params:
            if segments:
                segments[-1].outputs = _needs_grad(x)
            x, leaves = _cut(x)
            segments.append(Segment(leaves, []))
            first = False
        try:
            x = layer(x)
        except RuntimeError as exc:
            if "leaf Variable" not in str(exc):
                raise
            raise RuntimeError(
                f"layer {name} writes into its input in place; ZB-H1 cuts the graph at each "
                "layer's input to compute its weight gradient alone (see split_backward.py), and "
                "autograd refuses in-place writes into a cut: make the operation out-of-place or "
                "use schedule='1f1b'"
            ) from exc
    segments[-1].outputs = _needs_grad(x)
    x, leaves = _cut(x)
    segments.append(Segment(leaves, []))  # the tail: filled by the executor (loss or identity)
    return x


def _grads(
    outputs: list[torch.Tensor], grads: list[torch.Tensor | None], wrt: list[torch.Tensor]
) -> list[torch.Tensor]:
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None or o.dim() == 0]
    if not wrt:
        return []
    got = (
        torch.autograd.grad(
            [o for o, _ in pairs],
            wrt,
            [g for _, g in pairs],
            retain_graph=True,
            allow_unused=True,
        )
        if pairs
        else (None,) * len(wrt)
    )
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(got, wrt)]


def backward_input(
    outs: list[torch.Tensor], grads: list[torch.Tensor | None], segments: list[Segment]
) -> tuple[list[torch.Tensor], list[tuple[list[torch.Tensor], list[torch.Tensor | None]]]]:
    """The `b` pass: gradients of the first segment's leaves (the chunk's inputs that require
    grad), and the work `W` needs: each segment's (outputs, output gradients).

    `outs` / `grads`: the chunk's outputs and their gradients (the loss and `None` on the last
    stage, else the tail's leaves and the gradients received for them)."""
    segments[-1].outputs = outs
    work: list[tuple[list[torch.Tensor], list[torch.Tensor | None]]] = []
    out_grads: list[torch.Tensor | None] = list(grads)
    for k, seg in enumerate(reversed(segments)):
        leaf_grads = _grads(seg.outputs, out_grads, seg.leaves)
        # the tail (the loss, or the outputs themselves) rarely holds a parameter: keeping its
        # graph for W would keep the loss's saved tensors (the log-softmax of the logits) alive
        if k > 0 or _reaches_a_parameter(seg.outputs, seg.leaves):
            work.append((seg.outputs, out_grads))
        out_grads = list(leaf_grads)
    return out_grads, work


def _reaches_a_parameter(outputs: list[torch.Tensor], leaves: list[torch.Tensor]) -> bool:
    """Whether the graph from `outputs` back to `leaves` uses another leaf that requires grad
    (a parameter). Walks the tail's few autograd nodes once per micro-batch."""
    stop = {id(t) for t in leaves}
    seen: set[int] = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's gradient sink
        if variable is not None and id(variable) not in stop:
            return True
        todo.extend(fn for fn, _ in node.next_functions)
    return False


def backward_weight(
    work: list[tuple[list[torch.Tensor], list[torch.Tensor | None]]],
    params: list[torch.nn.Parameter],
) -> None:
    """The `W` pass: accumulate into `.grad` of `params` every use inside each segment of `work`
    (see Note [a weight pass counts each use once]); frees each segment's graph."""
    if not params:
        return
    for outputs, grads in work:
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn is not None]
        pairs = [(o, g) for o, g in pairs if g is not None or o.dim() == 0]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=params)
