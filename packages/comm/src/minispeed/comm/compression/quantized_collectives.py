"""Quantized all-gather and reduce-scatter: ZeRO++'s qwZ (weights) and qgZ (gradients).

Both move int8/int4 codes plus one fp32 scale per block instead of fp32 (`quantize`), each
rank's part padded to whole blocks (`P = B ceil(S / B)` elements for an S-element shard) so a
block never spans two ranks. Bytes per rank: `(n-1) q` with `q = ceil(P bits/8) + 4 P/B`
(`wire`), against `(n-1) 4 S` for fp32.

**qwZ** — `quantized_all_gather_into_tensor`: quantize my shard, all_gather the messages,
dequantize all n at once. Error per element: `|out_i - exact_i| <= max|block| / (2 qmax)` of
the block it came from (weights need no error feedback: they are re-gathered from the exact
fp32 shard every step).

**qgZ** — `quantized_reduce_scatter_tensor`: quantize my full input as n parts, send part
j to rank j with one all_to_all, dequantize the n parts I receive and add them in fp32. ZeRO++
does this all-to-all in two hops (within a node, then across); on one level it is the same
arithmetic. Error per element of the sum: `<= Σ_i max|block_i| / (2 qmax)` over the n
senders' blocks, or, with `error_feedback`, the accumulated error over steps is bounded by the
current residual (Note [why error feedback bounds the accumulated error]).
"""

from __future__ import annotations

from typing import Any

import torch

from minispeed.comm import all_to_all, collectives
from minispeed.comm.call import Call
from minispeed.comm.compression.compressor import ScaledCodes
from minispeed.comm.compression.error_feedback import ErrorFeedback
from minispeed.comm.compression.quantize import BlockQuantizer

__all__ = ["quantized_all_gather_into_tensor", "quantized_reduce_scatter_tensor"]

_DEFAULT = BlockQuantizer()
# What the checks raise; See Note [errors reach every rank] in handshake.py
_REJECTS = (ValueError, TypeError)


def _padded_rows(x: torch.Tensor, n: int, row_numel: int, padded_numel: int) -> torch.Tensor:
    """`x` as `(n, row_numel)` fp32 rows, each zero-padded to `padded_numel` columns."""
    rows = torch.zeros(n, padded_numel, dtype=torch.float32, device=x.device)
    rows[:, :row_numel] = x.detach().reshape(n, row_numel)
    return rows


def _check_sizes(
    op: str, full: torch.Tensor, full_name: str, part: torch.Tensor, part_name: str, n: int
) -> None:
    """`full` holds the n ranks' parts (`n * part.numel()` elements); both are floating-point."""
    if full.numel() != n * part.numel():
        raise ValueError(
            f"{full_name} has {full.numel()} elements but {n} ranks x {part.numel()} {part_name} "
            f"elements = {n * part.numel()}; pass an {full_name} of n * {part_name}.numel() "
            "elements"
        )
    if not (full.is_floating_point() and part.is_floating_point()):
        raise TypeError(
            f"quantized {op} needs float tensors, got {full_name} {full.dtype}, {part_name} "
            f"{part.dtype}"
        )


def quantized_all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    quantizer: BlockQuantizer = _DEFAULT,
    group: Any = None,
) -> torch.Tensor:
    """Gather every rank's `input` into `output` (`n * input.numel()` elements), quantized.

    Like `minispeed.comm.all_gather_into_tensor` but lossy: each element is off by at most
    `max|block| / (2 qmax)` of its block. Returns `output`.
    """
    call = Call("quantized_all_gather", group, rejects=_REJECTS)
    n, shard = call.n, input.numel()
    with call:
        _check_sizes("all-gather", output, "output", input, "input", n)
    call.agree(lambda: {"shape": tuple(input.shape), "quantizer": repr(quantizer)})
    padded = quantizer.padded_numel(shard)
    message = quantizer.compress(_padded_rows(input, 1, shard, padded)).to_bytes()
    gathered = torch.empty(n * message.numel(), dtype=torch.uint8, device=input.device)
    collectives.all_gather_into_tensor(gathered, message, group=group)
    packed = ScaledCodes.from_rows(
        gathered.view(n, -1), padded, quantizer.bits, quantizer.block_numel
    )
    values = quantizer.decompress(packed).view(n, padded)[:, :shard]  # (n, S)
    output.copy_(values.reshape(output.shape))
    return output


def quantized_reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    op: Any = None,
    quantizer: BlockQuantizer | None = None,
    error_feedback: ErrorFeedback | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Reduce `input` (`n * output.numel()` elements) over ranks; rank r keeps part r, quantized.

    `op` is `comm.ReduceOp.SUM` (default) or `comm.ReduceOp.AVG`. Pass an
    `ErrorFeedback` around a `BlockQuantizer` to carry this rank's quantization
    error into its next call (then leave `quantizer` unset or pass the same one). Returns
    `output`.
    """
    call = Call("quantized_reduce_scatter", group, rejects=_REJECTS)
    n = call.n
    with call:
        op = collectives.ReduceOp.SUM if op is None else op
        if op not in (collectives.ReduceOp.SUM, collectives.ReduceOp.AVG):
            raise ValueError(f"quantized reduce-scatter supports ReduceOp.SUM and AVG, got {op}")
        if error_feedback is not None:
            if not isinstance(error_feedback.compressor, BlockQuantizer):
                raise TypeError(
                    "error_feedback must wrap a BlockQuantizer for a quantized reduce-scatter"
                )
            if quantizer is not None and quantizer != error_feedback.compressor:
                raise ValueError(
                    f"quantizer {quantizer} differs from the error feedback's "
                    f"{error_feedback.compressor}; pass only error_feedback"
                )
            quantizer = error_feedback.compressor
        quantizer = quantizer if quantizer is not None else _DEFAULT
        shard = output.numel()
        _check_sizes("reduce-scatter", input, "input", output, "output", n)
    call.agree(lambda: {"shape": tuple(input.shape), "quantizer": repr(quantizer)})
    padded = quantizer.padded_numel(shard)
    rows = _padded_rows(input, n, shard, padded).view(-1)  # (n P,): part j = rows[j]
    packed = (
        error_feedback.compress(rows) if error_feedback is not None else quantizer.compress(rows)
    )
    to_ranks = packed.to_rows(n)  # (n, q) uint8: row j goes to rank j
    from_ranks = torch.empty_like(to_ranks)
    all_to_all.all_to_all_single(from_ranks, to_ranks, group=group)
    received = ScaledCodes.from_rows(from_ranks, padded, quantizer.bits, quantizer.block_numel)
    parts = quantizer.decompress(received).view(n, padded)[:, :shard]  # (n, S): sender i's part
    total = parts.sum(dim=0)
    if op == collectives.ReduceOp.AVG:
        total.div_(n)
    output.copy_(total.view(output.shape))
    return output
