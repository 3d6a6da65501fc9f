"""Where a released ZeRO-3 parameter shard lives: host memory (`HostShards`) or swap files
(`NvmeShards`).

`minispeed.zero` defines the small interface its stage 3 needs from such a place,
``ShardHome`` (zero/stage3/residency.py: `fetch`, `evict`, `write`, `flush`, `close`,
`io_failures`), and these classes implement it. They import nothing of zero (docs/architecture.md:
offload is usable alone, zero uses it as an optional extra): the *parameter* they are given is
any object with ``name``, ``shard`` (1-D tensor), ``shard_numel``, ``away`` (its value is in the
home only) and the moves ``to_away(home)`` (adopted), ``to_away()`` (evicted) and
``to_fetched(shard)``: zero's ``ShardedParam``, whose asserting methods these are.

Bytes per parameter (``s`` elements, ``p`` bytes each): `HostShards` keeps ``s·p`` of host
memory (pinned when asked) and copies ``s·p`` up per fetch; `NvmeShards` keeps one file of
``s·p`` bytes (rounded up to 4 KiB) and reads it through the swapper's pool per fetch. Both
write ``s·p`` per `write` (once per optimizer step).
"""

from __future__ import annotations

from typing import Any

import torch

from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.offload.swapper import SwapCounters, TensorSwapper

__all__ = ["HostShards", "NvmeShards"]


class HostShards:
    """``offload_param.device='cpu'`` on an accelerator: a host copy per shard, copied up per
    fetch. No file I/O (``io_failures`` is None)."""

    io_failures = None

    def __init__(self, pin_memory: bool) -> None:
        self.pin = pin_memory
        self.host: dict[int, torch.Tensor] = {}  # id(param) -> host shard
        self.bytes_read = 0
        self.bytes_written = 0

    def adopt(self, sp: Any) -> None:
        """Copy ``sp``'s shard to host memory and drop it on the accelerator."""
        h = torch.empty(sp.shard.shape, dtype=sp.shard.dtype, pin_memory=self.pin)
        self.host[id(sp)] = h.copy_(sp.shard)
        sp.to_away(self)

    def fetch(self, sp: Any) -> None:
        """Copy the shard up (``s·p`` bytes) unless it is resident already."""
        if sp.away:
            with ranges.range("zero3.offload.fetch"):
                host = self.host[id(sp)]
                sp.to_fetched(host.to(get_accelerator().device(), non_blocking=True))
            self.bytes_read += host.numel() * host.element_size()

    def evict(self, sp: Any) -> None:
        sp.to_away()

    def write(self, sp: Any, values: torch.Tensor) -> None:
        """``values`` (``s`` elements, any dtype) becomes the host copy."""
        with ranges.range("zero3.offload.store"):
            host = self.host[id(sp)]
            host.copy_(values)
        self.bytes_written += host.numel() * host.element_size()

    def flush(self) -> None:
        pass

    def resident_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host.values())

    def close(self) -> None:
        self.host.clear()


class NvmeShards(SwapCounters):
    """``offload_param.device='nvme'``: one swap file per shard, read through the pool per fetch.

    ``io_failures``: the caller's record of failed file I/O (an object with ``guard(what)``, a
    context manager that records an `OSError` and swallows it, and ``settlers``, a list of
    waits): a failed read hands out zeros and a failed write is skipped, so the rank keeps
    taking part in every collective until the caller's agreement raises on every rank.
    """

    def __init__(
        self, config: Any, aio: Any, dtype: torch.dtype, shards: list[Any], io_failures: Any
    ) -> None:
        self.buffer_numel = config.buffer_numel
        self.dtype = dtype
        for sp in shards:
            self._check(sp)
        self.swapper = TensorSwapper(
            config.nvme_path,
            buffer_count=config.buffer_count,
            buffer_numel=config.buffer_numel,
            dtype=dtype,
            pin_memory=config.pin_memory,
            aio=aio,
            config_key="offload_param",
        )
        self.files: dict[int, Any] = {}  # id(param) -> its SwappedTensor
        self.io_failures = io_failures
        self.io_failures.settlers.append(self.swapper.wait_all)

    def _check(self, sp: Any) -> None:
        if sp.shard_numel > self.buffer_numel:
            raise ValueError(
                f"offload_param.buffer_size={self.buffer_numel} elements is smaller than the "
                f"shard of {sp.name!r} ({sp.shard_numel} elements per rank): raise "
                f"offload_param.buffer_size to at least {sp.shard_numel}"
            )
        if sp.shard.dtype != self.dtype:
            raise ValueError(
                f"offload_param nvme: the shard of {sp.name!r} is {sp.shard.dtype}, its swap "
                f"files hold {self.dtype}; under zero.Init(config) create every parameter in "
                f"MixedPrecision.param_dtype (or build the model outside zero.Init)"
            )

    def reserve(self, sp: Any) -> None:
        """Register ``sp``'s swap file (nothing written yet), so that free space can be checked
        for every file before the first write."""
        if id(sp) not in self.files:
            self._check(sp)
            self.files[id(sp)] = self.swapper.register(f"param-{len(self.files)}", sp.shard_numel)

    def adopt(self, sp: Any) -> None:
        """Write ``sp``'s shard to its file and drop it here."""
        self.reserve(sp)
        self.write(sp, sp.shard)
        sp.to_away(self)

    def fetch(self, sp: Any) -> None:
        """Read the shard (``s·p`` bytes) unless it is resident already (zeros if it fails)."""
        if not sp.away:
            return
        with ranges.range("zero3.offload.fetch"):
            st = self.files[id(sp)]
            shard = torch.zeros(sp.shard_numel, dtype=self.dtype, device=get_accelerator().device())
            with self.io_failures.guard(f"reading the shard of {sp.name!r}"):
                self.swapper.wait_out(st)  # a write of this shard in flight: the file must be whole
                self.swapper.swap_in(st)
                shard.copy_(self.swapper.wait_in(st))
                self.swapper.release(st)
            sp.to_fetched(shard)

    def evict(self, sp: Any) -> None:
        sp.to_away()

    def write(self, sp: Any, values: torch.Tensor) -> None:
        """``values`` (``s`` elements, any dtype) into the file, straight from memory."""
        with ranges.range("zero3.offload.store"):
            st = self.files[id(sp)]
            with self.io_failures.guard(f"writing the shard of {sp.name!r}"):
                self.swapper.wait_out(st)
                self.swapper.write(st, values.to("cpu"))

    def flush(self) -> None:
        """Finish the writes in flight: the shard files must be whole before a fetch."""
        self.swapper.wait_all()

    def resident_bytes(self) -> int:
        return self.swapper.pool.nbytes

    def close(self) -> None:
        self.swapper.close()
