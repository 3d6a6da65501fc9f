"""`deepspeed.moe.sharded_moe`: DeepSpeed's gating functions over `minispeed.moe`'s gate.

```python
from minispeed.engine.moe.sharded_moe import top2gating    # was: deepspeed.moe.sharded_moe
l_aux, combine_weights, dispatch_mask, exp_counts = top2gating(logits, 1.0, 4)
```

`top1gating`, `top2gating` and `topkgating` take the router's (S, E) logits with DeepSpeed's
arguments and return DeepSpeed's four tensors: `l_aux` (the load-balancing loss, `E/j · Σ_e
f_e · P_e` over the first choices at top-1/top-2, over all k at top-k), `combine_weights`
(S, E, C) (each kept assignment's gate weight at its slot in its expert's buffer),
`dispatch_mask` (`combine_weights.bool()`) and `exp_counts` (E,) int64 (assignments offered to
each expert before dropping). The routing is `minispeed.moe.TopKGate.route` with the rules
DeepSpeed's function applies: top-1 keeps as DeepSpeed's does (`moe.layer.keep_as_deepspeed_top1`,
its random token selection drawn from the global RNG as DeepSpeed draws it); top-2 keeps first
choices before second ones in token order and renormalizes the kept pair; top-k keeps each
expert's most probable assignments (`drop_policy="probs"`) or its first in token order
(`"position"`, k = 1), in token-order slots, and renormalizes the kept choices (at k = 1 too,
where a kept weight is 1). C is
DeepSpeed's: `max(ceil(S/E · k · capacity_factor), min_capacity)` when dropping, else the
largest expert count (the maximum over `ep_group`, one all-reduce of one int64). The
differences: top-2's second-expert sampling draws its Gumbel noise in its own way (the same
distribution, other numbers than DeepSpeed's for one seed), and `logits` is left unchanged
(DeepSpeed's top-2 adds the noise into the caller's tensor). Refused by name: `used_token`,
`use_tutel=True`, `sparse_routes=True`, `drop_policy="position"` at k > 1; `TopKGate` and
`MOELayer` are `minispeed.moe.TopKGate` / `deepspeed.moe.layer.MoE`.
Cost: the gate's routing, O(S·E·log S), plus the (S, E, C) tensors, S·E·C·4 bytes each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import minispeed.comm as comm
import minispeed.moe as moe
from minispeed.engine.missing import decline
from minispeed.engine.moe.layer import deepspeed_rules, keep_as_deepspeed_top1
from minispeed.moe.dispatch_einsum import combine_weights, dispatch_mask

__all__ = ["top1gating", "top2gating", "topkgating"]

Gated = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _refuse(given: bool, what: str, instead: str) -> None:
    if given:
        raise NotImplementedError(f"{what} is not supported by minispeed; {instead}")


def _capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed's `_capacity`: `max(ceil(S/E · factor), min_capacity)`, in fp32 as there."""
    fair = torch.ceil(torch.tensor(num_tokens / num_experts) * torch.tensor(factor))
    return max(int(fair), int(min_capacity))


def _largest(counts: torch.Tensor, ep_group: Any) -> int:
    """The largest expert count, the maximum over `ep_group` when it has several ranks."""
    largest = counts.max().reshape(1).clone()
    if ep_group is not None and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(largest, op=comm.ReduceOp.MAX, group=ep_group)
    return int(largest.item())


def _route(logits: torch.Tensor, capacity: int | None, **config: Any) -> moe.Routing:
    with torch.random.fork_rng(devices=[]):  # its unused router draws nothing of the caller's
        gate = moe.TopKGate(1, moe.MoEConfig(num_experts=logits.shape[1], **config))
    return gate.route(logits.float(), capacity)  # the logits given: `route` only


def _as_topk(routing: moe.Routing) -> moe.Routing:
    """DeepSpeed's top-k slots and weights: each kept assignment's position is its rank among
    its expert's kept ones in token order (a cumulative sum over tokens), and the weights are
    renormalized over the kept choices at every k (the package renormalizes at k > 1 only)."""
    num_tokens, num_experts = routing.probs.shape
    kept = torch.zeros(num_tokens, num_experts, dtype=torch.int64)
    kept.scatter_(1, routing.expert_index, routing.kept.long())
    slots = (torch.cumsum(kept, dim=0) - 1).gather(1, routing.expert_index)
    shares = routing.probs.gather(1, routing.expert_index) * routing.kept
    weight = shares / shares.sum(dim=1, keepdim=True).clamp(min=torch.finfo(shares.dtype).eps)
    return dataclasses.replace(routing, position=torch.where(routing.kept, slots, 0), weight=weight)


def _gated(routing: moe.Routing, capacity: int) -> Gated:
    weights = combine_weights(routing, dispatch_mask(routing, capacity))
    return routing.aux_loss, weights, weights.bool(), routing.expert_counts.detach()


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: Any = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
) -> Gated:
    """DeepSpeed's top-1 gating (module docstring): `RSample` adds Gumbel noise to the choice."""
    _refuse(used_token is not None, "top1gating(used_token=...)", "pass None")
    _refuse(use_tutel, "top1gating(use_tutel=True)", "leave it False")
    _refuse(sparse_routes, "top1gating(sparse_routes=True)", "use the dense tensors")
    num_tokens, num_experts = logits.shape
    routing = _route(
        logits,
        None,
        top_k=1,
        drop_tokens=False,
        noisy_gate_policy="rsample" if noisy_gate_policy == "RSample" else None,
        random_token_selection=False,
    )
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(_largest(routing.expert_counts, ep_group), num_tokens)
    routing = keep_as_deepspeed_top1(routing, capacity, use_rts, min_capacity)
    return _gated(routing, capacity)


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
) -> Gated:
    """DeepSpeed's top-2 gating (module docstring)."""
    _refuse(sparse_routes, "top2gating(sparse_routes=True)", "use the dense tensors")
    num_tokens, num_experts = logits.shape
    config = deepspeed_rules(2, top2_2nd_expert_sampling=top2_2nd_expert_sampling)
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        return _gated(_route(logits, capacity, drop_tokens=True, **config), capacity)
    routing = _route(logits, None, drop_tokens=False, **config)
    return _gated(routing, _largest(routing.expert_counts, ep_group))


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
) -> Gated:
    """DeepSpeed's top-k gating (module docstring): `drop_policy="probs"` keeps each expert's
    most probable assignments."""
    _refuse(sparse_routes, "topkgating(sparse_routes=True)", "use the dense tensors")
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"topkgating(drop_policy={drop_policy!r}): use 'probs' or 'position'")
    _refuse(
        drop_policy == "position" and k > 1,
        f"topkgating(drop_policy='position') at k={k}",
        "use drop_policy='probs', or minispeed.moe's drop_order='choice'",
    )
    num_tokens, num_experts = logits.shape
    config = {**deepspeed_rules(3, drop_policy=drop_policy), "top_k": k}  # topk's, at any k
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        routing = _route(logits, min(capacity, num_tokens), drop_tokens=True, **config)
    else:
        routing = _route(logits, None, drop_tokens=False, **config)
        capacity = _largest(routing.expert_counts, ep_group)
    return _gated(_as_topk(routing), capacity)


_MODULES = {
    "TopKGate": "minispeed.moe.TopKGate (it returns a Routing) or deepspeed.moe.layer.MoE",
    "MOELayer": "deepspeed.moe.layer.MoE (minispeed.engine.moe.layer.MoE)",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        decline(
            f"deepspeed.moe.sharded_moe.{name} is not provided by minispeed; use {_MODULES[name]}",
            name,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
