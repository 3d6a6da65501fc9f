"""The engine's process grid: pipe × data × tensor, built once from the config.

```text
rank = (pipe · D + data) · T + tensor        tensor fastest, then data, then pipe
8 ranks, P = D = T = 2:
rank:    0      1      2      3      4      5      6      7
(p,d,t): (0,0,0)(0,0,1)(0,1,0)(0,1,1)(1,0,0)(1,0,1)(1,1,0)(1,1,1)
tensor groups [0,1] [2,3] [4,5] [6,7]    data groups [0,2] [1,3] [4,6] [5,7]
pipe groups   [0,4] [1,5] [2,6] [3,7]
```

Megatron-LM's and DeepSpeed's order (`PipeModelDataParallelTopology`: axes pipe, data, model):
the tensor axis, whose all-reduces run inside every layer, on adjacent ranks (one node); the
data axis, which talks once per step, next; pipeline stages, which exchange activations only,
outermost. What each axis carries:

| axis | collectives |
|---|---|
| tensor | the split layers' all-reduces (forward and backward, `minispeed.tensor_parallel.costs`), the vocabulary-parallel loss, the clipping norm's and fp16 verdict's scalar all-reduce |
| data | ZeRO's gradient reduction and parameter all-gather (`minispeed.zero`), replicas' broadcast at build |
| pipe | activations and their gradients (point to point), tied layers' gradient sums, the norm's and verdict's scalars |

`tensor_parallel.autotp_size` (DeepSpeed's key) gives T; a `PipelineModule` gives P; D is what
is left: `world / (P · T)`. A world size the grid does not tile is a `ConfigError` raised by
`grid_shape` on every rank before any collective (every rank computes the same arithmetic).

MiCS (`zero_optimization.mics_shard_size` = S) cuts each data line into D/S shard groups of S
consecutive data ranks (parameters partitioned inside one, replicated across them) and D/S-rank
replica groups (`mics_groups`; `minispeed.zero.MicsGroups`): S must divide D (`check_mics_size`).
```text
4 ranks, D = 4, S = 2:   data [0,1,2,3]   shard groups [0,1] [2,3]   replica groups [0,2] [1,3]
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.config import ConfigError
from minispeed.engine.sequence_groups import check_world_divides
from minispeed.tensor_parallel import TensorParallelConfig
from minispeed.tensor_parallel.sharding import sharded_parameters

__all__ = [
    "AXES",
    "build_grid",
    "check_mics_size",
    "check_optimizer",
    "grid_shape",
    "mics_groups",
    "model_parallel",
    "tensor_parallel_size",
]

AXES = ("pipe", "data", "tensor")
"""Outermost first; the last varies fastest (`minispeed.comm.ProcessTopology` is row-major)."""


def tensor_parallel_size(ds: Mapping[str, Any]) -> int:
    """T from the ds_config's `tensor_parallel` section (`TensorParallelConfig`, the rule
    `EngineConfig` reads it with: `autotp_size` absent, 0 or 1 is no tensor parallelism), read
    before `EngineConfig` because the data-parallel size it needs depends on T. Local; raises
    `ConfigError` naming the key."""
    return TensorParallelConfig.from_section(ds.get("tensor_parallel")).size


def grid_shape(world_size: int, pipe: int, tensor: int, sequence: int = 1) -> dict[str, int]:
    """`{"pipe": P, "data": D, "tensor": T, "sequence": S}` with `D = world / (P · T · S)`; a
    `ConfigError` naming the sizes and the ones that fit when `P · T · S` does not divide the
    world size. Local. S > 1 comes with P = T = 1 (`sequence_groups.check_sequence_grid`): its
    groups are `sequence_groups`' data x sequence grid, not built here."""
    if sequence > 1:
        check_world_divides(sequence, world_size)
        return {"pipe": 1, "data": world_size // sequence, "tensor": 1, "sequence": sequence}
    if world_size % (pipe * tensor):
        fits = [t for t in range(1, world_size + 1) if world_size % (pipe * t) == 0]
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"the process grid pipe {pipe} x tensor {tensor} (x data) does not tile the world "
            f"of {world_size} processes: pipe x data x tensor must equal the world size. With "
            f"{pipe} pipeline stage(s), pick autotp_size among {fits}, or launch "
            f"{pipe * tensor}·k processes",
        )
    return {"pipe": pipe, "data": world_size // (pipe * tensor), "tensor": tensor, "sequence": 1}


def build_grid(shape: Mapping[str, int]) -> comm.ProcessGrid:
    """The process groups of `shape` (collective: every rank of the world, same shape). The
    pipe axis is left out when P = 1 (no singleton groups to create)."""
    axes = [a for a in AXES if a != "pipe" or shape["pipe"] > 1]
    return comm.ProcessGrid(comm.ProcessTopology(axes, [shape[a] for a in axes]))


def check_mics_size(shape: Mapping[str, int], shard_size: int, trains: bool = True) -> None:
    """MiCS's shard size against the grid: S must divide the data axis, and, when the engine
    `trains`, the other axes are not composed with it yet (forward only, stage 3 without an
    optimizer, runs MiCS inside each tensor slice's data line: it has no norm and no tied
    gradients to combine over them). Local: a `ConfigError` on every rank before any
    collective."""
    if shard_size < 1:
        return
    data = shape["data"]
    if data % shard_size:
        fits = [s for s in range(1, data + 1) if data % s == 0]
        raise ConfigError(
            "zero_optimization.mics_shard_size",
            f"{shard_size} does not divide the data-parallel size {data} (pipe {shape['pipe']} x "
            f"data {data} x tensor {shape['tensor']}): MiCS cuts the data "
            f"ranks into groups of S; pick S among {fits} (usually the ranks of one node), or -1",
        )
    if trains and (shape["tensor"] > 1 or shape["pipe"] > 1):
        raise ConfigError(
            "zero_optimization.mics_shard_size",
            "MiCS with tensor or pipeline parallelism is not implemented for training (the norm "
            "and tied gradients over those axes are untested under it); drop "
            "tensor_parallel.autotp_size or the pipeline, or mics_shard_size (without an "
            "optimizer, stage 3 runs MiCS on a tensor-parallel grid)",
        )


def mics_groups(grid: comm.ProcessGrid | None, shard_size: int, hierarchical: bool = False) -> Any:
    """The MiCS groups of every data line of `grid` (None: the world is one data line).
    Collective: every rank of the world, once, after `check_mics_size`. `hierarchical`: also
    the two-level gathers (`zero_optimization.mics_hierarchical_params_gather`)."""
    if grid is None:
        return zero.MicsGroups.build(shard_size, hierarchical=hierarchical)
    lines = [[grid.ranks[r] for r in line] for line in grid.topology.axis_groups("data")]
    return zero.MicsGroups.build(
        shard_size, lines, data_group=grid.group("data"), hierarchical=hierarchical
    )


def check_optimizer(
    optimizer: Any,
    module: nn.Module,
    grid: comm.ProcessGrid,
    ties: list[tuple[nn.Parameter, Any, bool]] | None = None,
) -> Any:
    """`optimizer`, once `model_parallel`'s parameters are found among its own: the check
    `zero.shard` makes on each rank alone, made before it so that `initialize` can raise it on
    every rank (`minispeed.tensor_parallel.agreed`)."""
    if optimizer is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        model_parallel(module, grid, ties or []).check(params)
    return optimizer


def model_parallel(
    module: nn.Module,
    grid: comm.ProcessGrid,
    ties: list[tuple[nn.Parameter, Any, bool]] = (),  # type: ignore[assignment]
) -> zero.ModelParallel:
    """`zero.ModelParallel` for a module on `grid`: the norm and fp16 verdict over the pipe axis
    (when there is one) and the tensor axis; a tied parameter counted on its lowest stage, a
    parameter replicated over the tensor group (norms, row biases) on tensor rank 0 only, a
    split one on every tensor rank (its squares summed over the tensor group)."""
    axes = grid.topology.axes
    groups = tuple(grid.group(a) for a in ("pipe", "tensor") if a in axes and grid.size(a) > 1)
    elsewhere = [p for p, _, lowest in ties if not lowest]
    if "tensor" in axes and grid.rank_in("tensor") != 0:
        split = {id(module.get_parameter(n)) for n in sharded_parameters(module)}
        elsewhere += [p for p in module.parameters() if id(p) not in split]
    unique = list({id(p): p for p in elsewhere}.values())
    return zero.ModelParallel(
        groups=groups,
        shared=tuple((p, group) for p, group, _ in ties),
        counted_elsewhere=tuple(unique),
    )
