"""minispeed.comm: every collective minispeed issues, with a byte ledger, buckets and topology.

Use it as `import minispeed.comm as comm`. Reading order (see README.md):

1. `costs` — what each collective costs (message size, bus-bandwidth factor,
   bytes on the wire), written once.
2. `groups` — start torch.distributed, ranks, sub-groups.
3. `collectives` — the collectives, each handed to one `call.Call` (checks, cross-rank check,
   launch, ledger record); `all_to_all` — the all-to-all; `rooted` — reduce, gather, scatter;
   `p2p` — send/recv; `objects` — Python objects.
4. `logger` — the comms logger (off by default).
5. `validation` — errors and local checks; `handshake` — the cross-rank check (first call
   of each call site by default, every call in validation mode).
6. `api_compat` — what runs when a backend lacks a flat collective.
7. `buckets` — the unbucketed loop, and `LaunchQueue`: buckets launched in one fixed order
   while backward runs, with a bounded window in flight.
8. `topology` and `hierarchical` — process grids and
   the two-level all-gather.
"""

from minispeed.comm.all_to_all import all_to_all_autograd, all_to_all_single
from minispeed.comm.api_compat import reduce_scatter_impl
from minispeed.comm.buckets import InFlight, LaunchQueue, all_reduce_unbucketed
from minispeed.comm.call import CommWork
from minispeed.comm.collectives import (
    ReduceOp,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    reduce_scatter_tensor,
)
from minispeed.comm.groups import (
    collective_timeout_s,
    destroy_process_group,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    is_member,
    new_group,
    world_group,
)
from minispeed.comm.handshake import validation_enabled, validation_mode
from minispeed.comm.hierarchical import HierarchicalAllGather
from minispeed.comm.logger import CommRecord, CommsLogger, CommsLoggerConfig, comms_logger
from minispeed.comm.objects import all_gather_object, broadcast_object
from minispeed.comm.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from minispeed.comm.rooted import gather, reduce, scatter
from minispeed.comm.topology import ProcessGrid, ProcessTopology
from minispeed.comm.validation import (
    CommBackendError,
    CommError,
    CommInputError,
    CommMismatchError,
    CommTimeoutError,
    first_backend_error,
    tensor_device,
)

__all__ = [
    "CommBackendError",
    "CommError",
    "CommInputError",
    "CommMismatchError",
    "CommRecord",
    "CommTimeoutError",
    "CommWork",
    "CommsLogger",
    "CommsLoggerConfig",
    "HierarchicalAllGather",
    "InFlight",
    "LaunchQueue",
    "P2POp",
    "ProcessGrid",
    "ProcessTopology",
    "ReduceOp",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_unbucketed",
    "all_to_all_autograd",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object",
    "collective_timeout_s",
    "comms_logger",
    "destroy_process_group",
    "first_backend_error",
    "gather",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_initialized",
    "is_member",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_impl",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "tensor_device",
    "validation_enabled",
    "validation_mode",
    "world_group",
]

# -- gradient compression (owned by the compression engineer) ----------------------------------
# Gradient compression and the compressed-momentum optimizers are subpackages, imported last
# because they build on the collectives above: `comm.compression.OnebitAllReduce`,
# `comm.optim.OnebitAdam`.
from minispeed.comm import compression, optim

__all__ += ["compression", "optim"]
