"""ZeRO-Infinity's ``offload_param``: stage-3 parameter shards that live off the accelerator.

```text
zero_optimization: {stage: 3, offload_param: {device: nvme, nvme_path: /nvme, buffer_count: 5,
                                              buffer_size: 1e8, pin_memory: true}}
```

A released (SHARDED) parameter normally keeps its shard, ``s·p`` bytes, on the accelerator.
With ``offload_param`` the shard lives elsewhere and is brought back only while it is needed:

- ``device: cpu``: in host memory (pinned if ``pin_memory``), copied to the accelerator before
  its all-gather. On a CPU-only machine the accelerator *is* host memory: nothing moves.
- ``device: nvme``: in one swap file per shard under ``nvme_path``; read through the swapper's
  pool of ``buffer_count`` buffers of ``buffer_size`` elements before the all-gather.

The lifecycle (the parameter's `Residency`, moved by its home, the `ShardHome` of
stage3/residency.py that offload's `HostShards` and `NvmeShards` implement
(minispeed.offload.shard_homes); stage 3 calls the home
without asking whether offload is on):

```text
released (AWAY)      all_gather_params()  -> home.fetch: shard materialised (read s·p bytes)
GATHERING (FETCHED)  the collective reads the shard
GATHERED (AWAY)      to_gathered()        -> home.evict: shard dropped (no write: unchanged)
step                 publish_params       -> home.write: the new shard from the master (s·p)
```

So a shard is resident only between the fetch and the end of its all-gather: the fetch happens
when the coordinator issues the gather, i.e. *ahead of use* for prefetched units. Writes happen
once per step (the new values) and in ``GatheredParameters`` when a modifier changes a value.
Persistent parameters (``stage3_param_persistence_threshold``) stay gathered and are not
offloaded. An fp32 parameter's master normally *is* its shard; offloaded, it gets a master of
its own (``4s`` bytes, owned by the optimizer side: host memory with ``offload_optimizer: cpu``;
with ``offload_optimizer: nvme`` the master lives in the optimizer's swap file, no in-memory
copy at all, and the step writes each new shard straight from it: stage3/infinity.py).

Under ``zero.Init(config)`` with ``offload_param: nvme`` each shard is written to its file as the
module that owns it is built (`init_residency`), so the model never exists in memory, not even
partitioned; ``zero.shard`` adopts those files.

Bytes per step and parameter: read ``s·p`` once per fetch (forward, and backward again when the
parameter was released in between), write ``s·p`` once at the step.

A failed read or write of a shard file (nvme) is recorded in the home's `IOFailures` and the
fetch hands out zeros, so the rank keeps taking part in every collective; the step's agreement
makes every rank raise `OffloadIOError` before anything is stepped (Note [an I/O failure fails
every rank] in stage3/io_failures.py).
"""

from __future__ import annotations

from typing import Any

import torch

from minispeed.core.accelerator import get_accelerator
from minispeed.zero.offload_bridge import import_offload
from minispeed.zero.stage3.io_failures import IOFailures
from minispeed.zero.stage3.params import ShardedParam
from minispeed.zero.stage3.residency import Residency

__all__ = ["UnusableShards", "init_residency", "offload_params"]

# The ZeRO-Infinity optimizer side (masters, states and gradient shards in swap files) is
# `minispeed.zero.stage3.infinity`; this module holds the parameter side. The homes themselves
# (host memory, swap files) are offload's: minispeed.offload.shard_homes implements the
# `ShardHome` of stage3/residency.py.


def offload_params(strategy: Any, config: Any, keep_masters: bool = True) -> None:
    """Move every non-persistent shard of a `Stage3Strategy` to ``config.offload_param``'s
    device, and give the strategy its home (`Stage3Strategy.offload_params`), which stores
    each new shard after every step.

    With ``device='nvme'`` and ``max_in_cpu`` set, the first shards (in order, whole shards)
    holding at most ``max_in_cpu`` elements stay in host memory, the rest go to files
    (`in_cpu_budget`; DeepSpeed's ``max_in_cpu``).

    ``keep_masters=False`` (ZeRO-Infinity: the masters will live in the optimizer's files, see
    stage3/infinity.py): an fp32 parameter gets no in-memory master copy; its master is read
    from the shard file when the optimizer writes its own."""
    offload = import_offload("zero_optimization.offload_param")
    cfg = config.offload_param
    everything = strategy.sharded_params()
    sps = [sp for sp in everything if not sp.persistent]
    in_cpu = in_cpu_budget(cfg, sps)
    dtype = strategy.precision.param_dtype
    on_cpu = get_accelerator().name == "cpu"
    host = offload.HostShards(cfg.pin_memory and not on_cpu)  # in_cpu shards on an accelerator
    built = [sp for sp in everything if sp.residency is Residency.AWAY]  # files since zero.Init
    if built:
        home = built[0].home
        trained = set(map(id, strategy.trained))  # a master only for what the optimizer steps
        for sp in built:
            _adopt_built(sp, keep_masters, stay=id(sp) in in_cpu, trained=id(sp) in trained)
            if id(sp) in in_cpu and not sp.persistent and not on_cpu:  # to host memory
                host.adopt(sp)
        sps = [sp for sp in sps if sp.residency is Residency.HERE]
    elif cfg.device == "nvme":
        in_files = [sp for sp in sps if id(sp) not in in_cpu]
        home = offload.NvmeShards(cfg, config.aio, dtype, in_files, IOFailures())
    else:
        home = host
    offloaded = [sp for sp in built if sp.residency is Residency.AWAY]
    if cfg.device == "cpu" and on_cpu:  # host memory already: no move
        strategy.offload_params(home, offloaded, home.io_failures)
        return
    if isinstance(home, offload.NvmeShards):  # every new file's size against free space first
        for sp in sps:
            if id(sp) not in in_cpu:
                home.reserve(sp)
        offload.check_free_space([home.swapper])
    for sp in sps:
        if id(sp) in in_cpu and on_cpu:
            continue  # host memory already: the shard stays as stage 3 made it
        if sp.master is sp.shard:  # fp32: the master gets a storage of its own (or none)
            sp.set_master(sp.shard.clone() if keep_masters else None)
        (host if id(sp) in in_cpu else home).adopt(sp)
        offloaded.append(sp)
    strategy.offload_params(home, offloaded, home.io_failures)


def in_cpu_budget(cfg: Any, sps: list[ShardedParam]) -> set[int]:
    """``id(sp)`` of the shards ``offload_param.max_in_cpu`` keeps in host memory with nvme:
    the first ones, in order, whose elements add up to at most the budget (whole shards)."""
    budget = cfg.max_in_cpu_numel if cfg.device == "nvme" else None
    kept: set[int] = set()
    used = 0
    for sp in sps if budget else ():
        if used + sp.shard_numel > budget:
            break
        kept.add(id(sp))
        used += sp.shard_numel
    return kept


def _adopt_built(
    sp: ShardedParam, keep_masters: bool, stay: bool = False, trained: bool = True
) -> None:
    """A shard that zero.Init already put in a swap file (see `init_residency`): a persistent
    one (or one ``max_in_cpu`` keeps: ``stay``) comes back into memory for good; the master
    (fp32, when kept) is read from the file. A parameter the optimizer does not step
    (``trained`` False: frozen, or stage 3 without an optimizer) gets no master."""
    stay = stay or sp.persistent
    master = keep_masters and trained
    if stay or master:
        sp.home.fetch(sp)
        if master:
            sp.set_master(sp.shard.to(torch.float32, copy=True))
        if stay:
            sp.to_here()
            if not keep_masters and trained:
                sp.set_master(sp.shard)
        else:
            sp.home.evict(sp)


def init_residency(home: Any, config: Any, sp: ShardedParam) -> Any:
    """zero.Init(config) with ``offload_param.device='nvme'``: write ``sp``'s new shard to a swap
    file at once and drop it, so the whole model never sits in memory. Returns the home (made
    on the first call: offload's `NvmeShards`, or `UnusableShards` where the directory could not
    be set up; `Init` keeps it, and `offload_params` adopts it at `zero.shard`)."""
    if home is None:
        try:
            offload = import_offload("zero_optimization.offload_param")
            home = offload.NvmeShards(
                config.offload_param, config.aio, sp.shard.dtype, [], IOFailures()
            )
        except OSError as error:  # nvme_path missing on this rank only, say: agreed at the end
            home = UnusableShards(error)
    home.adopt(sp)  # a failed write is recorded; `Init`'s exit agrees on it
    return home


class UnusableShards:
    """zero.Init's shard home on a rank whose swap directory could not be set up (a per-rank
    check, e.g. ``nvme_path`` missing there): the error is recorded, the shards stay in memory,
    and `Init`'s exit agreement raises `OffloadIOError` on every rank (Note [a set-up check
    fails on every rank] in setup_agreement.py), instead of this rank raising alone in the
    middle of the model's construction while the others wait in its next broadcast."""

    def __init__(self, error: OSError) -> None:
        self.io_failures = IOFailures()
        self.io_failures.record("setting up offload_param's swap directory", error)

    def adopt(self, sp: ShardedParam) -> None:
        pass
