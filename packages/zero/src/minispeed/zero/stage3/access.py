"""Reading stage-3 parameters: fetch inside forward, clear errors where a read is a mistake.

A released parameter's ``.data`` is an empty tensor; using it by mistake gives shape errors far
from the cause, or silently wrong numbers (``weight.sum()`` of an empty tensor is 0). We cannot
intercept every use of a tensor, so we guard the paths a user actually takes:

1. **Attribute reads** (``module.weight``). Every module with partitioned parameters gets a
   `GuardedParameterDict` as its ``_parameters`` (Note [guarding module._parameters]). For a
   parameter that is not gathered, `check_access`:

   - inside a forward run by our hooks: fetches it now and charges it to the innermost running
     module, which keeps it as an *external* parameter from then on (a tied weight read by another
     module, ``nn.MultiheadAttention`` reading ``self.out_proj.weight`` without calling
     ``out_proj``). See ``FetchCoordinator.demand_fetch``;
   - anywhere else: returns the parameter object, released: its shape, dtype and device answer
     as the full parameter's and any use of its values raises (point 5). That is how user code
     names parameters for ``GatheredParameters(model.head.weight, ...)``, and how a
     parameter-less module run outside the model's forward checks a child's dtype before calling
     it (T5's feed-forward block does, when ``generate`` runs the encoder alone): neither may
     fail. A value read from inside a ``forward`` our hooks did not start (``module.forward(x)``
     instead of ``module(x)``) raises `ParameterNotGatheredError` naming that forward.

2. **Reads and writes during ``zero.Init``** (``nn.init.normal_(self.block.weight)`` after the
   block was partitioned, e.g. ``self.apply(init_fn)`` or Hugging Face's ``post_init`` at the end
   of a root ``__init__``): gathered on first touch and written back (init_writes.py).

3. **``state_dict()`` / ``load_state_dict()``**: outside ``GatheredParameters``,
   ``state_dict()`` holds each released stage-3 parameter itself as a placeholder (its keys,
   shapes and dtypes are right; saving or reading its values raises: Note [a released parameter
   in a state_dict] in released.py), and ``load_state_dict()`` raises `ParameterNotGatheredError`
   naming the code that works (a pre-hook installed with the guard). Inside
   ``GatheredParameters`` ``state_dict()`` returns *copies* of the stage-3 parameters (a
   post-hook), because a view would lose its memory when the block exits (Note [why storage is
   resized, not replaced]); ``zero.full_state_dict(model)`` does the same without a block.

4. **`full_value(param)`**: the helper to read a parameter's value; raises outside
   forward and GatheredParameters.

5. **Any use of the parameter object itself** (a reference obtained earlier, ``p.norm()``,
   ``p.shape``, ``F.linear(x, lin.weight)`` outside a forward): released.py, where each stage-3
   parameter's class answers shape queries with the full shape and raises on value reads.

``parameters()`` / ``named_parameters()`` iterate the dict without ``__getitem__`` and are never
checked here (the optimizer and zero.shard use them); what they yield is guarded by point 5. Not
detectable: views taken inside a GatheredParameters block (``v = lin.weight[0]``) and used after
it, and ``p.data``, the storage stage 3 swaps (empty while released).
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minispeed.core.compiling import eager, is_compiling
from minispeed.zero.stage3.params import REGISTRY, ParamState

__all__ = [
    "GuardedParameterDict",
    "ParameterNotGatheredError",
    "check_access",
    "full_value",
    "guard_module",
    "unguard_module",
]

# Note [guarding module._parameters]
# nn.Module.__getattr__ reads parameters with ``self._parameters[name]``. Replacing that dict by a
# subclass with a checking ``__getitem__`` is the one place where every attribute read of a
# parameter can be seen without patching nn.Parameter, nn.Module or torch functions globally. It is
# per module instance, installed when the module's parameters are partitioned and removed by
# ``unguard_module`` (Stage3Strategy.close). Iteration (``items()``, ``values()``), ``in`` and
# assignment are plain dict operations and are not checked. The check costs one dict lookup and
# one enum comparison per attribute read of a gathered parameter.


class ParameterNotGatheredError(RuntimeError):
    """A stage-3 parameter was used while only this rank's shard is present."""


class GuardedParameterDict(dict):
    """``module._parameters`` for a module with stage-3 parameters; checks reads by name."""

    __slots__ = ("guard", "handles", "owner_name")

    def __init__(
        self, params: dict, guard: Callable[[nn.Parameter, str, str], None], owner_name: str
    ) -> None:
        super().__init__(params)
        self.guard = guard  # guard(param, attribute name, owner module description)
        self.owner_name = owner_name
        self.handles: list[Any] = []  # the module's state-dict hooks, removed with the guard

    def __getitem__(self, name: str) -> Any:
        param = dict.__getitem__(self, name)
        if param is not None:
            if not is_compiling():
                self.guard(param, name, self.owner_name)
            elif param.numel() == 0:  # released: Note [the guard under torch.compile]
                _guard_eagerly(self.guard, param, name, self.owner_name)
        return param

    def __deepcopy__(self, memo: dict) -> Any:
        """Refuse to copy released parameters: the copies would be empty, untracked tensors."""
        for name, p in dict.items(self):
            sp = REGISTRY.get(p) if p is not None else None
            if sp is not None and sp.state is not ParamState.GATHERED:
                raise not_gathered_error(
                    sp.name or f"{self.owner_name}.{name}",
                    "by copy.deepcopy of its module",
                    fix="Copy modules before they are partitioned (outside zero.Init, before "
                    "zero.shard), or build each copy by calling its constructor inside zero.Init",
                )
        return {k: copy.deepcopy(v, memo) for k, v in dict.items(self)}


# Note [the guard under torch.compile]
# While dynamo traces a module's forward (``engine.compile()``), a read of a gathered parameter
# (its own, gathered by its module's pre-hook; ``numel()`` is its full size there) is not
# checked: the check is a weak-dict lookup dynamo cannot trace, and breaking the graph at every
# parameter read would cut each forward into one graph per op. A released one (``numel()`` 0 in
# the trace: another module's weight, the first time it is read) breaks the graph: the guard
# runs eagerly and demand-fetches it as in eager mode, and the trace goes on with the gathered
# value. From the next pass it is fetched with the reading module's unit, so the graph compiled
# for it is guarded on the released size and compiled once more. Stage 3 never releases a
# 0-element parameter's values: for one, the extra graph break is all it costs.
@eager
def _guard_eagerly(guard: Callable[[nn.Parameter, str, str], None], *args: Any) -> None:
    """A guard called from code dynamo traces (``engine.compile()``), run as plain Python."""
    guard(*args)


def guard_module(
    module: nn.Module, guard: Callable[[nn.Parameter, str, str], None], owner_name: str
) -> None:
    """Install (or re-point) the guarded parameter dict of ``module``."""
    params = module.__dict__["_parameters"]
    if isinstance(params, GuardedParameterDict):
        params.guard, params.owner_name = guard, owner_name
        return
    guarded = GuardedParameterDict(params, guard, owner_name)
    module.__dict__["_parameters"] = guarded
    guarded.handles = [
        module.register_state_dict_post_hook(_own_state_dict),
        module.register_load_state_dict_pre_hook(_refuse_load_state_dict),
    ]


def unguard_module(module: nn.Module) -> None:
    """Put a plain dict back (same entries, same order) and remove the state-dict hooks."""
    params = module.__dict__["_parameters"]
    if isinstance(params, GuardedParameterDict):
        for handle in params.handles:
            handle.remove()
        module.__dict__["_parameters"] = dict(params)


# -- state_dict / load_state_dict ------------------------------------------------------------------
def _released_param(module: nn.Module, loaded: Any, prefix: str) -> str | None:
    """The name of one of ``module``'s own stage-3 parameters that is not gathered and that the
    state dict ``loaded`` holds a value for (``prefix + name``), if any: torch's load leaves the
    others alone, so a state dict holding part of a module's parameters (transformers loads a
    checkpoint group by group) needs only that part gathered."""
    for name, p in dict.items(module._parameters):
        if prefix + name not in loaded:
            continue
        sp = REGISTRY.get(p) if p is not None else None
        if sp is not None and sp.state is not ParamState.GATHERED:
            return sp.name or name
    return None


def _refuse_load_state_dict(module: nn.Module, state_dict: Any, prefix: str, *rest: Any) -> None:
    name = _released_param(module, state_dict, prefix)
    if name is not None:
        raise not_gathered_error(
            name,
            "by load_state_dict() outside GatheredParameters",
            fix="Load inside `with zero.GatheredParameters(model.parameters(), modifier_rank=0): "
            "model.load_state_dict(sd)` (modifier_rank=0 re-partitions rank 0's loaded values on "
            "every rank), or use zero.load_checkpoint",
        )


def _own_state_dict(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
    """Replace views of gathered stage-3 parameters by copies.

    A view shares the parameter's full buffer, whose storage is resized to 0 bytes when the
    parameter is released (Note [why storage is resized, not replaced]): read after
    GatheredParameters exits, it would crash the process. Costs: one copy, ``n·p`` bytes, per
    stage-3 parameter of the state dict. ``keep_vars=True`` entries are the parameters
    themselves and are left alone, as are released parameters' placeholders (Note [a released
    parameter in a state_dict] in released.py).
    """
    for name, p in dict.items(module._parameters):
        key = prefix + name
        value = state_dict.get(key)
        sp = REGISTRY.get(p) if p is not None else None
        if sp is None or value is None or isinstance(value, nn.Parameter):
            continue
        if sp.state is ParamState.GATHERED:  # released: value is a placeholder, no bytes
            state_dict[key] = value.clone()


def check_access(param: nn.Parameter, attr: str, owner: str) -> None:
    """The guard of every stage-3 module (rules in the module docstring, point 1)."""
    sp = REGISTRY.get(param)
    if sp is None or sp.state is ParamState.GATHERED:
        return
    coordinator = sp.coordinator
    if coordinator is not None and coordinator.in_forward:
        coordinator.demand_fetch(sp, sp.name or f"{owner}.{attr}")


def full_value(param: nn.Parameter) -> torch.Tensor:
    """A copy of ``param``'s full value; stage-3 parameters must be gathered (forward or
    GatheredParameters), else `ParameterNotGatheredError`. Other tensors: a plain copy."""
    sp = REGISTRY.get(param)
    if sp is not None and sp.state is not ParamState.GATHERED:
        raise not_gathered_error(
            sp.name or "?", "outside a forward pass and outside GatheredParameters"
        )
    return param.detach().clone()


def not_gathered_error(
    param_name: str, where: str, fix: str | None = None
) -> ParameterNotGatheredError:
    """The error for a use of a released parameter, naming it and the fix."""
    fix = fix or (
        "Read or modify full parameters inside `with zero.GatheredParameters(params, "
        "modifier_rank=...)` (modifier_rank=r keeps the changes rank r makes), and call modules "
        "as module(x), not module.forward(x), so the stage-3 hooks fetch their parameters"
    )
    return ParameterNotGatheredError(
        f"stage-3 parameter {param_name!r} was used {where}, but only this rank's shard is present "
        f"(its .data is an empty tensor). {fix}"
    )


# Frames between a module's forward and the guard that sees its read: ours, torch's module call,
# and torch's dispatch of a function or method to ``__torch_function__``.
_SKIP_FILES = frozenset(
    os.path.abspath(f)
    for f in (
        __file__,
        os.path.join(os.path.dirname(__file__), "released.py"),
        nn.modules.module.__file__,
        torch.overrides.__file__,
        torch._tensor.__file__,
        torch.nn.functional.__file__,
    )
)


def unhooked_forward_caller() -> str | None:
    """The class name of the module whose ``forward`` made this read, if any."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _SKIP_FILES:
        frame = frame.f_back
    if frame is None or frame.f_code.co_name != "forward":
        return None
    owner = frame.f_locals.get("self")
    return type(owner).__name__ if isinstance(owner, nn.Module) else None
