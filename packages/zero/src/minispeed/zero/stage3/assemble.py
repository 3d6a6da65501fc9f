"""How ``zero.shard(model, optimizer, ZeroConfig(stage=3))`` builds stage 3, once: `assemble`.

Construction, in order (each step one block of `assemble`):

1. partition every parameter (or adopt the shards ``zero.Init`` already made): ShardedParam;
2. mixed precision: an fp32 master shard per parameter (the shard itself for fp32), the shard
   cast to ``param_dtype``;
3. persistent parameters (``numel <= stage3_param_persistence_threshold_numel``) gathered for good;
4. fetch units (one per module owning a non-persistent parameter, whose module has something to
   gather; a whole subtree for a leaf module; and the root), the coordinator, the module hooks (coordinator.py) and the attribute guards;
5. ZeRO++ when configured (zeropp.py): quantized / node-local gathers, quantized gradients;
6. gradient hooks: reduce-scatter into fp32 gradient shards (`GradShardReducer`, strategy.py).

The result is a `Stage3Strategy` (strategy.py), what the optimizer drives at every step. Costs
of the set-up: one broadcast of each parameter (Note [partitioning starts from the first rank's
values] in params.py) and one all-gather of the persistent parameters; the bytes it leaves on
each rank are `Stage3Strategy`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.config import ZeroConfig
from minispeed.zero.precision import MixedPrecision
from minispeed.zero.stage3.access import check_access, guard_module
from minispeed.zero.stage3.coordinator import FetchCoordinator, install_module_hooks
from minispeed.zero.stage3.init import is_leaf_module
from minispeed.zero.stage3.params import REGISTRY, FetchUnit, ShardedParam, partition_param
from minispeed.zero.stage3.released import guard_param
from minispeed.zero.stage3.residency import Residency
from minispeed.zero.stage3.strategy import GradShardReducer, Stage3Strategy
from minispeed.zero.stage3.trace import TraceCheck
from minispeed.zero.stage3.zeropp import ZeroPP, check_zeropp, zeropp_enabled

__all__ = ["assemble", "build_units"]


def assemble(
    model: nn.Module,
    config: ZeroConfig,
    precision: MixedPrecision,
    group: Any = None,
    *,
    param_groups: Sequence[Sequence[nn.Parameter]],
    reduce_scatter: Any = None,
    mics: Any = None,
) -> Stage3Strategy:
    """Stage 3 over ``model`` for an optimizer with ``param_groups`` (module docstring, in order).
    ``reduce_scatter``: the gradient collective when not comm's; ``mics``: the `MicsGroups` whose
    shard group ``group`` is (MiCS's two hops and groups, mics.py).

    Collective: every rank of ``group`` builds the same model and calls it.
    """
    world_size = comm.get_world_size(group)
    groups = [list(ps) for ps in param_groups]  # the optimizer's param groups
    node_size = 0  # ZeRO++ (stage3/zeropp.py): its errors come before any collective
    if zeropp_enabled(config):
        numels = [REGISTRY[p].numel if p in REGISTRY else p.numel() for p in model.parameters()]
        node_size = check_zeropp(config, group, numels, precision.param_dtype.itemsize)

    # 1. one ShardedParam per unique parameter (named_parameters() lists a tied one once).
    sharded: dict[nn.Parameter, ShardedParam] = {}
    for name, p in model.named_parameters():
        sp = REGISTRY.get(p)
        if sp is not None and sp.coordinator is not None:
            raise RuntimeError(
                f"parameter {name!r} is already managed by another stage-3 strategy; call its "
                f"close() before sharding the model again"
            )
        if sp is not None and (sp.world_size != world_size or sp.mics is not mics):
            raise ValueError(
                f"parameter {name!r} was partitioned by zero.Init over {sp.world_size} ranks "
                f"({'no' if sp.mics is None else 'a'} MiCS shard group) but zero.shard uses "
                f"{world_size} ({'no' if mics is None else 'a'} MiCS shard group); pass the same "
                f"group and the same ZeroConfig (mics_shard_size) to both"
            )
        sp = sp or partition_param(p, group, mics=mics)
        guard_param(p, sp)  # reads while released answer or raise (released.py)
        sp.name = name
        sharded[p] = sp
    trained = [sharded[p] for ps in groups for p in ps]

    # 2. masters and dtypes. See Note [fp32 stage 0 has no master copy] (stage0.py): same here.
    for sp in sharded.values():
        if sp.residency is Residency.AWAY:  # in a swap file since zero.Init(config)
            if sp.shard.dtype != precision.param_dtype:
                raise ValueError(
                    f"parameter {sp.name!r} was written to its swap file by zero.Init(config) "
                    f"as {sp.shard.dtype}, but MixedPrecision.param_dtype is "
                    f"{precision.param_dtype}: create the model in that dtype, or build it "
                    f"with zero.Init() (no config) and let zero.shard offload it"
                )
            sp.set_master(None)  # read from the file by offload_params / offload_masters
            continue
        if precision.needs_master_copy:
            master = sp.shard.to(torch.float32, copy=True)
            sp.set_shard(sp.shard.to(precision.param_dtype))
        else:
            sp.set_shard(sp.shard.to(torch.float32))
            master = sp.shard
        sp.set_master(master if sp in trained else None)

    # 3. persistent parameters: gathered once, kept.
    threshold = config.stage3_param_persistence_threshold_numel
    persistent = [sp for sp in sharded.values() if sp.numel <= threshold]
    for sp in persistent:
        sp.persistent = True
    FetchUnit(-1, "persistent", "", persistent).unshard()

    # 4. fetch units, coordinator, hooks, guards.
    units = build_units(model, sharded)
    coordinator = FetchCoordinator(
        group,
        list(units.values()),
        prefetch_numel=config.stage3_prefetch_bucket_numel,
        max_live_numel=config.stage3_max_live_numel,
        check=TraceCheck.from_config(config),
        reuse_numel=config.stage3_max_reuse_distance_numel,
    )
    for sp in sharded.values():
        sp.coordinator = coordinator
    hooks = install_module_hooks(model, units, coordinator)
    for name, module in model.named_modules():
        if dict.__len__(module._parameters):
            guard_module(module, check_access, name or type(module).__name__)

    # 5. ZeRO++ (optional): quantized / node-local gathers, quantized gradients.
    zeropp = ZeroPP(config, list(sharded.values()), node_size, model) if node_size else None

    # 6. gradients (torch.autocast's 16-bit ones over comm's own reduce-scatter only).
    collective = zeropp.reduce_scatter if zeropp and zeropp.grads else reduce_scatter
    autocast = precision.autocast if collective is None else None
    reducer = GradShardReducer(
        trained,
        group,
        bucket_numel=config.bucket_numel(precision.grad_accum_dtype.itemsize),
        grad_dtype=precision.grad_accum_dtype,
        overlap=config.overlap_comm,
        position={sharded[p]: k for k, p in enumerate(model.parameters())},
        reduce_scatter=collective,
        wire_dtypes=autocast.wire_dtypes(model) if autocast else None,
    )
    return Stage3Strategy(
        model,
        config,
        precision,
        group,
        data_group=group if mics is None else mics.data_group,
        groups=groups,
        sharded=sharded,
        persistent=persistent,
        units=units,
        coordinator=coordinator,
        module_hooks=hooks,
        zeropp=zeropp,
        reducer=reducer,
    )


def build_units(
    model: nn.Module, sharded: dict[nn.Parameter, ShardedParam]
) -> dict[nn.Module, FetchUnit]:
    """One FetchUnit per module that owns a non-persistent parameter (whole subtree for leaf
    modules) + the root. A module whose parameters all persist has nothing to gather or release,
    so it gets no unit and no hooks (four fewer hook calls and trace events per pass): a model
    under the persistence threshold runs with the root's unit alone."""
    units: dict[nn.Module, FetchUnit] = {}
    inside_leaf: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside_leaf:
            continue
        if is_leaf_module(module):
            owned = list(module.parameters())
            inside_leaf.update(id(m) for m in module.modules())
        else:
            owned = [p for p in dict.values(module._parameters) if p is not None]
        params = list(dict.fromkeys(sharded[p] for p in owned))
        if any(not sp.persistent for sp in params) or module is model:
            units[module] = FetchUnit(len(units), name, type(module).__name__, params)
    return units
