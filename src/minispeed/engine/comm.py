"""DeepSpeed's `deepspeed.comm` import path: `torch.distributed`'s signatures over `minispeed.comm`.

```python
from minispeed.engine import comm as dist      # was: from deepspeed import comm as dist
dist.all_reduce(loss)                           # in place, summed over the ranks
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, stats)         # torch's (output list, object) signature
```

DeepSpeed's module keeps `torch.distributed`'s signatures (an output list filled in place for
`all_gather` / `all_gather_object`, `broadcast_object_list`), where `minispeed.comm` returns its
results (`all_gather_object(obj) -> list`). This adapter keeps DeepSpeed's signatures and
sends every collective through `minispeed.comm`, so the comms logger and the input checks see
each one: the list form of `all_gather` as one flat `all_gather_into_tensor` copied out (one
staging buffer of the gathered bytes), `broadcast_object_list` as one `broadcast_object`; only
the queries (`is_available`, `get_global_rank`, `get_world_group`) read `torch.distributed`.
`prof`, `log_name` and `debug` (DeepSpeed's per-call logging arguments) are accepted and
unused: the config's `comms_logger` section chooses what is logged, for every call alike. Cost: one Python call over the
collective's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as _dist

import minispeed.comm as _comm
from minispeed.comm import ReduceOp
from minispeed.comm.logger import pass_through

pass_through(__name__)  # comms_logger.debug names the script's function, not this adapter's

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "log_summary",
    "new_group",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
]


def init_distributed(dist_backend: str | None = None, **kwargs: Any) -> None:
    """`deepspeed.comm.init_distributed`: the same as `minispeed.engine.init_distributed`."""
    from minispeed.engine.distributed import init_distributed as _init

    _init(dist_backend=dist_backend, **kwargs)


def is_available() -> bool:
    return _dist.is_available()


def is_initialized() -> bool:
    return _comm.is_initialized()


def get_rank(group: Any = None) -> int:
    return _comm.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return _comm.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node (torchrun's `LOCAL_RANK`; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return group_rank if group is None else _dist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    return _dist.group.WORLD


def new_group(ranks: list[int]) -> Any:
    return _comm.new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    _comm.destroy_process_group(group)


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    return _comm.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_: Any
) -> Any:
    return _comm.broadcast(tensor, src, group=group, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_: Any) -> None:
    _comm.barrier(group)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    return _comm.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    return _comm.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    return _comm.all_to_all_single(
        output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    """torch's list form over `minispeed.comm.all_gather_into_tensor`: one flat all-gather,
    then each rank's chunk copied into `tensor_list` (after `wait()` when `async_op`)."""
    if len(tensor_list) != get_world_size(group) or any(
        t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list
    ):
        raise ValueError(
            f"all_gather: tensor_list needs one tensor per rank ({get_world_size(group)}), each "
            f"shaped {tuple(tensor.shape)} {tensor.dtype} like the input"
        )
    flat = torch.empty((len(tensor_list), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    work = _comm.all_gather_into_tensor(flat, tensor.contiguous(), group=group, async_op=async_op)
    if work is None:
        _unstack(flat, tensor_list)
        return None
    return _AfterWait(work, lambda: _unstack(flat, tensor_list))


def _unstack(flat: torch.Tensor, tensor_list: list[torch.Tensor]) -> None:
    for out, chunk in zip(tensor_list, flat, strict=True):
        out.copy_(chunk)


class _AfterWait:
    """An async handle whose `wait()` also runs `then` (copies out of a staging buffer)."""

    def __init__(self, work: Any, then: Any) -> None:
        self._work, self._then, self._done = work, then, False

    def wait(self) -> bool:
        self._work.wait()
        if not self._done:
            self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether the gather finished (as `CommWork`: the list is filled only by `wait`)."""
        return self._done or self._work.is_completed()


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, **_: Any) -> None:
    """Fill `object_list` (one slot per rank) with every rank's `obj`, as torch's does."""
    if len(object_list) != get_world_size(group):
        raise ValueError(
            f"all_gather_object: object_list has {len(object_list)} slots for a group of "
            f"{get_world_size(group)} ranks; pass [None] * dist.get_world_size()"
        )
    object_list[:] = _comm.all_gather_object(obj, group=group)


def broadcast_object_list(
    object_list: list[Any], src: int, group: Any = None, device: Any = None, **_: Any
) -> None:
    """Every entry of global rank `src`'s `object_list` into every rank's list, in place."""
    object_list[:] = _comm.broadcast_object(list(object_list), src=src, group=group)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    return _comm.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: Any = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    return _comm.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: Any = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    return _comm.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """`deepspeed.comm.log_summary`: after a barrier, rank 0 prints the comms logger's table
    (the config's `comms_logger` section turns it on); with `return_dict`, every rank returns
    its own log in DeepSpeed's layout, `{"summary": {op: {msg_size_bytes: {"count",
    "total_latency_ms", "avg_latency_ms", "tput_avg_gbps", "busbw_avg_gbps", "msg_size_bytes",
    "msg_size_str"}}}, "straggler_analysis": None, "metadata": {...}}`. No logger: prints
    nothing, returns None. Cost: one barrier."""
    if show_straggler:
        raise NotImplementedError(
            "log_summary(show_straggler=True) is not implemented: each rank's comms log gives "
            "its own latencies (return_dict=True); compare them across ranks yourself"
        )
    barrier()
    logger = _comm.comms_logger()
    if logger is None:
        return None
    if get_rank() == 0:
        logger.summary()
    if not return_dict:
        return None
    summary: dict[str, dict[int, dict[str, Any]]] = {}
    for row in logger.aggregate():
        latency_ms = row["mean_latency_s"] * 1e3
        # DeepSpeed's record name: the op, and its caller under `comms_logger.debug`
        name = f"{row['op']} | [Caller Func: {row['caller']}]" if row["caller"] else row["op"]
        summary.setdefault(name, {})[row["msg_bytes"]] = {
            "count": row["count"],
            "total_latency_ms": latency_ms * row["count"],
            "avg_latency_ms": latency_ms,
            "tput_avg_gbps": row["algbw"] * 8 / 1e9,
            "busbw_avg_gbps": row["busbw"] * 8 / 1e9,
            "msg_size_bytes": row["msg_bytes"],
            "msg_size_str": f"{row['msg_bytes']} B",
        }
    return {
        "summary": summary,
        "straggler_analysis": None,
        "metadata": {"world_size": get_world_size(), "rank": get_rank()},
    }
