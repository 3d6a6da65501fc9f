"""One partitioned parameter (`ShardedParam`), the fetch unit (`FetchUnit`) and their collectives.

Stage 3 keeps only ``1/N`` of every parameter on each rank. The model's ``nn.Parameter`` objects
stay where they are (autograd leaves, optimizer references and ``named_parameters()`` keep
working); what changes is what their ``.data`` points to:

- released (SHARDED): ``param.data`` is an empty tensor (0 elements), and the parameter's full
  buffer keeps its shape but its storage is resized to 0 bytes, so the rank holds only its shard;
- fetched (GATHERED): the full buffer's storage is re-allocated, all-gathered into, and
  ``param.data`` is a view of it.

Everything stage 3 knows about a parameter lives in its `ShardedParam`, an object we own, found
through `REGISTRY` (a weak dict keyed by the parameter). Nothing is patched onto the
``nn.Parameter``. See Note [why .data is swapped] and Note [why storage is resized, not replaced].
A `FetchUnit` is the set of parameters one module needs: it owns the transitions of the whole set
(`unshard()`, `wait()`, `reshard()`) and its hold count (`hold()`, `unhold()`); the coordinator
decides when to call them.

Layout of one parameter of ``n`` elements over N ranks (``s = ceil(n / N)``):

```text
flattened parameter:  | x0 x1 x2 x3 x4 x5 x6 |  _  |      padded to N·s = 8 (N = 4, n = 7)
shard of rank r:        elements [r·s, (r+1)·s)       rank 3 holds x6 and one padding zero
```

The all-gather of the N shards (rank-major) *is* the padded flat parameter, so no copy is needed
after it: ``param.data = full[:n].view(shape)``.

Costs (p = bytes per element of the parameter dtype):

- kept per rank, always: the shard, ``s·p`` bytes (plus the fp32 master ``4s`` that the strategy
  attaches; for fp32 parameters the master *is* the shard); from its gradient's reduction to the
  optimizer step, the fp32 gradient shard ``4s`` (strategy.py, Note [lazy gradient shards]);
- while gathered: the full buffer, ``N·s·p`` bytes; while released: 0 bytes, even if autograd still
  holds views of it (Note [why storage is resized, not replaced]);
- one all-gather of a parameter: ``N·s·p`` bytes (message size; each rank sends ``(N-1)·s·p``);
- one reduce-scatter of its gradient: ``N·s·g`` bytes (g = bytes per reduced gradient element).
"""

from __future__ import annotations

import enum
import weakref
import zlib
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import minispeed.comm as comm
from minispeed.comm.validation import group_ranks
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.zero.stage3.residency import Resident

__all__ = [
    "PLAIN_GATHER",
    "REGISTRY",
    "FetchUnit",
    "ParamState",
    "ShardedParam",
    "all_gather_params",
    "mark_issued",
    "partition_param",
    "refresh_gathered",
]

# Note [why .data is swapped]
# Stage 3 must drop a parameter's full storage between uses, yet keep the nn.Parameter object
# itself: it is an autograd leaf (AccumulateGrad nodes point at it), the user's optimizer and the
# module hold references to it, and hooks are registered on it. Assigning ``param.data`` replaces
# the storage behind the same Python object without touching autograd's bookkeeping, so the
# parameter can alternate between an empty tensor and a view of a gathered buffer. Two
# consequences the rest of the package handles:
#   * autograd nodes that saved the parameter *itself* (e.g. ``x * weight`` saves ``weight``)
#     read its ``.data`` when backward runs, so the parameter must be gathered again before its
#     module's backward (coordinator.py: pre-backward hooks), and stay gathered until its gradient
#     has been accumulated (AccumulateGrad checks the gradient's layout against ``param``);
#   * nodes that saved a *view* of it (``weight.t()`` inside ``F.linear``) hold the gathered
#     buffer, not the parameter: swapping ``.data`` alone would leave every such buffer alive
#     until backward, i.e. the whole model at the end of forward. See the next Note.

# Note [why storage is resized, not replaced]
# Each ShardedParam owns ONE full-size buffer (``_full``, 1D, N·s elements) for its whole life.
# Releasing frees the buffer's *storage* in place (``untyped_storage().resize_(0)``) instead of
# dropping the tensor; fetching re-allocates that same storage (``resize_(N·s·p)``) and
# all-gathers into it. Every view of the buffer (``param.data`` while gathered, and whatever
# autograd saved in forward: ``weight.t()``, ``weight`` reshaped...) shares that storage, so:
#   * between forward and backward those saved views point at 0 bytes: a rank holds its shards
#     plus what is gathered right now, never the whole model (the point of stage 3);
#   * backward's pre-hook (coordinator.py) re-gathers into the same storage before the module's
#     backward nodes run, so the views autograd reads see the full values again.
# The price: reading a view while its storage is released is undefined (a crash, not an error
# message), so every module whose backward reads a parameter must re-gather it first: the
# pre-backward hook of the module (or of the module that read it as an external) does.
# ``param.data`` itself is still swapped to an empty tensor when released (Note [why .data is
# swapped]), so "released" keeps meaning ``param.data.numel() == 0`` to user code and tests.

# Note [a prefetch holds one copy]
# Several parameters fetched together travel in one coalesced all-gather. Where the backend's
# all-gather is a flat one (NCCL), its N·Σs buffer is unpacked into each parameter's full buffer.
# If the full buffers were allocated when the gather is issued, a prefetch in flight would hold
# the parameters twice (the buffer and the full buffers) for as long as it waits, and backward
# prefetches wait while the previous module's backward runs, at the moment activations peak. So
# the full buffers are allocated only when the data has landed (comm.all_gather_coalesced's lazy
# outputs, called in wait()): in flight, one copy. On the benchmark's GPT
# (benchmarks/zero_vs_torch.py) this moved the backward peak from 1.02x FSDP2's to below it.
# On gloo, whose all-gather comm runs as broadcasts, each full buffer receives its chunks in
# place, so comm makes them at issue: again one copy in flight, and neither the pack into the
# N·Σs buffer nor the unpack out of it (Σs + N·Σs elements copied per gather; issue 34: 17-37 ms
# of a 33.9M-parameter step). A single parameter is gathered straight into its full buffer.

# Note [ShardedParam holds its coordinator weakly]
# REGISTRY keeps a ShardedParam alive until its parameter dies, and a parameter usually dies inside
# a garbage-collection pass (model, optimizer and strategy form reference cycles). The collector
# decides what is garbage *before* REGISTRY's weak-key callback drops the entry, so the ShardedParam
# is still reachable (from REGISTRY, a module global) during that pass. Freed only by its reference
# count dropping afterwards, it must not sit in a cycle of its own: a strong ``sp.coordinator``
# (coordinator -> units -> ShardedParam -> coordinator) made one, and every shard, master and
# gradient shard (``Ψ/N·(p + 4 + g)`` bytes per rank) outlived ``del opt, model; gc.collect()``
# until the *next* collection. The strategy and the module hooks hold the coordinator strongly,
# so the weak reference is alive whenever a hook can use it.

#: Every partitioned parameter of this process -> its ShardedParam (weak: dropping the model drops
#: the entry). zero.Init, zero.shard and GatheredParameters all look parameters up here.
REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ParamState(enum.Enum):
    """Where a stage-3 parameter's full value is. ``n`` elements, ``s = ceil(n/N)``, p bytes each.

    | state | tensors that exist | bytes held for this parameter |
    |---|---|---|
    | SHARDED | shard (s); ``param.data`` = empty (0); full buffer (N·s) with storage of 0 bytes | ``s·p`` (shard only) |
    | GATHERING | shard; an async all-gather in flight, into the full buffer (one parameter; several on gloo) or into the collective's buffer, copied into the full buffer when it lands (several on NCCL: Note [a prefetch holds one copy]); ``param.data`` empty | ``s·p + N·s·p`` |
    | GATHERED | shard; full buffer; ``param.data`` = ``full[:n].view(shape)`` | ``s·p + N·s·p`` |

    (Plus the strategy's fp32 master, ``4s`` bytes in every state, and from backward to the step
    the gradient shard, ``4s``.)
    The full buffer is one tensor for the parameter's whole life; only its storage comes and goes
    (Note [why storage is resized, not replaced]), so views autograd saved stay valid.
    Transitions: SHARDED -> GATHERING -> GATHERED -> SHARDED, or SHARDED -> GATHERED for a
    synchronous fetch; each is one ``to_<state>()`` method that asserts its source state, and
    they (with `set_shard`, `load_full` and `to_plain`) are the only places ``param.data`` is
    assigned.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedParam(Resident):
    """Everything stage 3 keeps for one ``nn.Parameter``: its shard, state, and owners.

    Set by the strategy (``None`` until ``zero.shard`` runs): ``master`` (fp32, ``s`` elements;
    the very ``shard`` tensor for fp32 training; written only through `set_master` /
    `take_master`), ``coordinator`` (the FetchCoordinator that fetches it in forward), and
    ``gatherer`` (`set_gatherer`). Its gradient shard is the reducer's (strategy.py).
    ``holds`` counts the fetch units that need it gathered now (running modules,
    GatheredParameters contexts), changed only by `FetchUnit.hold` / `FetchUnit.unhold`; it is
    released only when that count is 0 and it is not ``persistent``.
    """

    def __init__(
        self, param: nn.Parameter, shard: torch.Tensor, group: Any, name: str = "", mics: Any = None
    ) -> None:
        # Weak: REGISTRY's values must not keep its (weak) keys alive, or no model is ever freed.
        self._param = weakref.ref(param)
        self.name = name  # qualified name; set by zero.shard (Init does not know it yet)
        self.shape = param.shape  # the full shape (param.shape is (0,) while released)
        self.numel = param.numel()
        self.group = group  # the ranks this parameter is partitioned over
        # MiCS (stage3/mics_groups.py): `group` is a shard group and each of its shards is held
        # by the ranks of a replica group too (`MicsGroups`); None for plain ZeRO-3.
        self.mics = mics
        # Every rank holding this parameter: `group`, and under MiCS its replicas too (the
        # data-parallel group). A changed value must reach all of them (`GatheredParameters`).
        self.data_group = group if mics is None else mics.data_group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.shard_numel = -(-self.numel // self.world_size)  # ceil(n / N)
        # Elements of the gathered buffer: N · ceil(n / N). A plain attribute: the prefetcher
        # reads it for every upcoming parameter at every module start.
        self.padded_numel = self.world_size * self.shard_numel
        self.shard = shard  # 1D, numel = shard_numel, param dtype; padding elements are 0
        self._master: torch.Tensor | None = None  # written only by set_master / take_master
        # Weak: Note [ShardedParam holds its coordinator weakly].
        self._coordinator: weakref.ref | None = None
        self.persistent = False
        self._holds = 0  # written only through FetchUnit.hold / FetchUnit.unhold
        self.state = ParamState.SHARDED
        # 1D, numel = N * shard_numel, created at the first fetch; its storage is 0 bytes while
        # SHARDED. Note [why storage is resized, not replaced].
        self._full: torch.Tensor | None = None
        self._work: Any = None  # the in-flight all-gather, while GATHERING
        # Who gathers it: PLAIN_GATHER, or ZeRO++ (stage3/zeropp.py), held weakly as the
        # coordinator; chosen once by the strategy (Note [optional features are chosen once]).
        self._gatherer: weakref.ref | None = None
        Resident.__init__(self)  # where the shard lives while released: HERE, no home yet
        param.data = shard.new_empty(0)  # born SHARDED (Note [why .data is swapped])

    @property
    def holds(self) -> int:
        """How many fetch units need this parameter gathered now."""
        return self._holds

    @property
    def coordinator(self) -> Any:
        """The FetchCoordinator managing this parameter, or None (no strategy, or it was freed)."""
        return None if self._coordinator is None else self._coordinator()

    @coordinator.setter
    def coordinator(self, coordinator: Any) -> None:
        self._coordinator = None if coordinator is None else weakref.ref(coordinator)

    @property
    def gatherer(self) -> Any:
        """What all-gathers this parameter: `PLAIN_GATHER`, or the strategy's `ZeroPP`."""
        gatherer = None if self._gatherer is None else self._gatherer()
        return PLAIN_GATHER if gatherer is None else gatherer

    def set_gatherer(self, gatherer: Any) -> None:
        """ZeRO++ (`ZeroPP`) gathers this parameter from now on, or (``None``) `PLAIN_GATHER`
        again: one or the other, switched at set-up or close, never during a gather."""
        assert (gatherer is None) != (self._gatherer is None) and self.state is not (
            ParamState.GATHERING
        ), f"{self.name}: gatherer {gatherer} over {self._gatherer} while {self.state}"
        self._gatherer = None if gatherer is None else weakref.ref(gatherer)

    @property
    def master(self) -> torch.Tensor | None:
        """The fp32 master shard (``s`` elements; the very ``shard`` for fp32 training), or
        ``None``: not trained here, or kept elsewhere (read from a swap file, ZeRO-Infinity's
        optimizer files)."""
        return self._master

    def set_master(self, master: torch.Tensor | None) -> None:
        """The strategy's set-up (and offload's): ``master`` is the fp32 master shard from now on."""
        assert master is None or (
            master.dtype == torch.float32 and master.numel() == self.shard_numel
        ), f"{self.name}: a master of {master.numel()} {master.dtype} elements"
        self._master = master

    def take_master(self) -> torch.Tensor | None:
        """Hand the master over (ZeRO-Infinity writes it to its files): returns it, keeps none."""
        master, self._master = self._master, None
        return master

    @property
    def param(self) -> nn.Parameter:
        """The model parameter this object partitions."""
        param = self._param()
        assert param is not None, f"{self.name}: its parameter was garbage-collected"
        return param

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def start(self) -> int:
        """Offset of this rank's shard in the flattened full parameter."""
        return self.rank * self.shard_numel

    @property
    def owned_numel(self) -> int:
        """Real (non-padding) elements in this rank's shard; may be 0 for tiny parameters."""
        return max(0, min(self.shard_numel, self.numel - self.start))

    @property
    def full_storage_nbytes(self) -> int:
        """Bytes allocated right now behind the full buffer (and every view of it): 0 if SHARDED."""
        return 0 if self._full is None else self._full.untyped_storage().nbytes()

    def allocate_full(self) -> torch.Tensor:
        """The full buffer (1D, ``padded_numel``) with its storage allocated, for a gather into it.

        Re-allocates the same storage that was freed at release, so autograd's saved views see
        what is gathered into it (Note [why storage is resized, not replaced]). A new buffer is
        made only at the first fetch, or if the shard's dtype/device changed since (zero.shard
        casting a shard that zero.Init made): then no view of the old one can be in use.
        """
        assert self.state is not ParamState.GATHERED, f"{self.name}: allocate_full while gathered"
        full = self._full
        if full is None or full.dtype != self.shard.dtype or full.device != self.shard.device:
            self._full = full = self.shard.new_empty(self.padded_numel)
        storage = full.untyped_storage()
        nbytes = self.padded_numel * full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return full

    # -- state transitions ------------------------------------------------------------------------
    def to_gathering(self, work: Any) -> None:
        """An async all-gather into ``allocate_full()`` was issued; ``param.data`` stays empty
        until it lands."""
        assert self.state is ParamState.SHARDED, f"{self.name}: to_gathering from {self.state}"
        self._work = work
        self.state = ParamState.GATHERING

    def to_gathered(self) -> None:
        """Finish the fetch: wait for the all-gather (if any) and point ``param.data`` at the result.

        From GATHERING (waits on the pending collective), or from SHARDED once a synchronous
        all-gather has filled ``allocate_full()``.
        """
        if self.state is ParamState.GATHERING:
            self._work.wait()  # CommWork.wait is idempotent: several params may share one call
            self._work = None
        else:
            # (a parameter of no element has nothing to allocate: a full buffer of 0 bytes)
            assert self.state is ParamState.SHARDED and (
                self.full_storage_nbytes or not self.padded_numel
            ), f"{self.name}: to_gathered from {self.state} without an allocated full buffer"
        self.param.data = self._full[: self.numel].view(self.shape)
        self.state = ParamState.GATHERED
        self._home.evict(self)  # offload_param: the gathered buffer holds it now

    def _add_hold(self, delta: int) -> None:
        """Only for FetchUnit.hold / unhold: an unmatched release is a bug, never clamped."""
        assert self._holds + delta >= 0, f"{self.name}: released more often than held"
        self._holds += delta

    def set_shard(self, shard: torch.Tensor) -> None:
        """Replace the shard (zero.shard casting it to ``param_dtype``); stays SHARDED."""
        assert self.state is ParamState.SHARDED, f"{self.name}: set_shard while {self.state}"
        self.shard = shard
        self.param.data = shard.new_empty(0)

    def load_full(self, values: torch.Tensor) -> None:
        """While GATHERED: make ``values`` (``n`` elements) the parameter's value, here and in
        this rank's shard and master (GatheredParameters keeping a modifier's changes)."""
        assert self.state is ParamState.GATHERED, f"{self.name}: load_full while {self.state}"
        self._full[: self.numel].copy_(values)
        self.param.data = self._full[: self.numel].view(self.shape)  # user code may have swapped it
        mine = values.reshape(-1)[self.start : self.start + self.owned_numel]
        self._home.fetch(self)
        self.shard[: self.owned_numel].copy_(mine)
        self._home.write(self, self.shard)
        self._home.evict(self)
        if self._master is not None and self._master is not self.shard:
            self._master[: self.owned_numel].copy_(mine)

    def to_plain(self) -> None:
        """While GATHERED: hand the parameter back to PyTorch with its own copy of the full value
        (Stage3Strategy.close); this object is not used afterwards."""
        assert self.state is ParamState.GATHERED, f"{self.name}: to_plain while {self.state}"
        self.param.data = self._full[: self.numel].view(self.shape).clone()
        self._full = None

    def to_sharded(self) -> None:
        """Release: free the full buffer's storage in place; ``param.data`` becomes empty.

        Note [why storage is resized, not replaced]: views autograd saved now hold 0 bytes.
        """
        assert self.state is ParamState.GATHERED, f"{self.name}: to_sharded from {self.state}"
        assert self.holds == 0 and not self.persistent, (
            f"{self.name}: released while held ({self.holds}) or persistent"
        )
        self.param.data = self.shard.new_empty(0)
        storage = self._full.untyped_storage()
        if storage.resizable():
            storage.resize_(0)
        else:
            # ``.numpy()`` of the gathered value (export code inside GatheredParameters) shares
            # the storage and makes it fixed-size: the array keeps it; the next fetch allocates
            # a new buffer (allocate_full).
            self._full = None
        self.state = ParamState.SHARDED

    # -- data views -------------------------------------------------------------------------------
    def full_flat(self) -> torch.Tensor:
        """The gathered buffer (1D, ``padded_numel``); only valid while GATHERED."""
        assert self.state is ParamState.GATHERED and self._full is not None, self.state
        return self._full

    def grad_by_rank(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A full gradient as an ``(N, s)`` matrix in ``dtype``: row r is rank r's shard.

        A view when no padding and no cast are needed, else one copy of ``padded_numel`` elements.
        """
        flat = grad.reshape(-1).to(dtype)
        pad = self.padded_numel - self.numel
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.world_size, self.shard_numel)

    def __repr__(self) -> str:
        return (
            f"ShardedParam({self.name or '?'}, shape={tuple(self.shape)}, state={self.state.name}, "
            f"shard={self.shard_numel}, holds={self.holds}, persistent={self.persistent})"
        )


# -- partitioning -----------------------------------------------------------------------------------
# Note [partitioning starts from the first rank's values]
# Each rank keeps only its slice of a parameter, so if the ranks built different values (seeded
# by rank, a common habit for data order) the model would be stitched from N initialisations,
# silently. Stages 0-2 broadcast the first rank's parameters in zero.shard; stage 3 does it here,
# per parameter, just before cutting: zero.shard and zero.Init alike. Cost: one broadcast of
# ``n·p`` bytes per parameter, once (Ψ·p in all); none with one rank. Under MiCS the broadcast
# spans the whole data-parallel group, not only the shard group, from its first rank: a shard
# group cut from another group's values would train a different model than its replicas.


def partition_param(
    param: nn.Parameter, group: Any, name: str = "", mics: Any = None
) -> ShardedParam:
    """Take the first holder's value of ``param``, keep our shard of it, release the rest.

    Collective (one broadcast of ``n·p`` bytes, Note [partitioning starts from the first rank's
    values]) over the holders: ``group``, or with ``mics`` (`MicsGroups`, ``group`` its shard
    group) the whole data-parallel group, so every replica starts equal. Every rank of it
    partitions the same parameters in the same order. Memory: after this call the rank holds
    ``ceil(n/N)`` elements of ``param`` instead of ``n``.
    """
    if param in REGISTRY:
        return REGISTRY[param]
    device = get_accelerator().device()
    n, world = param.numel(), comm.get_world_size(group)
    s = -(-n // world)
    start = comm.get_rank(group) * s
    flat = param.detach().reshape(-1)
    holders = group if mics is None else mics.data_group  # MiCS: every replica, the same values
    if comm.get_world_size(holders) > 1:
        flat = flat.contiguous()  # a copy only if the parameter is not contiguous
        comm.broadcast(flat, src=group_ranks(holders)[0], group=holders)
    shard = torch.zeros(s, dtype=param.dtype, device=device)
    owned = max(0, min(s, n - start))
    shard[:owned].copy_(flat[start : start + owned])
    sp = ShardedParam(param, shard, group, name, mics)
    REGISTRY[param] = sp
    return sp


# -- several parameters: one collective ------------------------------------------------------------
def all_gather_params(sps: Sequence[ShardedParam], async_op: bool = False) -> Any:
    """Fetch every SHARDED parameter of ``sps`` with ONE collective; returns its handle (or None).

    ``async_op``: the parameters become GATHERING and the caller later calls ``to_gathered()``
    (which waits); otherwise they are GATHERED on return. Parameters already GATHERING/GATHERED
    are skipped. All must share one process group and dtype. Sends Σ ``N·s·p`` bytes (message).
    """
    todo = [sp for sp in sps if sp.state is ParamState.SHARDED]
    if not todo:
        return None
    for sp in todo:  # offload_param: bring the shard back first (a no-op for STAYS_HERE)
        sp.home.fetch(sp)
    with ranges.range("zero3.gather"):
        return todo[0].gatherer.all_gather(todo, async_op)


class PlainGather:
    """The world all-gather of a parameter's shards (ZeRO++'s `ZeroPP` is the other gatherer)."""

    @staticmethod
    def all_gather(todo: list[ShardedParam], async_op: bool) -> Any:
        """One collective for ``todo`` (SHARDED, one group and dtype); marks them issued."""
        # Into each parameter's own 1D buffer (N*s, rank-major), whose storage autograd's saved
        # views share. See Note [a prefetch holds one copy].
        work = comm.all_gather_coalesced(
            lambda: [sp.allocate_full() for sp in todo],
            [sp.shard for sp in todo],
            group=todo[0].group,
            async_op=async_op,
        )
        mark_issued(todo, work, async_op)
        return work


#: The gatherer of every parameter without ZeRO++.
PLAIN_GATHER = PlainGather()


def mark_issued(todo: Sequence[ShardedParam], work: Any, async_op: bool) -> None:
    """The gather of ``todo`` was issued (as ``work``): they are GATHERING until waited for
    (async), or GATHERED now."""
    for sp in todo:
        if async_op:
            sp.to_gathering(work)
        else:
            sp.to_gathered()


def refresh_gathered(sps: Sequence[ShardedParam]) -> None:
    """Re-gather GATHERED parameters in place from their (updated) shards: one collective.

    Used after the optimizer step for persistent parameters, whose full buffers stay alive; writing
    into the same buffers keeps ``param.data`` (a view of them) valid. With one rank the shard
    *is* the padded full value: a local copy, no collective (ledger.py counts none).
    """
    sps = [sp for sp in sps if sp.state is ParamState.GATHERED]
    if not sps:
        return
    if sps[0].world_size == 1:
        for sp in sps:
            sp.full_flat().copy_(sp.shard)
        return
    with ranges.range("zero3.gather"):
        fulls, shards = [sp.full_flat() for sp in sps], [sp.shard for sp in sps]
        comm.all_gather_coalesced(fulls, shards, group=sps[0].group)


# -- the fetch unit ---------------------------------------------------------------------------------
class FetchUnit:
    """The parameters gathered together when one module runs, and their transitions.

    ``params``: the module's own parameters (its whole subtree for a leaf module, see
    ``set_leaf_module``), then *externals*: parameters of other modules it was seen reading in
    forward (added by the coordinator's demand fetch). Persistent parameters may be listed; they
    are simply always gathered. GatheredParameters and the prefetcher make units of their own
    (``index == -1``): a unit is whatever travels in one all-gather.

    Lifecycle, each step one method: `unshard` issues ONE all-gather for the members still
    SHARDED (async: they become GATHERING), `wait` finishes it (GATHERED), `hold` / `unhold`
    count this unit's users of every member, `reshard` releases the members nobody holds.
    A parameter shared by two units (a tied weight) is released only when neither holds it.
    Costs: `unshard` sends ``Σ N·s·p`` bytes (message) for the members not yet gathered; held
    while gathered: the same.
    """

    __slots__ = ("index", "kind", "name", "params")

    def __init__(self, index: int, name: str, kind: str, params: list[ShardedParam]) -> None:
        self.index = index
        self.name = name  # qualified module name ("" for the root)
        self.kind = kind  # module class name, for messages
        self.params = params

    @property
    def label(self) -> str:
        """``'name' (Class)``, for messages and the event log."""
        return f"'{self.name or '<root>'}' ({self.kind})"

    def fingerprint(self, what: str) -> int:
        """A rank-independent 31-bit hash of (event, module name): same module, same number."""
        return zlib.crc32(f"{what}:{self.name}".encode()) & 0x7FFFFFFF

    def missing(self) -> list[ShardedParam]:
        """Members still SHARDED (what `unshard` would gather)."""
        return [sp for sp in self.params if sp.state is ParamState.SHARDED]

    def unshard(self, async_op: bool = False) -> list[ShardedParam]:
        """Gather the SHARDED members with one collective; returns them. Synchronous: they are
        GATHERED on return (and members already in flight are waited for)."""
        missing = self.missing()
        all_gather_params(missing, async_op=async_op)
        if not async_op:
            self.wait()
        return missing

    def wait(self) -> None:
        """Finish the all-gathers in flight for members (GATHERING -> GATHERED)."""
        for sp in self.params:
            if sp.state is ParamState.GATHERING:
                sp.to_gathered()

    def hold(self) -> None:
        """One more user needs every member gathered (they must be, or about to be)."""
        for sp in self.params:
            sp._add_hold(+1)

    def unhold(self) -> None:
        """A user is done with the members (asserts it held them)."""
        for sp in self.params:
            sp._add_hold(-1)

    def reshard(self, keep: Collection[ShardedParam] = ()) -> list[ShardedParam]:
        """Release every member that no unit holds, is not persistent and not in ``keep``.

        A member still GATHERING is waited for first (its collective must complete on every
        rank). Returns the members released; frees ``N·s·p`` bytes for each.
        """
        released = []
        with ranges.range("zero3.release"):
            for sp in self.params:
                if sp.holds or sp.persistent or sp.state is ParamState.SHARDED or sp in keep:
                    continue
                if sp.state is ParamState.GATHERING:
                    sp.to_gathered()
                sp.to_sharded()
                released.append(sp)
        return released

    def __repr__(self) -> str:
        return f"FetchUnit({self.index}, {self.label}, {len(self.params)} params)"
