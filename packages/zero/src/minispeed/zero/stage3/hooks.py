"""Module hooks: the four moments stage 3 acts on, and what it does at each.

For every module that owns parameters (and for the root), four hooks, in the order they fire:

| hook | calls | what happens |
|---|---|---|
| forward pre-hook | ``coordinator.pre_forward(unit)`` | all-gather (or wait for the prefetch) |
| forward post-hook | ``coordinator.post_forward(unit)`` | release; a gradient hook on the outputs (-> pre-backward) |
| pre-backward | ``coordinator.pre_backward(unit)`` | all-gather again: backward reads the parameters forward released |
| post-backward | ``coordinator.post_backward(unit)`` | release once input gradients exist |

**Pre-backward** is ``torch.autograd.graph.register_multi_grad_hook(outputs, mode="any")``: it
fires once, when the first gradient for any output of the module is computed, i.e. before any of
the module's own backward nodes run.

**Post-backward** is an autograd function (`_PostBackward`) wrapped around the module's
tensor *inputs* in the pre-hook: its backward runs after every gradient w.r.t. those inputs has
been produced, i.e. after the module's backward. A module whose inputs need no gradient (the
embedding reading token ids, the root) has no such point; its parameters are released by the
coordinator's end-of-backward callback instead. (``register_full_backward_hook`` is no
substitute: for such modules it fires *before* their backward, not after.)

The root's pre/post hooks also open and close the forward pass (``begin_forward`` /
``end_forward``), where the trace is recorded or followed.

Limit: the inputs a parameter-owning module receives are views made by ``_PostBackward``, and
autograd forbids modifying such views in place; a module that writes into its own input
(``x.mul_(...)`` on an argument) must clone it first. Modules without parameters get no hooks.

Costs: a few Python calls per module per pass; no tensors are copied (``_PostBackward`` returns
views of its inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from minispeed.zero.stage3.coordinator import FetchCoordinator
from minispeed.zero.stage3.params import FetchUnit

__all__ = ["install_module_hooks"]


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward reports "this module's backward is done"."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple:
        ctx.callback = callback
        return tensors  # autograd returns them as views; see the module docstring (in-place)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.callback()
        return (None, *grads)


def _wrap_inputs(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict]:
    """Route the inputs that require grad through one ``_PostBackward`` (identity kept: x, x -> y, y)."""
    flat, spec = tree_flatten((args, kwargs))
    unique: dict[int, int] = {}  # id(tensor) -> position among the wrapped tensors
    tensors: list[torch.Tensor] = []
    for x in flat:
        if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in unique:
            unique[id(x)] = len(tensors)
            tensors.append(x)
    if not tensors:
        return args, kwargs
    wrapped = _PostBackward.apply(callback, *tensors)
    flat = [
        wrapped[unique[id(x)]] if isinstance(x, torch.Tensor) and id(x) in unique else x
        for x in flat
    ]
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs


def install_module_hooks(
    root: nn.Module, units: dict[nn.Module, FetchUnit], coordinator: FetchCoordinator
) -> list[RemovableHandle]:
    """Register the forward pre/post hooks on ``root`` and every module in ``units``."""
    handles: list[RemovableHandle] = []
    for module, unit in units.items():
        is_root = module is root
        handles.append(
            module.register_forward_pre_hook(
                _make_pre(unit, coordinator, is_root), with_kwargs=True
            )
        )
        handles.append(
            module.register_forward_hook(_make_post(unit, coordinator, is_root), with_kwargs=True)
        )
    return handles


def _make_pre(unit: FetchUnit, coordinator: FetchCoordinator, is_root: bool) -> Callable:
    def post_backward() -> None:
        coordinator.post_backward(unit)

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if is_root:
            coordinator.begin_forward()
        coordinator.pre_forward(unit)
        if torch.is_grad_enabled():
            return _wrap_inputs(args, kwargs, post_backward)
        return args, kwargs

    return pre_hook


def _make_post(unit: FetchUnit, coordinator: FetchCoordinator, is_root: bool) -> Callable:
    def pre_backward(_grad: torch.Tensor) -> None:
        coordinator.pre_backward(unit)

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        coordinator.post_forward(unit)
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            needs_grad = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            if needs_grad:
                register_multi_grad_hook(needs_grad, pre_backward, mode="any")
        if is_root:
            coordinator.end_forward()

    return post_hook
