"""How `zero.shard` applies the offload sections: parameters (stage 3) first, then the optimizer.

One function, `apply_offload`, over the pieces of offload_bridge.py (host masters and the CPU
optimizer), stage3/offloaded.py (`offload_param`) and stage3/infinity.py (ZeRO-Infinity's
optimizer side), inside one set-up agreement so that a bad path or a full disk on any rank
fails every rank. It sits above those modules (they never import it), so nothing here is
imported inside a function: `minispeed.offload` itself is still loaded only when a section
asks for it (Note [offload is imported lazily] in offload_bridge.py).
"""

from __future__ import annotations

from typing import Any

import torch

from minispeed.zero.offload_bridge import HostMasters, check_free_space, host_optimizer, swappers_of
from minispeed.zero.setup_agreement import agree_on_setup
from minispeed.zero.stage3.infinity import agree_on_first_masters, offload_masters
from minispeed.zero.stage3.offloaded import offload_params

__all__ = ["apply_offload"]


def wants_optimizer_offload(config: Any) -> bool:
    opt = config.offload_optimizer
    return opt is not None and opt.device != "none"


def wants_param_offload(config: Any) -> bool:
    par = config.offload_param
    return par is not None and par.device != "none"


def wants_masters_in_files(config: Any) -> bool:
    """Stage 3 with ``offload_optimizer.device='nvme'``: ZeRO-Infinity keeps the fp32 masters
    and the gradient shards in swap files too (stage3/infinity.py). Stages 1-2 keep them in
    host memory: there the masters of fp32 training are the model's own parameters and the
    gradient partition is the reducer's flat buffer."""
    opt = config.offload_optimizer
    return config.stage == 3 and opt is not None and opt.device == "nvme"


def apply_optimizer_offload(
    strategy: Any, optimizer: torch.optim.Optimizer, config: Any
) -> tuple[Any, torch.optim.Optimizer]:
    """`zero.shard`'s hook: the strategy with host masters, and the CPU optimizer over them."""
    host = HostMasters(strategy, config.offload_optimizer.pin_memory)
    return host, host_optimizer(optimizer, host.master_params(), config)


def apply_offload(
    strategy: Any, optimizer: torch.optim.Optimizer, config: Any, group: Any = None
) -> tuple[Any, torch.optim.Optimizer]:
    """`zero.shard`'s one hook: parameter offload (stage 3) first, then optimizer offload.

    Runs on every rank of `group`. The set-up is local (paths, free space, page-locked buffers,
    the first writes) and ends in one agreement, so a bad `nvme_path`, too little free space, a
    `buffer_size` below one partition or an impossible `pin_memory` on ANY rank raises
    `OffloadSetupError` on EVERY rank, naming the rank, the key and the fix (Note [a set-up
    check fails on every rank] in setup_agreement.py). Costs one 1-element all-reduce (two
    under ZeRO-Infinity, whose first masters are agreed on too).
    """
    infinity = wants_masters_in_files(config)

    def build() -> tuple[Any, torch.optim.Optimizer]:
        built_strategy, built_optimizer = strategy, optimizer
        if wants_param_offload(config):
            offload_params(built_strategy, config, keep_masters=not infinity)
        if infinity:
            return offload_masters(built_strategy, built_optimizer, config)
        if wants_optimizer_offload(config):
            built_strategy, built_optimizer = apply_optimizer_offload(
                built_strategy, built_optimizer, config
            )
        check_free_space(built_strategy, built_optimizer)
        return built_strategy, built_optimizer

    strategy, optimizer = agree_on_setup(
        group, "zero.shard's offload set-up", build, discard=_delete_swap_files
    )
    if infinity:
        agree_on_first_masters(strategy)
    return strategy, optimizer


def _delete_swap_files(built: tuple[Any, Any]) -> None:
    """After a failed set-up on another rank: this rank's swap directories go at once."""
    for swapper in swappers_of(*built):
        swapper.abandon()
        swapper.close()
