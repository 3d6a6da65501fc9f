"""A tiny model with one MoE layer, built the same way on one process and on many."""

from __future__ import annotations

import torch
from torch import nn

import minispeed.moe as moe

HIDDEN, FFN, NUM_EXPERTS, TOKENS = 8, 16, 4, 12


class Block(nn.Module):
    """in-projection (dense) -> mlp (becomes the MoE) -> out-projection (dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.mlp(h))


def config(ep: int, drop: bool, top_k: int = 2) -> moe.MoEConfig:
    # capacity_factor 0.5 and min_capacity 1: experts overflow, so dropping really drops.
    return moe.MoEConfig(
        num_experts=NUM_EXPERTS,
        expert_parallel_degree=ep,
        top_k=top_k,
        capacity_factor=0.5,
        min_capacity=1,
        drop_tokens=drop,
        random_token_selection=False,
        aux_loss_coef=0.1,
        z_loss_coef=0.01,
    )


def build(cfg: moe.MoEConfig, groups: moe.ExpertGroups | None = None) -> nn.Module:
    torch.manual_seed(0)
    return moe.replace_mlp(Block(), cfg, groups=groups)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (input, target) at `step`: 2 sequences of TOKENS // 2 tokens."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(2, TOKENS // 2, HIDDEN, generator=g)
    return x, torch.randn(2, TOKENS // 2, HIDDEN, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y) + moe.aux_loss(model)


def named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by parameter name, expert parameters renamed by GLOBAL expert id."""
    out = {}
    for layer_name, m in model.named_modules():
        if isinstance(m, moe.Experts):
            for gid, expert in zip(m.global_ids, m.local_experts):
                for n, p in expert.named_parameters():
                    out[f"{layer_name}.expert{gid}.{n}"] = p.grad.clone()
    experts = {id(p) for p in moe.expert_parameters(model)}
    for n, p in model.named_parameters():
        if id(p) not in experts:
            out[n] = p.grad.clone()
    return out
