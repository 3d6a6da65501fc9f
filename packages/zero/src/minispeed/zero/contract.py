"""The contract between the ZeRO optimizer and the stages, and what every stage uses alike.

- `ShardStrategy`: what a ZeRO stage does with parameters and gradients (stage 0: `stage0.py`,
  stages 1-2: `stage12.py`, stage 3: `stage3/`); the optimizer (`optimizer.py`) is the same for
  all of them.
- `ParamFragment`: which piece of which parameter a rank's master tensors hold; checkpoints are
  written and read through fragments, so they do not depend on the stage.
- `param_names`: one name per parameter (the first of a tied one), the name every message and
  checkpoint uses.
- `weak_hook`: how a stage registers a parameter hook without keeping itself alive forever.
- `StrategyWrapper`: a strategy that changes part of a stage's (where masters and gradients
  live: offload) and hands the rest of the `ShardStrategy` methods to it, by name.

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
from collections.abc import Callable, Sequence
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

    The stages subclass it to inherit the defaults of `io_failures`, `grad_square_sum` and
    `scale_grads` (no file I/O; the optimizer computes and applies the clipping norm itself).
    """

    partitions_grads: bool  # master_grads() are disjoint shards (stages 1-3): the norm needs a sum
    #: File I/O whose failures the step agrees on (`stage3.io_failures.IOFailures`: ZeRO-Infinity,
    #: offload_param nvme), or None.
    io_failures: Any = None
    #: ``master_grads()`` are markers; the values are in swap files (ZeRO-Infinity).
    grads_in_files: bool = False

    def master_params(self) -> list[list[torch.Tensor]]:
        """Per optimizer param group: the fp32 tensors this rank updates."""
        ...

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Same shapes as ``master_params``, fp32, averaged over ranks at the boundary."""
        ...

    def backward_begins(self, is_boundary: bool) -> None:
        """Before each micro-step's backward: whether it ends the accumulation window (a
        schedule that reduces only at the window's end decides it here, in the hooks)."""
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

    def grad_square_sum(self) -> torch.Tensor | None:
        """This rank's Σ g² for the clipping norm when the strategy computes it itself (weighted
        replica groups, gradients in swap files), else None: the optimizer sums `master_grads`."""
        return None

    def marks_used(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether `used_marks` says which of `params` got a gradient, so the optimizer needs
        no hook of its own (Note [the reducer marks the used parameters] in reducer.py); False:
        the optimizer hooks them."""
        return False

    def used_marks(self) -> bytearray:
        """1 per parameter of `marks_used`'s `params` that got a gradient on this rank since the
        last call (the optimizer's step), and start over."""
        raise NotImplementedError(f"{type(self).__name__} keeps no used marks (marks_used)")

    def scale_grads(self, coef: float) -> bool:
        """Clip: scale the gradients by ``coef`` where the strategy keeps them itself (in swap
        files, applied as they are read back) and return True; False: the optimizer scales
        `master_grads` in place."""
        return False


class StrategyWrapper(ShardStrategy):
    """A `ShardStrategy` over a stage's strategy (`offload_bridge.HostMasters`,
    `stage3.infinity.InfinityStrategy`): every `ShardStrategy` member not overridden is the
    wrapped one's, named here one by one (nothing else is delegated, so a misspelled attribute
    is an AttributeError). `stage` is the innermost stage strategy, for what only it has."""

    def __init__(self, strategy: Any) -> None:
        self._inner = strategy
        self.io_failures = strategy.io_failures
        self.grads_in_files = strategy.grads_in_files

    @property
    def strategy(self) -> Any:
        """The wrapped strategy."""
        return self._inner

    @property
    def partitions_grads(self) -> bool:  # type: ignore[override]
        """The wrapped strategy's (a subclass may change it while training: 1-bit Adam's local
        phase)."""
        return self._inner.partitions_grads

    @property
    def stage(self) -> Any:
        """The stage strategy at the bottom of the wrappers (`Stage3Strategy`...)."""
        inner = self._inner
        return inner.stage if isinstance(inner, StrategyWrapper) else inner

    def master_params(self) -> list[list[torch.Tensor]]:
        return self._inner.master_params()

    def master_grads(self) -> list[list[torch.Tensor]]:
        return self._inner.master_grads()

    def backward_begins(self, is_boundary: bool) -> None:
        self._inner.backward_begins(is_boundary)

    def backward_done(self, is_boundary: bool) -> None:
        self._inner.backward_done(is_boundary)

    def publish_params(self) -> None:
        self._inner.publish_params()

    def zero_grad(self) -> None:
        self._inner.zero_grad()

    def fragments(self) -> list[ParamFragment]:
        return self._inner.fragments()

    def close(self) -> None:
        self._inner.close()

    def grad_square_sum(self) -> torch.Tensor | None:
        return self._inner.grad_square_sum()

    def scale_grads(self, coef: float) -> bool:
        return self._inner.scale_grads(coef)

    # The stage's own, read by tests, the ledgers and the memory report through the wrappers.
    def bucket_numels(self) -> list[int]:
        """Stages 0-2: elements of each gradient reduce call (`BucketedStrategy`)."""
        return self.stage.bucket_numels()

    def gather_numels(self) -> list[int]:
        """Stages 1-2: output elements of each parameter all-gather call."""
        return self.stage.gather_numels()

    def sharded_params(self) -> list[Any]:
        """Stage 3: every ShardedParam of the model (`Stage3Strategy.sharded_params`)."""
        return self.stage.sharded_params()

    @property
    def param_home(self) -> Any:
        """Stage 3 with offload_param: where released shards live (`Stage3Strategy`)."""
        return self.stage.param_home

    @property
    def offloaded(self) -> list[Any]:
        """Stage 3 with offload_param: the parameters whose shards live there."""
        return self.stage.offloaded


def param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    """Parameter -> its first ``model.named_parameters()`` name (a tied parameter appears once)."""
    return {p: name for name, p in model.named_parameters()}


def weak_hook(method: Callable[..., None], *args: Any) -> Callable[[nn.Parameter], None]:
    """A parameter hook calling the bound ``method(param, *args)`` while its object is alive, a
    no-op after.

    See Note [hooks hold their owner weakly]. Costs one weak-reference lookup per call and no
    Python call besides `method` itself (`weakref.WeakMethod`'s lookup is a Python method;
    this one is a plain reference to the object and its function). `args` are bound once
    (e.g. where the parameter's gradient goes), so the hook needs no lookup keyed by the
    parameter, whose `__hash__` is a Python call too.
    """
    ref, func = weakref.ref(method.__self__), method.__func__  # type: ignore[attr-defined]

    def hook(param: nn.Parameter) -> None:
        owner = ref()
        if owner is not None:
            func(owner, param, *args)

    return hook
