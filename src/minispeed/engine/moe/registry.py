"""Which parameters are expert parameters, and of which expert group: a registry, not attributes.

DeepSpeed marks an expert parameter by patching `param.allreduce = False` and
`param.group_name = "ep_size_<E_p>"` onto it; minispeed never patches `nn.Parameter`
(STYLE.md), so `MoE` records its expert parameters here and
`split_params_into_different_moe_groups_for_optimizer` reads them back. Weak keys: a parameter
that is freed leaves the registry with it.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["expert_group_name", "is_moe_param", "register_expert_params"]

# id(param) -> (weak reference, group name). Keyed by id, not by the tensor: a WeakKeyDictionary
# compares weak references with ==, which compares tensors by value. The weak reference's
# callback drops the entry when the parameter is freed (before its id can be reused).
_ENTRIES: dict[int, tuple[weakref.ref, str]] = {}


def register_expert_params(params: list[torch.nn.Parameter], group_name: str) -> None:
    """Record `params` as expert parameters of the expert group `group_name`."""
    for p in params:
        key = id(p)
        _ENTRIES[key] = (weakref.ref(p, lambda _, key=key: _ENTRIES.pop(key, None)), group_name)


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` belongs to the experts of an `MoE` layer (DeepSpeed's `is_moe_param`)."""
    entry = _ENTRIES.get(id(param))
    return entry is not None and entry[0]() is param


def expert_group_name(param: torch.Tensor) -> str:
    """The expert group (`"ep_size_<E_p>"`) of an expert parameter."""
    if not is_moe_param(param):
        raise KeyError("not an expert parameter of a minispeed.engine.moe.layer.MoE")
    return _ENTRIES[id(param)][1]
