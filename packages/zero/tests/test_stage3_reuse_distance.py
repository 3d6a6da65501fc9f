"""``stage3_max_reuse_distance``: a module called twice per pass stays gathered between its calls.

``Twice`` applies ``shared`` before and after ``mid``. With the distance at 0 every call
all-gathers its unit; with a distance larger than ``mid`` the second call (forward and backward)
finds ``shared`` still gathered: fewer all-gathers, counted by the comms logger, by exactly
``shared``'s bytes per reuse, and the same losses, equal to single-process PyTorch. Prefetching
is off (``stage3_prefetch_bucket_numel=1``) so that each unit is one all-gather.
"""

from __future__ import annotations

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

WIDTH, STEPS = 16, 4


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.shared(h))
        return self.head(h).pow(2).mean()


def _data() -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(5))


def _train(rank: int, world_size: int, distance: int) -> dict:
    torch.manual_seed(0)
    model = Twice()
    cfg = zero.ZeroConfig(
        stage=3,
        stage3_param_persistence_threshold_numel=0,
        stage3_prefetch_bucket_numel=1,
        stage3_max_reuse_distance_numel=distance,
    )
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    n = 8 // world_size
    x = _data()[rank * n : (rank + 1) * n]
    losses, calls, nbytes = [], 0, 0
    for step in range(STEPS):
        with comm.CommsLogger() as log:
            loss = model(x)
            opt.backward(loss)
            opt.step()
        t = loss.detach().clone().reshape(1)
        comm.all_reduce(t)
        losses.append(t.item() / world_size)
        if step >= 1:  # steady state: the trace is followed
            gathers = [r for r in log.records if r.op.startswith("all_gather")]
            gathers = [r for r in gathers if r.dtype != "torch.int64"]  # not the order check
            calls += len(gathers)
            nbytes += sum(r.msg_bytes for r in gathers)
    return dict(losses=losses, calls=calls, bytes=nbytes)


def _body(rank: int, world_size: int) -> dict:
    return dict(zero=_train(rank, world_size, 0), far=_train(rank, world_size, 10_000))


def _reference() -> list[float]:
    torch.manual_seed(0)
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = model(_data())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_reuse_distance_keeps_a_twice_called_module_gathered() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=120)
    want = _reference()
    shared_bytes = (WIDTH * WIDTH + WIDTH) * 4  # padded to N = 2: already even
    for res in results:
        near, far = res["zero"], res["far"]
        assert far["losses"] == near["losses"]
        for a, b in zip(near["losses"], want, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (near["losses"], want)
        # per steady step: one reuse in forward, one in backward
        assert near["calls"] - far["calls"] == 2 * (STEPS - 1), (near, far)
        assert near["bytes"] - far["bytes"] == 2 * (STEPS - 1) * shared_bytes, (near, far)
