"""The contract between the ZeRO optimizer and the stages, and what every stage uses alike.

- `ShardStrategy`: what a ZeRO stage does with parameters and gradients (stage 0: `stage0.py`,
  stages 1-2: `stage12.py`, stage 3: `stage3/`); the optimizer (`optimizer.py`) is the same for
  all of them.
- `ParamFragment`: which piece of which parameter a rank's master tensors hold; checkpoints are
  written and read through fragments, so they do not depend on the stage.
- `param_names`: one name per parameter (the first of a tied one), the name every message and
  checkpoint uses.
- `weak_hook`: how a stage registers a parameter hook without keeping itself alive forever.
- `StrategyWrapper`: a strategy that changes part of a stage's (where masters, gradients or
  shards live: offload) and delegates the rest to it.

Note [hooks hold their owner weakly]
A hook registered on a parameter (``register_post_accumulate_grad_hook``) is stored by autograd
in C++, where Python's garbage collector cannot follow references. A hook that is a bound method
of its owner would close the cycle parameter -> hook -> owner -> parameter invisibly, and the
owner (a ZeroOptimizer with its masters, optimizer state and gradient buffers) would never be
freed after the user drops the model and the optimizer. So every such hook is built by
`weak_hook`: it holds its owner through a weak reference and does nothing once the owner
is gone. ``close()`` (``ZeroOptimizer.close``) removes the hooks outright.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ParamFragment", "ShardStrategy", "StrategyWrapper", "param_names", "weak_hook"]


@dataclass(frozen=True)
class ParamFragment:
    """The piece of one model parameter whose fp32 master this rank holds.

    Checkpoints (`checkpoints/`) use fragments to write and read optimizer state without knowing
    which stage produced it: the master values of parameter `name` for flattened elements
    `[start, start + numel)` live in `optimizer.param_groups[group]["params"][master_index]`,
    flattened, at `[master_offset, master_offset + numel)`; every per-element optimizer state
    tensor (`exp_avg`, `momentum_buffer`...) of that master uses the same offsets, and its
    scalar state (Adam's `step`) is this fragment's alone. Every stage gives each fragment a
    master of its own, so `master_offset` is 0 (Note [one master per fragment] in stage12.py).
    """

    name: str  # model.named_parameters() name (the first name of a tied parameter)
    shape: torch.Size  # the full parameter's shape
    start: int  # offset of this fragment in the flattened full parameter
    numel: int  # elements this rank holds (may be 0)
    group: int  # optimizer param-group index
    master_index: int  # index into optimizer.param_groups[group]["params"]
    master_offset: int  # offset of the fragment inside that master tensor (flattened)


@runtime_checkable
class ShardStrategy(Protocol):
    """What a ZeRO stage does to parameters and gradients; the optimizer logic is shared.

    Construction convention (how `zero.shard` builds a strategy):

    ```python
    Strategy(model, config, precision, group, param_groups=param_groups)
    ```

    ``param_groups`` is ``list[list[nn.Parameter]]``: the model parameters of each of the user's
    optimizer param groups, in the user's order (validated: every one belongs to ``model``, none
    twice). ``master_params()`` and ``master_grads()`` are indexed the same way.
    """

    partitions_grads: bool  # master_grads() are disjoint shards (stages 1-3): the norm needs a sum

    def master_params(self) -> list[list[torch.Tensor]]:
        """Per optimizer param group: the fp32 tensors this rank updates."""
        ...

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Same shapes as ``master_params``, fp32, averaged over ranks at the boundary."""
        ...

    def backward_done(self, is_boundary: bool) -> None:
        """After each micro-step's backward: finish in-flight reductions."""
        ...

    def publish_params(self) -> None:
        """After the inner step: master -> model params."""
        ...

    def zero_grad(self) -> None:
        """Clear every gradient buffer this strategy keeps."""
        ...

    def fragments(self) -> list[ParamFragment]:
        """One entry per (parameter, piece held here), for checkpoints. Each master tensor holds
        one fragment, at `master_offset == 0` (padding may follow it), so that the inner
        optimizer keeps its per-tensor state (Adam's `step`) per parameter."""
        ...

    def close(self) -> None:
        """Finish in-flight communication and remove every hook this strategy put on the model."""
        ...


class StrategyWrapper:
    """A `ShardStrategy` that wraps a stage's strategy: what it does not define is the wrapped
    one's (`offload_bridge.HostMasters`, `stage3.offloaded.ParamOffloadStrategy`,
    `stage3.infinity.InfinityStrategy`)."""

    def __init__(self, strategy: Any) -> None:
        self._inner = strategy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def strategy(self) -> Any:
        """The wrapped stage strategy."""
        return self._inner


def param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Parameter -> its first ``model.named_parameters()`` name (a tied parameter appears once)."""
    return {p: name for name, p in model.named_parameters()}


def weak_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """A parameter hook calling the bound ``method`` while its object is alive, a no-op after.

    See Note [hooks hold their owner weakly]. Costs one weak-reference lookup per call.
    """
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook
