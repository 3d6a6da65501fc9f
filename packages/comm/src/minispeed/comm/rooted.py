"""The rooted collectives torch.distributed has beside broadcast: `reduce`, `gather`, `scatter`.

Each goes through one `Call` (`minispeed.comm.call`) like every collective: local checks, the
cross-rank check (shape, dtype, root, reduce op), the ledger record, named backend errors. The
root is a global rank, as in `torch.distributed`. Costs (`costs.wire_bytes`; `S` the message):

| op | S | bytes this rank sends |
|---|---|---|
| `reduce(t, dst)` | bytes of `t` | S off the root (a chain of partial sums), 0 on it |
| `gather(t, gather_list, dst)` | n · bytes of `t` (what the root receives) | S/n off the root |
| `scatter(t, scatter_list, src)` | n · bytes of `t` (what the root hands out) | (n-1)/n · S on the root |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm import costs, validation
from minispeed.comm.call import Call, CommWork
from minispeed.comm.validation import CommInputError

__all__ = ["gather", "reduce", "scatter"]


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> CommWork | None:
    """Reduce `tensor` over the group into global rank `dst`'s `tensor`, in place (the other
    ranks' tensors are left undefined, as torch's)."""
    call = Call("reduce", group)
    with call:
        validation.check_tensors(call.op, group, tensor)
        validation.check_peer(call.op, dst, "dst", group)
    call.agree(
        lambda: {
            "shape": tuple(tensor.shape),
            "dtype": str(tensor.dtype),
            "dst": dst,
            "op": str(op),
        }
    )
    msg_bytes = tensor.numel() * tensor.element_size()
    return call.launch(
        lambda: dist.reduce(tensor, dst, op=op, group=group, async_op=async_op),
        async_op,
        tensor,
        tensor.numel(),
        (tensor,),
        wire=costs.wire_bytes(call.op, msg_bytes, call.n, is_root=dist.get_rank() == dst),
    )


def gather(
    tensor: torch.Tensor,
    gather_list: Sequence[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> CommWork | None:
    """Every rank's `tensor` into `gather_list` (one tensor per group rank, given on `dst`
    only) on global rank `dst`."""
    call = Call("gather", group)
    is_root = dist.get_rank() == dst
    with call:
        validation.check_tensors(call.op, group, tensor)
        validation.check_peer(call.op, dst, "dst", group)
        _check_list(call, tensor, gather_list, is_root, "gather_list", dst)
    call.agree(lambda: {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "dst": dst})
    msg_bytes = call.n * tensor.numel() * tensor.element_size()
    listed = list(gather_list) if is_root else None
    return call.launch(
        lambda: dist.gather(tensor, listed, dst, group=group, async_op=async_op),
        async_op,
        tensor,
        call.n * tensor.numel(),
        (tensor, *(listed or ())),
        wire=costs.wire_bytes(call.op, msg_bytes, call.n, is_root=is_root),
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: Sequence[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> CommWork | None:
    """Group rank j's `tensor` receives `scatter_list[j]` (given on global rank `src` only)."""
    call = Call("scatter", group)
    is_root = dist.get_rank() == src
    with call:
        validation.check_tensors(call.op, group, tensor)
        validation.check_peer(call.op, src, "src", group)
        _check_list(call, tensor, scatter_list, is_root, "scatter_list", src)
    call.agree(lambda: {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "src": src})
    msg_bytes = call.n * tensor.numel() * tensor.element_size()
    listed = list(scatter_list) if is_root else None
    return call.launch(
        lambda: dist.scatter(tensor, listed, src, group=group, async_op=async_op),
        async_op,
        tensor,
        call.n * tensor.numel(),
        (tensor, *(listed or ())),
        wire=costs.wire_bytes(call.op, msg_bytes, call.n, is_root=is_root),
    )


def _check_list(
    call: Call,
    tensor: torch.Tensor,
    tensors: Sequence[torch.Tensor] | None,
    is_root: bool,
    name: str,
    root: int,
) -> None:
    """The root's list: one tensor per group rank, each shaped and typed like `tensor`."""
    if not is_root:
        return
    if tensors is None or len(tensors) != call.n:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise CommInputError(
            f"{call.op}: global rank {root} is the root and needs {name} with one tensor per "
            f"rank of the group ({call.n}), got {got}"
        )
    for j, t in enumerate(tensors):
        if tuple(t.shape) != tuple(tensor.shape) or t.dtype != tensor.dtype:
            raise CommInputError(
                f"{call.op}: {name}[{j}] is {tuple(t.shape)} {t.dtype}; every entry must match "
                f"the tensor, {tuple(tensor.shape)} {tensor.dtype}"
            )
