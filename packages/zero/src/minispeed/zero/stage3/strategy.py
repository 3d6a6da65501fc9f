"""Stage3Strategy: ZeRO stage 3 as the optimizer sees it (the ``ShardStrategy`` of stage 3).

``zero.shard(model, optimizer, ZeroConfig(stage=3))`` builds one. Construction, in order:

1. partition every parameter (or adopt the shards ``zero.Init`` already made): ShardedParam;
2. mixed precision: an fp32 master shard per parameter (the shard itself for fp32), the shard
   cast to ``param_dtype``;
3. persistent parameters (``numel <= stage3_param_persistence_threshold_numel``) gathered for good;
4. fetch units (one per module owning parameters; a whole subtree for a leaf module), the
   coordinator, the module hooks and the attribute guards;
5. ZeRO++ when configured (zeropp.py): quantized / node-local gathers, quantized gradients;
6. gradient hooks: reduce-scatter into fp32 gradient shards.

Per rank (Ψ parameters, N ranks, p/g bytes per parameter/gradient element, K = 8 for Adam's
state): ``Ψ/N·(p + 4 + g + K)`` kept (padding: < 1 element per parameter per rank; ``4`` is the
master, absent for fp32 where master and shard are one tensor; ``g`` is held from backward to the
step only: Note [lazy gradient shards] in grads.py), plus persistent parameters whole
(``Ψ_pers·p``) and what is gathered at the moment (bounded by the largest unit plus the prefetch
window, within ``stage3_max_live_numel``). Bytes sent per micro-step: see ledger.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import ParamFragment, ShardStrategy
from minispeed.zero.precision import MixedPrecision
from minispeed.zero.stage3.access import check_access, guard_module, unguard_module
from minispeed.zero.stage3.coordinator import FetchCoordinator
from minispeed.zero.stage3.grads import GradShardReducer
from minispeed.zero.stage3.hooks import install_module_hooks
from minispeed.zero.stage3.init import is_leaf_module
from minispeed.zero.stage3.params import (
    REGISTRY,
    FetchUnit,
    ParamState,
    ShardedParam,
    partition_param,
    refresh_gathered,
)
from minispeed.zero.stage3.released import guard_param, unguard_param
from minispeed.zero.stage3.residency import Residency, ShardHome
from minispeed.zero.stage3.trace import TraceCheck
from minispeed.zero.stage3.zeropp import ZeroPP, check_zeropp, zeropp_enabled

__all__ = ["Stage3Strategy"]

# Note [optional features are chosen once]
# ZeRO++ and offload_param change how a parameter is gathered and where its released shard
# lives, on the hottest path of stage 3 (every fetch and release of every module). Instead of
# asking "is ZeRO++ on? is this shard offloaded?" there, each ShardedParam is given, once at
# setup, the objects that do it: its `gatherer` (params.PLAIN_GATHER, or the strategy's ZeroPP)
# and its `home` (residency.STAYS_HERE, or offload's home for it). The gather path calls them
# unconditionally; a feature that is off costs one no-op call. ZeRO-Infinity's optimizer side
# (masters and gradients in files) is a strategy of its own wrapping this one (infinity.py).


class Stage3Strategy(ShardStrategy):
    """Parameters, gradients and optimizer state partitioned; parameters fetched per module."""

    partitions_grads = True  # each rank holds 1/N of the gradients: the norm needs an all-reduce

    def __init__(
        self,
        model: nn.Module,
        config: ZeroConfig,
        precision: MixedPrecision,
        group: Any = None,
        *,
        param_groups: Sequence[Sequence[nn.Parameter]],
    ) -> None:
        self.model = model
        self.config = config
        self.precision = precision
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.groups = [list(ps) for ps in param_groups]  # the optimizer's param groups
        # offload_param (stage3/offloaded.py, through `offload_params`): where released shards
        # live, the parameters that live there, and its record of failed file I/O.
        self.param_home: ShardHome | None = None
        self.offloaded: list[ShardedParam] = []
        self.io_failures: Any = None
        node_size = 0  # ZeRO++ (stage3/zeropp.py): its errors come before any collective
        if zeropp_enabled(config):
            numels = [REGISTRY[p].numel if p in REGISTRY else p.numel() for p in model.parameters()]
            node_size = check_zeropp(config, group, numels, precision.param_dtype.itemsize)

        # 1. one ShardedParam per unique parameter (named_parameters() lists a tied one once).
        self.sharded: dict[nn.Parameter, ShardedParam] = {}
        for name, p in model.named_parameters():
            sp = REGISTRY.get(p)
            if sp is not None and sp.coordinator is not None:
                raise RuntimeError(
                    f"parameter {name!r} is already managed by another stage-3 strategy; call its "
                    f"close() before sharding the model again"
                )
            if sp is not None and sp.world_size != self.world_size:
                raise ValueError(
                    f"parameter {name!r} was partitioned by zero.Init over {sp.world_size} ranks but "
                    f"zero.shard uses a group of {self.world_size}; pass the same group to both"
                )
            sp = sp or partition_param(p, group)
            guard_param(p, sp)  # reads while released answer or raise (released.py)
            sp.name = name
            self.sharded[p] = sp
        self.trained = [self.sharded[p] for ps in self.groups for p in ps]

        # 2. masters and dtypes. See Note [fp32 stage 0 has no master copy] (stage0.py): same here.
        for sp in self.sharded.values():
            if sp.residency is Residency.AWAY:  # in a swap file since zero.Init(config)
                if sp.shard.dtype != precision.param_dtype:
                    raise ValueError(
                        f"parameter {sp.name!r} was written to its swap file by zero.Init(config) "
                        f"as {sp.shard.dtype}, but MixedPrecision.param_dtype is "
                        f"{precision.param_dtype}: create the model in that dtype, or build it "
                        f"with zero.Init() (no config) and let zero.shard offload it"
                    )
                sp.master = None  # read from the file by offload_params / offload_masters
                continue
            if precision.needs_master_copy:
                master = sp.shard.to(torch.float32, copy=True)
                sp.set_shard(sp.shard.to(precision.param_dtype))
            else:
                sp.set_shard(sp.shard.to(torch.float32))
                master = sp.shard
            sp.master = master if sp in self.trained else None

        # 3. persistent parameters: gathered once, kept.
        threshold = config.stage3_param_persistence_threshold_numel
        self.persistent = [sp for sp in self.sharded.values() if sp.numel <= threshold]
        for sp in self.persistent:
            sp.persistent = True
        FetchUnit(-1, "persistent", "", self.persistent).unshard()

        # 4. fetch units, coordinator, hooks, guards.
        self.units = _build_units(model, self.sharded)
        self.coordinator = FetchCoordinator(
            group,
            list(self.units.values()),
            prefetch_numel=config.stage3_prefetch_bucket_numel,
            max_live_numel=config.stage3_max_live_numel,
            check=TraceCheck.from_config(config),
            reuse_numel=config.stage3_max_reuse_distance_numel,
        )
        for sp in self.sharded.values():
            sp.coordinator = self.coordinator
        self._handles = install_module_hooks(model, self.units, self.coordinator)
        for name, module in model.named_modules():
            if dict.__len__(module._parameters):
                guard_module(module, check_access, name or type(module).__name__)

        # 5. ZeRO++ (optional): quantized / node-local gathers, quantized gradients.
        self.zeropp = (
            ZeroPP(config, list(self.sharded.values()), node_size, model) if node_size else None
        )

        # 6. gradients.
        position = {self.sharded[p]: k for k, p in enumerate(model.parameters())}
        self.reducer = GradShardReducer(
            self.trained,
            group,
            bucket_numel=config.bucket_numel(precision.grad_accum_dtype.itemsize),
            grad_dtype=precision.grad_accum_dtype,
            overlap=config.overlap_comm,
            position=position,
            reduce_scatter=self.zeropp.reduce_scatter
            if self.zeropp and self.zeropp.grads
            else None,
        )

    # -- ShardStrategy ------------------------------------------------------------------------------
    def master_params(self) -> list[list[torch.Tensor]]:
        """Per group, one fp32 shard per parameter (``ceil(n/N)`` elements, zero padding)."""
        return [[self.sharded[p].master for p in ps] for ps in self.groups]

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Per group, the fp32 gradient shards, averaged over ranks (valid after backward_done)."""
        return [[self.reducer.grad_of(self.sharded[p]) for p in ps] for ps in self.groups]

    def backward_done(self, is_boundary: bool) -> None:
        """Wait for the gradient reduce-scatters; make sure nothing gathered for backward remains."""
        self.reducer.flush()
        self.coordinator.end_backward()

    @torch.no_grad()
    def publish_params(self) -> None:
        """Write the stepped masters into the 16-bit shards; re-gather persistent parameters.

        Non-persistent parameters are released now and pick up the new shards at their next
        fetch. Sends one all-gather of ``Σ_persistent N·s·p`` bytes. With offload_param each
        new shard is written to its home (``s·p`` bytes); with nvme the step ends in the I/O
        agreement (one 1-element all-reduce, `IOFailures.agree`).
        """
        for sp in self.trained:
            if sp.master is not sp.shard:
                sp.home.write(sp, sp.master)
        refresh_gathered([sp for sp in self.trained if sp.state is ParamState.GATHERED])
        if self.io_failures is not None:
            self.io_failures.agree(self.group, "the end of the optimizer step")

    def zero_grad(self) -> None:
        """Drop the gradient shards (and any ``param.grad`` left by hand-written backward code)."""
        self.reducer.zero_grad()
        for p in self.sharded:
            p.grad = None

    def fragments(self) -> list[ParamFragment]:
        """Per trained parameter, the slice ``[r·s, r·s + owned)`` this rank holds (padding excluded)."""
        out = []
        for g, ps in enumerate(self.groups):
            for i, p in enumerate(ps):
                sp = self.sharded[p]
                out.append(ParamFragment(sp.name, sp.shape, sp.start, sp.owned_numel, g, i, 0))
        return out

    # -- extras -------------------------------------------------------------------------------------
    def offload_params(self, home: Any, offloaded: list[ShardedParam], io_failures: Any) -> None:
        """offload_param, chosen once at ``zero.shard`` (stage3/offloaded.py): ``offloaded``
        live in ``home`` (closed by `close`); ``io_failures`` (None without file I/O) is agreed
        on at the end of each step and of `close`."""
        self.param_home, self.offloaded, self.io_failures = home, offloaded, io_failures

    def sharded_params(self) -> list[ShardedParam]:
        """Every ShardedParam of the model, in ``named_parameters()`` order."""
        return list(self.sharded.values())

    def close(self) -> None:
        """Gather every parameter back into the model and remove all stage-3 hooks and guards.

        Afterwards the model is a plain nn.Module with full parameters (``Ψ·p`` bytes per rank)
        and this strategy must not be used. Collective: one all-gather of all released parameters;
        with offload_param nvme, a shard that could not be read makes every rank raise (one
        1-element all-reduce), and the shard files are deleted either way.
        """
        try:
            self._close()
            if self.io_failures is not None:
                self.io_failures.agree(self.group, "close(), gathering the model back")
        finally:
            if self.param_home is not None:
                self.param_home.close()

    def _close(self) -> None:
        self.reducer.wait_in_flight()
        self.coordinator.end_backward()
        FetchUnit(-1, "close", "", list(self.sharded.values())).unshard()
        for sp in self.sharded.values():
            sp.to_plain()
            unguard_param(sp.param)
            sp.coordinator = None
            REGISTRY.pop(sp.param, None)
        self.reducer.remove()
        if self.zeropp is not None:
            self.zeropp.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self.model.modules():
            unguard_module(module)


def _build_units(
    model: nn.Module, sharded: dict[nn.Parameter, ShardedParam]
) -> dict[nn.Module, FetchUnit]:
    """One FetchUnit per module that owns parameters (whole subtree for leaf modules) + the root."""
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
        if params or module is model:
            units[module] = FetchUnit(len(units), name, type(module).__name__, params)
    return units
