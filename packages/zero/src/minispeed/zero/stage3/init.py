"""Three user-facing contexts of stage 3: build partitioned, look at full values, fetch subtrees.

- `Init` partitions parameters while the model is being constructed, so a model larger
  than one rank's memory can be built: each rank holds ``Ψ/N`` plus the modules under
  construction (see Note [when Init partitions a module]).
- `GatheredParameters` gathers parameters for user code (initialisation, inspection,
  surgery) and, with ``modifier_rank=r``, keeps the changes rank r made, on every rank.
- `set_leaf_module` makes a module's whole subtree one fetch unit: fetched when the module
  starts, released when it ends. For blocks whose children run depending on the data (MoE experts,
  early exit), where a per-child fetch order would differ between ranks.

All three are collective when they move data: every rank of the group must enter them in the
same order.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

import minispeed.comm as comm
from minispeed.zero.stage3.access import check_access, guard_module
from minispeed.zero.stage3.init_writes import InitAccess, WriteBack
from minispeed.zero.stage3.mics_groups import MicsGroups, check_mics, mics_enabled, resolve_groups
from minispeed.zero.stage3.offloaded import init_residency
from minispeed.zero.stage3.params import REGISTRY, FetchUnit, ShardedParam, partition_param
from minispeed.zero.stage3.released import guard_param

__all__ = ["GatheredParameters", "Init", "full_state_dict", "is_leaf_module", "set_leaf_module"]

# Note [when Init partitions a module]
# We never patch nn.Module.__init__. Two registration hooks, installed by the context and removed
# on exit, fire whenever a parameter is created or a module is attached to a parent. At each of
# them, and before each tensor factory call (``torch.empty``... seen by the InitWriteGuard mode, so
# that the next layer's weight is allocated after the previous layer is partitioned), we look at
# the Python call stack (``sys._getframe``) for the modules whose ``__init__`` is
# running: those are still being built. A module is *finished* when it is not being built and,
# if it was attached to a parent that is not a container, that parent is finished too: a parent's
# __init__ may still initialise a child it attached (nn.MultiheadAttention zeroes
# ``self.out_proj.bias`` after attaching ``out_proj``), while containers (ModuleList,
# Sequential, ModuleDict) never touch their children. At every registration the parameters of
# finished modules are partitioned. So ``nn.ModuleList([Block() for _ in range(L)])``,
# ``nn.Sequential(*layers)`` and the generator form all hold one unpartitioned layer at a time,
# and what remains is partitioned when the context exits. Peak: Ψ/N + one layer. Cost: one walk
# of the call stack per registration and per tensor factory call, only inside the context.
# Code that initialises parameters after they were partitioned (``self.apply(init_fn)`` at the
# end of a root __init__, Hugging Face's post_init) gets their full values: gathered on first
# touch, written back from the first rank (init_writes.InitAccess, a torch-function mode active
# only inside the context; Note [writing back what Init's initialisers change]).
# ``copy.deepcopy`` of a module whose parameters are partitioned raises
# (access.GuardedParameterDict).

# Note [what Init keeps after it exits]
# Only the shards of the parameters it partitioned, in ``Init.sharded``, and only while the
# parameter lives: a parameter replaced after it was partitioned (a head tied to the embedding
# by post_init) leaves its shard behind otherwise, and one replaced before (still in
# ``_created``) would have held its full value until the exit and then been partitioned for
# nothing. The mode and the write-back object hold bound methods of the Init object (a
# reference cycle): dropping them at exit lets the object, and what it holds, go when the user
# drops it, not at the next garbage collection.

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _modules_being_built() -> set[int]:
    """``id`` of every nn.Module whose ``__init__`` (of any class in its MRO) is running here."""
    building = set()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module):
                building.add(id(owner))
        frame = frame.f_back
    return building


class Init:
    """Context: partition every parameter created inside it across ``group`` as modules are built.

    ``config``: the `ZeroConfig` given to ``zero.shard``; with ``offload_param.device='nvme'``
    each shard is written to a swap file as it is made and dropped from memory (ZeRO-Infinity:
    the model never exists in memory, not even partitioned); otherwise unused. The
    parameters keep the dtype they are created with (``zero.shard`` makes the fp32 masters from
    them, then casts to ``MixedPrecision.param_dtype``). Every rank must construct the same
    modules in the same order; the values are the group's first rank's, whatever each rank's
    seed (Note [partitioning starts from the first rank's values] in params.py).

    Memory while building: ``Ψ/N`` of partitioned parameters plus the module not yet partitioned
    (Note [when Init partitions a module]). Communication: one broadcast per parameter, ``Ψ·p``
    bytes in all.

    Code that reads or writes parameters after their module was partitioned (``self.apply(
    init_fn)``, Hugging Face's ``post_init()``) sees full values: they are gathered on first
    touch and written back from the first rank, one module at a time (init_writes.py; one
    all-gather and one broadcast per module touched).

    MiCS (``config.mics_shard_size = S``): each parameter is partitioned over this rank's shard
    group of S ranks, as ``zero.shard`` will train it, from the first rank of ``group`` (every
    replica equal): ``Ψ/S`` per rank. The groups are ``mics_groups`` (`zero.MicsGroups`, when
    ``group`` is not the world), else built on entry (collective over the world);
    `mics_groups` keeps them and ``zero.shard`` finds them on the parameters.
    """

    def __init__(
        self,
        config: Any = None,
        group: Any = None,
        enabled: bool = True,
        *,
        mics_groups: MicsGroups | None = None,
    ) -> None:
        self.config = config
        self.group = group  # the data-parallel group: the broadcasts' and agreements' ranks
        self.enabled = enabled
        self.mics_groups = mics_groups  # MiCS: built on entry when None
        self.sharded: list[ShardedParam] = []
        self._created: dict[nn.Parameter, tuple[nn.Module, str]] = {}  # -> (module, attribute)
        self._parent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # non-containers
        self._sweeping = False
        self._handles: list[Any] = []
        # With a ZeroConfig whose offload_param device is nvme, each shard is written to a swap
        # file as soon as it is made (stage3/offloaded.py: init_residency); zero.shard adopts them.
        par = getattr(config, "offload_param", None)
        self._to_files = enabled and par is not None and par.device == "nvme"
        self._param_home: Any = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not comm.is_initialized():
            raise RuntimeError(
                "zero.Init partitions parameters across ranks, but torch.distributed is not "
                "initialized: call minispeed.comm.init_distributed() before entering zero.Init"
            )
        if self.config is not None and mics_enabled(self.config):  # before any collective
            check_mics(self.config, comm.get_world_size(self.group))
            self.mics_groups = resolve_groups(self.config, self.group, self.mics_groups)
        self._handles = [
            register_module_parameter_registration_hook(self._on_parameter),
            register_module_module_registration_hook(self._on_module),
        ]
        self._write_back = WriteBack(GatheredParameters)
        self._mode = InitAccess(self._partition_finished, self._write_back.touch)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        self._mode.__exit__(None, None, None)
        self._write_back.flush(exc_type)  # Note [writing back what Init's initialisers change]
        for h in self._handles:
            h.remove()
        self._handles = []
        if exc_type is None:
            for p, (module, _) in list(self._created.items()):
                self._partition(module, p)
        self._created.clear()
        self._parent = weakref.WeakKeyDictionary()
        # Note [what Init keeps after it exits]
        self._mode = self._write_back = None
        self.sharded = [sp for sp in self.sharded if sp._param() is not None]
        if exc_type is None and self._param_home is not None:
            # offload_param nvme: every shard file written, on every rank, or an error on every
            # rank (Note [an I/O failure fails every rank]): one 1-element all-reduce.
            self._param_home.io_failures.settle()
            self._param_home.io_failures.agree(self.group, "the end of zero.Init, writing shards")

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        # Called before the assignment: a parameter created here and now replaced (an output
        # head's weight tied to the embedding's) is dropped, not partitioned, so its full
        # value is freed now. Note [what Init keeps after it exits].
        old = dict.get(module._parameters, name)
        if old is not None and old is not param and self._created.get(old) == (module, name):
            del self._created[old]
        self._partition_finished()
        if param is not None and param not in REGISTRY:
            self._created[param] = (module, name)

    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is not None and not isinstance(parent, _CONTAINERS):
            self._parent[child] = parent
        self._partition_finished()

    def _partition_finished(self) -> None:
        """Partition the parameters of every module whose construction has returned.

        Note [when Init partitions a module].
        """
        if not self._created or self._sweeping:  # partitioning itself allocates shards
            return
        self._sweeping = True
        try:
            self._partition_modules(_modules_being_built())
        finally:
            self._sweeping = False

    def _partition_modules(self, building: set[int]) -> None:
        finished: dict[nn.Module, bool] = {}
        for p, (module, _) in list(self._created.items()):
            if module not in finished:
                m: nn.Module | None = module
                while m is not None and id(m) not in building:
                    m = self._parent.get(m)  # a non-container parent may still initialise it
                finished[module] = m is None
            if finished[module]:
                self._partition(module, p)

    def _partition(self, module: nn.Module, p: nn.Parameter) -> None:
        if p in REGISTRY:
            return
        _, attr = self._created.pop(p, (module, "?"))
        # The qualified name is known only once the model is complete; zero.shard sets it.
        mics = self.mics_groups
        group = self.group if mics is None else mics.shard_group
        sp = partition_param(p, group, f"{type(module).__name__}.{attr}", mics)
        guard_param(p, sp)  # reads while released answer or raise (released.py)
        if self._write_back is not None:  # None after exit
            self._write_back.owner_of[sp] = id(module)
        self.sharded.append(sp)
        if self._to_files:  # offload_param nvme: the shard goes to its swap file now
            self._param_home = init_residency(self._param_home, self.config, sp)
        guard_module(module, check_access, type(module).__name__)


class GatheredParameters:
    """Context: the full values of ``params`` on every rank; keep changes made by ``modifier_rank``.

    ```python
    with zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if comm.get_rank() == 0:
            model.head.weight.data.normal_()      # the change rank 0 makes...
    # ...is broadcast and re-partitioned: every rank's shard (and fp32 master) holds it
    ```

    With ``modifier_rank=None`` changes are discarded at exit (read-only use). Parameters that are
    not partitioned by stage 3 are left alone, so the same code runs with and without stage 3.
    ``modifier_rank`` is a global rank, like ``src`` in ``torch.distributed.broadcast``, among
    the parameters' holders (``ShardedParam.data_group``: under MiCS every replica of the shard
    group, which all receive the change).

    Costs: one all-gather of the released parameters on entry (``Σ N·s·p`` bytes message); with a
    modifier, one broadcast of ``Σ n·p`` bytes on exit, over the holders; ``Σ N·s·p`` bytes held
    inside.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        seen: dict[ShardedParam, None] = {}
        for p in params:
            sp = REGISTRY.get(p) if p is not None else None  # None: a module's absent bias
            if sp is not None:
                seen[sp] = None
        self.sharded = list(seen)
        self._unit = FetchUnit(-1, "GatheredParameters", "", self.sharded)
        if len({(id(sp.group), id(sp.mics)) for sp in self.sharded}) > 1:
            raise ValueError(
                "GatheredParameters got parameters partitioned over different process groups; "
                "enter one context per group"
            )

    def __enter__(self) -> GatheredParameters:
        if self.enabled and self.sharded:
            self._unit.unshard()
            self._unit.hold()
            io = _io_failures(self.sharded)
            if io is not None:  # offload_param nvme: no rank may look at a failed read's zeros
                try:
                    io.agree(self.sharded[0].data_group, "GatheredParameters, reading shards")
                except BaseException:
                    self._unit.unhold()
                    self._unit.reshard()
                    raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not (self.enabled and self.sharded):
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._keep_changes()
        finally:
            self._unit.unhold()
            self._unit.reshard()

    @torch.no_grad()
    def _keep_changes(self) -> None:
        """Broadcast the modifier's full values to every holder (MiCS: every replica, not only
        the modifier's shard group), then each re-partitions them."""
        values = torch.cat([sp.param.data.reshape(-1).to(sp.shard.dtype) for sp in self.sharded])
        comm.broadcast(values, src=self.modifier_rank, group=self.sharded[0].data_group)
        offset = 0
        for sp in self.sharded:
            sp.load_full(values[offset : offset + sp.numel])
            offset += sp.numel


def _io_failures(sps: list[ShardedParam]) -> Any:
    """The `IOFailures` of the first parameter whose shard lives in a file (None without any):
    a `GatheredParameters` over such parameters agrees on its reads (one 1-element all-reduce)."""
    return next((sp.home.io_failures for sp in sps if sp.home.io_failures is not None), None)


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with full values that belong to the caller, for a stage-3 model.

    Walks the modules in ``state_dict`` order and gathers one module's own parameters at a time
    (``GatheredParameters`` without a modifier), copying each stage-3 parameter out before it is
    released, so the tensors returned never lose their memory (a plain view would: Note [why
    storage is resized, not replaced] in params.py). Buffers and other entries are what
    ``state_dict()`` returns, copied too. Works for models without stage 3 as well (a copy of
    ``state_dict()``). Module state-dict hooks are not run (the entries are each module's own
    ``_save_to_state_dict``).

    Collective: every rank of the group must call it. With ``rank0_only=True`` only the group's
    first rank keeps the copies and the others get ``{}`` (MiCS: the data-parallel group's
    first rank, not each shard group's).

    Costs: one all-gather per module owning parameters (``Σ N·s·p`` bytes message in all); held:
    the copies (``Ψ·p`` bytes on each rank that keeps them) plus one module's gathered parameters.
    """
    sps = [REGISTRY[p] for p in model.parameters() if p in REGISTRY]
    group = sps[0].data_group if sps else None
    keep = not rank0_only or not comm.is_initialized() or comm.get_rank(group) == 0
    out: dict[str, Any] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        with GatheredParameters([p for p in dict.values(module._parameters) if p is not None]):
            if keep:
                entries: dict[str, Any] = {}
                module._save_to_state_dict(entries, prefix + "." if prefix else "", False)
                out.update(
                    (k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entries.items()
                )
    return out


_LEAF_MODULES: weakref.WeakSet = weakref.WeakSet()


def set_leaf_module(modules: nn.Module | Iterable[nn.Module]) -> None:
    """Fetch each module's whole subtree at once when it starts (call before ``zero.shard``).

    Its descendants get no hooks of their own, so whichever of them run (data-dependent routing),
    the ranks issue the same collective. Cost: the subtree's parameters are all gathered while the
    module runs (``Σ N·s·p`` bytes held), even children that end up unused.
    """
    if isinstance(modules, nn.Module):
        modules = [modules]
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"set_leaf_module takes nn.Module objects, got {type(module).__name__}")
        for p in module.parameters():
            sp = REGISTRY.get(p)
            if sp is not None and sp.coordinator is not None:
                raise RuntimeError(
                    f"set_leaf_module({type(module).__name__}) after zero.shard: the fetch units are "
                    f"already built; call set_leaf_module before zero.shard"
                )
        _LEAF_MODULES.add(module)


def is_leaf_module(module: nn.Module) -> bool:
    """Whether `set_leaf_module` marked ``module``."""
    return module in _LEAF_MODULES
