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
from minispeed.comm.handoff import lend
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
        lambda: dist.reduce(lend(tensor), dst, op=op, group=group, async_op=async_op),
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
    return _to_or_from_list(
        "gather", tensor, gather_list, "gather_list", dst, "dst", group, async_op, dist.gather
    )


def scatter(
    tensor: torch.Tensor,
    scatter_list: Sequence[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> CommWork | None:
    """Group rank j's `tensor` receives `scatter_list[j]` (given on global rank `src` only)."""
    return _to_or_from_list(
        "scatter", tensor, scatter_list, "scatter_list", src, "src", group, async_op, dist.scatter
    )


def _to_or_from_list(
    op: str,
    tensor: torch.Tensor,
    tensors: Sequence[torch.Tensor] | None,
    list_name: str,
    root: int,
    root_name: str,
    group: Any,
    async_op: bool,
    backend: Any,
) -> CommWork | None:
    """gather and scatter, mirror images: n chunks shaped like `tensor` meet at `root`'s list."""
    call = Call(op, group)
    is_root = dist.get_rank() == root
    with call:
        validation.check_tensors(call.op, group, tensor)
        validation.check_peer(call.op, root, root_name, group)
        _check_list(call, tensor, tensors, is_root, list_name, root)
    call.agree(lambda: {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), root_name: root})
    msg_bytes = call.n * tensor.numel() * tensor.element_size()
    listed = list(tensors) if is_root else None

    def issue() -> Any:
        lent = None if listed is None else [lend(t) for t in listed]
        return backend(lend(tensor), lent, root, group=group, async_op=async_op)

    return call.launch(
        issue,
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
