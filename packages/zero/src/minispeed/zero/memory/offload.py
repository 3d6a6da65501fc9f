"""Where offloaded model states live: predicted from the formulas and measured on a live run.

With ``offload_optimizer`` / ``offload_param`` (`minispeed.zero.offload_bridge`) some of the
columns of `formulas.minispeed_state_bytes` leave the accelerator. Per rank (Ψ optimized
parameters, N ranks, p bytes per parameter, S = 8 bytes of Adam state per element, s = Ψ/N):

| section                  | accelerator keeps | host keeps                          | swap files |
|--------------------------|-------------------|-------------------------------------|------------|
| offload_optimizer cpu    | params, grads     | masters 4s + states S·s (+ grads 4s)| -          |
| offload_optimizer nvme   | params, grads     | masters 4s + pool (+ grads 4s)      | S·s        |
| ... at stage 3 (Infinity)| params            | pools only                          | (4+S+4)·s  |
| offload_param cpu (st. 3)| gathered only     | shards p·s                          | -          |
| offload_param nvme       | gathered only     | pool (buffer_count·buffer_size·p)   | p·s        |

At stage 3, ``offload_optimizer nvme`` is ZeRO-Infinity's optimizer side
(`minispeed.zero.stage3.infinity`): the fp32 masters 4s live with the states in the partition
files (12 B per element for Adam), and the gradient shards 4s are written to files as they are
reduced; host memory keeps only the pools (``buffer_count·12·partition`` for the optimizer,
``buffer_count`` gradient-sized write buffers and 2 partition-sized read buffers).

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
    #: Gradient shards kept in swap files (stage 3 with ``offload_optimizer.device='nvme'``).
    grad_files: int = 0

    @property
    def files(self) -> int:
        """Everything in swap files."""
        return self.optimizer_files + self.param_files + self.grad_files


def _roundup(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _swappers(opt: Any) -> tuple[Any, Any]:
    """(optimizer-state swapper, parameter-shard swapper), None where that is not offloaded.
    (The strategy wrappers delegate attributes, so ``param_home`` is found through them.)"""
    home = getattr(opt.strategy, "param_home", None)
    return getattr(opt.optimizer, "swapper", None), getattr(home, "swapper", None)


def predict_offload(opt: Any) -> OffloadBytes:
    """The formula: 8 B per optimizer element in files (Adam, nvme; 12 B with the master, and
    4 B more of gradient, at stage 3), p B per shard element (param nvme), and the pools'
    ``buffer_count · buffer_numel · itemsize``; each file rounded up to 4 KiB as the swapper
    writes it."""
    opt_swapper, param_swapper = _swappers(opt)
    optimizer_files = pool = param_files = grad_files = 0
    if opt_swapper is not None:
        inner = opt.optimizer
        slots = 3 if getattr(inner, "masters_in_files", False) else 2  # [master |] m | v
        for part in inner.partitions:
            optimizer_files += _roundup(slots * 4 * part.numel)
        cfg = opt.config.offload_optimizer
        largest = max((p.numel for p in inner.partitions), default=1)
        pool += cfg.buffer_count * _roundup(slots * 4 * largest)
        if slots == 3:  # gradient files, write buffers and 2 read buffers (aligned per grad)
            sizes = [q.numel() for part in inner.partitions for q in part.params]
            grad_files = sum(_roundup(4 * n) for n in sizes)
            pool += cfg.buffer_count * _roundup(4 * max(sizes, default=1))
            spans = [sum(_roundup(4 * q.numel()) for q in p.params) for p in inner.partitions]
            pool += 2 * max(spans, default=_ALIGN)
    if param_swapper is not None:
        itemsize = opt.precision.param_dtype.itemsize
        for sp in opt.strategy.offloaded:
            param_files += _roundup(sp.shard_numel * itemsize)
        cfg = opt.config.offload_param
        pool += cfg.buffer_count * _roundup(cfg.buffer_numel * itemsize)
    return OffloadBytes(optimizer_files, param_files, pool, grad_files)


def measure_offload(opt: Any) -> OffloadBytes:
    """Measured: the sizes of the swap files on disk and the swappers' pool buffers."""
    opt_swapper, param_swapper = _swappers(opt)

    def on_disk(swapper: Any) -> int:
        if swapper is None:
            return 0
        return sum(
            os.stat(st.path).st_size for st in swapper.tensors.values() if os.path.exists(st.path)
        )

    grads = getattr(opt.optimizer, "grads", None)  # stage 3, ZeRO-Infinity: SwappedGrads
    grad_swapper = grads.swapper if grads is not None else None
    swappers = (opt_swapper, param_swapper, grad_swapper)
    pool = sum(s.pool.nbytes for s in swappers if s is not None)
    pool += grads.read_pool.nbytes if grads is not None else 0
    return OffloadBytes(on_disk(opt_swapper), on_disk(param_swapper), pool, on_disk(grad_swapper))


@dataclass(frozen=True)
class Placement:
    """Per-rank model-state bytes by where they live (the estimator's offload columns)."""

    accelerator: int
    host: int
    files: int

    @property
    def total(self) -> int:
        return self.accelerator + self.host + self.files


def offload_placement(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    state_bytes: int = 8,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    persistent_params: int = 0,
) -> Placement:
    """Where minispeed's stage ``stage`` keeps each model-state byte with the given offload
    devices, on a machine whose accelerator is not host memory (a GPU), as built today.

    Starts from `formulas.minispeed_state_bytes` and moves columns (s = ceil(Ψ/N), p, g, S):

    - ``offload_optimizer`` cpu: host gets the fp32 masters 4s, a gradient copy 4s and the
      states S·s; the accelerator keeps params, grads and, for 16-bit, the strategy's own fp32
      master partition 4s (`offload_bridge.HostMasters` copies between the two);
    - ``offload_optimizer`` nvme: the same, with S·s in files instead of host memory; at
      stage 3 (ZeRO-Infinity, `minispeed.zero.stage3.infinity`) the masters 4s and the
      gradient shards (fp32, 4s) go to files too, and neither the accelerator nor the host
      keeps any master or gradient (only pools, not counted here);
    - ``offload_param`` cpu / nvme (stage 3): the non-persistent shards p·(s - persistent/N)
      go to host memory / files; an fp32 master stops aliasing its shard and stays with the
      optimizer (host with ``offload_optimizer``, else the accelerator).

    Swap buffer pools (``buffer_count`` buffers) come on top, in host memory; so do gathered
    parameters, activations and buckets, on the accelerator.
    """
    from minispeed.zero.memory.formulas import minispeed_state_bytes, partition_numel

    for key, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device not in ("none", "cpu", "nvme"):
            raise ValueError(f"{key} must be 'none', 'cpu' or 'nvme', got {device!r}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError("offload_optimizer needs stage 1, 2 or 3")
    if offload_param != "none" and stage != 3:
        raise ValueError("offload_param needs stage 3")
    row = minispeed_state_bytes(
        num_params,
        world_size,
        stage,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        state_bytes=state_bytes,
        persistent_params=persistent_params,
    )
    s = partition_numel(num_params, world_size)
    states = state_bytes * s
    master = row.optimizer - states  # the strategy's fp32 master: 4s for 16-bit, 0 when aliased
    acc, host, files = row.params + row.grads, 0, 0
    if offload_param != "none":
        moved = param_bytes * (s - partition_numel(persistent_params, world_size))
        acc -= moved
        if offload_param == "cpu":
            host += moved
        else:
            files += moved
        if param_bytes == 4:
            master = 4 * s  # the fp32 master no longer aliases the shard
    if offload_optimizer == "nvme" and stage == 3:  # masters + states + fp32 gradients
        return Placement(acc - row.grads, host, files + 4 * s + states + 4 * s)
    acc += master
    if offload_optimizer == "none":
        return Placement(acc + states, host, files)
    host += 4 * s + 4 * s  # host masters + host gradient copy
    if offload_optimizer == "cpu":
        host += states
    else:
        files += states
    return Placement(acc, host, files)
