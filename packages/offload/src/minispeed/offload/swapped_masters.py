"""ZeRO-Infinity's optimizer: fp32 masters, Adam states *and* gradients on NVMe.

    masters = [torch.empty(n, device="meta") for n in sizes]     # shape-only handles
    opt = SwappedMastersOptimizer(masters, OffloadOptimizerConfig(device="nvme", nvme_path=...,
                                  pipeline_read=True, pipeline_write=True), lr=1e-3,
                                  on_stepped=lambda m, value: ...)  # e.g. write the new shard
    opt.fill_masters(lambda m: initial_value_of(m))               # written once, then dropped
    opt.grads.add(m, g)                                           # during backward: out to disk
    m.grad = torch.empty(n, device="meta"); opt.step()            # the marker: m is stepped

`SwappedOptimizer` keeps the masters and their gradients in host memory (8 B per parameter) and
swaps only the two states. Here a partition's file holds ``[master | exp_avg | exp_avg_sq]``
(12 B per element) and the gradients live in `SwappedGrads` files, so host memory holds no
per-parameter bytes at all: only the pools (``buffer_count`` buffers of ``12 * partition`` bytes,
plus `SwappedGrads`' buffers). The step is the same pipeline (Note [the swap pipeline] in
swapped.py): while partition i is stepped, partition i+1's states and gradients are read and
partition i-1 is written. After each partition is stepped, ``on_stepped(handle, new_value)`` is
called for each of its parameters while the new master is still in the buffer: that is where
ZeRO writes the parameter shard (one pass over the bytes, no second fp32 copy kept anywhere).

The optimizer's parameters are *handles*: meta tensors with the masters' shapes, which hold no
bytes and refuse to be read, so code that would read a master by mistake fails loudly. ``.grad``
set on a handle (any meta tensor) marks it for the next `step`, as torch.optim's ``.grad`` does.

Bytes per step and element: read 12 (partition) + 4 (gradient), write 12; plus 4 written per
micro-step by `SwappedGrads.add`. `state_dict`, `states_in_memory` and `load_state_dict` read
the masters and states back into real tensors (12 B per element for the duration).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from minispeed.core import ranges
from minispeed.offload.config import AioConfig, OffloadOptimizerConfig
from minispeed.offload.optimizers import _refuse, adam_step_by_count
from minispeed.offload.swapped import Partition, SwappedOptimizer
from minispeed.offload.swapped_grads import SwappedGrads

__all__ = ["SwappedMastersOptimizer"]

OnStepped = Callable[[torch.Tensor, torch.Tensor], None]


class SwappedMastersOptimizer(SwappedOptimizer):
    """Adam/AdamW whose masters, states and gradients all live in swap files (see module doc)."""

    _name = "SwappedMastersOptimizer"
    _slots = 3  # master, exp_avg, exp_avg_sq
    masters_in_files = True  # zero's checkpoint loader materialises them (states_in_memory)

    def __init__(
        self,
        params: Iterable[Any],
        config: OffloadOptimizerConfig,
        aio: AioConfig | None = None,
        *,
        sub_group_numel: int = 100_000_000,
        on_stepped: OnStepped | None = None,
        **adam_kwargs: Any,
    ) -> None:
        super().__init__(params, config, aio, sub_group_numel=sub_group_numel, **adam_kwargs)
        self.on_stepped = on_stepped
        assert config.nvme_path is not None
        self.grads = SwappedGrads(
            [[(p, p.numel()) for p in part.params] for part in self.partitions],
            config.nvme_path,
            buffer_count=config.buffer_count,
            read_buffers=2,
            pin_memory=config.pin_memory,
            aio=aio,
            config_key="offload_optimizer",
        )
        self._where = {
            p: (i, k) for i, part in enumerate(self.partitions) for k, p in enumerate(part.params)
        }
        self._real: dict[torch.Tensor, torch.Tensor] = {}  # handle -> materialised master

    def _check_group(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if p.dtype != torch.float32 or (p.device.type != "meta" and p not in self._real_ids()):
                raise TypeError(
                    f"{self._name} steps fp32 masters that live in its files: pass meta tensors "
                    f"of the masters' shapes as handles (got {p.dtype} on {p.device}) and give "
                    "the values with fill_masters"
                )
        _refuse(
            self._name, amsgrad=group.get("amsgrad", False), maximize=group.get("maximize", False)
        )

    def _real_ids(self) -> set[int]:
        return {id(t) for t in getattr(self, "_real", {}).values()}

    # -- memory, for the reports -----------------------------------------------------------------
    def swapped_state_bytes(self) -> int:
        """Bytes kept in files instead of host memory: masters + states ``12 * numel``, grads ``4 * numel``."""
        return sum(12 * p.numel for p in self.partitions) + self.grads.swapped_bytes

    def resident_state_bytes(self) -> int:
        """Host bytes held: the partition pool and the gradient buffers."""
        return self.swapper.pool.nbytes + self.grads.resident_bytes

    # -- the values --------------------------------------------------------------------------------
    def _views(self, part: Partition, buf: torch.Tensor) -> tuple[list, list, list]:  # type: ignore[override]
        n = part.numel
        cut = [buf[s * n : (s + 1) * n] for s in range(3)]
        return tuple(  # type: ignore[return-value]
            [c[o : o + p.numel()] for p, o in zip(part.params, part.offsets)] for c in cut
        )

    @torch.no_grad()
    def fill_masters(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Write every master's first value (``value_of(handle)``: numel elements, any device);
        the states start at zero. One pass, ``buffer_count`` partitions in flight."""
        sw = self.swapper
        for part in self.partitions:
            sw.swap_in(part.swap)  # a NEW file: a zeroed buffer, no read
            ws, _, _ = self._views(part, sw.wait_in(part.swap))
            for p, w in zip(part.params, ws):
                w.copy_(value_of(p).reshape(-1))
            sw.swap_out(part.swap)
        sw.wait_all()

    @torch.no_grad()
    def read_masters(self, handles: Sequence[torch.Tensor], fn: OnStepped) -> None:
        """``fn(handle, master_value)`` for each of ``handles`` (a view valid during the call)."""
        wanted = {id(h) for h in handles}
        for part in self.partitions:
            if not any(id(p) in wanted for p in part.params):
                continue
            self.swapper.swap_in(part.swap)
            ws, _, _ = self._views(part, self.swapper.wait_in(part.swap))
            for p, w in zip(part.params, ws):
                if id(p) in wanted:
                    fn(p, w)
            self.swapper.release(part.swap)

    @torch.no_grad()
    def write_master(self, handle: torch.Tensor, values: torch.Tensor, start: int = 0) -> None:
        """Overwrite elements ``[start, start + len(values))`` of ``handle``'s master in its file
        (e.g. a value changed under ``zero.GatheredParameters``); synchronous."""
        i, k = self._where[handle]
        part = self.partitions[i]
        self.swapper.wait_out(part.swap)
        self.swapper.swap_in(part.swap)
        ws, _, _ = self._views(part, self.swapper.wait_in(part.swap))
        flat = values.reshape(-1)
        ws[k][start : start + flat.numel()].copy_(flat)
        self.swapper.swap_out(part.swap)
        self.swapper.wait_out(part.swap)

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, write_back: Any = None
    ) -> float | None:
        """One pipelined step of every partition holding a marked handle (``.grad`` not None)."""
        if write_back is not None:
            raise ValueError(f"{self._name}: use on_stepped instead of write_back")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sw, grads = self.swapper, self.grads
        todo = [
            i for i, p in enumerate(self.partitions) if any(q.grad is not None for q in p.params)
        ]
        with ranges.range("offload.swapped_step"):
            try:
                self._pipeline(todo)
            except BaseException:  # stop cleanly: nothing in flight, every buffer free
                grads.abandon()
                sw.abandon()
                raise
        return loss

    def _pipeline(self, todo: list[int]) -> None:
        """Read, step and write the partitions ``todo``, reading ahead and writing behind."""
        sw, cfg, grads = self.swapper, self.config, self.grads
        if cfg.pipeline_read and todo:
            sw.swap_in(self.partitions[todo[0]].swap)
            grads.start_read(todo[0])
        for n, i in enumerate(todo):
            part = self.partitions[i]
            if not cfg.pipeline_read:
                sw.swap_in(part.swap)
            buf = sw.wait_in(part.swap)
            gs = grads.wait_read(i)
            if cfg.pipeline_read and n + 1 < len(todo):  # read ahead while i is stepped
                sw.swap_in(self.partitions[todo[n + 1]].swap)
                grads.start_read(todo[n + 1])
            with ranges.range("offload.cpu_step"):
                self._step_with(part, buf, gs)
            grads.done_read(i)
            sw.swap_out(part.swap)
            if not cfg.pipeline_write:
                sw.wait_out(part.swap)
        sw.wait_all()

    def _step_with(self, part: Partition, buf: torch.Tensor, gs: list[torch.Tensor]) -> None:
        group = self.param_groups[part.group]
        ws, ms, vs = self._views(part, buf)
        idx = [k for k, p in enumerate(part.params) if p.grad is not None]
        adam_step_by_count(
            group,
            self._count_steps([part.params[k] for k in idx]),
            [ws[k] for k in idx],
            [gs[k] for k in idx],
            [ms[k] for k in idx],
            [vs[k] for k in idx],
            simd=self._simd,
        )
        if self.on_stepped is not None:
            for k in idx:
                self.on_stepped(part.params[k], ws[k])

    # -- checkpoints: masters and states as real tensors, for the duration ---------------------------
    def _materialize(self) -> None:
        """Replace every handle in ``param_groups`` by a real tensor holding its master, with its
        ``exp_avg``/``exp_avg_sq`` in ``state`` (torch.optim.Adam's layout); `absorb_states` undoes it."""
        if self._real:
            return
        for part in self.partitions:
            self.swapper.swap_in(part.swap)
            ws, ms, vs = self._views(part, self.swapper.wait_in(part.swap))
            for p, w, m, v in zip(part.params, ws, ms, vs):
                real = w.clone().view(p.shape)
                self._real[p] = real
                state = self.state.pop(p, {})
                if "step" in state:
                    state.update(
                        exp_avg=m.clone().view(p.shape), exp_avg_sq=v.clone().view(p.shape)
                    )
                if state:
                    self.state[real] = state
            self.swapper.release(part.swap)
        for group in self.param_groups:
            group["params"] = [self._real.get(p, p) for p in group["params"]]

    def absorb_states(self) -> None:
        """Write the materialised masters (and any ``exp_avg``/``exp_avg_sq`` in ``state``) back
        to the files and put the handles back; a no-op when nothing is materialised."""
        if not self._real:
            return
        handle_of = {id(r): h for h, r in self._real.items()}
        for group in self.param_groups:
            group["params"] = [handle_of.get(id(t), t) for t in group["params"]]
        for part in self.partitions:
            self.swapper.swap_in(part.swap)
            ws, ms, vs = self._views(part, self.swapper.wait_in(part.swap))
            for p, w, m, v in zip(part.params, ws, ms, vs):
                real = self._real[p]
                w.copy_(real.reshape(-1))
                state = self.state.pop(real, {})  # not mutated: a state_dict may share it
                if "exp_avg" in state and "exp_avg_sq" in state:
                    m.copy_(state["exp_avg"].reshape(-1))
                    v.copy_(state["exp_avg_sq"].reshape(-1))
                rest = {k: x for k, x in state.items() if k not in ("exp_avg", "exp_avg_sq")}
                if rest:
                    self.state[p] = rest
            self.swapper.swap_out(part.swap)
        self.swapper.wait_all()
        self._real = {}

    @contextlib.contextmanager
    def states_in_memory(self) -> Iterator[SwappedMastersOptimizer]:
        """Inside, ``param_groups`` hold real fp32 masters and ``state`` torch.optim.Adam's
        entries (12 B per element of host memory); on exit both go back to the files."""
        self._materialize()
        try:
            yield self
        finally:
            self.absorb_states()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adam's format; the masters are not part of it (as in torch)."""
        with self.states_in_memory():
            return torch.optim.Optimizer.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.optim.Adam's format into the files."""
        with self.states_in_memory():
            torch.optim.Optimizer.load_state_dict(self, state_dict)

    def close(self) -> None:
        """Delete the swap files (partitions and gradients) now."""
        try:
            self.grads.close()
        finally:
            self.swapper.close()
