"""minispeed.offload: SIMD CPU optimizers, async file I/O, and optimizer states swapped to NVMe.

Reading order:

1. `.cpu_optim_reference` then `.cpu_optim` (and ``csrc/cpu_optim``): the optimizer
   steps, pure PyTorch beside the AVX-512/AVX2/scalar C++ kernels;
2. `.optimizers`: ``CPUAdam``, ``CPUAdamW``, ``CPUAdagrad``, ``CPULion`` as torch.optim classes
   (and ``Lion``, the Lion reference as a torch.optim class for any device);
3. `.aio` (and ``csrc/aio``, `.aio_reference`): reading/writing tensors at file offsets,
   asynchronously, on a thread pool;
4. `.swapper`: tensors in swap files, a fixed pool of host buffers, stale-file cleanup;
5. `.swapped`: ``SwappedOptimizer``, Adam with its states on NVMe, pipelined; then
   `.swapped_grads` and `.swapped_masters` (ZeRO-Infinity: masters and gradients on NVMe too);
   `.shard_homes` (``HostShards``, ``NvmeShards``: where a released ZeRO-3 parameter shard
   lives, the ``ShardHome`` interface minispeed.zero defines, implemented without importing it);
6. `.config`: the ``offload_optimizer`` / ``offload_param`` / ``aio`` sections.

The entry point an engine (or ``minispeed.zero``) calls is `offload_optimizer`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from minispeed.offload.aio import AsyncIO, IORequest, direct_io_supported, io_busy_seconds
from minispeed.offload.config import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from minispeed.offload.optimizers import CPUAdagrad, CPUAdam, CPUAdamW, CPULion, Lion
from minispeed.offload.shard_homes import HostShards, NvmeShards
from minispeed.offload.swapped import SwappedOptimizer
from minispeed.offload.swapped_grads import SwappedGrads
from minispeed.offload.swapped_masters import SwappedMastersOptimizer
from minispeed.offload.swapper import SwapState, TensorSwapper, check_free_space

__all__ = [
    "AioConfig",
    "AsyncIO",
    "CPUAdagrad",
    "CPUAdam",
    "CPUAdamW",
    "CPULion",
    "HostShards",
    "IORequest",
    "Lion",
    "NvmeShards",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "SwapState",
    "SwappedGrads",
    "SwappedMastersOptimizer",
    "SwappedOptimizer",
    "TensorSwapper",
    "check_free_space",
    "direct_io_supported",
    "io_busy_seconds",
    "offload_optimizer",
]


def offload_optimizer(
    params: Iterable[Any],
    config: OffloadOptimizerConfig,
    aio: AioConfig | None = None,
    *,
    sub_group_numel: int = 100_000_000,
    **adam_kwargs: Any,
) -> torch.optim.Optimizer:
    """The optimizer an offload config asks for, over fp32 CPU parameters (e.g. ZeRO's masters).

    ``device='cpu'``: `CPUAdam` (states in host memory, 8 B per parameter);
    ``device='nvme'``: `SwappedOptimizer` (states in files under ``nvme_path``, host memory
    only for ``buffer_count`` partition buffers). ``adam_kwargs`` are `CPUAdam`'s (``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``decoupled_weight_decay`` (default False: Adam, as
    ``torch.optim.Adam``; True for AdamW), ``bias_correction``). Both support
    ``step(write_back=[...])`` to emit bf16/fp16 copies of the updated weights in the same pass.
    """
    if config.device == "cpu":
        return CPUAdam(params, **adam_kwargs)
    if config.device == "nvme":
        return SwappedOptimizer(params, config, aio, sub_group_numel=sub_group_numel, **adam_kwargs)
    raise ValueError(
        "offload_optimizer.device='none' offloads nothing: use a regular optimizer, or set device "
        "to 'cpu' or 'nvme'"
    )
