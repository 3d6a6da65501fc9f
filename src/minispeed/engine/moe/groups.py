"""DeepSpeed's `split_params_into_different_moe_groups_for_optimizer`, group for group.

```python
from minispeed.engine.moe.utils import split_params_into_different_moe_groups_for_optimizer
groups = split_params_into_different_moe_groups_for_optimizer(
    {"params": list(model.parameters()), "name": "params"})
optimizer = torch.optim.AdamW(groups, lr=1e-3)
```

Each input group keeps its non-expert parameters; for each input group and each expert group
(`"ep_size_<E_p>"`) a new group follows, a copy of the input group's options with
`name = "ep_size_<E_p>"`, `moe = True` and that expert group's parameters, split into groups
of at most `max_group_size` elements as DeepSpeed does. The input groups are changed in place
(their `params` lose the experts) and returned with the new groups appended, as in DeepSpeed.
Every input group needs a `name`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from minispeed.engine.moe.layer import MoE
from minispeed.engine.moe.registry import expert_group_name, is_moe_param

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "holds_experts",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """See the module docstring."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for i, group in enumerate(param_groups):
        if "name" not in group:
            raise KeyError(
                f"param group {i} has no 'name'; split_params_into_different_moe_groups_for_"
                "optimizer names the expert groups after the input groups (DeepSpeed needs it too)"
            )
        group["params"] = list(group["params"])
    names = sorted(
        {expert_group_name(p) for g in param_groups for p in g["params"] if is_moe_param(p)}
    )
    moe_groups: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for group in param_groups:
        for name in names:
            moe_groups[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                moe_groups[group["name"]][expert_group_name(p)]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for by_name in moe_groups.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            chunks: list[list[Any]] = []
            current: list[Any] = []
            size = 0
            for p in group["params"]:
                if size + p.numel() <= max_group_size:
                    current.append(p)
                    size += p.numel()
                else:
                    chunks.append(current)
                    current, size = [p], p.numel()
            if current:
                chunks.append(current)
            for chunk in chunks:
                param_groups.append({**group, "params": chunk})
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether an optimizer group holds expert parameters (DeepSpeed's helper)."""
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]]:
    """Optimizer groups ready for expert parallelism, as `initialize` builds them from
    `model_parameters`: a list of parameters becomes one group named `dense-params`, split;
    a list of groups is split unless one already says `moe`, then returned as given."""
    if not isinstance(model_parameters, list) or not model_parameters:
        raise TypeError("configure_moe_param_groups: pass a non-empty list of parameters or groups")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                "configure_moe_param_groups: each entry must be a parameter or a parameter group "
                f"(dict), got {type(p).__name__}"
            )
    if isinstance(model_parameters[0], torch.Tensor):
        group = {"params": model_parameters, "name": "dense-params"}
        return split_params_into_different_moe_groups_for_optimizer(group)
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


def holds_experts(model_parameters: list[Any]) -> bool:
    """Whether a list of parameters or of parameter groups holds an expert's parameter. A
    group's `params` given as an iterator becomes a list (as torch's optimizers make it), so
    reading it here does not consume it."""
    for entry in model_parameters:
        if isinstance(entry, dict) and not isinstance(entry.get("params"), list | tuple):
            one = isinstance(entry.get("params"), torch.Tensor)
            entry["params"] = [entry["params"]] if one else list(entry.get("params", ()))
    return any(
        is_moe_param(p)
        for entry in model_parameters
        for p in (entry["params"] if isinstance(entry, dict) else [entry])
    )


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """Whether `model` holds a `MoE` layer, and the first one's number of experts (0 if none)."""
    layer = next((m for m in model.modules() if isinstance(m, MoE)), None)
    return (layer is not None, layer.num_experts if layer is not None else 0)


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`params` as (the ones every rank holds, the experts'), each in the given order."""
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of `group`'s parameters that have one, in each parameter's dtype, as
    (shared, expert): the two norms clipping takes separately."""
    with_grad = [p for p in group if p.grad is not None]
    shared, expert = split_params_into_shared_and_expert_params(with_grad)
    return [p.grad.to(p.dtype) for p in shared], [p.grad.to(p.dtype) for p in expert]
