"""Quantized all-gather (qwZ) and reduce-scatter (qgZ) on 2 and 4 gloo ranks.

Compared with single-process PyTorch on the same data: the result equals quantize-then-
dequantize of every rank's part (emulated with the reference kernels), stays within the
per-block bound, and the comms logger counts exactly the bytes of
:mod:`minispeed.comm.compression.wire`.
"""

from __future__ import annotations

import pytest
import torch

import minispeed.comm as comm
from minispeed.comm.compression import (
    BlockQuantizer,
    ErrorFeedback,
    ops,
    quantized_all_gather_into_tensor,
    quantized_reduce_scatter_tensor,
    wire,
)
from minispeed.comm.compression import reference as ref
from minispeed.core.testing import run_distributed

SHARD = 1001  # per-rank elements: not a multiple of the block, odd (int4 nibble tail)
BLOCK = 64


@pytest.fixture(scope="module", autouse=True)
def _built_once():
    """Build (or load) the op in the parent first, so ranks import the cached .so in parallel."""
    ops.load_op("cpu")


def _data(rank: int, numel: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * rank + step)
    return torch.randn(numel, generator=g) * torch.rand(numel, generator=g).pow(2) * 3


def _roundtrip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What one rank's part becomes after the wire: reference quantize + dequantize."""
    q, scales = ref.quantize_blocks(x, BLOCK, bits)
    return ref.dequantize_blocks(q, scales, BLOCK, bits, x.numel())


def _block_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per element: max|block| / (2 qmax) of its block (blocks restart at each part)."""
    qmax = ref.qmax_for_bits(bits)
    blocks = x.split(BLOCK)
    return torch.cat([b.abs().max().expand(b.numel()) / (2 * qmax) for b in blocks])


def _all_gather(rank: int, world_size: int, bits: int) -> dict:
    out = torch.empty(world_size * SHARD)
    with comm.CommsLogger() as log:
        quantized_all_gather_into_tensor(
            out, _data(rank, SHARD), quantizer=BlockQuantizer(bits, BLOCK)
        )
    return {
        "out": out,
        "calls": [(r.op, r.msg_bytes) for r in log.records],
        "wire": log.total_wire_bytes(),
    }


def _reduce_scatter(rank: int, world_size: int, bits: int, steps: int, feedback: bool) -> dict:
    quantizer = BlockQuantizer(bits, BLOCK)
    ef = ErrorFeedback(quantizer) if feedback else None
    out = torch.empty(SHARD)
    error = torch.zeros(SHARD)  # Σ_t (out_t - exact_t)
    with comm.CommsLogger() as log:
        for step in range(steps):
            quantized_reduce_scatter_tensor(
                out,
                _data(rank, world_size * SHARD, step),
                quantizer=None if feedback else quantizer,
                error_feedback=ef,
                op=comm.ReduceOp.AVG,
            )
            exact = sum(_data(r, world_size * SHARD, step) for r in range(world_size)) / world_size
            error += out - exact.view(world_size, SHARD)[rank]
            if step == 0:
                first = out.clone()
    return {
        "first": first,
        "error": float(error.norm()),
        "calls": [(r.op, r.msg_bytes) for r in log.records[:1]],
        "wire": log.records[0].wire_bytes,
    }


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world_size", [2, 4])
def test_quantized_all_gather_equals_per_rank_roundtrip_within_bound(world_size, bits):
    results = run_distributed(_all_gather, world_size=world_size, args=(bits,), timeout_s=120)
    parts = [_data(r, SHARD) for r in range(world_size)]
    expected = torch.cat([_roundtrip(p, bits) for p in parts])
    exact = torch.cat(parts)
    bound = torch.cat([_block_bound(p, bits) for p in parts])
    for res in results:
        assert torch.equal(res["out"], expected)
        assert torch.all((res["out"] - exact).abs() <= bound * (1 + 1e-6))
    calls = wire.quantized_all_gather_calls(SHARD, world_size, BlockQuantizer(bits, BLOCK))
    assert results[0]["calls"] == calls
    assert results[0]["wire"] == wire.wire_bytes(calls, world_size)
    fp32_wire = (world_size - 1) * 4 * SHARD
    assert fp32_wire / results[0]["wire"] >= (3.5 if bits == 8 else 6.5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world_size", [2, 4])
def test_quantized_reduce_scatter_equals_sum_of_roundtrips_within_bound(world_size, bits):
    results = run_distributed(
        _reduce_scatter, world_size=world_size, args=(bits, 1, False), timeout_s=120
    )
    inputs = [_data(r, world_size * SHARD).view(world_size, SHARD) for r in range(world_size)]
    for rank, res in enumerate(results):
        parts = [x[rank] for x in inputs]  # what every sender contributes to my shard
        expected = sum(_roundtrip(p, bits) for p in parts) / world_size
        torch.testing.assert_close(res["first"], expected, rtol=1e-6, atol=1e-6)
        exact = sum(parts) / world_size
        bound = sum(_block_bound(p, bits) for p in parts) / world_size
        assert torch.all((res["first"] - exact).abs() <= bound * (1 + 1e-5) + 1e-6)
    calls = wire.quantized_reduce_scatter_calls(SHARD, world_size, BlockQuantizer(bits, BLOCK))
    assert results[0]["calls"] == calls
    assert results[0]["wire"] == wire.wire_bytes(calls, world_size)


def test_quantized_reduce_scatter_error_feedback_keeps_the_accumulated_error_small():
    with_ef = run_distributed(_reduce_scatter, world_size=2, args=(4, 30, True), timeout_s=120)
    without = run_distributed(_reduce_scatter, world_size=2, args=(4, 30, False), timeout_s=120)
    for a, b in zip(with_ef, without):
        assert a["error"] * 3 <= b["error"]


def _bad_sizes(rank: int, world_size: int) -> list[str]:
    messages = []
    try:
        quantized_all_gather_into_tensor(torch.empty(5), torch.ones(3))
    except ValueError as err:
        messages.append(str(err))
    try:
        quantized_reduce_scatter_tensor(torch.empty(3), torch.ones(5))
    except ValueError as err:
        messages.append(str(err))
    return messages


def test_quantized_collectives_reject_mismatched_sizes_before_communicating():
    messages = run_distributed(_bad_sizes, world_size=2, timeout_s=120)[0]
    assert len(messages) == 2
    assert "n * input.numel()" in messages[0] and "n * output.numel()" in messages[1]


def _non_finite_body(rank: int, world_size: int, bits: int) -> dict:
    quantizer = BlockQuantizer(bits, BLOCK)
    shard = 3 * BLOCK
    x = _data(rank, world_size * shard)
    if rank == 0:  # a NaN in the part for rank 1, an inf in the part for rank 0
        x[shard + 10] = float("nan")
        x[2 * BLOCK + 5] = float("inf")
    out = torch.empty(shard)
    quantized_reduce_scatter_tensor(out, x, quantizer=quantizer)
    gathered = torch.empty(world_size * shard)
    mine = _data(rank, shard)
    if rank == 1:
        mine[BLOCK + 1] = float("nan")
    quantized_all_gather_into_tensor(gathered, mine, quantizer=quantizer)
    return {"rs": out, "ag": gathered}


@pytest.mark.parametrize("bits", [8, 4])
def test_nan_and_inf_arrive_non_finite_through_quantized_collectives(bits):
    # fp16 loss scaling looks for non-finite gradients; quantization must not hide them.
    n, shard = 2, 3 * BLOCK
    results = run_distributed(_non_finite_body, world_size=n, args=(bits,), timeout_s=60)
    rs0, rs1 = results[0]["rs"], results[1]["rs"]
    assert rs1[10:BLOCK].isnan().all() and rs1[:10].isnan().all()  # the NaN's whole block
    assert rs1[BLOCK:].isfinite().all()
    assert rs0[2 * BLOCK :].isnan().all()  # inf block: 0 * inf = NaN throughout, never finite
    assert rs0[: 2 * BLOCK].isfinite().all()
    for res in results:  # the all-gather: rank 1's NaN block arrives as NaN on every rank
        ag = res["ag"]
        assert ag[shard + BLOCK : shard + 2 * BLOCK].isnan().all()
        assert ag[:shard].isfinite().all() and ag[shard + 2 * BLOCK :].isfinite().all()


def _one_bad_rank_body(rank: int, world_size: int) -> str:
    out = torch.empty(3 if rank == 0 else 4)  # rank 0's output does not fit its input
    with pytest.raises(ValueError) as info:  # CommInputError is a ValueError too
        quantized_reduce_scatter_tensor(out, torch.ones(4 * world_size))
    comm.barrier()  # rank 1 did not wait in the all-to-all for rank 0
    return str(info.value)


def test_a_size_error_on_one_rank_reaches_the_other():
    messages = run_distributed(_one_bad_rank_body, world_size=2, timeout_s=60)
    assert "n * output.numel()" in messages[0]
    assert "rank(s) [0] rejected their arguments" in messages[1]
    assert "n * output.numel()" in messages[1]
