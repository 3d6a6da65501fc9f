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

from minispeed.engine.moe.registry import expert_group_name, is_moe_param

__all__ = [
    "is_moe_param",
    "is_moe_param_group",
    "split_params_into_different_moe_groups_for_optimizer",
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
