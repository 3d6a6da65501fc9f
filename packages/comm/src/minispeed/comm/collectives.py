"""The collectives minispeed issues, over torch.distributed (gloo on CPU, NCCL on GPU).

(The all-to-all is in all_to_all.py, send/recv in p2p.py, Python-object collectives in objects.py.)

Each function has the signature of its torch.distributed namesake and goes through one `Call`
(`minispeed.comm.call`: this file and that one are the whole path from here to the backend),
which adds four things:

- **checks before blocking**: bad devices, dtypes, sizes, sparse tensors and group membership
  raise `CommInputError` on the calling rank before any rank waits (see
  `minispeed.comm.validation`);
- **a cross-rank check** of the first call of each call site (every call in validation mode):
  ranks that disagree, or a rank that rejected its own arguments, raise on every rank (see
  `minispeed.comm.handshake`);
- **a ledger**: when a `CommsLogger` is active each call appends one record (op, size, dtype,
  group size, latency, algbw, busbw, wire bytes); when none is, the cost is one global read (see
  Note [logger off is one global read]);
- **named failures**: a backend timeout becomes a `CommTimeoutError` naming the op, shapes and
  group.

`async_op=True` returns a `CommWork`; call `wait()` before reading the output. Groups are the
objects `new_group` returns; `None` is the world. Ranks passed as `src`/`dst` are *global* ranks,
as in torch.distributed. The flat collectives (reduce-scatter, all-gather) hand the
backend 1-D views: only element counts matter, and shapes a backend mishandles (gloo segfaults
on a 0-dim reduce-scatter output) never reach it.

Bytes per call (S = message size, n = group size) are in `minispeed.comm.costs`; in short, a
ring all_reduce sends 2(n-1)/n · S per rank and all_gather / reduce_scatter (n-1)/n · S.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm import api_compat, costs, validation
from minispeed.comm.call import (
    Call,
    CommWork,
    Issued,
    all_gather_flat,
    reduce_scatter_flat,
)
from minispeed.comm.handoff import lend
from minispeed.comm.validation import CommInputError

__all__ = [
    "CommWork",
    "ReduceOp",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "reduce_scatter_tensor",
]

ReduceOp = dist.ReduceOp
#: Where the all-gather is broadcasts, `all_gather_coalesced` receives its inputs straight into
#: their outputs when they hold at least this many elements on average (n broadcasts each), and
#: packs smaller ones into one buffer (n broadcasts in all, then the unpack). On 2 gloo ranks here
#: a broadcast cost its caller ~0.1 ms of CPU and a copy ~0.9 ns an element (issue 34,
#: `benchmarks/stage3_gather_costs.py`): an input's n = 2 broadcasts cost what packing and
#: unpacking its (n+1)·s elements does at s ≈ 70K.
DIRECT_NUMEL = 1 << 16


# -- collectives --------------------------------------------------------------------------------
def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> CommWork | None:
    """Reduce `tensor` elementwise over the group, in place on every rank.

    Sends 2(n-1)/n · S bytes per rank (ring: reduce-scatter then all-gather), S = tensor bytes.
    """
    call = Call("all_reduce", group)
    with call:
        validation.check_tensor_list(call.op, call.facts, (tensor,))
    call.agree(lambda: {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "op": str(op)})
    return call.launch(
        lambda: dist.all_reduce(lend(tensor), op=op, group=group, async_op=async_op),
        async_op,
        tensor,
        tensor.numel(),
        (tensor,),
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> CommWork | None:
    """Reduce `input` (n · m elements) over the group; rank r receives chunk r into `output` (m).

    S = input bytes; sends (n-1)/n · S per rank. On gloo, whose own reduce-scatter is an
    all-reduce of a copy, a SUM runs as comm's ring over point-to-point messages (`ring_p2p`,
    (n-1)/n · S sent, one S/n scratch; Note [ring reduce-scatter over p2p] in ring.py). On a
    backend without reduce-scatter, and on gloo for other ops, it runs as an all-reduce:
    `all_reduce+slice`, or `all_reduce_in_place` when `output` is this rank's chunk of `input`
    (Notes [backend fallbacks], [gloo's reduce-scatter is an all-reduce] in api_compat):
    2(n-1)/n · S sent. The logger records the `impl` with its wire bytes. In place, the other
    chunks of `input` are scratch afterwards (Note [in-place flat collectives]).
    """
    call = Call("reduce_scatter", group)
    with call:
        validation.check_tensor_list(call.op, call.facts, (output, input))
        validation.check_same_dtype(call.op, output, input)
        validation.check_divisible(call.op, input.numel(), call.n)
        fix = "allocate output with input.numel() // group size elements"
        validation.check_numel(call.op, "output", output.numel(), input.numel() // call.n, fix)
    call.agree(lambda: {"shape": tuple(input.shape), "dtype": str(input.dtype), "op": str(op)})
    impl = call.impl = api_compat.reduce_scatter_impl(group, output, input, op)
    return call.launch(
        lambda: reduce_scatter_flat(_flat(output), _flat(input), op, group, async_op, impl),
        async_op,
        input,
        input.numel(),
        (output, input),
        compat_op=call.op,
    )


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
) -> CommWork | None:
    """Gather every rank's `input` (m elements) into `output` (n · m, rank-major).

    S = output bytes; sends (n-1)/n · S per rank (ring). On gloo it runs as n broadcasts (the
    same bytes; Note [gloo's all-gather is broadcasts] in api_compat): the record's `impl`.
    """
    call = Call("all_gather", group)
    with call:
        validation.check_tensor_list(call.op, call.facts, (output, input))
        validation.check_same_dtype(call.op, output, input)
        fix = "allocate output with group size * input.numel() elements"
        validation.check_numel(call.op, "output", output.numel(), call.n * input.numel(), fix)
    call.agree(lambda: {"shape": tuple(input.shape), "dtype": str(input.dtype)})
    impl = call.impl = api_compat.all_gather_impl(group)
    return call.launch(
        lambda: all_gather_flat([_flat(output)], [_flat(input)], group, async_op, impl),
        async_op,
        output,
        output.numel(),
        (output, input),
        compat_op=call.op,
    )


def all_gather_coalesced(
    outputs: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> CommWork | None:
    """All-gather a list of tensors of different sizes with ONE collective.

    `outputs[i]` (n · inputs[i].numel() elements, contiguous) receives every rank's `inputs[i]`,
    rank-major. One input is gathered straight into its output. Where the backend's all-gather
    is broadcasts (gloo: Note [gloo's all-gather is broadcasts] in api_compat.py) so are several
    of `DIRECT_NUMEL` elements or more on average: chunk j from rank j, n broadcasts per input,
    this rank's chunk a copy of its input, no other buffer and no other copy. Otherwise the
    inputs are packed straight into this rank's chunk of one flat buffer of n · Σ numel elements,
    gathered in place (the input is a view of the output: see Note [in-place flat collectives]
    in api_compat.py), and unpacked into the outputs. Cost: one call's latency instead of
    len(inputs) (straight in: n · len(inputs) messages); (n-1)/n · S sent with S = Σ output
    bytes; memory: the outputs, plus (packed) one temporary of n · Σ numel elements, alive until
    the call completes.

    `outputs` may be a function returning the output tensors: it is called when the data has
    somewhere to land, at issue where the outputs receive it, else once it has arrived (in
    `wait()` for an async call), so an in-flight gather holds one copy, never the flat buffer
    and the outputs at once (ZeRO-3 prefetches this way). Its tensors are checked then.
    """
    call = Call("all_gather_coalesced", group)
    with call:
        if not inputs:
            raise CommInputError(f"{call.op}: got no inputs; pass at least one tensor")
        validation.check_tensor_list(call.op, call.facts, inputs, False)
        validation.check_one_dtype(call.op, "inputs", inputs, inputs[0].dtype, "the first")
        if not callable(outputs):  # lazy outputs are checked when they are made
            _check_coalesced_outputs(call, outputs, inputs)
    dtype = inputs[0].dtype
    call.agree(lambda: {"shapes": [tuple(t.shape) for t in inputs], "dtype": str(dtype)})
    n, sizes = call.n, [t.numel() for t in inputs]
    total = sum(sizes)
    impl = call.impl = api_compat.all_gather_impl(group)
    if len(inputs) == 1 or (impl == "broadcasts" and total >= len(inputs) * DIRECT_NUMEL):
        outs, finish = [_flat(o) for o in _made(call, outputs, inputs)], None
        ins = [t.reshape(-1) for t in inputs]
    else:
        outs = [inputs[0].new_empty(n * total)]  # 1D, rank-major: [rank0: in0|in1|..][rank1: ..]
        me = call.facts.rank  # this rank's chunk (below) is gathered in place
        ins = [outs[0][me * total : (me + 1) * total]]
        torch.cat([t.reshape(-1) for t in inputs], out=ins[0])

        def finish() -> None:  # unpack: outputs[i] takes column block i of every rank's chunk
            by_rank, offset = outs[0].view(n, total), 0
            for o, size in zip(_made(call, outputs, inputs), sizes):
                o.view(n, size).copy_(by_rank[:, offset : offset + size])
                offset += size

    def issue() -> Issued:
        work, inner_finish = all_gather_flat(outs, ins, group, async_op, impl)
        if inner_finish is not None:
            raise AssertionError("the flat all-gather fallback needs no finishing step")
        return work, finish

    return call.launch(issue, async_op, inputs[0], n * total, inputs, compat_op="all_gather")


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False
) -> CommWork | None:
    """Copy `tensor` from global rank `src` to every rank of the group, in place.

    S = tensor bytes; the root sends S (pipelined chain or tree), the others forward or receive.
    """
    call = Call("broadcast", group)
    with call:
        validation.check_tensor_list(call.op, call.facts, (tensor,))
        validation.check_peer(call.op, src, "src", group)
    call.agree(lambda: {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "src": src})
    return call.launch(
        lambda: dist.broadcast(lend(tensor), src, group=group, async_op=async_op),
        async_op,
        tensor,
        tensor.numel(),
        (tensor,),
        wire=costs.wire_bytes(call.op, tensor.nbytes, call.n, is_root=call.facts.me == src),
    )


def barrier(group: Any = None) -> None:
    """Block until every rank of the group reached this call."""
    call = Call("barrier", group)
    call.agree(dict)
    call.launch(lambda: dist.barrier(group=group), False, None, 0, [])


# -- local checks shared by the collectives above ----------------------------------------------
def _check_coalesced_outputs(
    call: Call, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> None:
    """One output per input, of the inputs' dtype, with n times its elements."""
    if len(outputs) != len(inputs):
        raise CommInputError(
            f"{call.op}: got {len(outputs)} outputs for {len(inputs)} inputs; pass one output "
            "per input"
        )
    validation.check_tensor_list(call.op, call.facts, outputs)  # contiguous: viewed flat
    validation.check_one_dtype(call.op, "outputs", outputs, inputs[0].dtype, "the inputs")
    for i, (o, t) in enumerate(zip(outputs, inputs)):
        validation.check_numel(
            call.op,
            f"outputs[{i}]",
            o.numel(),
            call.n * t.numel(),
            f"allocate outputs[{i}] with {call.n} * inputs[{i}].numel() elements",
        )


def _made(call: Call, outputs: Any, inputs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """A coalesced all-gather's outputs, made now (and checked) when `outputs` is a function."""
    if not callable(outputs):
        return outputs
    made = outputs()
    _check_coalesced_outputs(call, made, inputs)
    return made


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 1-D view (contiguous: checked before)."""
    return t if t.dim() == 1 else t.view(-1)
