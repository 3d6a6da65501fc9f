"""The conjugate communication functions of `mappings.py`, each alone: forward and backward equal
what the ranks' tensors say they should (sums, concatenations, slices), on 2 and 4 gloo ranks,
with the collectives and sizes the module docstring's table states."""

from __future__ import annotations

import pytest
import torch

import minispeed.comm as comm
import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

SHAPE = (2, 8, 12)
S = 4 * 2 * 8 * 12  # bytes of one rank's x
FUNCTIONS = {
    "copy": tp.copy_to_parallel,
    "reduce": tp.reduce_from_parallel,
    "gather": tp.gather_from_parallel,
    "scatter": tp.scatter_to_parallel,
    "gather_seq": tp.gather_from_sequence,
    "reduce_scatter_seq": tp.reduce_scatter_to_sequence,
    "scatter_seq": tp.scatter_to_sequence,
}


def _x(rank: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(10 + rank))


def _g(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def _body(rank: int, world_size: int) -> dict:
    tg, out = tp.TensorGroup.of(None), {}
    for name, fn in FUNCTIONS.items():
        x = _x(rank).requires_grad_(True)
        with comm.CommsLogger() as log:
            y = fn(x, tg)
            y.backward(_g(rank, tuple(y.shape)))
        out[name] = (y.detach(), x.grad, [(r.op, r.msg_bytes) for r in log.records])
    return out


def _expected(name: str, r: int, n: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    xs, total = [_x(k) for k in range(n)], sum(_x(k) for k in range(n))

    def gs(shape):
        return [_g(k, shape) for k in range(n)]

    if name == "copy":
        return xs[r], sum(gs(SHAPE)), [("all_reduce", S)]
    if name == "reduce":
        return total, gs(SHAPE)[r], [("all_reduce", S)]
    if name == "gather":
        y = torch.cat(xs, -1)
        return y, gs(y.shape)[r].chunk(n, -1)[r], [("all_gather", n * S)]
    if name == "scatter":
        y = xs[r].chunk(n, -1)[r]
        return y, torch.cat(gs(y.shape), -1), [("all_gather", S)]
    if name == "gather_seq":
        y = torch.cat(xs, -2)
        return (
            y,
            sum(gs(y.shape)).chunk(n, -2)[r],
            [("all_gather", n * S), ("reduce_scatter", n * S)],
        )
    if name == "reduce_scatter_seq":
        y = total.chunk(n, -2)[r]
        return y, torch.cat(gs(y.shape), -2), [("reduce_scatter", S), ("all_gather", S)]
    y = xs[r].chunk(n, -2)[r]
    return y, torch.cat(gs(y.shape), -2), [("all_gather", S)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_conjugate_pair_moves_what_its_table_says(world_size, rel_close):
    results = run_distributed(_body, world_size=world_size)
    for r, got in enumerate(results):
        for name in FUNCTIONS:
            y, grad, records = got[name]
            want_y, want_grad, want_records = _expected(name, r, world_size)
            rel_close(y, want_y)
            rel_close(grad, want_grad)
            assert sorted(records) == sorted(want_records), name
