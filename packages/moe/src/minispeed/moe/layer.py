"""The MoE layer: gate → dispatch → (all-to-all) → experts → (all-to-all) → combine.

```python
import minispeed.moe as moe

cfg = moe.MoEConfig(num_experts=8, expert_parallel_degree=2, top_k=2)
model = moe.replace_mlp(model, cfg)           # every submodule named "mlp" becomes an MoE
loss = task_loss + moe.aux_loss(model)        # the layers' weighted router losses
loss.backward()
moe.reduce_gradients(model, moe.groups_of(model))   # dense over W ranks, experts over W/E_p
```

One forward on a rank with S tokens of width d (b bytes per element):

1. **gate** (`gating.py`): top-k experts, weights, capacity, losses. When dropping across
   ranks, C is the expert group's maximum (one all-reduce of one int64; see
   Note [one capacity per expert group]), so ranks with different token counts can exchange.
2. **dispatch** (`dispatch.py`, `permute.py`): gather the S·k kept assignments into a buffer
   grouped by expert: E·C rows when dropping across ranks (equal all-to-all splits), Σ kept
   otherwise (all experts local, or no dropping).
3. **all-to-all** (`exchange.py`, E_p > 1 only): each expert's rows to its rank.
4. **experts** (`experts.py`): each local expert on its contiguous rows.
5. **all-to-all back**, then **combine**: each token sums its k outputs times its gate weights.

The output has the input's shape and dtype, so the layer drops into an MLP's place. The router
losses of the last forward wait in `layer.loss` (`aux_loss_coef · l_aux + z_loss_coef · z`);
`aux_loss(model)` sums them. `layer.last_routing` keeps the last `Routing` for inspection
(expert counts, dropped assignments).
"""

from __future__ import annotations

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core import ranges
from minispeed.moe import permute as perm
from minispeed.moe.config import MoEConfig
from minispeed.moe.dispatch import plan_dispatch
from minispeed.moe.exchange import send_to_experts
from minispeed.moe.experts import Experts
from minispeed.moe.gating import Routing, TopKGate
from minispeed.moe.groups import ExpertGroups

__all__ = ["MoE", "aux_loss", "groups_of", "moe_layers", "replace_mlp"]


class MoE(nn.Module):
    """A mixture-of-experts layer holding E/E_p of E copies of `expert` (d → d).

    `groups` (an `ExpertGroups` for `config.expert_parallel_degree`) is shared between layers;
    when None one is built here, which is collective when E_p > 1.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        config: MoEConfig,
        groups: ExpertGroups | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE: config must be a MoEConfig, got {type(config).__name__}")
        if groups is None:
            groups = ExpertGroups(config.expert_parallel_degree)
        if groups.expert_parallel_degree != config.expert_parallel_degree:
            raise ValueError(
                f"MoE: groups were built for expert_parallel_degree="
                f"{groups.expert_parallel_degree} but the config says "
                f"{config.expert_parallel_degree}; build ExpertGroups with the config's degree"
            )
        self.config = config
        self.hidden_size = hidden_size
        self.groups = groups
        self.gate = TopKGate(hidden_size, config)
        e_local = config.num_local_experts
        self.experts = Experts(expert, e_local, groups.expert_rank * e_local, seed)
        self.last_routing: Routing | None = None
        self.loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (..., d) -> (..., d); see the module docstring for the steps and their costs."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: input width {x.shape[-1]} != hidden_size {self.hidden_size}")
        tokens = x.reshape(-1, self.hidden_size)  # (S, d)
        # Padded E·C rows only where the equal-split all-to-all needs them; see dispatch.py.
        padded = self.config.drop_tokens and self.groups.distributed
        capacity = self._agreed_capacity(tokens) if padded else None
        routing = self.gate(tokens, capacity=capacity)
        plan = plan_dispatch(routing, padded=padded)
        with ranges.range("moe.dispatch"):
            buf = perm.permute(tokens, plan.slot_token, plan.token_slot)  # (slots, d)
            if self.groups.distributed:
                capacity = routing.capacity if padded else None
                buf, exchange = send_to_experts(buf, plan.rows_per_expert, capacity, self.groups)
                rows = exchange.local_rows_per_expert
            else:
                rows = plan.rows_per_expert
        with ranges.range("moe.experts"):
            out_rows = self.experts(buf, rows)
        with ranges.range("moe.combine"):
            if self.groups.distributed:
                out_rows = exchange.return_to_tokens(out_rows, self.groups)
            weight = routing.weight.to(out_rows.dtype)
            out = perm.unpermute(out_rows, weight, plan.token_slot, plan.slot_token)
        self.last_routing = routing
        cfg = self.config
        self.loss = cfg.aux_loss_coef * routing.aux_loss + cfg.z_loss_coef * routing.z_loss
        return out.reshape(x.shape).to(x.dtype)

    def _agreed_capacity(self, tokens: torch.Tensor) -> int:
        """The expert group's largest C: see Note [one capacity per expert group].

        Cost: one all-reduce (MAX) of one int64 over the expert group per forward.
        """
        local = self.gate.capacity_for(tokens.shape[0])
        assert local is not None
        agreed = torch.tensor([local], dtype=torch.int64, device=tokens.device)
        comm.all_reduce(agreed, op=comm.ReduceOp.MAX, group=self.groups.expert_group)
        return int(agreed.item())


# Note [one capacity per expert group]
# When dropping, every rank sends E·C rows to the all-to-all and expects E·C back, with equal
# splits; C follows the rank's token count S, so a short last batch on one rank would give
# unequal buffers (gloo aborts the process). The layer takes the maximum C over the expert
# group: the rank with fewer tokens keeps every assignment it would have kept with its own C
# (positions below its C are below the maximum too) and more, and pads the rest with zero rows.
# DeepSpeed agrees C this way only when not dropping.


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every `MoE` layer of `model`, in `named_modules` order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Σ over the model's MoE layers of their last forward's weighted router losses.

    Raises if a layer has not run a forward since it was built.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError("aux_loss: the model has no MoE layer; call replace_mlp first")
    losses = []
    for layer in layers:
        if layer.loss is None:
            raise RuntimeError(
                "aux_loss: an MoE layer has not run forward yet; call the model first"
            )
        losses.append(layer.loss)
    return torch.stack(losses).sum()


def groups_of(model: nn.Module) -> ExpertGroups:
    """The `ExpertGroups` the model's MoE layers share (they must share one)."""
    found = {id(layer.groups): layer.groups for layer in moe_layers(model)}
    if len(found) != 1:
        raise ValueError(
            f"groups_of: the model's MoE layers use {len(found)} ExpertGroups; build the layers "
            "with one shared ExpertGroups (replace_mlp does)"
        )
    return next(iter(found.values()))


def _hidden_size(module: nn.Module) -> int:
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            return sub.in_features
    raise ValueError(
        f"replace_mlp: cannot infer the hidden size of {type(module).__name__} (no nn.Linear); "
        "pass hidden_size="
    )


def replace_mlp(
    model: nn.Module,
    config: MoEConfig,
    *,
    name: str = "mlp",
    hidden_size: int | None = None,
    groups: ExpertGroups | None = None,
    seed: int = 0,
) -> nn.Module:
    """Replace every submodule whose attribute name is `name` with an `MoE` of copies of it.

    The engine's entry point (after pipeline partitioning, before ZeRO). The hidden size is the
    first `nn.Linear`'s `in_features` unless given. Layers share one `ExpertGroups` (built here,
    collectively, when not given); layer i seeds its experts with `seed + 1000 · i`. Returns
    `model`, changed in place.
    """
    targets = [
        (parent, child_name)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if child_name == name and not isinstance(child, MoE)
    ]
    if not targets:
        raise ValueError(
            f"replace_mlp: no submodule named {name!r}; pass name= the MLP's attribute"
        )
    if groups is None:
        groups = ExpertGroups(config.expert_parallel_degree)
    for i, (parent, child_name) in enumerate(targets):
        mlp = getattr(parent, child_name)
        d = hidden_size if hidden_size is not None else _hidden_size(mlp)
        setattr(parent, child_name, MoE(d, mlp, config, groups, seed=seed + 1000 * i))
    return model
