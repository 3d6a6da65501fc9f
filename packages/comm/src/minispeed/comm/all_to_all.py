"""`all_to_all_single`: each rank sends a different chunk to every rank (MoE's token dispatch).

Like every collective it goes through one `Call` (`minispeed.comm.call`): local checks, the
cross-rank check (in validation mode ``all`` the split sizes too: rank r's input split j must
equal rank j's output split r), the ledger record, named backend errors. Where the backend has
no all-to-all (gloo on some builds) it runs as point-to-point sends and receives
(`api_compat.all_to_all_p2p`, Note [backend fallbacks] in api_compat.py).

S = input bytes; each rank sends S minus its own chunk (equal splits: (n-1)/n · S).

`all_to_all_autograd` is the same exchange as an autograd function along dim 0: its backward is
the all-to-all with the splits swapped (what rank r received from rank j goes back to rank j),
so the backward sends what the forward received. MoE's token dispatch and Ulysses' sequence
all-to-all (`minispeed.tensor_parallel.ulysses`) both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm import api_compat, costs, validation
from minispeed.comm.call import Call, CommWork, Issued, native_or_fallback
from minispeed.comm.handoff import lend
from minispeed.comm.validation import CommInputError

__all__ = ["all_to_all_autograd", "all_to_all_single"]


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> CommWork | None:
    """Rank r sends chunk j of `input` (along dim 0) to rank j and receives chunk j of
    `output` from rank j. Equal chunks when split sizes are `None`; uneven otherwise.

    S = input bytes; sends S minus its own chunk (equal splits: (n-1)/n · S).
    """
    call = Call("all_to_all", group)
    n = call.n
    with call:
        validation.check_tensors(call.op, group, output, input)
        validation.check_same_dtype(call.op, output, input)
        # a 0-dim tensor is one row of one element (gloo mishandles 0-dim tensors)
        input, output = (
            (input.view(1) if input.dim() == 0 else input),
            (output.view(1) if output.dim() == 0 else output),
        )
        _check_all_to_all_rows(call, output, input, output_split_sizes, input_split_sizes)
    in_splits = None if input_split_sizes is None else [int(s) for s in input_split_sizes]
    out_splits = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
    in_dim0, out_dim0 = input.shape[0], output.shape[0]
    call.agree(
        lambda: {"dtype": str(input.dtype), "row": tuple(input.shape[1:])},
        # every call in mode all: the split sizes must mirror each other
        payload=lambda: (in_splits or [in_dim0 // n] * n, out_splits or [out_dim0 // n] * n),
        check_payload=validation.check_all_to_all_splits,
    )
    me = dist.get_rank(group)
    row = input[:1].numel() if in_dim0 else 0
    own = (
        in_splits[me] * row if in_splits is not None else input.numel() // n
    ) * input.element_size()
    msg_bytes = input.numel() * input.element_size()

    def issue() -> Issued:  # the p2p fallback where the backend lacks it (api_compat)
        return native_or_fallback(
            call.op,
            group,
            lambda: dist.all_to_all_single(
                lend(output), lend(input), out_splits, in_splits, group=group, async_op=async_op
            ),
            lambda: api_compat.all_to_all_p2p(
                output, input, out_splits, in_splits, group, async_op
            ),
        )

    return call.launch(
        issue,
        async_op,
        input,
        input.numel(),
        (output, input),
        compat_op=call.op,
        wire=costs.wire_bytes(call.op, msg_bytes, n, own_chunk_bytes=own),
    )


def _check_all_to_all_rows(
    call: Call,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> None:
    """Split sizes that fit the first dimensions, rows of one shape, equal sizes without splits."""
    in_dim0, out_dim0 = input.shape[0], output.shape[0]
    validation.check_splits(call.op, "input", input_split_sizes, in_dim0, call.n)
    validation.check_splits(call.op, "output", output_split_sizes, out_dim0, call.n)
    if input[:1].numel() != output[:1].numel() and in_dim0 and out_dim0:
        raise CommInputError(
            f"{call.op}: input rows have shape {tuple(input.shape[1:])}, output rows "
            f"{tuple(output.shape[1:])}; they must match"
        )
    if input_split_sizes is None and output_split_sizes is None and input.numel() != output.numel():
        raise CommInputError(
            f"{call.op}: equal splits need output.numel() == input.numel() "
            f"({output.numel()} != {input.numel()}); pass split sizes"
        )


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` along dim 0 forward; the same with the splits swapped backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits, in_splits, group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        rows = grad.shape[0] if in_splits is None else sum(in_splits)
        back = grad.new_empty((rows, *grad.shape[1:]))
        all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_autograd(
    x: torch.Tensor,
    group: Any,
    out_splits: Sequence[int] | None = None,
    in_splits: Sequence[int] | None = None,
) -> torch.Tensor:
    """Differentiable `all_to_all_single` along dim 0 (equal splits when both are `None`).

    Returns a new tensor of `sum(out_splits)` rows (`x.shape[0]` with equal splits). Backward
    runs the inverse exchange on the gradient: the same bytes again, (n-1)/n · S with equal
    splits (S = bytes of `x`).
    """
    return _AllToAll.apply(x, out_splits, in_splits, group)
