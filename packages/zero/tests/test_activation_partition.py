"""zero.checkpoint's partitioned inputs and Megatron's tracked random states, on 2 gloo ranks:
each rank keeps half of every floating input (padded when the count is odd) and all-gathers it
once in backward, and the gradients equal plain autograd's bit for bit, dropout drawn from the
default generator and from `rng_tracker().fork()` (a different mask per rank) included, for the
saved-tensor-hooks form and the reentrant one."""

from __future__ import annotations

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core.rng import rng_tracker
from minispeed.core.testing import run_distributed
from minispeed.zero.activation import ReentrantCheckpoint, checkpoint


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.tanh(self.lin(x)), 0.3)
        with rng_tracker().fork():
            h = h + nn.functional.dropout(h, 0.5)  # a mask of this rank's own
        return h


def _run(mode: str, group, rank: int) -> dict:
    torch.manual_seed(0)
    rng_tracker().reset()
    rng_tracker().add("model-parallel-rng", 100 + rank)
    block = _Block()
    x = torch.randn(3, 5, requires_grad=True)  # 15 elements: halves of 8, the last padded
    with comm.CommsLogger() as log:
        if mode == "plain":
            out = block(x)
        elif mode == "hooks":
            out = checkpoint(block, x, partition_group=group)
        elif mode == "hooks+offload":
            out = checkpoint(block, x, offload_to_cpu=True, partition_group=group)
        else:
            out = ReentrantCheckpoint.apply(block, [], (False, group), x)
        out.square().sum().backward()
    with rng_tracker().fork():
        after = torch.rand(2)
    gathers = [r.msg_bytes for r in log.records if r.op.startswith("all_gather")]
    return dict(
        grads=(x.grad, block.lin.weight.grad), after=(torch.rand(2), after), gathers=gathers
    )


def _body(rank: int, world_size: int) -> dict:
    group = comm.new_group(list(range(world_size)))
    try:
        return {
            mode: _run(mode, group, rank)
            for mode in ("plain", "hooks", "hooks+offload", "reentrant")
        }
    finally:
        rng_tracker().reset()


def test_partitioned_inputs_give_plain_gradients_and_one_gather():
    for result in run_distributed(_body, world_size=2, timeout_s=60):
        plain = result["plain"]
        assert plain["gathers"] == []
        for mode in ("hooks", "hooks+offload", "reentrant"):
            got = result[mode]
            for a, b in zip(got["grads"] + got["after"], plain["grads"] + plain["after"]):
                assert torch.equal(a, b), mode
            assert got["gathers"] == [16 * 4], mode  # 2 halves of 8 fp32 elements
