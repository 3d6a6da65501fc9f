"""Which slice of a weight each rank keeps, and putting the slices back together.

A weight is cut along one dimension into `n` equal slices, rank r keeping slice r. A fused weight
(GPT's `qkv`: q, k and v stacked) is first cut into `parts` equal parts, each part cut into `n`,
and rank r keeps slice r of every part, concatenated: so each rank holds whole heads of q, k and
v alike. `ShardSpec` records the cut; `shard` applies it; `unshard` gathers the slices back into
the whole tensor (one all-gather of the whole tensor's bytes), which is how tests compare
gradients with the unsplit model and how a checkpoint can be written independent of `n`.

This is the one implementation of the split: the training layers of this package and
`minispeed.inference`'s tensor-parallel blocks both slice through `shard`.
"""

from __future__ import annotations

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
    """How one parameter is cut: along `dim`, in `parts` equal parts each split over the group."""

    dim: int
    """The dimension cut (0: the rows of an `nn.Linear` weight, its output features)."""
    parts: int = 1
    """Fused parts cut separately (3 for a fused q/k/v weight)."""

    def check(self, size: int, n: int, what: str) -> None:
        """Raise a `ValueError` naming `what` when `size` does not split into parts × n."""
        if size % (self.parts * n):
            per = f" in {self.parts} parts" if self.parts > 1 else ""
            raise ValueError(
                f"{what}: dimension {self.dim} has size {size}, which does not split{per} over "
                f"{n} tensor-parallel ranks; pick a size dividing {size // self.parts}"
            )


def shard(t: torch.Tensor, spec: ShardSpec, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s slice of `t` (a contiguous copy, detached): `1/n` of its bytes."""
    parts = t.detach().chunk(spec.parts, spec.dim)
    return torch.cat([p.chunk(n, spec.dim)[rank] for p in parts], spec.dim).contiguous()


def unshard(local: torch.Tensor, spec: ShardSpec, tg: TensorGroup) -> torch.Tensor:
    """The whole tensor from every rank's slice (collective: one all-gather of its bytes)."""
    gathered = all_gather_along(local.detach(), spec.dim, tg)  # slices in rank order
    return _part_major(gathered, spec, tg.size)


def join(slices: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The whole tensor from the slices of ranks 0..n-1, in order (local: the inverse of
    `shard`; e.g. a checkpoint's slices re-cut for another tensor-parallel size)."""
    return _part_major(torch.cat([t.detach() for t in slices], spec.dim), spec, len(slices))


def _part_major(gathered: torch.Tensor, spec: ShardSpec, n: int) -> torch.Tensor:
    if spec.parts == 1 or n == 1:
        return gathered
    # rank-major (rank, part, piece) -> part-major (part, rank, piece)
    pieces = gathered.chunk(n * spec.parts, spec.dim)
    return torch.cat(
        [pieces[r * spec.parts + p] for p in range(spec.parts) for r in range(n)], spec.dim
    )


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
