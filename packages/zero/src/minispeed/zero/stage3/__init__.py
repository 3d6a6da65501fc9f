"""ZeRO stage 3: parameters partitioned across ranks and fetched module by module.

Reading order, outside-in (packages/zero/README.md lists the same; its "The stage-3 path"
lists, as a test traces them, the files one step runs from the optimizer to the collectives):

1. `assemble` — what ``zero.shard`` builds, once, in order (partitions, fp32 masters,
   persistent parameters, fetch units, hooks, ZeRO++, the reducer); `strategy` —
   `Stage3Strategy`, what the optimizer sees at every step, and `GradShardReducer`, the
   gradient reduce-scatter into fp32 shards; `forward_only` — `ForwardOnly`, what
   ``zero.shard(model, None)`` returns (ZeRO-Inference): the same build over no trained
   parameters, so the shards alone (no masters, no gradients);
2. `coordinator` — the module hooks (the four moments: pre/post forward, pre/post backward)
   and `FetchCoordinator`, which fetch unit to gather and release when, in which pass
   (`FetchPhase`); beside it `prefetch` — `Prefetcher`, what to fetch ahead within the
   prefetch and live-parameter budgets and what to keep for reuse (the reuse distance);
3. `params` — `FetchUnit` (``unshard`` / ``wait`` / ``reshard``, the hold count) and one
   partitioned parameter, `ShardedParam` with its state enum; the all-gather itself
   (`PlainGather`); beside it `residency` — where a released shard lives (`Residency`, its
   transitions in `Resident`, and `ShardHome`, the interface offload implements);
4. `trace` — the recorded module order (`TraceState`: recording, following, diverged), and how
   ranks that run modules in different orders are caught (`FetchOrderError`) instead of hanging;
5. `init` — `Init` (build a model already partitioned), `GatheredParameters` (full values for
   user code), `full_state_dict`, `set_leaf_module` (fetch a subtree at once); `init_writes` —
   initialisers run after `Init` partitioned a module; `access` — why reading a released
   parameter raises; `released` — what a released parameter answers (its full shape) and which
   reads raise; `ledger` — bytes per step, as a formula;
6. `zeropp` (qwZ, hpZ), `zeropp_grads` (qgZ) and `zeropp_ledger` — ZeRO++ (and MiCS's bytes per
   axis); `mics` — MiCS: stage 3 over shard groups, replicated across them;
7. ZeRO-Infinity (``offload_param`` / ``offload_optimizer`` on NVMe): `offloaded` (where shards
   live), `infinity` (masters, states and gradients in files), `io_failures` (a failed file
   read or write becomes `OffloadIOError` on every rank, never a wait).

The life of one parameter, with a measured trace, is in docs/packages/zero-stage3.md.
"""

from minispeed.zero.stage3.access import ParameterNotGatheredError
from minispeed.zero.stage3.init import (
    GatheredParameters,
    Init,
    full_state_dict,
    is_leaf_module,
    set_leaf_module,
)
from minispeed.zero.stage3.ledger import Stage3StepBytes, stage3_step_bytes
from minispeed.zero.stage3.params import REGISTRY, FetchUnit, ParamState, ShardedParam
from minispeed.zero.stage3.released import register_param_attribute
from minispeed.zero.stage3.strategy import Stage3Strategy
from minispeed.zero.stage3.trace import FetchOrderError, TraceCheck
from minispeed.zero.stage3.zeropp import ZeroPP
from minispeed.zero.stage3.zeropp_ledger import (
    ZeroPPStepBytes,
    axis_of,
    bytes_by_axis,
    cross_node_bytes,
    mics_step_bytes,
    zeropp_step_bytes,
)

__all__ = [
    "REGISTRY",
    "FetchOrderError",
    "FetchUnit",
    "GatheredParameters",
    "Init",
    "ParamState",
    "ParameterNotGatheredError",
    "ShardedParam",
    "Stage3StepBytes",
    "Stage3Strategy",
    "TraceCheck",
    "ZeroPP",
    "ZeroPPStepBytes",
    "axis_of",
    "bytes_by_axis",
    "cross_node_bytes",
    "full_state_dict",
    "is_leaf_module",
    "mics_step_bytes",
    "register_param_attribute",
    "set_leaf_module",
    "stage3_step_bytes",
    "zeropp_step_bytes",
]
