"""ZeRO++ on stage 3: quantized weights (qwZ), a node-local secondary partition (hpZ), quantized
gradients (qgZ; the arithmetic is in `zeropp_grads`). Each is one ZeroConfig field, usable alone
or together (DeepSpeed keys `zero_quantized_weights`, `zero_hpz_partition_size`,
`zero_quantized_gradients`).

The world of N ranks is M nodes of k ranks, node-major (global rank = node·k + local), k =
``LOCAL_WORLD_SIZE`` as torchrun sets it (set it by hand to emulate nodes on one machine), and
``hpz_partition_size`` must equal it. `NodeLayout` builds the two `ProcessGrid` axes: ``local``
(the k ranks of my node) and ``node`` (the M ranks with my local index).

**qwZ.** A parameter gather (`FetchUnit.unshard` -> params.py `all_gather_params`, which hands
the work to the parameter's gatherer: `ZeroPP.all_gather` when ZeRO++ is on) quantizes each member's shard (``s`` elements,
zero-padded to ``P = B·ceil(s/B)``) with comm's `BlockQuantizer` (int8, one fp32 scale per
``B = quant_block_numel`` elements), concatenates the members' messages into ONE uint8 message,
all-gathers it over the world and dequantizes every rank's part into the member's full buffer.
The shard, and the fp32 master, are never touched: only the gathered copy is approximate, by at
most ``max|block| / 254`` per element (comm/compression/quantize.py). The same shard quantizes to
the same bytes every time, so backward re-gathers exactly the weights forward used.
Bytes per parameter and gather (message, logger convention): ``N·(P + 4P/B)`` instead of
``N·s·p``, i.e. ``≈ 4x`` fewer than fp32 and ``≈ 2x`` fewer than bf16.

**hpZ.** Every rank also keeps a *secondary shard* of each non-persistent parameter: the slice
``[j·(N/k)·s, (j+1)·(N/k)·s)`` of the padded full parameter, j = my local rank, in the parameter
dtype. It is written when a forward gather lands (from the gathered, possibly dequantized,
values). A gather in backward, when every member's secondary shard was written in this forward,
all-gathers the secondary shards over the k ranks of the node, which rebuilds the padded full
parameter directly (node-local rank j holds chunk j): no byte crosses a node boundary. Otherwise
(a parameter not gathered in this forward) it falls back to the world gather. Cost: memory
``(N/k)·s·p`` per parameter per rank (`hpz_secondary_bytes` in memory/formulas.py, which
``zero.memory.predict`` adds); backward's message stays ``N·s·p`` but on a k-rank group, each rank
sending ``(k-1)·(N/k)·s·p`` bytes, all within the node. Secondary shards are invalidated at the
start of every forward (the shards may have stepped).

**qgZ.** The gradient reducer (strategy.py) calls `ZeroPP.reduce_scatter` instead of
``comm.reduce_scatter_tensor``: see `zeropp_grads` for the two hops and their error.

Only the coordinator's gathers inside a forward or backward pass are quantized or node-local.
Gathers outside a pass stay exact: `close()`, `GatheredParameters`, ``full_state_dict`` and
checkpoints see the true parameters. Persistent parameters
(``stage3_param_persistence_threshold_numel``) travel unquantized too: they are gathered once, and
re-gathered after each step, by the plain path.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import minispeed.comm as comm
from minispeed.comm import api_compat
from minispeed.comm.compression import BlockQuantizer, ScaledCodes
from minispeed.core import ranges
from minispeed.core.compiling import eager
from minispeed.zero.config import ZeroConfig
from minispeed.zero.stage3.params import ShardedParam, mark_issued
from minispeed.zero.stage3.zeropp_grads import hierarchical_quantized_reduce_scatter

__all__ = ["NodeLayout", "ZeroPP", "check_zeropp", "node_size_from_env", "zeropp_enabled"]


def zeropp_enabled(config: ZeroConfig) -> bool:
    """Whether any of qwZ, hpZ, qgZ is on."""
    return bool(
        config.quantized_weights or config.quantized_gradients or config.hpz_partition_size > 1
    )


def node_size_from_env(world_size: int) -> int:
    """Ranks per node: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else the whole world (one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else world_size


class NodeLayout:
    """M nodes × k ranks, node-major, with the two ProcessGrid axes' groups.

    Collective over the world (ProcessGrid creates groups on every rank).
    """

    def __init__(self, node_size: int) -> None:
        world = comm.get_world_size()
        self.node_size = node_size  # k
        self.num_nodes = world // node_size  # M
        topo = comm.ProcessTopology(axes=("node", "local"), dims=(self.num_nodes, node_size))
        self.grid = comm.ProcessGrid(topo)
        self.intra_group = self.grid.group("local")  # the k ranks of my node
        self.inter_group = self.grid.group("node")  # the M ranks with my local index
        self.local_rank = self.grid.rank_in("local")
        self.node = self.grid.rank_in("node")


# -- errors at shard() ------------------------------------------------------------------------------
def check_zeropp(config: ZeroConfig, group: Any, numels: Sequence[int], param_bytes: int) -> int:
    """Refuse a ZeRO++ configuration that cannot work here; returns the node size k.

    Every check but the last depends only on the config, the environment and the model, so every
    rank raises the same error before any collective. The last (qgZ needs an all-to-all) runs one
    tiny all-to-all on every rank and raises on every rank alike.
    """
    world = comm.get_world_size(group)
    nodes = config.hpz_partition_size > 1 or config.quantized_gradients  # a NodeLayout's
    if not nodes:  # qwZ alone quantizes the gather of whatever group stage 3 runs on
        if config.quantized_weights:
            _check_block_pays(config, world, numels, param_bytes)
        return node_size_from_env(world)
    if world != comm.get_world_size():
        raise ValueError(
            f"ZeRO++ (zero_quantized_weights / zero_hpz_partition_size / zero_quantized_gradients) "
            f"lays out nodes over the whole world, but zero.shard got a group of {world} of "
            f"{comm.get_world_size()} ranks; pass group=None or turn the ZeRO++ keys off"
        )
    env_node = node_size_from_env(world)
    hpz = config.hpz_partition_size
    if hpz > 1:
        if world % hpz:
            raise ValueError(
                f"zero_hpz_partition_size={hpz} does not divide the world of {world} ranks; set it "
                f"to the number of ranks per node (a divisor of {world}), or 1 to turn hpZ off"
            )
        if hpz != env_node:
            raise ValueError(
                f"zero_hpz_partition_size={hpz} does not match the node size {env_node} "
                f"(LOCAL_WORLD_SIZE): hpZ keeps its secondary partition inside one node; set "
                f"zero_hpz_partition_size to {env_node}, or 1 to turn hpZ off"
            )
    if world % env_node:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={env_node} does not divide the world of {world} ranks, so ZeRO++ "
            f"cannot lay out nodes; launch the same number of ranks on every node"
        )
    if config.quantized_weights:
        _check_block_pays(config, world, numels, param_bytes)
    if config.quantized_gradients and world > 1:
        _check_all_to_all()
    return env_node


def _check_block_pays(config: ZeroConfig, world: int, numels: Sequence[int], p: int) -> None:
    """qwZ must send fewer bytes than the plain gather, or the block size is nonsensical here."""
    q = BlockQuantizer(8, config.quant_block_numel)
    gathered = [
        -(-n // world) for n in numels if n > config.stage3_param_persistence_threshold_numel
    ]
    plain = sum(s * p for s in gathered)
    quantized = sum(q.packed_nbytes(q.padded_numel(s)) for s in gathered)
    if gathered and quantized >= plain:
        raise ValueError(
            f"zero_quantized_weights with quant_block_numel={config.quant_block_numel} would send "
            f"{quantized} bytes per rank and gather instead of {plain} unquantized: the shards "
            f"(largest {max(gathered)} elements over {world} ranks) are padded to whole blocks. "
            f"Use a block no larger than the typical shard (e.g. 64 or 256), raise "
            f"stage3_param_persistence_threshold so tiny parameters stay gathered, or turn "
            f"zero_quantized_weights off"
        )


def _check_all_to_all() -> None:
    """qgZ's hops are all-to-alls: probe one on the world; a backend without it is refused."""
    probe = torch.zeros(comm.get_world_size(), dtype=torch.float32)
    backend_error: Exception | None = None
    try:
        comm.all_to_all_single(torch.empty_like(probe), probe)
    except comm.CommError as err:
        backend_error = err
    if backend_error is not None or api_compat.impl_of("all_to_all", None) != "native":
        why = f" ({backend_error})" if backend_error is not None else ""
        raise ValueError(
            f"zero_quantized_gradients needs a backend with an all-to-all (qgZ reduce-scatters "
            f"gradients in two all-to-all hops), and this one has none{why}; use a backend with "
            f"all_to_all_single (nccl, gloo, mpi) or set zero_quantized_gradients to false"
        )


# -- the policy object --------------------------------------------------------------------------------
class _Finishing:
    """A gather handle whose ``wait()`` also runs ``finish`` (dequantize, write secondaries), once.

    Several parameters share one handle; ``ShardedParam.to_gathered`` waits on it for each, so
    waiting twice must be harmless (as for ``CommWork``).
    """

    __slots__ = ("_finish", "_work")

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> bool:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            finish, self._finish, self._work = self._finish, None, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None or self._work is None or self._work.is_completed()


class ZeroPP:
    """ZeRO++ for one Stage3Strategy: its gathers (qwZ, hpZ) and its gradient reduce-scatter (qgZ).

    ``secondary_shards``: hpZ's node-local copy, one 1D tensor of ``(N/k)·s`` elements (parameter
    dtype) per non-persistent parameter, allocated here and kept for the strategy's life.
    """

    def __init__(
        self,
        config: ZeroConfig,
        sharded: Sequence[ShardedParam],
        node_size: int,
        model: nn.Module,
    ) -> None:
        # The group stage 3 runs on: the world, or MiCS's shard group (qwZ alone: mics.py).
        self.world_size = comm.get_world_size(sharded[0].group if sharded else None)
        nodes = config.hpz_partition_size > 1 or config.quantized_gradients
        self.layout = NodeLayout(node_size) if self.world_size > 1 and nodes else None
        self.weights = (
            BlockQuantizer(8, config.quant_block_numel) if config.quantized_weights else None
        )
        self.grads = (  # with one rank there is nothing to reduce: the plain path copies
            BlockQuantizer(config.quantized_gradient_bits, config.quant_block_numel)
            if config.quantized_gradients and self.layout is not None
            else None
        )
        self.hpz = config.hpz_partition_size > 1 and self.layout is not None
        self.secondary_shards: dict[ShardedParam, torch.Tensor] = {}
        self._fresh: set[ShardedParam] = set()  # secondary written in this forward
        self._handle: RemovableHandle | None = None
        if self.hpz:
            per = self.world_size // node_size
            for sp in sharded:
                if not sp.persistent:
                    self.secondary_shards[sp] = sp.shard.new_zeros(per * sp.shard_numel)
            me = weakref.ref(self)

            @eager  # state, not math: never traced (engine.compile())
            def invalidate(module: nn.Module, args: Any) -> None:
                zeropp = me()
                if zeropp is not None:
                    zeropp._fresh.clear()

            # Before stage 3's own root hook, which gathers the root's parameters.
            self._handle = model.register_forward_pre_hook(invalidate, prepend=True)
        self._sharded = list(sharded)
        for sp in self._sharded:
            sp.set_gatherer(self)

    def remove(self) -> None:
        """Remove the forward hook and detach from the parameters (Stage3Strategy.close)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for sp in self._sharded:
            sp.set_gatherer(None)

    # -- gathers ------------------------------------------------------------------------------------
    def all_gather(self, todo: list[ShardedParam], async_op: bool) -> Any:
        """`PlainGather.all_gather` (params.py) with ZeRO++: the same contract (states set, handle returned)."""
        phase = self._phase(todo[0])
        if self.world_size == 1 or phase == "idle":  # exact: close(), GatheredParameters, saving
            work = self._plain(todo, async_op, keep=False)
        elif self.hpz and phase == "backward" and all(sp in self._fresh for sp in todo):
            with ranges.range("zero3.hpz_gather"):
                work = self._from_secondary(todo, async_op)
        elif self.weights is not None:
            with ranges.range("zero3.qwz_gather"):
                work = self._quantized(todo, async_op)
        else:
            work = self._plain(todo, async_op)
        mark_issued(todo, work, async_op)
        return work

    @staticmethod
    def _phase(sp: ShardedParam) -> str:
        """The coordinator's pass: "forward", "backward", or "idle" (outside both)."""
        coordinator = sp.coordinator
        return "idle" if coordinator is None else coordinator.phase.value

    def _keep_secondary(self, todo: list[ShardedParam]) -> None:
        """hpZ: copy my node-local chunk of each freshly gathered parameter."""
        if not self.hpz:
            return
        j = self.layout.local_rank
        for sp in todo:
            secondary = self.secondary_shards.get(sp)
            if secondary is not None:
                n = secondary.numel()
                # sp._full: the landed full buffer (GATHERING, or about to become GATHERED)
                secondary.copy_(sp._full[j * n : (j + 1) * n])
                self._fresh.add(sp)

    def _plain(self, todo: list[ShardedParam], async_op: bool, keep: bool = True) -> Any:
        """The world gather of params.py, plus (``keep``) hpZ's secondary copy when it lands."""
        work = comm.all_gather_coalesced(
            lambda: [sp.allocate_full() for sp in todo],
            [sp.shard for sp in todo],
            group=todo[0].group,
            async_op=async_op,
        )
        return self._finish(work, lambda: self._keep_secondary(todo) if keep else None, async_op)

    def _from_secondary(self, todo: list[ShardedParam], async_op: bool) -> Any:
        """hpZ: all-gather the secondary shards inside the node; chunk j of the result is local
        rank j's secondary, so the output *is* the padded full parameter."""
        return comm.all_gather_coalesced(
            lambda: [sp.allocate_full() for sp in todo],
            [self.secondary_shards[sp] for sp in todo],
            group=self.layout.intra_group,
            async_op=async_op,
        )

    def _quantized(self, todo: list[ShardedParam], async_op: bool) -> Any:
        """qwZ: one uint8 all-gather of every member's quantized shard; dequantized on landing."""
        q = self.weights
        messages, layout = [], []  # layout: (sp, byte offset, bytes, padded elements P)
        offset = 0
        for sp in todo:
            padded = q.padded_numel(sp.shard_numel)
            x = sp.shard.new_zeros(padded, dtype=torch.float32)
            x[: sp.shard_numel] = sp.shard
            message = q.compress(x).to_bytes()
            messages.append(message)
            layout.append((sp, offset, message.numel(), padded))
            offset += message.numel()
        mine = torch.cat(messages) if len(messages) > 1 else messages[0]
        gathered = mine.new_empty(self.world_size * mine.numel())  # (N · Σ bytes) uint8
        work = comm.all_gather_into_tensor(gathered, mine, group=todo[0].group, async_op=async_op)

        def finish() -> None:
            rows = gathered.view(self.world_size, -1)  # row r: rank r's messages
            for sp, start, nbytes, padded in layout:
                packed = ScaledCodes.from_rows(
                    rows[:, start : start + nbytes], padded, q.bits, q.block_numel
                )
                values = q.decompress(packed).view(self.world_size, padded)[:, : sp.shard_numel]
                full = sp.allocate_full()  # N·s, rank-major: row r = rank r's shard
                full.view(self.world_size, sp.shard_numel).copy_(values)
            self._keep_secondary(todo)

        return self._finish(work, finish, async_op)

    @staticmethod
    def _finish(work: Any, finish: Callable[[], None], async_op: bool) -> Any:
        if async_op:
            return _Finishing(work, finish)
        finish()
        return None

    # -- gradients (qgZ) ----------------------------------------------------------------------------
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> None:
        """qgZ in place of ``comm.reduce_scatter_tensor`` (SUM; synchronous: hop 2 needs hop 1's
        result, so the call returns when both hops are done, and the handle is None)."""
        with ranges.range("zero3.qgz_reduce_scatter"):
            hierarchical_quantized_reduce_scatter(
                output,
                input,
                quantizer=self.grads,
                intra_group=self.layout.intra_group,
                inter_group=self.layout.inter_group,
                node_size=self.layout.node_size,
            )
        return None
