"""Which modules own the work running now, in forward, in backward and in recomputation.

`ModuleTracker(root)` puts a forward pre-hook and a forward hook on every submodule of `root`
for as long as it is entered (removed on exit, whatever happens), and answers `owners()`: the
names of the modules whose work the operator being run is.

- **forward**: a pre-hook pushes the module's name on a stack, a post-hook (`always_call`, so
  an exception still pops) pops it. A module called several times pushes once per call.
- **backward**: each autograd node is owned by the module stack that created it
  (Note [backward belongs to the node's creator]); autograd tells which node runs now
  (`torch._C._current_autograd_node()`).
- **recomputation**: activation checkpointing re-runs a forward during backward; its modules
  push on the forward stack then, under the modules that enclosed the checkpointed call.

Note [backward belongs to the node's creator]: the backward of a module is the backward of the
autograd nodes its forward created, nothing else. At every module boundary (pre-hook: from the
inputs, with the caller's stack; post-hook: from the outputs, with the module's own stack) the
tracker walks the graph back from those tensors and tags every node it has not tagged yet with
the stack of that moment, so each node is tagged with the stack that was running when it was
made. That makes the attribution exact where hook timing is not: siblings reading one input
(q, k, v) each own only their nodes; a module returning its input (`Identity`, `Dropout(p=0)`)
creates none and owns nothing; a block called three times made three sets of nodes. Two kinds
of work have no creating node:

- a parameter's (or leaf input's) `AccumulateGrad`, and the engine's adding up of the
  gradients of one tensor that several nodes read: both belong to the innermost module common
  to all the tensor's readers (the `q, k, v` projections' parent adds their three input
  gradients; a block called three times adds its weight's three gradients). The adds of the
  engine are recognized by their operand, the gradient the node just produced (a post-hook
  on each tagged node hands it over).
- nodes no boundary walk reached (work done outside every module, such as a loss computed by
  the caller; or a tensor a module keeps as an attribute instead of returning it): outside.

Every node hook also stamps the time, so each module gets a forward latency (summed over its
calls) and a backward latency (the run time of the nodes it owns, summed).

Cost: each autograd node is visited once by one walk and gets two hooks (one Python call each
when backward runs it); the tags live until the tracker is entered again or `clear()`ed.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleTracker", "in_backward"]

Stack = tuple[str, ...]
"""Module names, outermost first: the forward stack at some moment."""
OUTSIDE: Stack = ()


def tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of a module's inputs or outputs (tuples, lists, dicts, `ModelOutput`s)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from tensors_in(x)
    elif isinstance(tree, Mapping):
        for x in tree.values():
            yield from tensors_in(x)


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _common(a: Stack, b: Stack) -> Stack:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return a[:n]


def _is_ancestor(name: str, of: str) -> bool:
    return name == "" or of.startswith(name + ".")


class ModuleTracker:
    """Names of the modules owning the work running now (`owners()`), with latencies.

    `names[module]` is the module's qualified name under `root` (`""` for the root, shown as
    `model`); a module reachable under two names keeps the first; modules of the `ignore`
    types are not tracked. `sync` is called before each time stamp (the accelerator's
    synchronize, so GPU latencies are real; a no-op on CPU).
    """

    def __init__(
        self,
        root: nn.Module,
        sync: Callable[[], None] | None = None,
        ignore: tuple[type, ...] = (),
    ) -> None:
        self.names: dict[nn.Module, str] = {}
        for name, module in root.named_modules():
            if not isinstance(module, ignore):  # an ignored type's work is its caller's
                self.names.setdefault(module, name)
        self.sync = sync or (lambda: None)
        self.stack: list[str] = []  # forward (and recomputation) stack
        self.calls: dict[str, int] = defaultdict(int)
        self.forward_s: dict[str, float] = defaultdict(float)
        self.backward_s: dict[str, float] = defaultdict(float)
        self._fwd_start: dict[str, list[float]] = defaultdict(list)
        self._handles: list[Any] = []
        self._entered = False
        self._local = threading.local()  # per autograd thread: the node just run, its grads
        self.clear()

    def clear(self) -> None:
        """Forget the tags of every autograd node seen so far (and the references to them)."""
        self._creator: dict[Any, Stack] = {}  # autograd node -> the stack that created it
        self._readers: dict[Any, Stack] = {}  # node -> innermost stack common to its readers
        self._recompute_base: Stack = OUTSIDE
        self._hooked_leaves: set[Any] = set()

    # ---- queries -----------------------------------------------------------------------------
    def owners(self) -> Stack:
        """The stack owning the operator running now (`OUTSIDE`, empty, when none)."""
        if not in_backward():
            return tuple(self.stack)
        if self.stack:  # a forward re-run inside backward (Note [backward belongs to ...])
            return self._recompute_base + tuple(self.stack)
        node = torch._C._current_autograd_node()
        return self._owners_of(node) if node is not None else OUTSIDE

    def owners_of_op(self, args: tuple) -> Stack:
        """`owners()`, except for the engine's accumulation of a gradient the current node
        produced (an operand is that gradient): the innermost module reading the tensor."""
        if self.stack or not in_backward():
            return self.owners()
        node = torch._C._current_autograd_node()
        done = getattr(self._local, "done", None)
        if done is not None and done[0] is node:
            for grad, target in done[1]:
                if any(a is grad for a in args):
                    return self._readers.get(target, OUTSIDE)
        return self._owners_of(node) if node is not None else OUTSIDE

    @property
    def recomputing(self) -> bool:
        """True while a forward runs inside a backward (activation checkpointing)."""
        return bool(self.stack) and in_backward()

    def _owners_of(self, node: Any) -> Stack:
        stack = self._creator.get(node)
        return stack if stack is not None else self._readers.get(node, OUTSIDE)

    # ---- tagging the graph -------------------------------------------------------------------
    def _tag(self, tree: Any, stack: Stack) -> None:
        """Tag every untagged node behind the tensors of `tree` with `stack`."""
        todo = [t.grad_fn for t in tensors_in(tree) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in self._creator:
                continue
            self._creator[node] = stack
            node.register_prehook(self._node_start)
            node.register_hook(self._node_done(node, stack))
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                self._readers[nxt] = _common(self._readers.get(nxt, stack), stack)
                if type(nxt).__name__ == "AccumulateGrad":
                    if nxt not in self._hooked_leaves:
                        self._hook_leaf(nxt)
                elif nxt not in self._creator:
                    todo.append(nxt)

    def _hook_leaf(self, node: Any) -> None:
        # A parameter's AccumulateGrad outlives the graph: its hooks stay with it, so they
        # look the tracker up rather than capture one walk's state.
        node.register_prehook(self._node_start)
        node.register_hook(self._leaf_done(node))
        self._hooked_leaves.add(node)

    def _node_start(self, grad_outputs: Any) -> None:
        if self._entered:
            self._local.t0 = self._now()
            self._local.done = None

    def _node_done(self, node: Any, stack: Stack) -> Callable[..., None]:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if not self._entered:
                return
            self._account(stack)
            targets = [
                (g, nxt)
                for g, (nxt, _) in zip(grad_inputs, node.next_functions, strict=False)
                if isinstance(g, torch.Tensor) and nxt is not None
            ]
            self._local.done = (node, targets)

        return hook

    def _leaf_done(self, node: Any) -> Callable[..., None]:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if self._entered:
                self._account(self._readers.get(node, OUTSIDE))

        return hook

    def _account(self, stack: Stack) -> None:
        t0 = getattr(self._local, "t0", None)
        if t0 is None:
            return
        dt = self._now() - t0
        for name in set(stack):
            self.backward_s[name] += dt
        self._local.t0 = None

    # ---- module hooks ------------------------------------------------------------------------
    def _now(self) -> float:
        self.sync()
        return time.perf_counter()

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        name = self.names[module]
        if in_backward():
            if not self.stack:  # a recomputation starts: under the modules around the call
                node = torch._C._current_autograd_node()
                around = self._owners_of(node) if node is not None else OUTSIDE
                self._recompute_base = tuple(n for n in around if _is_ancestor(n, name))
        else:
            self.calls[name] += 1
        if torch.is_grad_enabled():  # what the caller made so far is the caller's
            self._tag((args, kwargs), self.owners())
        self.stack.append(name)
        self._fwd_start[name].append(self._now())

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        name = self.names[module]
        if name in self.stack:
            if torch.is_grad_enabled():  # what it made, up to its outputs, is the module's
                self._tag(output, self.owners())
            while self.stack.pop() != name:  # pop to it: a raising child may have left entries
                pass
        starts = self._fwd_start[name]
        if starts:
            start = starts.pop()
            if not in_backward():  # recomputation time belongs to the backward
                self.forward_s[name] += self._now() - start

    # ---- lifetime ----------------------------------------------------------------------------
    def __enter__(self) -> ModuleTracker:
        for module in self.names:
            self._handles.append(
                module.register_forward_pre_hook(self._pre, prepend=True, with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post, always_call=True, with_kwargs=True)
            )
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
