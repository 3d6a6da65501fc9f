"""A prefetch gathers at most one chunk ahead of the running modules, whatever the budget
(Note [a prefetch stays one chunk ahead], prefetch.py): the next module waits only for its own
gather, and the backward's first module does not start with the whole model gathered on top of
the forward's activations.

``Stack`` is six linears of 272 elements each. The prefetch budget is DeepSpeed's default (5e7
elements: the whole model). With the chunk above the model, when the root starts (it owns no
parameter) every unit is admitted at once: one all-gather per pass, the whole model gathered at
once. With a chunk of one unit, each module start gathers the next unit: one all-gather per unit,
and never more than the running unit and the next gathered. With a chunk smaller than a unit,
the next unit is still gathered ahead: one unit ahead is the least a prefetch keeps.
Either way the steady-state steps gather the same bytes and train to the same losses as
single-process PyTorch.
"""

from __future__ import annotations

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

WIDTH, DEPTH, STEPS = 16, 6, 3
UNIT_NUMEL = WIDTH * WIDTH + WIDTH  # one Linear: weight + bias, no padding at N = 2


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _data() -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(3))


def _train(rank: int, world_size: int, chunk_numel: int) -> dict:
    torch.manual_seed(0)
    model = Stack()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    coordinator = opt.strategy.coordinator
    coordinator.prefetcher.chunk_numel = chunk_numel
    coordinator.log_events = True
    n = 8 // world_size
    x = _data()[rank * n : (rank + 1) * n]
    losses, calls, nbytes, ahead = [], [], 0, []
    for step in range(STEPS):
        coordinator.stats.events.clear()
        with comm.CommsLogger() as log:
            loss = model(x)
            opt.backward(loss)
            opt.step()
        t = loss.detach().clone().reshape(1)
        comm.all_reduce(t)
        losses.append(t.item() / world_size)
        if step >= 1:  # steady state: the trace is followed, prefetches happen
            gathers = [r for r in log.records if r.op.startswith("all_gather")]
            gathers = [r for r in gathers if r.dtype != "torch.int64"]  # not the order check
            calls.append(len(gathers))
            nbytes += sum(r.msg_bytes for r in gathers)
            # Units gathered by each prefetch of this step (one event per all-gather).
            events = [e.split() for e in coordinator.stats.events if " prefetch " in e]
            ahead.append([int(e[e.index("B") - 1]) // (UNIT_NUMEL * 4) for e in events])
    live = opt.strategy.coordinator.stats.peak_live_numel
    return dict(losses=losses, calls=calls, bytes=nbytes, live=live, ahead=ahead)


def _body(rank: int, world_size: int) -> dict:
    return dict(
        one=_train(rank, world_size, 1 << 40),
        chunked=_train(rank, world_size, UNIT_NUMEL),
        below=_train(rank, world_size, 1),  # a chunk smaller than any unit
        three=_train(rank, world_size, 3 * UNIT_NUMEL),  # a chunk of 3 units, below the model
    )


def _reference() -> list[float]:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = model(_data())
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def test_prefetch_stays_one_chunk_ahead_with_same_bytes_and_losses() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=120)
    ref = _reference()
    for res in results:
        one, chunked = res["one"], res["chunked"]
        # Per pass, the root (which owns no parameter) starts first: with the chunk above the
        # model it admits all DEPTH units in one all-gather; with a chunk of one unit each module
        # start gathers the next: DEPTH calls. Forward and backward alike.
        assert one["calls"] == [2] * (STEPS - 1)
        assert chunked["calls"] == [2 * DEPTH] * (STEPS - 1)
        # Gathered at once: the whole model, or the running unit and the one ahead.
        assert one["live"] == DEPTH * UNIT_NUMEL
        assert chunked["live"] == 2 * UNIT_NUMEL
        assert chunked["bytes"] == one["bytes"] == (STEPS - 1) * 2 * DEPTH * UNIT_NUMEL * 4
        assert chunked["losses"] == one["losses"]
        # A chunk smaller than the next unit still lets that one unit ahead: the same plan as a
        # chunk of one unit (before, nothing was prefetched and every module waited for its own).
        below = res["below"]
        assert (below["calls"], below["live"], below["bytes"]) == (
            chunked["calls"],
            chunked["live"],
            chunked["bytes"],
        )
        assert below["losses"] == one["losses"]
        # A chunk of 3 units, below the model's 6: one unit ahead while the rest of the pass does
        # not fit it (a deeper window holds more and saves no call: every module start tops it
        # up), then the rest in one call once it fits: 1+1+1+3 units per pass. Before, the first
        # prefetch took 3 units and each later start one: 3+1+1+1.
        three = res["three"]
        assert three["ahead"] == [[1, 1, 1, 3] * 2] * (STEPS - 1)
        assert three["bytes"] == one["bytes"]
        assert three["losses"] == one["losses"]
        for a, b in zip(chunked["losses"], ref):
            assert abs(a - b) <= 1e-6 * abs(b)
