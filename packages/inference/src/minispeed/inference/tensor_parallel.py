"""Tensor parallelism for inference: each block's attention and MLP split over a TP group of n ranks.

The Megatron split. Rank r of n keeps:

- **attention, column-parallel by heads**: the rows of W_q, W_k, W_v (GPT's fused `qkv`: rows of
  each of its three parts) for heads `[r·H/n, (r+1)·H/n)`; it attends over those heads only,
  so its KV cache holds H/n heads (LLaMA: KV/n key/value heads, grouped-query attention stays
  local because head h reads kv head `h // (H/KV)` and both ranges are cut at the same place);
- **attention output, row-parallel**: the columns of W_o that read those heads: each rank's
  product is a partial sum of the output, summed by one all-reduce, then the bias is added once;
- **MLP**: W_fc (and LLaMA's gate and up) column-parallel (rows `[r·F/n, (r+1)·F/n)` with their
  bias slice; GeLU / SiLU are elementwise, so they run on the slice), W_proj (down) row-parallel:
  one all-reduce, then the bias.

Norms, embeddings and the output head stay whole on every rank (replicated), so every rank ends
with the same logits and samples the same tokens.

```text
                x (B, T, C), the same on every rank
                        │  LayerNorm 1 (replicated)
          ┌─────────────┴─────────────┐
   qkv rows, heads 0..H/n-1     qkv rows, heads H/n..2H/n-1        column-parallel (no comm)
   attention + KV cache (H/n)   attention + KV cache (H/n)
   W_o columns of its heads     W_o columns of its heads           row-parallel: partial sums
          └──────── all-reduce (sum) ─┘ + bias + x                 all-reduce #1 of the block
                        │  LayerNorm 2 (replicated)
          ┌─────────────┴─────────────┐
   fc rows F/n, GeLU            fc rows F/n, GeLU                  column-parallel
   proj columns F/n             proj columns F/n                   row-parallel
          └──────── all-reduce (sum) ─┘ + bias + h                 all-reduce #2 of the block
```

Costs, with L blocks, width C, n ranks, fp32:

- all-reduces per forward of M tokens (a prefill of T tokens: M = T; a decode step of B sequences:
  M = B): `2·L`, each of `4·M·C` bytes; a ring sends `2(n−1)/n · 4·M·C` bytes per rank for each
  (`allreduce_cost`);
- weight bytes per rank: each block's linears / n (plus the replicated norms, the row-parallel
  biases, the embeddings and the head); KV cache bytes per rank: 1/n of TP=1's.

The split itself is `minispeed.tensor_parallel`'s, the one training uses: the slices come from
its `shard` (`ShardSpec(0, parts)` for the column layers, `ShardSpec(1)` for the row layers),
the all-reduce from its `reduce_from_parallel`, the size check from its `check_divides`, and
`TPContext` is its `TensorGroup`. What stays here is inference's own: the config, the group it
builds when none is given, and module copies fit for the fused kernels (plain or int8 linears).

The group: a `ProcessGrid` with axes `("data", "tensor")` built over the world, or a group
handle / `ProcessGrid` the caller passes as `tp_group`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.tensor_parallel as tp
from minispeed.core.config import field_error
from minispeed.core.sections import Section, key, read_section

__all__ = [
    "RowParallelLinear",
    "TPConfig",
    "TPContext",
    "allreduce_cost",
    "check_divides",
    "column_shard",
    "resolve",
    "row_shard",
    "split_by_structure",
]


@dataclass(frozen=True)
class TPConfig(Section):
    """`init_inference(tensor_parallel=...)`: DeepSpeed's inference `tensor_parallel` section
    (`init_inference` also takes the TP size as an int, or a `TPConfig`)."""

    ds_path: ClassVar[str] = "tensor_parallel"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default
    ds_extra: ClassVar[dict[str, Any]] = {
        "enabled": {
            "type": "boolean",
            "default": True,
            "description": "False: no tensor parallelism, whatever tp_size says.",
        }
    }

    tp_size: int = key("tp_size", 1)
    """Ranks that split each block (1: no tensor parallelism)."""
    tp_group: Any = key("tp_group", None)
    """None: a `("data", "tensor")` `ProcessGrid` over the world is built (collective: every rank
    calls `init_inference`); or a process group from `minispeed.comm.new_group`, or a `ProcessGrid`
    with a `"tensor"` (or `"model"`) axis."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp_size < 1:
            raise field_error(self, "tp_size", f"must be an int >= 1, got {self.tp_size!r}")

    @classmethod
    def from_section(
        cls, section: Mapping[str, Any] | None = None, *, path: str | None = None
    ) -> TPConfig:
        """From DeepSpeed's keys `tp_size`, `enabled` (false means tp_size 1) and `tp_group`;
        other keys are errors naming the nearest known one."""
        path = cls.ds_path if path is None else path
        if isinstance(section, Mapping) and "enabled" in section:
            section = dict(section)
            if not section.pop("enabled"):
                section.pop("tp_size", None)
                section.pop("tp_group", None)
        return read_section(cls, section, path)


TPContext = tp.TensorGroup
"""This rank's place in the TP group: `rank` of `size`, and the group to all-reduce over."""


def check_divides(tp_size: int, sizes: dict[str, int]) -> None:
    """Raise a `ValueError` naming each of `sizes` (heads, kv heads, MLP width) `tp_size` does not divide.

    Called before any group is built: every rank reaches the same verdict without talking.
    """
    tp.check_divides(tp_size, sizes, label="tensor_parallel tp_size")


def resolve(cfg: TPConfig) -> TPContext | None:
    """The `TPContext` of this rank (collective when it builds a grid), or None for tp_size 1."""
    n = cfg.tp_size
    if n == 1 and cfg.tp_group is None:
        return None
    if not comm.is_initialized():
        raise RuntimeError(
            f"tensor_parallel tp_size={n} needs a process group: call "
            "minispeed.comm.init_distributed() on every rank first (or launch with torchrun)"
        )
    group = cfg.tp_group
    if group is None:
        world = comm.get_world_size()
        if world % n:
            raise ValueError(
                f"tensor_parallel tp_size={n} does not tile the world of {world} ranks; pick a "
                f"divisor of {world}: {[d for d in range(1, world + 1) if world % d == 0]}"
            )
        grid = comm.ProcessGrid(comm.ProcessTopology(("data", "tensor"), (world // n, n)))
        return TPContext(grid.rank_in("tensor"), n, grid.group("tensor"))
    try:
        ctx = TPContext.of(group)  # a handle, a ProcessGrid (its tensor axis) or a TensorGroup
    except ValueError as err:
        raise ValueError(f"tensor_parallel tp_group: {err}") from None
    if ctx.size != n:
        raise ValueError(
            f"tensor_parallel tp_size={n} but the given tp_group has {ctx.size} ranks: make them "
            "equal"
        )
    return ctx


def split_by_structure(model: nn.Module, cfg: TPConfig) -> tuple[str, ...]:
    """AutoTP for inference: `model` cut in place over `cfg`'s group by the plan read from its
    structure (`minispeed.tensor_parallel.auto_plan`), for a model no injection policy fuses
    (Qwen2, Mistral, OPT, GPT-NeoX, ...) or when fused kernels are not asked for. Returns the
    paths of the modules split.

    The model then runs its own forward and `generate`: each decoder layer's attention and MLP
    split as in the module docstring (column then row, two all-reduces per layer of `4·M·C`
    bytes), its output head column-parallel with the logits all-gathered (`4·M·V` bytes per
    forward), so every rank holds the whole logits and samples the same tokens; a tied head,
    the embeddings and the norms stay whole. Every rank must hold the same weights (the same
    `from_pretrained`, or the same seed), as under DeepSpeed. The plan and its size checks run
    before the group is built: a module the plan does not recognise, or a size that does not
    divide the heads, is a `ValueError` on every rank, naming the module or the counts.
    """
    plan = tp.auto_plan(model)
    check_divides(cfg.tp_size, plan.divides)
    ctx = resolve(cfg)
    tp.parallelize(model, plan, ctx)
    model.eval()
    return tuple(
        p
        for p, m in model.named_modules()
        if isinstance(m, tp.ColumnParallelLinear | tp.RowParallelLinear)
    )


def _frozen_linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        out.bias = nn.Parameter(b, requires_grad=False)
    return out


def column_shard(linear: nn.Linear, tp_ctx: TPContext, parts: int = 1) -> nn.Linear:
    """This rank's output rows of `linear` (a copy): W `(N, K)` cut into `parts` equal parts
    (GPT's fused qkv: 3), each cut in `tp_ctx.size`; chunk `tp_ctx.rank` of each, concatenated
    (`minispeed.tensor_parallel.shard` with `ShardSpec(0, parts)`).

    Bytes kept: 4·N·K / n (+ 4·N / n of bias)."""
    spec, r, n = tp.ShardSpec(0, parts), tp_ctx.rank, tp_ctx.size
    bias = None if linear.bias is None else tp.shard(linear.bias, spec, r, n)
    return _frozen_linear(tp.shard(linear.weight, spec, r, n), bias)


def row_shard(linear: nn.Linear, tp_ctx: TPContext) -> nn.Linear:
    """This rank's input columns of `linear` (a copy, `ShardSpec(1)`), without the bias
    (`RowParallelLinear` adds it once, after the all-reduce). Bytes kept: 4·N·K / n."""
    return _frozen_linear(tp.shard(linear.weight, tp.ShardSpec(1), tp_ctx.rank, tp_ctx.size), None)


class RowParallelLinear(nn.Module):
    """`reduce_from_parallel(local(x)) + bias`: the row-parallel half of a split, one all-reduce
    per call (the training `minispeed.tensor_parallel.RowParallelLinear`'s forward, around a local
    product that may be int8).

    `local` is this rank's column slice (an `nn.Linear` or `Int8Linear`, bias-free): its output is
    a partial sum over the inputs this rank holds. Sends `2(n−1)/n · 4·M·N` bytes per rank for an
    `(M, N)` output.
    """

    def __init__(self, local: nn.Module, bias: torch.Tensor | None, tp_ctx: TPContext) -> None:
        super().__init__()
        self.local = local
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.tp = tp_ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp.reduce_from_parallel(self.local(x), self.tp)
        return y if self.bias is None else y.add_(self.bias)


def allreduce_cost(n_layer: int, width: int, tokens: int, tp_size: int) -> tuple[int, int, int]:
    """`(calls, message bytes, wire bytes per rank)` of one TP forward over `tokens` positions.

    `calls = 2·L` (attention out and MLP out of each block), each message `4·tokens·C` bytes
    (fp32), a ring sending `2(n−1)/n` of it per rank.
    """
    calls = 2 * n_layer
    msg = calls * 4 * tokens * width
    return calls, msg, msg * 2 * (tp_size - 1) // tp_size
