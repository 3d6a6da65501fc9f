"""The experts a rank holds: E / E_p copies of one expert module, each with its global id.

Expert g (global id) lives on the rank whose expert-parallel coordinate is g // (E/E_p), as
local expert g % (E/E_p). Its initial weights depend on g and the seed only (not on E_p), so a
model built with any expert-parallel degree starts from the same experts: see Note [expert init].

Note [expert init]
Each copy is re-initialized by calling `reset_parameters()` on its submodules under a private
RNG state seeded with `seed + g`. Without that, deep copies would start identical and the
router could never tell them apart except by noise; and seeding by global id (not by rank)
keeps one process with all experts and E_p processes with a share each bit-identical.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["Experts"]


class Experts(nn.Module):
    """`num_local` experts with global ids `first_global_id ...`; runs each on its rows."""

    def __init__(
        self, expert: nn.Module, num_local: int, first_global_id: int, seed: int = 0
    ) -> None:
        super().__init__()
        self.first_global_id = first_global_id
        self.local_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local))
        for i, module in enumerate(self.local_experts):
            _reinit(module, seed + first_global_id + i)

    @property
    def global_ids(self) -> list[int]:
        """Global id of each local expert, in local order."""
        return [self.first_global_id + i for i in range(len(self.local_experts))]

    def forward(self, x: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        """`x` (Σ rows, d) grouped by local expert; returns the experts' outputs, same layout.

        FLOPs: those of each expert on its rows (for an MLP d → h → d, 4·rows·d·h forward).
        """
        chunks = x.split(rows_per_expert)
        return torch.cat([expert(c) for expert, c in zip(self.local_experts, chunks)])


def _reinit(module: nn.Module, seed: int) -> None:
    """See Note [expert init]."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
