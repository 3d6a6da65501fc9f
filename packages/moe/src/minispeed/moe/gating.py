"""The gate: which k experts each token goes to, with what weight, and which assignments fit.

A linear router scores every token against every expert; the top-k scores pick the experts;
capacity decides which assignments survive; two losses keep the router healthy. Everything the
decision is made from stays on the returned `Routing`, so a user can look at it.

Cost: the router is one (S, d) × (d, E) matmul, 2·S·d·E FLOPs, plus O(S·E) softmax and
O(k·S·log(k·S)) for the stable sort that ranks assignments inside each expert.

Note [priority inside an expert]
When an expert is offered more than C assignments, which ones stay? `drop_order` decides the
priority of the k·S assignments:

- `"choice"` (GShard): choice by choice (every token's first choice before any second choice),
  and inside a choice either by token position or, with random token selection, by a random
  permutation of the tokens (so late tokens in a sequence are not the ones always dropped);
- `"probability"` (DeepSpeed's top-k gate, k >= 3): by router probability, highest first.

`position[s, j]` is the rank of assignment (s, j) among those offered to its expert, in that
priority; it is kept iff position < C. The ranking is a stable sort by expert of the
assignments in priority order, not a one-hot cumsum over (S, E).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minispeed.moe import costs
from minispeed.moe.config import MoEConfig

__all__ = ["JITTER_EPS", "Routing", "TopKGate", "load_balancing_loss", "router_z_loss"]

JITTER_EPS = 1e-2


@dataclasses.dataclass(frozen=True)
class Routing:
    """The gate's decision for S tokens, and the tensors it was computed from."""

    expert_index: torch.Tensor
    """(S, k) int64: expert of each token's j-th choice (distinct within a row)."""
    weight: torch.Tensor
    """(S, k) fp32, differentiable: gate weight of each choice (k = 1: the softmax probability;
    k > 1: probabilities renormalized over the k choices, or over the kept ones with
    `weights_over="kept"`, where dropped choices weigh 0). The combine skips dropped choices."""
    kept: torch.Tensor
    """(S, k) bool: whether the assignment fits in its expert's capacity."""
    position: torch.Tensor
    """(S, k) int64: rank among the assignments offered to the same expert
    (see Note [priority inside an expert])."""
    probs: torch.Tensor
    """(S, E) fp32: router softmax."""
    logits: torch.Tensor
    """(S, E) fp32: router logits."""
    expert_counts: torch.Tensor
    """(E,) int64: assignments offered to each expert (all k choices, before dropping)."""
    kept_counts: torch.Tensor
    """(E,) int64: assignments each expert accepted."""
    capacity: int | None
    """C, assignments per expert when dropping; None when nothing is dropped."""
    aux_loss: torch.Tensor
    """Scalar: the load-balancing loss `load_balancing_loss(probs, expert_index[:, :1])`
    (`expert_index` whole with `aux_loss_choices="all"`)."""
    z_loss: torch.Tensor
    """Scalar: the router z-loss `router_z_loss(logits)`."""

    @property
    def dropped_assignments(self) -> int:
        """Assignments that did not fit: k·S − Σ kept_counts."""
        return int((~self.kept).sum())

    @property
    def dropped_tokens(self) -> int:
        """Tokens none of whose k choices fit (their MoE output is zero)."""
        return int((~self.kept.any(dim=1)).sum())


def load_balancing_loss(probs: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """The Switch/GShard auxiliary loss `E/j · Σ_e f_e · P_e`.

    `choices` is (S,) or (S, j) experts per token (the first choices: Switch and GShard; all k:
    DeepSpeed's top-k gate). f_e = fraction of tokens having e among their choices (counted, so
    not differentiable), P_e = mean router probability of e (differentiable). Its minimum, 1,
    is reached when routing is uniform (f_e = j/E, P_e = 1/E); concentrating tokens on few
    experts raises it, so its gradient lowers the probability of experts that already receive
    more than their share. Zero for S = 0.
    """
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum() * 0.0  # no tokens, no imbalance (a mean over none would be NaN)
    choices = choices.reshape(num_tokens, -1)
    counts = torch.bincount(choices.reshape(-1), minlength=num_experts)
    f = counts.to(probs.dtype) / num_tokens
    p = probs.mean(dim=0)
    return num_experts / choices.shape[1] * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss `mean_s (logsumexp_e logits[s, e])²`: keeps logits small (bf16-safe)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0  # zero, and still part of the graph
    return torch.logsumexp(logits, dim=-1).square().mean()


def _gumbel_like(t: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise shaped like `t`: -log(-log u), u uniform on [tiny, 1 - eps), computed
    as torch's `Gumbel(0, 1).rsample` computes it, so a draw from the same RNG state is the
    same noise (DeepSpeed's gates draw theirs that way)."""
    info = torch.finfo(t.dtype)
    u = info.tiny + torch.rand_like(t) * (1.0 - info.eps)
    return -torch.log(-torch.log(u))


class TopKGate(nn.Module):
    """Router of one MoE layer: `wg` (d → E, no bias) and the routing rules of `config`.

    The router computes in fp32 whatever dtype the model is cast to (input and weight are cast
    on the way in), so routing decisions do not change with the training precision.
    """

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.wg = nn.Linear(hidden_size, config.num_experts, bias=False, dtype=torch.float32)

    def capacity_for(self, num_tokens: int) -> int | None:
        """C for `num_tokens` tokens in the current mode (None when not dropping)."""
        cfg = self.config
        if not cfg.drop_tokens:
            return None
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        return costs.capacity(num_tokens, cfg.num_experts, cfg.top_k, factor, cfg.min_capacity)

    def forward(self, x: torch.Tensor, capacity: int | None = None) -> Routing:
        """Route `x` (S, d). Noise and random token selection apply in training mode only.

        `capacity` overrides C (dropping only): the layer passes the maximum of its expert
        group's capacities, so ranks holding different token counts share one buffer shape.
        """
        cfg = self.config
        x = x.float()  # the router runs in fp32 whatever the model's dtype
        if self.training and cfg.noisy_gate_policy == "jitter":
            x = x * torch.empty_like(x).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        # fp32 even when the model was cast to bf16: the softmax and the top-k need the bits.
        return self.route(nn.functional.linear(x, self.wg.weight.float()), capacity)

    def route(self, logits: torch.Tensor, capacity: int | None = None) -> Routing:
        """Route from the router's (S, E) fp32 `logits` (what `forward` computes from `x`): the
        choice, the capacity and the weights, with `config`'s rules (noise and random token
        selection in training mode only)."""
        cfg = self.config
        probs = torch.softmax(logits, dim=-1)
        expert_index = self._choose(logits.detach())  # (S, k)
        num_tokens = logits.shape[0]
        if capacity is not None and not cfg.drop_tokens:
            raise ValueError("TopKGate: capacity= needs drop_tokens=True (nothing is dropped)")
        position, expert_counts = self._rank_in_expert(expert_index, probs.detach())
        if cfg.drop_tokens:
            cap = self.capacity_for(num_tokens) if capacity is None else capacity
            kept = position < cap
        else:
            cap, kept = None, torch.ones_like(position, dtype=torch.bool)
        kept_counts = torch.bincount(expert_index[kept], minlength=cfg.num_experts)
        weight = probs.gather(1, expert_index)  # (S, k)
        if cfg.top_k > 1:
            shares = weight * kept if cfg.weights_over == "kept" else weight
            weight = shares / shares.sum(dim=1, keepdim=True).clamp(
                min=torch.finfo(torch.float32).eps
            )
        aux_choices = expert_index if cfg.aux_loss_choices == "all" else expert_index[:, :1]
        return Routing(
            expert_index=expert_index,
            weight=weight,
            kept=kept,
            position=position,
            probs=probs,
            logits=logits,
            expert_counts=expert_counts,
            kept_counts=kept_counts,
            capacity=cap,
            aux_loss=load_balancing_loss(probs, aux_choices),
            z_loss=router_z_loss(logits),
        )

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """(S, k) distinct experts per token, greedy unless a training-time sampling policy applies."""
        cfg = self.config
        chosen = []
        masked = logits.clone()
        for j in range(cfg.top_k):
            scores = masked
            if self.training and (
                (j == 0 and cfg.noisy_gate_policy == "rsample")
                or (j > 0 and cfg.second_expert_sampling)
            ):
                scores = masked + _gumbel_like(masked)
            pick = scores.argmax(dim=1)  # (S,)
            chosen.append(pick)
            masked = masked.scatter(1, pick[:, None], float("-inf"))
        return torch.stack(chosen, dim=1)

    def _priority(self, expert_index: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """(k·S,) flat indices into `expert_index` in priority order: see
        Note [priority inside an expert]."""
        cfg = self.config
        num_tokens, k = expert_index.shape
        device = expert_index.device
        if cfg.drop_order == "probability":
            chosen_probs = probs.gather(1, expert_index).reshape(-1)
            return torch.sort(chosen_probs, descending=True, stable=True).indices
        if self.training and cfg.random_token_selection and cfg.drop_tokens:
            token_order = torch.randperm(num_tokens, device=device)
        else:
            token_order = torch.arange(num_tokens, device=device)
        # Choice-major: (j, i) -> assignment (token_order[i], j), flat index token·k + j.
        return (token_order[None, :] * k + torch.arange(k, device=device)[:, None]).reshape(-1)

    def _rank_in_expert(
        self, expert_index: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(position (S, k), counts (E,)): see Note [priority inside an expert]."""
        order = self._priority(expert_index, probs)  # (k·S,)
        experts_in_order = expert_index.reshape(-1)[order]
        counts = torch.bincount(experts_in_order, minlength=self.config.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        by_expert = torch.sort(experts_in_order, stable=True).indices  # (k·S,)
        rank_in_order = torch.empty_like(by_expert)
        rank_in_order[by_expert] = (
            torch.arange(by_expert.numel(), device=by_expert.device)
            - starts[experts_in_order[by_expert]]
        )
        # Back from priority order to (token, choice).
        position = torch.empty_like(rank_in_order)
        position[order] = rank_in_order
        return position.view_as(expert_index), counts
