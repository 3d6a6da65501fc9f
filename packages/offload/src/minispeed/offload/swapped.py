"""An Adam/AdamW whose states live in NVMe files, stepped partition by partition in a pipeline.

    opt = SwappedOptimizer(model.parameters(), OffloadOptimizerConfig(
        device="nvme", nvme_path="/nvme", pipeline_read=True, pipeline_write=True), lr=1e-3)

Parameters (fp32, on the CPU) are cut into partitions of at most ``sub_group_numel`` elements
(consecutive parameters of one group; a larger parameter is a partition alone). Each partition's
``exp_avg`` and ``exp_avg_sq`` sit back to back in one swap file. A step runs, for partition i:

    wait for the read of i  ->  start reading i+1 (pipeline_read)  ->  CPU Adam on i
    ->  start writing i (pipeline_write; otherwise wait for it)

so while the CPU updates partition i the disk reads i+1 and writes i-1 (Note [the swap pipeline]).

Bytes: host memory holds the parameters and gradients (8 B per parameter) plus the pool,
``buffer_count * 2 * 4 * max_partition_numel`` bytes, instead of 8 B per parameter of states:
`SwappedOptimizer.resident_state_bytes` and `SwappedOptimizer.swapped_state_bytes`.
Each step reads and writes ``8 * numel`` bytes of the disk; with a disk of R B/s and a CPU step of
S s per partition, the step is disk-bound when ``8 * numel_i / R > S_i`` (docs/packages/offload.md).

`minispeed.offload.swapped_masters.SwappedMastersOptimizer` moves the masters and the gradients
to files as well (ZeRO-Infinity: no per-parameter host bytes at all).

``state_dict()`` has torch.optim.Adam's format (the states are read back from the files), so a
checkpoint moves between this, `minispeed.offload.optimizers.CPUAdam` and torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from minispeed.core import ranges
from minispeed.offload.config import AioConfig, OffloadOptimizerConfig
from minispeed.offload.optimizers import CPUAdam, adam_step_by_count, write_back_by_param
from minispeed.offload.swapper import SwappedTensor, TensorSwapper

__all__ = ["Partition", "SwappedOptimizer"]

_STATES = ("exp_avg", "exp_avg_sq")

# Note [the swap pipeline]
# With pipeline_read, the read of partition i+1 is submitted before partition i is stepped, so
# the disk works while the CPU does; with pipeline_write, the write of partition i is waited on
# only when its buffer is needed again (TensorSwapper._acquire waits for the oldest write). Three
# buffers cover the steady state (stepping i, reading i+1, writing i-1); with two, the read of
# i+1 first waits for the write of i-1. The step time per partition is then about
# max(cpu_i, (read_{i+1} + write_{i-1}) / disk) instead of their sum.


@dataclasses.dataclass
class Partition:
    """Consecutive parameters of one param group whose states share a swap file."""

    group: int
    params: list[torch.Tensor]
    offsets: list[int]  # element offset of each parameter inside the partition
    numel: int
    swap: SwappedTensor | None = None  # layout: [exp_avg (numel) | exp_avg_sq (numel)]


class SwappedOptimizer(CPUAdam):
    """`CPUAdam` (Adam/AdamW: same arguments) with ``exp_avg``/``exp_avg_sq`` on NVMe.

    ``config.device`` must be ``"nvme"``. ``sub_group_numel`` caps a partition (DeepSpeed's
    ``sub_group_size``); the pool holds ``config.buffer_count`` buffers of two states each.
    """

    _name = "SwappedOptimizer"
    _slots = 2  # fp32 values per element in a partition's file: exp_avg, exp_avg_sq

    def __init__(
        self,
        params: Iterable[Any],
        config: OffloadOptimizerConfig,
        aio: AioConfig | None = None,
        *,
        sub_group_numel: int = 100_000_000,
        **adam_kwargs: Any,
    ) -> None:
        if config.device != "nvme":
            raise ValueError(
                f"SwappedOptimizer needs offload_optimizer.device='nvme', got {config.device!r}; "
                "for device='cpu' use CPUAdam (see minispeed.offload.offload_optimizer)"
            )
        if sub_group_numel < 0:  # 0: one partition per parameter, as DeepSpeed's sub-groups
            raise ValueError(f"sub_group_numel must be >= 0, got {sub_group_numel}")
        super().__init__(params, **adam_kwargs)
        self.config = config
        self.partitions = self._cut(sub_group_numel)
        largest = max((p.numel for p in self.partitions), default=1)
        assert config.nvme_path is not None  # checked by OffloadOptimizerConfig
        self.swapper = TensorSwapper(
            config.nvme_path,
            buffer_count=config.buffer_count,
            buffer_numel=self._slots * largest,
            pin_memory=config.pin_memory,
            aio=aio,
            config_key="offload_optimizer",
        )
        for i, part in enumerate(self.partitions):
            part.swap = self.swapper.register(f"optimizer-{i}", self._slots * part.numel)

    def _cut(self, limit: int) -> list[Partition]:
        parts: list[Partition] = []
        for g, group in enumerate(self.param_groups):
            current: Partition | None = None
            for p in group["params"]:
                n = p.numel()
                if current is None or current.numel + n > limit:
                    current = Partition(g, [], [], 0)
                    parts.append(current)
                current.params.append(p)
                current.offsets.append(current.numel)
                current.numel += n
        return parts

    # -- memory, for the reports -----------------------------------------------------------------
    def swapped_state_bytes(self) -> int:
        """Bytes of optimizer state kept in files instead of host memory: ``8 * numel``."""
        return sum(8 * p.numel for p in self.partitions)

    def resident_state_bytes(self) -> int:
        """Host bytes the states cost while swapped: the buffer pool."""
        return self.swapper.pool.nbytes

    # -- the step ----------------------------------------------------------------------------------
    def _views(self, part: Partition, buf: torch.Tensor) -> tuple[list, list]:
        exp_avg, exp_avg_sq = buf[: part.numel], buf[part.numel : 2 * part.numel]
        ms = [exp_avg[o : o + p.numel()].view_as(p) for p, o in zip(part.params, part.offsets)]
        vs = [exp_avg_sq[o : o + p.numel()].view_as(p) for p, o in zip(part.params, part.offsets)]
        return ms, vs

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        write_back: Sequence[torch.Tensor | None] | None = None,
    ) -> float | None:
        """One pipelined step of every partition (see Note [the swap pipeline])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        out_of = write_back_by_param(self, write_back)
        sw, cfg = self.swapper, self.config
        # Only partitions with a gradient are read and written: a caller stepping a few
        # sub-groups per call (minispeed.zero's sub_group_size) moves only those.
        parts = [p for p in self.partitions if any(q.grad is not None for q in p.params)]
        with ranges.range("offload.swapped_step"):
            if cfg.pipeline_read and parts:
                sw.swap_in(parts[0].swap)
            for i, part in enumerate(parts):
                if not cfg.pipeline_read:
                    sw.swap_in(part.swap)
                buf = sw.wait_in(part.swap)
                if cfg.pipeline_read and i + 1 < len(parts):
                    sw.swap_in(parts[i + 1].swap)  # read ahead while this partition is stepped
                with ranges.range("offload.cpu_step"):
                    self._step_partition(part, buf, out_of)
                sw.swap_out(part.swap)
                if not cfg.pipeline_write:
                    sw.wait_out(part.swap)
            sw.wait_all()
        return loss

    def _count_steps(self, params: list[torch.Tensor]) -> list[float]:
        """Add one to each parameter's ``state["step"]`` (created at 0 on its first step); the
        new counts, in order."""
        counts = []
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["step"] += 1
            counts.append(float(state["step"]))
        return counts

    def _step_partition(self, part: Partition, buf: torch.Tensor, out_of: dict) -> None:
        group = self.param_groups[part.group]
        self._check_group(group)
        ms, vs = self._views(part, buf)
        idx = [k for k, p in enumerate(part.params) if p.grad is not None]
        adam_step_by_count(
            group,
            self._count_steps([part.params[k] for k in idx]),
            [part.params[k] for k in idx],
            [part.params[k].grad.detach().float().contiguous() for k in idx],
            [ms[k] for k in idx],
            [vs[k] for k in idx],
            write_back=[out_of.get(id(part.params[k])) for k in idx],
            simd=self._simd,
        )

    # -- checkpoints in torch.optim.Adam's format ------------------------------------------------
    def _materialize(self) -> None:
        """Copy ``exp_avg``/``exp_avg_sq`` of every stepped partition from the files into ``state``."""
        for part in self.partitions:
            stepped = ["step" in self.state[p] for p in part.params]  # never stepped: no state
            if not any(stepped):
                continue
            self.swapper.swap_in(part.swap)
            ms, vs = self._views(part, self.swapper.wait_in(part.swap))
            for p, m, v, has in zip(part.params, ms, vs, stepped):
                if has:
                    self.state[p].update(exp_avg=m.clone(), exp_avg_sq=v.clone())
            self.swapper.release(part.swap)  # only read: the file is still current

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adam's format; ``exp_avg``/``exp_avg_sq`` are copies read from the files."""
        saved = {p: dict(s) for p, s in self.state.items()}
        try:
            self._materialize()
            return super().state_dict()
        finally:
            self.state.clear()
            self.state.update(saved)

    @contextlib.contextmanager
    def states_in_memory(self) -> Iterator[SwappedOptimizer]:
        """Inside, ``state[p]`` holds ``exp_avg``/``exp_avg_sq`` as torch.optim.Adam's does (copies
        read from the files: 8 B per parameter of host memory, for the duration), for code that
        reads or fills ``state`` directly (minispeed.zero's checkpoints). On exit the states
        present are written back to the files (`absorb_states`), so changes made inside persist.
        """
        self._materialize()
        try:
            yield self
        finally:
            self.absorb_states()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.optim.Adam's (or CPUAdam's) format; the states are written to the files."""
        super().load_state_dict(state_dict)
        self.absorb_states()

    def absorb_states(self) -> None:
        """Move every ``exp_avg``/``exp_avg_sq`` found in ``state`` into the files (and out of
        ``state``); the other parameters of its partition keep what their file holds."""
        for part in self.partitions:
            present = [all(k in self.state[p] for k in _STATES) for p in part.params]
            if not any(present):
                continue
            self.swapper.swap_in(part.swap)
            ms, vs = self._views(part, self.swapper.wait_in(part.swap))
            for p, m, v, has in zip(part.params, ms, vs, present):
                if has:
                    state = self.state[p]
                    m.copy_(state.pop("exp_avg"))
                    v.copy_(state.pop("exp_avg_sq"))
            self.swapper.swap_out(part.swap)
            self.swapper.wait_out(part.swap)

    def close(self) -> None:
        """Delete the swap files now (also done at exit and when the optimizer is collected)."""
        self.swapper.close()
