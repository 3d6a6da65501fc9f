"""DeepSpeed's `deepspeed.moe.layer.MoE` over `minispeed.moe.MoE`.

```python
from minispeed.engine.moe.layer import MoE          # was: from deepspeed.moe.layer import MoE
moe = MoE(hidden_size=64, expert=mlp, num_experts=8, ep_size=2, k=1)
out, l_aux, exp_counts = moe(h)                      # loss = task_loss + coef * l_aux
```

The same arguments, defaults and outputs as DeepSpeed 0.19.8:

- `output` has the input's shape; `l_aux` is the unscaled load-balancing loss
  `E · Σ_e f_e · P_e` (f_e the fraction of tokens whose first choice is e, P_e the mean router
  probability); `exp_counts` (E,) int64 counts each expert's assignments before dropping.
- The experts start as copies of `expert` (DeepSpeed deep-copies it; minispeed.moe would
  re-initialise each copy with its own seed, so the adapter copies `expert`'s weights back).
  The router `wg` (d → E, fp32, no bias) draws from the global RNG as DeepSpeed's does.
- `use_residual=True` (Residual MoE): `expert` itself runs as a dense MLP beside the experts and
  `coefficient` (d → 2) mixes the two, as in DeepSpeed.
- Which assignments an over-full expert keeps (top-1, dropping): DeepSpeed's rule, written in
  `_DeepSpeedTop1Gate`: `torch.topk` over the (S, E) one-hot mask, times U(0, 1) noise drawn from
  the global RNG with `use_rts` (in eval mode too, as in DeepSpeed). Without noise the ties of
  the 0/1 mask are broken by `torch.topk`'s implementation, not by token order, so minispeed's
  own rule (token order) keeps other tokens; the adapter keeps DeepSpeed's. At k ≥ 2 the
  package's gate runs with DeepSpeed's rules (`deepspeed_rules`: the weights
  renormalized over the kept choices, no random token order, RSample ignored as DeepSpeed's
  top-2 and top-k gates ignore it; at k = 2 the second choice sampled in eval mode too, at
  k > 2 the most probable assignments kept).
- The expert-parallel groups are made when the layer is built (DeepSpeed's engine makes them in
  `set_deepspeed_parallelism()`, a no-op here): construction is collective when `ep_size > 1`,
  and each layer holds its own groups (one communicator per group per layer).
- Expert parameters are recorded for `split_params_into_different_moe_groups_for_optimizer`
  under DeepSpeed's group name `ep_size_<ep_size>` (see `registry.py`).

Refused by name: `use_tutel=True`, `enable_expert_tensor_parallelism=True`, `used_token`, `k`
other than 1 or 2 (DeepSpeed's own limit), `set_deepspeed_parallelism(True)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import minispeed.moe as moe
from minispeed.engine.moe.registry import register_expert_params

__all__ = ["MoE"]

_POLICIES = {None: None, "None": None, "Jitter": "jitter", "RSample": "rsample"}


class MoE(nn.Module):
    """DeepSpeed's MoE layer (see the module docstring); `forward` returns
    `(output, l_aux, exp_counts)`.

    Bytes per rank: E / ep_size copies of `expert`'s parameters, the router's d·E fp32 weights,
    and (Residual MoE) `expert` itself plus d·2 + 2 for the coefficient.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if use_tutel:
            raise NotImplementedError(
                "MoE(use_tutel=True): minispeed has no Tutel kernels (its permutation op plays "
                "their part); leave use_tutel=False"
            )
        if enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "MoE(enable_expert_tensor_parallelism=True): minispeed has no tensor "
                "parallelism for experts; leave it False"
            )
        if not isinstance(k, int) or k < 1 or k > num_experts:
            raise ValueError(f"MoE(k={k!r}): k experts per token must be 1..num_experts")
        if noisy_gate_policy not in _POLICIES:
            raise ValueError(
                f"MoE(noisy_gate_policy={noisy_gate_policy!r}): use None, 'Jitter' or 'RSample'"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size if ep_size else 0
        self.expert_group_name = f"ep_size_{ep_size}"
        if k == 1:  # top-1 dropping selects as DeepSpeed does in _DeepSpeedTop1Gate
            rules = dict(top_k=1, random_token_selection=use_rts and not drop_tokens)
        else:  # DeepSpeed's top2gating / topkgating: no RSample noise, no random token order
            rules = deepspeed_rules(k, top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        policy = _POLICIES[noisy_gate_policy]
        config = moe.MoEConfig(
            num_experts=num_experts,
            expert_parallel_degree=ep_size,
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            min_capacity=min_capacity,
            drop_tokens=drop_tokens,
            noisy_gate_policy=policy if k == 1 or policy == "jitter" else None,
            **rules,
        )
        self.deepspeed_moe = moe.MoE(hidden_size, expert, config, moe.ExpertGroups(ep_size))
        gate = None
        with torch.random.fork_rng(devices=[]):  # the router already drew DeepSpeed's init
            if k == 1 and drop_tokens:
                gate = _DeepSpeedTop1Gate(hidden_size, config, use_rts)
            elif k == 2 and top2_2nd_expert_sampling:
                gate = _DeepSpeedTop2Gate(hidden_size, config)
        if gate is not None:
            gate.load_state_dict(self.deepspeed_moe.gate.state_dict())
            self.deepspeed_moe.gate = gate
        # DeepSpeed's experts are deep copies of `expert`: undo the package's per-expert init.
        with torch.no_grad():
            for local in self.deepspeed_moe.experts.local_experts:
                local.load_state_dict(expert.state_dict())
        register_expert_params(
            list(self.deepspeed_moe.experts.parameters()), self.expert_group_name
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine makes the expert groups here; minispeed made them at construction."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError(
                "use_data_before_expert_parallel_=True (data-major expert groups) is not "
                "implemented: minispeed's expert groups are adjacent ranks"
            )

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(output, l_aux, exp_counts)` for `hidden_states` (..., d); see the module docstring."""
        if used_token is not None:
            raise NotImplementedError("MoE.forward(used_token=...) is not supported; pass None")
        output = self.deepspeed_moe(hidden_states)
        routing = self.deepspeed_moe.last_routing
        assert routing is not None
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, routing.aux_loss, routing.expert_counts.detach()


class _DeepSpeedTop1Gate(moe.TopKGate):
    """minispeed's router with DeepSpeed's choice of the assignments an over-full expert keeps
    (top-1 with dropping; `keep_as_deepspeed_top1`)."""

    def __init__(self, hidden_size: int, config: moe.MoEConfig, use_rts: bool) -> None:
        super().__init__(hidden_size, config)
        self.use_rts = use_rts

    def forward(self, x: torch.Tensor, capacity: int | None = None) -> moe.Routing:
        # `capacity`: the expert group's agreed C (moe.MoE passes it when ranks may differ).
        routing = super().forward(x, capacity=capacity)
        assert routing.capacity is not None and self.config.top_k == 1
        return keep_as_deepspeed_top1(
            routing, routing.capacity, self.use_rts, self.config.min_capacity
        )


def deepspeed_rules(
    k: int, *, top2_2nd_expert_sampling: bool = True, drop_policy: str = "probs"
) -> dict[str, Any]:
    """`MoEConfig`'s routing rules (k > 1) under which minispeed.moe's gate routes as the gate
    DeepSpeed's layer calls at top-`k`: `top2gating` (k = 2: first choices before second ones in token order, no random
    token selection, the weights renormalized over the kept choices, the auxiliary loss over
    first choices, the second choice sampled with Gumbel noise) or `topkgating` (k > 2: the most
    probable assignments kept with `drop_policy="probs"`, the loss over all k choices, no
    sampling). The functional gates here and the `MoE` layer use the same rules."""
    if k == 2:
        return dict(
            top_k=2,
            drop_order="choice",
            weights_over="kept",
            aux_loss_choices="first",
            random_token_selection=False,
            second_expert_sampling=top2_2nd_expert_sampling,
        )
    return dict(
        top_k=k,
        drop_order="probability" if drop_policy == "probs" else "choice",
        weights_over="kept",
        aux_loss_choices="all",
        random_token_selection=False,
        second_expert_sampling=False,
    )


class _DeepSpeedTop2Gate(moe.TopKGate):
    """minispeed's router sampling the second choice in eval mode too, as DeepSpeed's
    `top2gating` does (it has no training flag: Gumbel noise from the global RNG always)."""

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        training, self.training = self.training, True  # only the sampling reads it here
        try:
            return super()._choose(logits)
        finally:
            self.training = training


def keep_as_deepspeed_top1(
    routing: moe.Routing, capacity: int, use_rts: bool, min_capacity: int
) -> moe.Routing:
    """`routing` (top-1) with DeepSpeed's choice of the assignments each expert keeps
    (`deepspeed.moe.sharded_moe.top1gating`): `torch.topk` over the (S, E) one-hot mask, times
    U(0, 1) noise drawn from the global RNG with `use_rts`, at most `capacity` per expert; a
    kept assignment's position is its rank among the expert's kept tokens in token order.
    Cost: an (S, E) one-hot mask, its top-C over tokens and a cumulative sum, O(S·E)."""
    first = routing.expert_index  # (S, 1)
    num_experts = routing.probs.shape[1]
    mask = nn.functional.one_hot(first[:, 0], num_experts)  # (S, E) int64
    num_tokens = mask.shape[0]
    if num_tokens < min_capacity:
        raise ValueError(
            f"MoE: {num_tokens} tokens but min_capacity={min_capacity}; set "
            "min_capacity=0 or feed more tokens (DeepSpeed asserts the same)"
        )
    ranked = mask
    if use_rts:  # DeepSpeed draws this noise from the global RNG, in eval mode too
        device = routing.logits.device
        zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
        ranked = mask * torch.distributions.uniform.Uniform(zero, one).rsample(mask.shape)
    top = torch.topk(ranked, k=min(capacity, num_tokens), dim=0)[1]  # (C, E)
    mask = mask * torch.zeros_like(mask).scatter_(0, top, 1)
    kept = mask.sum(dim=1, keepdim=True).bool()  # (S, 1)
    slot_in_expert = (torch.cumsum(mask, dim=0) - 1).gather(1, first)  # (S, 1)
    position = torch.where(kept, slot_in_expert, capacity + routing.position)
    return dataclasses.replace(routing, kept=kept, position=position, kept_counts=mask.sum(0))
