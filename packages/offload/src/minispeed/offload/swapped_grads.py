"""Gradient partitions on NVMe: written as they are produced, read back partition by partition.

    grads = SwappedGrads([[("w", 1000), ("b", 10)], [("v", 5000)]], "/nvme", buffer_count=2)
    grads.add("w", g_w)            # during backward: the (reduced) gradient leaves memory now
    grads.add("w", g_w2)           # a later micro-step of the window: read, add, write
    grads.square_sum()             # exact global-norm input, kept as the files were written
    grads.start_read(0); views = grads.wait_read(0)   # at the step, pipelined by the caller

ZeRO-Infinity's gradient path (DeepSpeed swaps gradient partitions out as they are reduced and in
again for the step). Each gradient (one ZeRO shard) has a swap file of its own; a partition is a
list of gradients stepped together (the optimizer's partition), and at the step its gradients
are read side by side into one read buffer, each at a 4 KiB-aligned offset (O_DIRECT).

Host memory: ``buffer_count`` write buffers of the largest gradient (a gradient is copied into
one and written while backward goes on) plus ``read_buffers`` read buffers of the largest
partition (padded); never the gradients themselves. Disk per step and element: 4 B written per
micro-step (plus 4 B read from the second micro-step of a window on), 4 B read at the step.

Note [the norm is kept as the gradients are written]
Clipping needs the global norm before any partition is stepped, but after the gradients have
left memory. So every write also records ``sum(g**2)`` of the value written (the accumulated
value, from the second micro-step on), per gradient; `square_sum` adds them up. The clipping
coefficient is then handed back with `set_scale` and applied to each partition as it is read:
the same arithmetic as scaling in-memory gradients, one pass later.
"""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Sequence

import torch

from minispeed.core import ranges
from minispeed.offload.aio import ALIGN
from minispeed.offload.config import AioConfig
from minispeed.offload.swapper import BufferPool, SwapCounters, SwapState, TensorSwapper

__all__ = ["SwappedGrads"]

_PER_ALIGN = ALIGN // 4  # fp32 elements per aligned block


def _padded(numel: int) -> int:
    return -(-numel // _PER_ALIGN) * _PER_ALIGN


class SwappedGrads(SwapCounters):
    """fp32 gradients in swap files, one per key; partitions of keys read back together."""

    def __init__(
        self,
        partitions: Sequence[Sequence[tuple[Hashable, int]]],
        nvme_path: str | os.PathLike[str],
        *,
        buffer_count: int = 2,
        read_buffers: int = 2,
        pin_memory: bool = False,
        aio: AioConfig | None = None,
        config_key: str = "offload_optimizer",
    ) -> None:
        self.partitions = [list(p) for p in partitions]
        numel = {k: n for part in self.partitions for k, n in part}
        largest = max(numel.values(), default=1)
        self.swapper = TensorSwapper(
            nvme_path,
            buffer_count=max(1, buffer_count),
            buffer_numel=largest,
            pin_memory=pin_memory,
            aio=aio,
            config_key=config_key,
        )
        self.files = {
            k: self.swapper.register(f"grad-{i}", n) for i, (k, n) in enumerate(numel.items())
        }
        # offsets[i][j]: where gradient j of partition i starts in its read buffer (aligned).
        self.offsets: list[list[int]] = []
        for part in self.partitions:
            at, offs = 0, []
            for _, n in part:
                offs.append(at)
                at += _padded(n)
            self.offsets.append(offs)
        span = max(
            (o[-1] + _padded(p[-1][1]) for o, p in zip(self.offsets, self.partitions) if p),
            default=1,
        )
        self.read_pool = BufferPool(
            max(1, read_buffers), span, torch.float32, pin=pin_memory, key=config_key
        )
        self._reading: dict[int, tuple[int, list]] = {}  # partition -> (buffer, requests)
        self.written: set[Hashable] = set()  # gradients written in this accumulation window
        self._squares: dict[Hashable, float] = {}
        self.scale = 1.0

    # -- memory and traffic, for the reports -----------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        """Host bytes held: the write buffers and the read buffers (never the gradients)."""
        return self.swapper.pool.nbytes + self.read_pool.nbytes

    @property
    def swapped_bytes(self) -> int:
        """Gradient bytes that live in files instead of host memory: ``4 * Σ numel``."""
        return sum(4 * st.numel for st in self.files.values())

    # -- backward: gradients out ---------------------------------------------------------------
    @torch.no_grad()
    def add(self, key: Hashable, grad: torch.Tensor) -> None:
        """Add ``grad`` to ``key``'s gradient of this window and start writing it to its file.

        The first call of a window writes ``grad`` (no read); later calls read the file, add,
        and write the sum. See Note [the norm is kept as the gradients are written].
        """
        st = self.files[key]
        with ranges.range("offload.grad_swap_out"):
            if key not in self.written:
                self.swapper.wait_out(st)
                self.swapper.write(st, grad.detach().reshape(-1).float())
                buf = self.swapper.pool.buffers[st.buffer_index][: st.numel]
            else:
                self.swapper.wait_out(st)
                self.swapper.swap_in(st)
                buf = self.swapper.wait_in(st)
                buf.add_(grad.detach().reshape(-1).to(buf.device, torch.float32))
                self.swapper.swap_out(st)
            self._squares[key] = float(buf.pow(2).sum())
        self.written.add(key)

    def square_sum(self) -> float:
        """``Σ g²`` over every gradient written in this window (the norm's input, exact)."""
        return sum(self._squares[k] for k in self.written)

    def set_scale(self, coef: float) -> None:
        """Multiply every gradient of this window by ``coef`` as it is read (clipping)."""
        self.scale = float(coef)

    def new_window(self) -> None:
        """Forget this window's gradients (after the step): the next `add` overwrites."""
        self.written.clear()
        self._squares.clear()
        self.scale = 1.0

    # -- the step: partitions in ------------------------------------------------------------------
    def start_read(self, i: int) -> None:
        """Start reading partition ``i``'s gradients into a free read buffer."""
        if i in self._reading:
            return
        if not self.read_pool.free:
            raise RuntimeError(
                "SwappedGrads: every read buffer is in use; finish a partition (done_read) first"
            )
        self.swapper.wait_all()  # the files must be whole before they are read
        index = self.read_pool.free.popleft()
        buf = self.read_pool.buffers[index]
        reqs = []
        with ranges.range("offload.grad_swap_in"):
            for (key, n), off in zip(self.partitions[i], self.offsets[i]):
                st = self.files[key]
                if key in self.written and st.state is SwapState.ON_DISK:
                    view = buf[off : off + _padded(n)]
                    reqs.append((key, self.swapper.io.submit_read(view, st.path)))
                else:  # no gradient this window (or never written): zeros
                    buf[off : off + n].zero_()
        self._reading[i] = (index, reqs)

    def wait_read(self, i: int) -> list[torch.Tensor]:
        """Finish partition ``i``'s read; returns one 1-D view per gradient (scaled by `set_scale`),
        valid until `done_read`."""
        if i not in self._reading:
            self.start_read(i)
        index, reqs = self._reading[i]
        for _, req in reqs:
            start = time.perf_counter()
            try:
                self.swapper.bytes_read += req.wait()
            except OSError:
                self.done_read(i)
                raise
            finally:
                self.swapper.wait_s["read"] += time.perf_counter() - start
        self._reading[i] = (index, [])
        buf = self.read_pool.buffers[index]
        views = [buf[o : o + n] for (_, n), o in zip(self.partitions[i], self.offsets[i])]
        if self.scale != 1.0:
            for v in views:
                v.mul_(self.scale)
        return views

    def done_read(self, i: int) -> None:
        """Give partition ``i``'s read buffer back."""
        index, reqs = self._reading.pop(i)
        for _, req in reqs:  # an abandoned read must finish before the buffer is reused
            try:
                req.wait()
            except OSError:
                pass
        self.read_pool.free.append(index)

    def abandon(self) -> None:
        """After a failure part-way through a step: give every read buffer back (waiting for
        the reads in flight) and free the write buffers."""
        for i in list(self._reading):
            self.done_read(i)
        self.swapper.abandon()

    def close(self) -> None:
        """Delete the gradient files now."""
        self.swapper.close()
