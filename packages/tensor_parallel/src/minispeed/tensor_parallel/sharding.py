"""Which slice of a weight each rank keeps, and putting the slices back together.

A weight is cut along one dimension into `n` equal slices, rank r keeping slice r. A fused weight
(GPT's `qkv`: q, k and v stacked) is first cut into its parts, each part cut into `n`, and rank r
keeps slice r of every part, concatenated: so each rank holds whole heads of q, k and v alike.
The parts are equal (`parts=3`) or in given proportions (`parts=(H, KV, KV)`: Phi-3's `qkv_proj`
under grouped-query attention, q of H heads then k and v of KV heads each). `ShardSpec` records
the cut; `shard` applies it; `unshard` gathers the slices back into the whole tensor (one
all-gather of the whole tensor's bytes), which is how tests compare gradients with the unsplit
model and how a checkpoint can be written independent of `n` (proportions, unlike row counts,
hold at every n).

This is the one implementation of the split: the training layers of this package and
`minispeed.inference`'s tensor-parallel blocks both slice through `shard`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from minispeed.tensor_parallel.group import TensorGroup
from minispeed.tensor_parallel.mappings import all_gather_along

__all__ = [
    "ShardSpec",
    "join",
    "shard",
    "sharded_parameters",
    "unshard",
    "unshard_module",
    "unshard_state_dict",
]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is cut: along `dim`, in `parts` parts each split over the group."""

    dim: int
    """The dimension cut (0: the rows of an `nn.Linear` weight, its output features)."""
    parts: int | tuple[int, ...] = 1
    """Fused parts cut separately: a count of equal parts (3 for a fused q/k/v weight), or the
    parts' proportions (`(H, KV, KV)`: q of H heads, k and v of KV heads each)."""

    def __post_init__(self) -> None:
        if isinstance(self.parts, list):  # as a checkpoint's specs read back
            object.__setattr__(self, "parts", tuple(self.parts))

    def sizes(self, size: int) -> list[int]:
        """The parts' lengths along `dim` of a tensor `size` long there (`check` refuses a size
        the proportions do not divide)."""
        weights = (1,) * self.parts if isinstance(self.parts, int) else self.parts
        unit = size // sum(weights)
        return [w * unit for w in weights]

    def check(self, size: int, n: int, what: str) -> None:
        """Raise a `ValueError` naming `what` when `size` does not split into its parts, each
        into n."""
        sizes = self.sizes(size)
        per = f" in parts {tuple(sizes)}" if len(sizes) > 1 else ""
        if sum(sizes) != size:
            fix = f"its parts ({self.parts}) do not divide it"
        elif any(s % n for s in sizes):
            fix = f"pick a size dividing {math.gcd(*sizes)}"
        else:
            return
        raise ValueError(
            f"{what}: dimension {self.dim} has size {size}, which does not split{per} over "
            f"{n} tensor-parallel ranks; {fix}"
        )


def shard(t: torch.Tensor, spec: ShardSpec, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s slice of `t` (a contiguous copy, detached): `1/n` of its bytes."""
    parts = t.detach().split(spec.sizes(t.shape[spec.dim]), spec.dim)
    return torch.cat([p.chunk(n, spec.dim)[rank] for p in parts], spec.dim).contiguous()


def unshard(local: torch.Tensor, spec: ShardSpec, tg: TensorGroup) -> torch.Tensor:
    """The whole tensor from every rank's slice (collective: one all-gather of its bytes)."""
    gathered = all_gather_along(local.detach(), spec.dim, tg)  # slices in rank order
    return part_major(gathered, spec, tg.size)


def join(slices: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The whole tensor from the slices of ranks 0..n-1, in order (local: the inverse of
    `shard`; e.g. a checkpoint's slices re-cut for another tensor-parallel size)."""
    return part_major(torch.cat([t.detach() for t in slices], spec.dim), spec, len(slices))


def part_major(gathered: torch.Tensor, spec: ShardSpec, n: int) -> torch.Tensor:
    """The unsplit order of `n` ranks' slices concatenated in rank order along `spec.dim`
    (rank-major `(rank, part, piece)` -> part-major `(part, rank, piece)`; local)."""
    sizes = spec.sizes(gathered.shape[spec.dim])
    if len(sizes) == 1 or n == 1:
        return gathered
    pieces = gathered.split([s // n for s in sizes] * n, spec.dim)
    p = len(sizes)
    return torch.cat([pieces[r * p + q] for q in range(p) for r in range(n)], spec.dim)


def sharded_parameters(module: nn.Module) -> dict[str, ShardSpec]:
    """Parameter name (relative to `module`) -> `ShardSpec`, for every tensor-parallel layer
    inside `module` (its `shard_specs`); parameters not listed are replicated."""
    out: dict[str, ShardSpec] = {}
    for prefix, m in module.named_modules():
        for name, spec in getattr(m, "shard_specs", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = spec
    return out


def unshard_module(
    module: nn.Module, tg: TensorGroup, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter of `module` whole, by name (its `.grad` with `grads=True`; parameters
    without a gradient are left out). Collective: every rank of the group calls it; one
    all-gather per sharded parameter, in the order of `named_parameters`."""
    specs = sharded_parameters(module)
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        out[name] = unshard(t, specs[name], tg) if name in specs else t.detach().clone()
    return out


def unshard_state_dict(module: nn.Module, tg: TensorGroup) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every split parameter whole (the unsplit model's state dict:
    its names, shapes and dtypes), e.g. to save a split Hugging Face model with
    `save_pretrained`. Collective: one all-gather per split parameter (its whole bytes), in the
    order of `named_parameters`; the rest is copied."""
    whole = unshard_module(module, tg)
    return {k: whole.get(k, v.detach().clone()) for k, v in module.state_dict().items()}
