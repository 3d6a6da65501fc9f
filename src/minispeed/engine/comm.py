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
    "P2POp",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_global_rank",
    "get_local_rank",
    "get_local_rank_from_launcher",
    "get_rank",
    "get_world_group",
    "get_world_rank_from_launcher",
    "get_world_size",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
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


def get_local_rank_from_launcher() -> int:
    """The launcher's `LOCAL_RANK` (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_rank_from_launcher() -> int:
    """The launcher's `RANK` (0 without one)."""
    return int(os.environ.get("RANK", 0))


def get_world_size_from_launcher() -> int:
    """The launcher's `WORLD_SIZE` (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def has_all_gather_into_tensor() -> bool:
    """Always True: `minispeed.comm` provides it on every torch it supports."""
    return True


def has_reduce_scatter_tensor() -> bool:
    """Always True: `minispeed.comm` provides it on every torch it supports."""
    return True


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return group_rank if group is None else _dist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    return _comm.world_group()


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


def inference_all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, **_: Any
) -> Any:
    """DeepSpeed's all-reduce for inference's tensor-parallel layers: `all_reduce`, blocking."""
    return _comm.all_reduce(tensor, op=op, group=group)


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    """Every tensor of `tensors` all-reduced in place by ONE collective: they are copied into
    one flat buffer (their summed bytes, all of one dtype), reduced, and copied back (after
    `wait()` when `async_op`)."""
    if not tensors or len({t.dtype for t in tensors}) != 1:
        raise ValueError(
            "all_reduce_coalesced: pass a non-empty list of tensors of one dtype (got "
            f"{sorted({str(t.dtype) for t in tensors})}); call it once per dtype"
        )
    flat = torch.cat([t.reshape(-1) for t in tensors])
    work = _comm.all_reduce(flat, op=op, group=group, async_op=async_op)
    return _copied_out(work, flat, tensors)


def _copied_out(work: Any, flat: torch.Tensor, tensors: list[torch.Tensor]) -> Any:
    """`tensors` filled from the staging buffer `flat` (their elements one after the other):
    now after a blocking call (returns None), at `wait()` after an async one (returns the
    handle whose `wait()` copies)."""

    def copy() -> None:
        start, values = 0, flat.reshape(-1)
        for t in tensors:
            t.copy_(values[start : start + t.numel()].view_as(t))
            start += t.numel()

    if work is None:
        copy()
        return None
    return _AfterWait(work, copy)


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_: Any
) -> Any:
    return _comm.broadcast(tensor, src, group=group, async_op=async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_: Any) -> None:
    _comm.barrier(group)


def monitored_barrier(
    group: Any = None, timeout: Any = None, wait_all_ranks: bool = False, **_: Any
) -> None:
    """`barrier`: minispeed's collectives already name the ranks that did not arrive when the
    comm timeout passes (`minispeed.comm.CommTimeoutError`), so `timeout` and `wait_all_ranks`
    add nothing and are accepted unused."""
    _comm.barrier(group)


def _no_tag(op: str, tag: int) -> None:
    if tag != 0:
        raise ValueError(
            f"{op}(tag={tag}): minispeed's point-to-point calls match messages by order, not by "
            "tag; leave tag at 0 and send in the order they are received"
        )


def _peer(op: str, peer: int | None, name: str) -> int:
    if peer is None:
        raise ValueError(
            f"{op}({name}=None): a receive from any rank is not supported; pass the sending "
            f"rank as {name}"
        )
    return peer


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any) -> None:
    """Send `tensor` to global rank `dst` (minispeed.comm.send: S bytes sent)."""
    _no_tag("send", tag)
    _comm.send(tensor, dst, group=group)


def recv(
    tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any
) -> int:
    """Receive into `tensor` from global rank `src`; returns `src`, as torch's does."""
    _no_tag("recv", tag)
    src = _peer("recv", src, "src")
    _comm.recv(tensor, src, group=group)
    return src


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any) -> Any:
    """Async `send`: returns the handle to `wait()` on."""
    _no_tag("isend", tag)
    return _comm.isend(tensor, dst, group=group)


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any
) -> Any:
    """Async `recv`: returns the handle to `wait()` on."""
    _no_tag("irecv", tag)
    return _comm.irecv(tensor, _peer("irecv", src, "src"), group=group)


def P2POp(  # DeepSpeed's and torch's name, a class there
    op: Any, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0
) -> _comm.P2POp:
    """One send or receive for `batch_isend_irecv`: `op` is this module's `isend`/`irecv`
    (or `minispeed.comm`'s, or torch's)."""
    _no_tag("P2POp", tag)
    return _comm.P2POp({isend: _comm.isend, irecv: _comm.irecv}.get(op, op), tensor, peer, group)


def batch_isend_irecv(p2p_op_list: list[Any], **_: Any) -> list[Any]:
    """Issue the sends and receives together (pairs that would deadlock one by one do not);
    returns the handles to `wait()` on."""
    return _comm.batch_isend_irecv(p2p_op_list)


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


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    """torch's list form: `input_tensor_list[j]` goes to rank j, rank j's arrives in
    `output_tensor_list[j]`. One `all_to_all_single` over flat copies (one staging buffer each
    way, the lists' summed bytes), split by the tensors' sizes; the outputs are filled after
    `wait()` when `async_op`."""
    n = get_world_size(group)
    if len(input_tensor_list) != n or len(output_tensor_list) != n:
        raise ValueError(
            f"all_to_all: pass one input and one output tensor per rank ({n}); got "
            f"{len(input_tensor_list)} inputs and {len(output_tensor_list)} outputs"
        )
    dtype = input_tensor_list[0].dtype
    if any(t.dtype != dtype for t in [*input_tensor_list, *output_tensor_list]):
        raise ValueError("all_to_all: every input and output tensor must have one dtype")
    flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    flat_out = torch.empty(
        sum(t.numel() for t in output_tensor_list), dtype=dtype, device=flat_in.device
    )
    work = _comm.all_to_all_single(
        flat_out,
        flat_in,
        [t.numel() for t in output_tensor_list],
        [t.numel() for t in input_tensor_list],
        group=group,
        async_op=async_op,
    )
    return _copied_out(work, flat_out, output_tensor_list)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **_: Any,
) -> Any:
    """torch's list form: `output` gets the reduction over the ranks of their
    `input_list[rank]`. One `reduce_scatter_tensor` over a flat copy of the list (one staging
    buffer of its bytes)."""
    n = get_world_size(group)
    if len(input_list) != n or any(
        t.shape != output.shape or t.dtype != output.dtype for t in input_list
    ):
        raise ValueError(
            f"reduce_scatter: input_list needs one tensor per rank ({n}), each shaped "
            f"{tuple(output.shape)} {output.dtype} like the output"
        )
    flat = torch.cat([t.reshape(-1) for t in input_list])
    return _comm.reduce_scatter_tensor(output, flat, op=op, group=group, async_op=async_op)


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
    return _copied_out(work, flat, tensor_list)


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
        """Whether the call finished (as `CommWork`: the outputs are filled only by `wait`)."""
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
