"""One partitioned parameter (:class:`ShardedParam`) and the collectives that move it.

Stage 3 keeps only ``1/N`` of every parameter on each rank. The model's ``nn.Parameter`` objects
stay where they are (autograd leaves, optimizer references and ``named_parameters()`` keep
working); what changes is what their ``.data`` points to:

- released (SHARDED): ``param.data`` is an empty tensor (0 elements), so the rank holds only its
  shard;
- fetched (GATHERED): ``param.data`` is a view of a freshly all-gathered full buffer.

Everything stage 3 knows about a parameter lives in its :class:`ShardedParam`, an object we own,
found through :data:`REGISTRY` (a weak dict keyed by the parameter). Nothing is patched onto the
``nn.Parameter``. See Note [why .data is swapped].

Layout of one parameter of ``n`` elements over N ranks (``s = ceil(n / N)``)::

    flattened parameter:  | x0 x1 x2 x3 x4 x5 x6 |  _  |      padded to N·s = 8 (N = 4, n = 7)
    shard of rank r:        elements [r·s, (r+1)·s)       rank 3 holds x6 and one padding zero

The all-gather of the N shards (rank-major) *is* the padded flat parameter, so no copy is needed
after it: ``param.data = full[:n].view(shape)``.

Costs (p = bytes per element of the parameter dtype):

- kept per rank, always: the shard, ``s·p`` bytes (plus the fp32 master ``4s`` and fp32 gradient
  shard ``4s`` that the strategy attaches; for fp32 parameters the master *is* the shard);
- while gathered: the full buffer, ``N·s·p`` bytes;
- one all-gather of a parameter: ``N·s·p`` bytes (message size; each rank sends ``(N-1)·s·p``);
- one reduce-scatter of its gradient: ``N·s·g`` bytes (g = bytes per reduced gradient element).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import minispeed.comm as comm
from minispeed.core.accelerator import get_accelerator

__all__ = [
    "REGISTRY",
    "ParamState",
    "ShardedParam",
    "all_gather_params",
    "partition_param",
    "refresh_gathered",
    "release_params",
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
#     module's backward (hooks.py: pre-backward hooks), and stay gathered until its gradient has
#     been accumulated (AccumulateGrad checks the gradient's layout against ``param``);
#   * nodes that saved a *view* of it (``weight.t()`` inside ``F.linear``) keep the old buffer
#     alive until backward frees them, so between forward and backward some released parameters
#     still cost memory. (Resizing the storage to 0 instead would free them, at the price of
#     parameters that keep their shape while holding no bytes; we keep the simpler rule of the
#     contract: released means ``param.data.numel() == 0``.)

#: Every partitioned parameter of this process -> its ShardedParam (weak: dropping the model drops
#: the entry). zero.Init, zero.shard and GatheredParameters all look parameters up here.
REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ParamState(enum.Enum):
    """Where a stage-3 parameter's full value is. ``n`` elements, ``s = ceil(n/N)``, p bytes each.

    ==========  ==========================================  =================================
    state       tensors that exist                          bytes held for this parameter
    ==========  ==========================================  =================================
    SHARDED     shard (s); ``param.data`` = empty (0)       ``s·p``
    GATHERING   shard; full buffer (N·s) being written by   ``s·p + N·s·p``
                an async all-gather; ``param.data`` empty
    GATHERED    shard; full buffer; ``param.data`` =        ``s·p + N·s·p``
                ``full[:n].view(shape)``
    ==========  ==========================================  =================================

    (Plus the strategy's fp32 master and gradient shards, ``4s`` bytes each, in every state.)
    Transitions: SHARDED -> GATHERING -> GATHERED -> SHARDED, or SHARDED -> GATHERED for a
    synchronous fetch; each is one ``to_<state>()`` method that asserts its source state.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardedParam:
    """Everything stage 3 keeps for one ``nn.Parameter``: its shard, state, and owners.

    Attributes set by the strategy (``None`` until ``zero.shard`` runs): ``master`` (fp32,
    ``s`` elements; the very ``shard`` tensor for fp32 training), ``grad_shard`` (``s`` elements of
    ``grad_accum_dtype``), ``coordinator`` (the FetchCoordinator that fetches it in forward).
    ``holds`` counts the users that need it gathered now (running modules, GatheredParameters
    contexts); it is released only when that count is 0 and it is not ``persistent``.
    """

    def __init__(
        self, param: nn.Parameter, shard: torch.Tensor, group: Any, name: str = ""
    ) -> None:
        # Weak: REGISTRY's values must not keep its (weak) keys alive, or no model is ever freed.
        self._param = weakref.ref(param)
        self.name = name  # qualified name; set by zero.shard (Init does not know it yet)
        self.shape = param.shape  # the full shape (param.shape is (0,) while released)
        self.numel = param.numel()
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.shard_numel = -(-self.numel // self.world_size)  # ceil(n / N)
        self.shard = shard  # 1D, numel = shard_numel, param dtype; padding elements are 0
        self.master: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.coordinator: Any = None
        self.persistent = False
        self.holds = 0
        self.state = ParamState.SHARDED
        self._full: torch.Tensor | None = None  # 1D, numel = N * shard_numel, while not SHARDED
        self._work: Any = None  # the in-flight all-gather, while GATHERING

    @property
    def param(self) -> nn.Parameter:
        """The model parameter this object partitions."""
        param = self._param()
        assert param is not None, f"{self.name}: its parameter was garbage-collected"
        return param

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def padded_numel(self) -> int:
        """Elements of the gathered buffer: ``N · ceil(n / N)``."""
        return self.world_size * self.shard_numel

    @property
    def start(self) -> int:
        """Offset of this rank's shard in the flattened full parameter."""
        return self.rank * self.shard_numel

    @property
    def owned_numel(self) -> int:
        """Real (non-padding) elements in this rank's shard; may be 0 for tiny parameters."""
        return max(0, min(self.shard_numel, self.numel - self.start))

    # -- state transitions ------------------------------------------------------------------------
    def to_gathering(self, full: torch.Tensor, work: Any) -> None:
        """An async all-gather into ``full`` was issued; ``param.data`` stays empty until it lands."""
        assert self.state is ParamState.SHARDED, f"{self.name}: to_gathering from {self.state}"
        self._full, self._work = full, work
        self.state = ParamState.GATHERING

    def to_gathered(self, full: torch.Tensor | None = None) -> None:
        """Finish the fetch: wait for the all-gather (if any) and point ``param.data`` at the result.

        From GATHERING (waits on the pending collective), or from SHARDED with ``full`` already
        holding the gathered values (a synchronous fetch).
        """
        if self.state is ParamState.GATHERING:
            assert full is None, f"{self.name}: a pending gather already owns the buffer"
            self._work.wait()  # CommWork.wait is idempotent: several params may share one call
            self._work = None
        else:
            assert self.state is ParamState.SHARDED and full is not None, (
                f"{self.name}: to_gathered from {self.state}"
            )
            self._full = full
        self.param.data = self._full[: self.numel].view(self.shape)
        self.state = ParamState.GATHERED

    def to_sharded(self) -> None:
        """Release: drop the full buffer; ``param.data`` becomes an empty tensor."""
        assert self.state is ParamState.GATHERED, f"{self.name}: to_sharded from {self.state}"
        assert self.holds == 0 and not self.persistent, (
            f"{self.name}: released while held ({self.holds}) or persistent"
        )
        self.param.data = self.shard.new_empty(0)
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

    def write_full(self, full_flat: torch.Tensor) -> None:
        """Re-partition: take this rank's slice of new full values into the shard (and master)."""
        mine = full_flat.reshape(-1)[self.start : self.start + self.owned_numel]
        self.shard[: self.owned_numel].copy_(mine)
        if self.master is not None and self.master is not self.shard:
            self.master[: self.owned_numel].copy_(mine)

    def __repr__(self) -> str:
        return (
            f"ShardedParam({self.name or '?'}, shape={tuple(self.shape)}, state={self.state.name}, "
            f"shard={self.shard_numel}, holds={self.holds}, persistent={self.persistent})"
        )


# -- one parameter or a group -----------------------------------------------------------------------
def partition_param(param: nn.Parameter, group: Any, name: str = "") -> ShardedParam:
    """Cut ``param``'s current full value into N shards, keep ours, release the rest.

    Every rank must hold the same full value (same seed, or loaded from the same file): each keeps
    only its slice, so a rank whose value differs contributes that slice. Memory: after this call
    the rank holds ``ceil(n/N)`` elements of ``param`` instead of ``n``.
    """
    if param in REGISTRY:
        return REGISTRY[param]
    device = get_accelerator().device()
    n, world = param.numel(), comm.get_world_size(group)
    s = -(-n // world)
    start = comm.get_rank(group) * s
    flat = param.detach().reshape(-1)
    shard = torch.zeros(s, dtype=param.dtype, device=device)
    owned = max(0, min(s, n - start))
    shard[:owned].copy_(flat[start : start + owned])
    sp = ShardedParam(param, shard, group, name)
    param.data = shard.new_empty(0)
    REGISTRY[param] = sp
    return sp


def all_gather_params(sps: Sequence[ShardedParam], async_op: bool = False) -> Any:
    """Fetch every SHARDED parameter of ``sps`` with ONE collective; returns its handle (or None).

    ``async_op``: the parameters become GATHERING and the caller later calls ``to_gathered()``
    (which waits); otherwise they are GATHERED on return. Parameters already GATHERING/GATHERED
    are skipped. All must share one process group and dtype. Sends Σ ``N·s·p`` bytes (message).
    """
    todo = [sp for sp in sps if sp.state is ParamState.SHARDED]
    if not todo:
        return None
    group = todo[0].group
    fulls = [sp.shard.new_empty(sp.padded_numel) for sp in todo]  # 1D, N*s each, rank-major
    if len(todo) == 1:
        work = comm.all_gather_into_tensor(fulls[0], todo[0].shard, group=group, async_op=async_op)
    else:
        work = comm.all_gather_coalesced(
            fulls, [sp.shard for sp in todo], group=group, async_op=async_op
        )
    for sp, full in zip(todo, fulls):
        if async_op:
            sp.to_gathering(full, work)
        else:
            sp.to_gathered(full)
    return work


def refresh_gathered(sps: Sequence[ShardedParam]) -> None:
    """Re-gather GATHERED parameters in place from their (updated) shards: one collective.

    Used after the optimizer step for persistent parameters, whose full buffers stay alive; writing
    into the same buffers keeps ``param.data`` (a view of them) valid.
    """
    sps = [sp for sp in sps if sp.state is ParamState.GATHERED]
    if not sps:
        return
    if len(sps) == 1:
        comm.all_gather_into_tensor(sps[0].full_flat(), sps[0].shard, group=sps[0].group)
    else:
        comm.all_gather_coalesced(
            [sp.full_flat() for sp in sps], [sp.shard for sp in sps], group=sps[0].group
        )


def release_params(sps: Sequence[ShardedParam]) -> list[ShardedParam]:
    """Release every parameter of ``sps`` that nobody holds and is not persistent.

    A parameter still GATHERING is waited for first (its collective must complete on every rank).
    Returns the parameters released.
    """
    released = []
    for sp in sps:
        if sp.holds or sp.persistent or sp.state is ParamState.SHARDED:
            continue
        if sp.state is ParamState.GATHERING:
            sp.to_gathered()
        sp.to_sharded()
        released.append(sp)
    return released
