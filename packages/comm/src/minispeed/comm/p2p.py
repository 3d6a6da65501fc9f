"""Point-to-point messages: send/recv, their async forms, and batched isend/irecv.

Each message of S bytes costs this rank S on the wire when it sends and nothing when it receives.
Cross-rank validation does not cover point-to-point calls (there is no group-wide call to check).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from minispeed.comm import api_compat, validation
from minispeed.comm.call import Call, CommWork
from minispeed.comm.handoff import lend
from minispeed.comm.validation import CommInputError

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _p2p(op: str, tensor: torch.Tensor, peer: int, group: Any, async_op: bool) -> CommWork | None:
    # no group-wide call to compare; the ledger's group size: a message has two ends
    call = Call(op, group, cross_check=False, ledger_group_size=2)
    validation.check_tensors(op, group, tensor)
    validation.check_peer(op, peer, "dst" if op == "send" else "src", group)
    fn = {
        ("send", False): dist.send,
        ("send", True): dist.isend,
        ("recv", False): dist.recv,
        ("recv", True): dist.irecv,
    }[(op, async_op)]
    return call.launch(
        lambda: fn(lend(tensor), peer, group=group), async_op, tensor, tensor.numel(), (tensor,)
    )


def send(tensor: torch.Tensor, dst: int, group: Any = None) -> None:
    """Send `tensor` to global rank `dst` (blocks until handed to the backend). Sends S bytes."""
    _p2p("send", tensor, dst, group, False)


def recv(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """Receive into `tensor` from global rank `src`."""
    _p2p("recv", tensor, src, group, False)


def isend(tensor: torch.Tensor, dst: int, group: Any = None) -> CommWork:
    """Async `send`; returns a handle."""
    return _p2p("send", tensor, dst, group, True)  # type: ignore[return-value]


def irecv(tensor: torch.Tensor, src: int, group: Any = None) -> CommWork:
    """Async `recv`; returns a handle."""
    return _p2p("recv", tensor, src, group, True)  # type: ignore[return-value]


class P2POp(NamedTuple):
    """One send or receive for `batch_isend_irecv`: `P2POp(comm.isend, tensor, peer)`."""

    op: Callable[..., Any]
    """`isend` or `irecv`."""
    tensor: torch.Tensor
    """What to send, or the buffer to receive into."""
    peer: int
    """Global rank of the other side."""
    group: Any = None
    """Process group (the world when `None`)."""
    tag: int = 0
    """Matches a send with a receive when several are in flight between the same two ranks."""


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[CommWork]:
    """Issue several sends/receives (`comm.P2POp(comm.isend or comm.irecv, tensor, peer)`) at once.

    Pairs that would deadlock as blocking calls (each rank sending first) are safe here. Logged
    as ONE `batch_p2p` record: msg_bytes = bytes sent + received, wire_bytes = bytes sent.
    Returns one handle (a list of one, like torch returns a list).
    """
    if not ops:
        raise CommInputError("batch_isend_irecv: got no ops; pass at least one comm.P2POp")
    torch_ops = []
    sent = recvd = 0
    for p in ops:
        fn = {
            isend: dist.isend,
            irecv: dist.irecv,
            dist.isend: dist.isend,
            dist.irecv: dist.irecv,
        }.get(p.op)
        if fn is None:
            raise CommInputError(
                "batch_isend_irecv: each P2POp's op must be comm.isend or comm.irecv"
            )
        name = "send" if fn is dist.isend else "recv"
        validation.check_group(name, p.group)
        validation.check_tensors(name, p.group, p.tensor)
        validation.check_peer(name, p.peer, "peer", p.group)
        torch_ops.append((fn, p))
        nbytes = p.tensor.numel() * p.tensor.element_size()
        sent, recvd = (sent + nbytes, recvd) if name == "send" else (sent, recvd + nbytes)
    first = ops[0].tensor
    call = Call("batch_p2p", ops[0].group, cross_check=False, ledger_group_size=2)
    work = call.launch(
        lambda: api_compat.WorkList(
            dist.batch_isend_irecv(
                [dist.P2POp(fn, lend(p.tensor), p.peer, p.group, p.tag) for fn, p in torch_ops]
            )
        ),
        True,
        first,
        (sent + recvd) // first.element_size(),
        [p.tensor for p in ops],
        wire=sent,
        msg_bytes=sent + recvd,
    )
    return [work]  # type: ignore[list-item]
