"""Which modules are running now, in forward and in backward: the profiler's attribution.

`ModuleTracker(root)` puts four hooks on every submodule of `root` for as long as it is entered
(removed on exit, whatever happens), and keeps `active`, the names of the modules whose forward
or backward is running:

- **forward**: a pre-hook pushes the module's name on a stack, a post-hook (`always_call`, so
  an exception still pops) pops it. Modules called several times push once per call.
- **backward**: autograd runs a module's backward between the moment the gradients of its
  outputs are ready and the moment those of its inputs are. The forward post-hook registers a
  multi-gradient hook on the outputs that *enters* the module, the pre-hook one on the inputs
  that *leaves* it (Note [backward without input gradients]).
- **recomputation**: activation checkpointing re-runs a forward during backward; its modules
  push on the forward stack then, so `recomputing` is true while the stack is non-empty inside
  a backward.

Note [backward without input gradients]: a module whose inputs need no gradient (the first
embedding: its input is token ids) leaves when its parameters' gradients are ready instead; a
module with neither never gets the "leave" hook and stays active until the backward ends (an
autograd engine callback clears the backward set).

Every hook also stamps the time, so each module gets a forward latency (summed over its calls)
and a backward latency (enter to leave, or to the end of backward).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

__all__ = ["ModuleTracker"]


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class ModuleTracker:
    """Names of the modules running now (`active`), with forward/backward latencies.

    `names[module]` is the module's qualified name under `root` (`""` for the root, shown as
    `model`); a module reachable under two names keeps the first. `sync` is called before each
    time stamp (the accelerator's synchronize, so GPU latencies are real; a no-op on CPU).
    """

    def __init__(self, root: nn.Module, sync: Callable[[], None] | None = None) -> None:
        self.names: dict[nn.Module, str] = {}
        for name, module in root.named_modules():
            self.names.setdefault(module, name)
        self.sync = sync or (lambda: None)
        self.stack: list[str] = []  # forward (and recomputation) stack
        self.backward_set: set[str] = set()
        self.calls: dict[str, int] = defaultdict(int)
        self.forward_s: dict[str, float] = defaultdict(float)
        self.backward_s: dict[str, float] = defaultdict(float)
        self._fwd_start: dict[str, list[float]] = defaultdict(list)
        self._bwd_start: dict[str, float] = {}
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._callback_queued = False

    # ---- queries -----------------------------------------------------------------------------
    @property
    def active(self) -> set[str]:
        """Names of every module whose forward or backward is running now."""
        if self.backward_set:
            return self.backward_set | set(self.stack)
        return set(self.stack)

    @property
    def recomputing(self) -> bool:
        """True while a forward runs inside a backward (activation checkpointing)."""
        return bool(self.stack) and in_backward()

    # ---- hooks -------------------------------------------------------------------------------
    def _now(self) -> float:
        self.sync()
        return time.perf_counter()

    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names[module]
        self.stack.append(name)
        if not in_backward():
            self.calls[name] += 1
        self._fwd_start[name].append(self._now())
        # Leave when the inputs' gradients are ready; with none (token ids), when the module's
        # own parameters' are (Note [backward without input gradients]).
        grads = _grad_tensors(args) or [p for p in module.parameters() if p.requires_grad]
        if grads and torch.is_grad_enabled() and not in_backward():
            self._grad_handles.append(register_multi_grad_hook(grads, self._leave_backward(name)))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names[module]
        if name in self.stack:  # pop to it: a raising child may have left entries above
            while self.stack.pop() != name:
                pass
        starts = self._fwd_start[name]
        if starts:
            start = starts.pop()
            if not in_backward():  # recomputation time belongs to the backward
                self.forward_s[name] += self._now() - start
        grads = _grad_tensors(output)
        if grads and torch.is_grad_enabled() and not in_backward():
            # mode "any": the module's backward starts with the first output gradient (and an
            # "all" hook never fires on the tensor `.backward()` is called on).
            enter = self._enter_backward(name)
            self._grad_handles.append(register_multi_grad_hook(grads, enter, mode="any"))

    def _enter_backward(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._queue_end_of_backward()
            self.backward_set.add(name)
            self._bwd_start.setdefault(name, self._now())

        return hook

    def _leave_backward(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.backward_set.discard(name)
            start = self._bwd_start.pop(name, None)
            if start is not None:
                self.backward_s[name] += self._now() - start

        return hook

    def _queue_end_of_backward(self) -> None:
        if self._callback_queued:
            return

        def end() -> None:  # Note [backward without input gradients]
            now = self._now()
            for name, start in self._bwd_start.items():
                self.backward_s[name] += now - start
            self._bwd_start.clear()
            self.backward_set.clear()
            self._callback_queued = False

        torch.autograd.Variable._execution_engine.queue_callback(end)
        self._callback_queued = True

    # ---- lifetime ----------------------------------------------------------------------------
    def __enter__(self) -> ModuleTracker:
        for module in self.names:
            self._handles.append(module.register_forward_pre_hook(self._pre, prepend=True))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles + self._grad_handles:
            handle.remove()
        self._handles.clear()
        self._grad_handles.clear()
