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
  gradients of one tensor that several nodes read: both belong to the innermost module *call*
  common to all the tensor's readers (Note [who adds up a gradient]). The adds of the engine
  are recognized by their operand, the gradient the node just produced (a post-hook on each
  tagged node hands it over).
- nodes no boundary walk reached (work done outside every module, such as a loss computed by
  the caller; or a tensor a module keeps as an attribute instead of returning it): outside.

Note [work in a gradient hook]: a hook on a parameter's gradient
(`register_post_accumulate_grad_hook`: ZeRO's copy of each gradient into its bucket, scaled by
1/N on the way; an optimizer stepping in backward) runs inside the parameter's `AccumulateGrad`
node, after the node's own accumulation, so the node says nothing of whose it is. Its operands
do: the accumulation reads the gradient the node received (`.grad += new`, the one operator
with FLOPs autograd runs there), a hook reads `param.grad`, another tensor (the received one
detached, or the sum). So the tracker's pre-hook on each `AccumulateGrad` notes the received
gradient, by `id` only (holding it would stop `AccumulateGrad` from stealing it into `.grad`: it
would copy it instead; it lives until the node ends, so the id is its own meanwhile), and
`in_gradient_hook(args)` answers True for an operator of that node reading none of it: no
module's work (`test_flops_module_attribution.py` checks ZeRO's kind of hook and an
accumulation side by side).

Note [who adds up a gradient]: a tensor read k times gets k gradients, which autograd's engine
sums with k - 1 adds of the tensor's size (elementwise, counted like any add); its
`AccumulateGrad` then adds the sum into `.grad` when one exists (gradient accumulation, another
add of its size). Those adds go to the innermost module *call* enclosing every read, each call
being its own (a stack holds one `_Call` per call, compared by identity). So a module's count
is the sum of its calls' counts: a `Linear` called three times is charged exactly three times
what one call costs, and the adds that combine its calls go to the caller that made them: its
weight's three gradients (2 × out·in: 2,048 FLOPs for a `Linear(32, 32)`), and the two
gradients of an input handed to it twice (`lin(lin(x)) + lin(x)`: one add of x's size). Reads
within one call stay that call's: a block's residual input read twice (`x + attn(ln(x))`), a
weight used twice in one forward; the `q, k, v` projections' input, read by three calls,
is summed by their parent. `test_flops_module_attribution.py` checks a module called 1, 2 and
3 times.

Every node hook also stamps the time, so each module gets a forward latency (summed over its
calls) and a backward latency (the run time of the nodes it owns, summed).

Cost: each autograd node is visited once by one walk and gets two hooks (one Python call each
when backward runs it) and a small tag in its own `metadata` dict, freed with the graph (the
tracker keeps no reference to any node, so a profiled forward without backward frees its
activations as usual).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleTracker", "in_backward"]

Stack = tuple[str, ...]
"""Module names, outermost first: the forward stack at some moment (each entry the `_Call` of
one module call: Note [who adds up a gradient])."""
OUTSIDE: Stack = ()
_KEY = "minispeed.profiler"
"""The key of our `_Tag` in an autograd node's `metadata` dict."""
_SESSIONS = itertools.count()


@dataclass(slots=True)
class _Tag:
    """What the tracker knows of one autograd node; kept in the node's own `metadata`, so it
    lives and dies with the graph (the tracker holds no node)."""

    session: int
    creator: Stack | None = None
    """The stack that created the node (None for a leaf's `AccumulateGrad`)."""
    readers: Stack | None = None
    """The innermost stack common to the nodes reading the node's output."""
    hooked: bool = False


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


class _Call(str):
    """One call of a module: its name (a `str`, equal to any other call's of that module) made
    once per call, so that stacks can be compared call by call (`_common`, by identity)."""

    __slots__ = ()


def _common(a: Stack, b: Stack) -> Stack:
    """The innermost module call enclosing both stacks (Note [who adds up a gradient])."""
    n = 0
    while n < len(a) and n < len(b) and a[n] is b[n]:
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
        self._session = next(_SESSIONS)  # tags of other trackers (or earlier steps') are stale
        self._recompute_base: Stack = OUTSIDE

    # ---- queries -----------------------------------------------------------------------------
    def owners(self) -> Stack:
        """The stack owning the operator running now (`OUTSIDE`, empty, when none)."""
        if not in_backward():
            return tuple(self.stack)
        if self.stack:  # a forward re-run inside backward (Note [backward belongs to ...])
            return self._recompute_base + tuple(self.stack)
        return self._owners(self._tag_of(torch._C._current_autograd_node()))

    def in_gradient_hook(self, args: tuple) -> bool:
        """True for an operator (called with `args`) run by a hook on a parameter's gradient
        inside its `AccumulateGrad` node, not by the accumulation (Note [work in a gradient
        hook])."""
        leaf = getattr(self._local, "leaf", None)
        if leaf is None or self.stack or not in_backward():
            return False
        if self._tag_of(torch._C._current_autograd_node()) is not leaf[0]:
            return False
        return not any(id(a) == leaf[1] for a in args if isinstance(a, torch.Tensor))

    def owners_of_op(self, args: tuple) -> Stack:
        """`owners()`, except for the engine's accumulation of a gradient the current node
        produced (an operand is that gradient): the innermost module reading the tensor."""
        if self.stack or not in_backward():
            return self.owners()
        tag = self._tag_of(torch._C._current_autograd_node())
        done = getattr(self._local, "done", None)
        if tag is not None and done is not None and done[0] is tag:
            for grad, target in done[1]:
                if any(a is grad for a in args):
                    return target.readers or OUTSIDE
        return self._owners(tag)

    @property
    def recomputing(self) -> bool:
        """True while a forward runs inside a backward (activation checkpointing)."""
        return bool(self.stack) and in_backward()

    @staticmethod
    def _owners(tag: _Tag | None) -> Stack:
        if tag is None:
            return OUTSIDE
        return tag.creator if tag.creator is not None else tag.readers or OUTSIDE

    # ---- tagging the graph -------------------------------------------------------------------
    def _tag_of(self, node: Any) -> _Tag | None:
        """This tracker's tag on autograd node `node` (None: untagged, or another's)."""
        if node is None:
            return None
        tag = node.metadata.get(_KEY)
        return tag if tag is not None and tag.session == self._session else None

    def _tag_or_new(self, node: Any) -> _Tag:
        tag = self._tag_of(node)
        if tag is None:
            tag = node.metadata[_KEY] = _Tag(self._session)
        return tag

    def _tag(self, tree: Any, stack: Stack) -> None:
        """Tag every untagged node behind the tensors of `tree` with `stack`."""
        todo = [t.grad_fn for t in tensors_in(tree) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            tag = self._tag_or_new(node)
            if tag.creator is not None:
                continue
            tag.creator = stack
            targets: list[tuple[int, _Tag]] = []  # (index of the edge, the tag of its node)
            for i, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                target = self._tag_or_new(nxt)
                target.readers = stack if target.readers is None else _common(target.readers, stack)
                targets.append((i, target))
                if type(nxt).__name__ == "AccumulateGrad":
                    if not target.hooked:  # outlives the graph; its readers decide its owner
                        nxt.register_prehook(self._leaf_start(target))
                        nxt.register_hook(self._leaf_done(target))
                        target.hooked = True
                elif target.creator is None:
                    todo.append(nxt)
            # The hooks hold tags, never nodes: a node holding a hook that holds the node
            # would be a cycle through C++ that Python's collector cannot free.
            node.register_prehook(self._node_start)
            node.register_hook(self._node_done(tag, targets))

    def _node_start(self, grad_outputs: Any) -> None:
        if self._entered:
            self._local.t0 = self._now()
            self._local.done = None
            self._local.leaf = None

    def _leaf_start(self, tag: _Tag) -> Callable[..., None]:
        def hook(grad_outputs: tuple) -> None:
            if self._entered:
                self._node_start(grad_outputs)
                received = grad_outputs[0] if grad_outputs else None
                # Its id, never the tensor: See Note [work in a gradient hook].
                self._local.leaf = (tag, id(received) if received is not None else None)

        return hook

    def _node_done(self, tag: _Tag, targets: list[tuple[int, _Tag]]) -> Callable[..., None]:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if not self._entered:
                return
            self._account(tag.creator or OUTSIDE)
            grads = [(grad_inputs[i], t) for i, t in targets if i < len(grad_inputs)]
            self._local.done = (tag, [(g, t) for g, t in grads if isinstance(g, torch.Tensor)])

        return hook

    def _leaf_done(self, tag: _Tag) -> Callable[..., None]:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if self._entered:
                self._account(tag.readers or OUTSIDE)

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
                around = self._owners(self._tag_of(node))
                self._recompute_base = tuple(n for n in around if _is_ancestor(n, name))
        else:
            self.calls[name] += 1
        if torch.is_grad_enabled():  # what the caller made so far is the caller's
            self._tag((args, kwargs), self.owners())
        self.stack.append(_Call(name))
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
        self._local.done = None  # the last node's gradients
        self._local.leaf = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
