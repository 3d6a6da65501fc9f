"""Where offloaded model states live: predicted from the formulas and measured on a live run.

With ``offload_optimizer`` / ``offload_param`` (`minispeed.zero.offload_bridge`) some of the
columns of `formulas.minispeed_state_bytes` leave the accelerator. Per rank (Ψ optimized
parameters, N ranks, p bytes per parameter, S = 8 bytes of Adam state per element, s = Ψ/N):

| section                  | accelerator keeps | host keeps                          | swap files |
|--------------------------|-------------------|-------------------------------------|------------|
| offload_optimizer cpu    | params, grads     | masters 4s + states S·s (+ grads 4s)| -          |
| offload_optimizer nvme   | params, grads     | masters 4s + pool (+ grads 4s)      | S·s        |
| offload_param cpu (st. 3)| gathered only     | shards p·s                          | -          |
| offload_param nvme       | gathered only     | pool (buffer_count·buffer_size·p)   | p·s        |

(the host gradient copy exists only where the accelerator is not the host; on a CPU-only
machine accelerator and host are one memory, and offload changes only what sits in files.)
`predict_offload` states the swap-file and pool bytes; `measure_offload` reads them from
the live swappers and the files on disk (each file is padded to 4 KiB for O_DIRECT).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["OffloadBytes", "measure_offload", "predict_offload"]

_ALIGN = 4096


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes of offloaded model states on this rank, by where they live."""

    #: Adam states (exp_avg, exp_avg_sq) kept in swap files (``offload_optimizer.device='nvme'``).
    optimizer_files: int
    #: Parameter shards kept in swap files (``offload_param.device='nvme'``).
    param_files: int
    #: Host buffers of the swappers' pools (the only host memory a swapped tensor occupies).
    pool: int

    @property
    def files(self) -> int:
        """Everything in swap files."""
        return self.optimizer_files + self.param_files


def _roundup(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _swappers(opt: Any) -> tuple[Any, Any]:
    """(optimizer-state swapper, parameter-shard swapper), None where that is not offloaded.
    (The strategy wrappers delegate attributes, so ``param_home`` is found through them.)"""
    home = getattr(opt.strategy, "param_home", None)
    return getattr(opt.optimizer, "swapper", None), getattr(home, "swapper", None)


def predict_offload(opt: Any) -> OffloadBytes:
    """The formula: 8 B per optimizer element in files (Adam, nvme), p B per shard element
    (param nvme), and the pools' ``buffer_count · buffer_numel · itemsize``; each file rounded
    up to 4 KiB as the swapper writes it."""
    opt_swapper, param_swapper = _swappers(opt)
    optimizer_files = pool = param_files = 0
    if opt_swapper is not None:
        for part in opt.optimizer.partitions:
            optimizer_files += _roundup(2 * 4 * part.numel)  # exp_avg + exp_avg_sq, fp32
        cfg = opt.config.offload_optimizer
        largest = max((p.numel for p in opt.optimizer.partitions), default=1)
        pool += cfg.buffer_count * _roundup(2 * 4 * largest)
    if param_swapper is not None:
        itemsize = opt.precision.param_dtype.itemsize
        for sp in opt.strategy.offloaded:
            param_files += _roundup(sp.shard_numel * itemsize)
        cfg = opt.config.offload_param
        pool += cfg.buffer_count * _roundup(cfg.buffer_numel * itemsize)
    return OffloadBytes(optimizer_files, param_files, pool)


def measure_offload(opt: Any) -> OffloadBytes:
    """Measured: the sizes of the swap files on disk and the swappers' pool buffers."""
    opt_swapper, param_swapper = _swappers(opt)

    def on_disk(swapper: Any) -> int:
        if swapper is None:
            return 0
        return sum(
            os.stat(st.path).st_size for st in swapper.tensors.values() if os.path.exists(st.path)
        )

    pool = sum(s.pool.nbytes for s in (opt_swapper, param_swapper) if s is not None)
    return OffloadBytes(on_disk(opt_swapper), on_disk(param_swapper), pool)
