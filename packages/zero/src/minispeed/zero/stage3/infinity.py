"""ZeRO-Infinity's optimizer side at stage 3: masters, Adam states and gradient shards on NVMe.

```text
zero_optimization: {stage: 3, offload_optimizer: {device: nvme, nvme_path: /nvme},
                              offload_param:     {device: nvme, nvme_path: /nvme}}
```

With ``offload_optimizer.device='nvme'`` at stage 3, nothing of size Ψ/N stays in host memory
on the optimizer's side (DeepSpeed's ZeRO-Infinity does the same):

- **masters + states**: offload's `SwappedMastersOptimizer` keeps each partition's
  ``[master | exp_avg | exp_avg_sq]`` in one swap file (12 B per element); the optimizer's
  "parameters" are meta *handles* (shape only, no bytes), one per trained shard;
- **gradient shards**: the reducer hands each reduced shard to `SwappedGrads` as its bucket
  lands (``GradShardReducer.redirect``), which writes it out at once (read-add-write from the second
  micro-step of an accumulation window) and keeps ``Σ g²`` for clipping (Note [the norm is kept
  as the gradients are written] in offload/swapped_grads.py);
- **the step**: partition by partition, master + states + gradients read, stepped, written
  back (pipelined), and each new master written straight into its parameter shard (a swap file
  with ``offload_param nvme``, the in-memory shard otherwise) while still in the buffer. So an
  fp32 value is kept once per home: the optimizer file and the parameter shard, never a third
  in-memory copy.

Bytes per rank (s = Ψ/N elements, p bytes per parameter element):

| where  | bytes                                                                  |
|--------|------------------------------------------------------------------------|
| files  | 12s (masters + states) + 4s (gradients) (+ p·s shards with param nvme) |
| host   | pools only: buffer_count·12·partition + gradient buffers (+ param pool)|

Disk traffic per step: read 12s + 4s, write 12s + p·s (new shards); per micro-step 4s written
(plus 4s read from the second micro-step of a window). fp16 (loss scaling) is refused: the
overflow check would have to read every gradient back before the step. In bf16 and fp32 a
gradient holding an inf or a NaN still skips the step, as at stage 3 in memory: its Σ g², kept
as it was written, is not finite (`LossScaler.unscale` reads `grad_square_sum`), so the check
reads no file.

`InfinityHome` (each trained parameter's `ShardHome`, over the home its shard had) routes a
value changed under `zero.GatheredParameters` into the master's file as well, so checkpoints, `full_state_dict` and `close()` see one truth.

A failed read or write of any of these files is recorded on the failing rank, which goes on
taking part in every collective; the step then raises `OffloadIOError` on every rank (Note [an
I/O failure fails every rank] in stage3/io_failures.py). Cost: one 1-element all-reduce at the
end of each step (4 bytes), and one more fp32 slot in the step's agreement flags.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from minispeed.zero.contract import StrategyWrapper
from minispeed.zero.offload_bridge import check_free_space, host_optimizer, swappers_of
from minispeed.zero.stage3.io_failures import IOFailures
from minispeed.zero.stage3.params import ParamState, ShardedParam, refresh_gathered
from minispeed.zero.stage3.residency import ShardHome

__all__ = ["InfinityHome", "InfinityStrategy", "agree_on_first_masters", "offload_masters"]


class InfinityHome:
    """A trained shard's `ShardHome` under ZeRO-Infinity: its own home (a swap file, host
    memory, or `STAYS_HERE` for an in-memory shard) does the fetches and evictions; a new value
    is also written into the master's file (one write of ``4s`` bytes)."""

    def __init__(
        self, shard_home: ShardHome, optimizer: Any, handle: torch.Tensor, io: IOFailures
    ) -> None:
        self.shard_home = shard_home
        self.optimizer = optimizer
        self.handle = handle  # the optimizer's handle of this parameter's master
        self.io_failures = io

    def fetch(self, sp: ShardedParam) -> None:
        self.shard_home.fetch(sp)

    def evict(self, sp: ShardedParam) -> None:
        self.shard_home.evict(sp)

    def write(self, sp: ShardedParam, values: torch.Tensor) -> None:
        self.shard_home.write(sp, values)
        with self.io_failures.guard(f"writing the master of {sp.name!r}"):
            self.optimizer.write_master(self.handle, values.float())

    def flush(self) -> None:
        self.shard_home.flush()

    def close(self) -> None:
        self.shard_home.close()


class InfinityStrategy(StrategyWrapper):
    """A stage-3 strategy (possibly with offloaded shards) whose masters and gradient shards
    live in the optimizer's swap files. The other `ShardStrategy` methods are the stage's."""

    def __init__(
        self,
        strategy: Any,
        optimizer: Any,
        handles: dict[ShardedParam, torch.Tensor],
        io_failures: IOFailures,
    ):
        super().__init__(strategy)
        self.grads_in_files = True
        self.optimizer = optimizer
        self.swapped_grads = optimizer.grads  # the clipping norm is read from here
        self.data_group = strategy.data_group  # the I/O agreements' ranks (MiCS: every replica)
        self._handles = handles
        self._sp_of = {id(h): sp for sp, h in handles.items()}
        self._marks = {id(h): torch.empty_like(h) for h in handles.values()}  # meta: no bytes
        self._written: set[int] = set()  # id(sp) whose shard the last step wrote
        self._homes = {id(sp): sp.home for sp in handles}  # each shard's own home
        self._swapped_homes = list(
            {id(h): h for h in self._homes.values() if h.io_failures is not None}.values()
        )
        optimizer.on_stepped = self._write_shard
        # One record of failed file I/O for the shard files and the optimizer's files.
        self.io_failures = io_failures
        self.io_failures.settlers.append(self.swapped_grads.swapper.wait_all)
        for sp, handle in handles.items():
            sp.set_home(InfinityHome(sp.home, optimizer, handle, io_failures))
        strategy.reducer.redirect(self._grad_out)

    # -- ShardStrategy ------------------------------------------------------------------------------
    def master_params(self) -> list[list[torch.Tensor]]:
        """Per group, the optimizer's handles (meta tensors: the masters live in its files)."""
        stage = self.stage
        return [[self._handles[stage.sharded[p]] for p in ps] for ps in stage.groups]

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Per group, meta markers: setting one as a handle's ``.grad`` selects it for the step;
        the values are in `SwappedGrads`' files."""
        stage = self.stage
        return [
            [self._marks[id(self._handles[stage.sharded[p]])] for p in ps] for ps in stage.groups
        ]

    def _grad_out(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        # Called in backward, between collectives: a failure is recorded, never raised here.
        with self.io_failures.guard(f"writing the gradient shard of {sp.name!r}"):
            self.swapped_grads.add(self._handles[sp], grad)

    @torch.no_grad()
    def _write_shard(self, handle: torch.Tensor, value: torch.Tensor) -> None:
        """The optimizer's ``on_stepped``: the new master becomes the parameter shard."""
        sp = self._sp_of[id(handle)]
        self._homes[id(sp)].write(sp, value)  # a file: straight from the buffer
        self._written.add(id(sp))

    @torch.no_grad()
    def publish_params(self) -> None:
        """The step already wrote the stepped shards; write the others from the master files
        (after a checkpoint load, or a parameter no rank used), then re-gather the persistent.

        Ends in the I/O agreement of the step (Note [an I/O failure fails every rank]): one
        1-element fp32 all-reduce, 4 bytes; after a failure on any rank, every rank raises
        `OffloadIOError`. Once this rank has failed, its local I/O here is skipped.
        """
        io = self.io_failures
        trained = self.stage.trained
        todo = [self._handles[sp] for sp in trained if id(sp) not in self._written]
        self._written.clear()
        if todo:
            io.run(
                "writing the parameter shards from the master files",
                lambda: self.optimizer.read_masters(todo, self._write_shard),
            )
            self._written.clear()
        for home in self._swapped_homes:  # the shard files must be whole before a fetch
            io.run("writing the parameter shards", home.flush)
        refresh_gathered([sp for sp in trained if sp.state is ParamState.GATHERED])
        io.agree(self.data_group, "the end of the optimizer step")

    def grad_square_sum(self) -> torch.Tensor:
        """Σ g², kept as the gradient shards were written (Note [the norm is kept as the
        gradients are written] in offload/swapped_grads.py): nothing is read back for it."""
        return torch.tensor(float(self.swapped_grads.square_sum()), dtype=torch.float32)

    def scale_grads(self, coef: float) -> bool:
        """The clipping coefficient is applied as the gradients are read back at the step."""
        self.swapped_grads.set_scale(coef)
        return True

    def zero_grad(self) -> None:
        """Drop the gradient shards: the files' contents are overwritten by the next window."""
        self._inner.zero_grad()
        self.swapped_grads.new_window()

    def close(self) -> None:
        """Gather the full parameters back into the model, then delete every swap file."""
        try:
            self._inner.close()  # with nvme shards: agrees on the reads of its gather
        finally:
            self.stage.reducer.redirect(None)
            self.optimizer.close()


def offload_masters(strategy: Any, user: torch.optim.Optimizer, config: Any) -> tuple[Any, Any]:
    """`zero.shard`'s hook for stage 3 with ``offload_optimizer.device='nvme'``: the masters
    (from the in-memory master, or read from the shard file) are written into the optimizer's
    files and dropped from memory; returns the wrapped strategy and the optimizer.

    Local: a failed write is recorded, not raised; `agree_on_first_masters` (collective) must
    follow, after the set-up agreement (Note [a set-up check fails on every rank])."""
    if strategy.precision.uses_loss_scaling:
        raise ValueError(
            "offload_optimizer.device='nvme' at stage 3 keeps the gradients in swap files, where "
            "fp16's overflow check cannot see them before the step: train in bf16 or fp32 "
            "(MixedPrecision(param_dtype=torch.bfloat16)), or set offload_optimizer.device to 'cpu'"
        )
    handles = {sp: torch.empty(sp.shard_numel, device="meta") for sp in strategy.trained}
    by_id = {id(h): sp for sp, h in handles.items()}
    masters = [[handles[strategy.sharded[p]] for p in ps] for ps in strategy.groups]
    optimizer = host_optimizer(user, masters, config, swap_masters=True)
    check_free_space(strategy, optimizer)  # before the first write

    def first_value(handle: torch.Tensor) -> torch.Tensor:
        sp = by_id[id(handle)]
        if sp.master is not None:  # the strategy's master (or the shard itself, fp32)
            return sp.take_master()
        sp.home.fetch(sp)  # fp32 shard in a swap file: it is its own master
        value = sp.shard.float()
        sp.home.evict(sp)
        return value

    # One record of failed file I/O for the shard files and the optimizer's files.
    io: IOFailures = strategy.io_failures or IOFailures()
    io.run(
        "writing the first masters into the optimizer's files",
        lambda: optimizer.fill_masters(first_value),
    )
    return InfinityStrategy(strategy, optimizer, handles, io), optimizer


def agree_on_first_masters(strategy: InfinityStrategy) -> None:
    """Collective, at the end of `zero.shard`: the first masters were written on every rank, or
    every rank raises `OffloadIOError` (one 1-element all-reduce). After a failure the swap
    files are deleted; their own errors (the other writes in flight on a full disk) are not
    raised in place of the agreed one."""
    try:
        strategy.io_failures.agree(strategy.data_group, "zero.shard, writing the first masters")
    except BaseException:
        for swapper in swappers_of(strategy, strategy.optimizer):  # the parameters' files too
            swapper.abandon()
            with contextlib.suppress(OSError):  # the files are removed even when this raises
                swapper.close()
        raise
