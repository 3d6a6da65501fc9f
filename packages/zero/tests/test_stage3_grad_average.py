"""Stage 3 averages gradients at the loss on 2 ranks: the shards are DDP's mean, bit for bit, and
no pass over the reduced gradients divides them (Note [averaging at the loss] in stage3/strategy.py).

DDP's mean of two ranks' gradients is ``(g0 + g1) / 2``, computed here in one process from the two
ranks' micro-batches. Stage 3 divides the loss by 2 instead, so backward produces ``g/2`` exactly
and the reduce-scatter's sum is the mean: the test compares with ``torch.equal``. It also counts,
under a `TorchDispatchMode`, the elementwise multiplications of more than one element that
`ZeroOptimizer.backward` runs, against those of the same model's plain backward: before the change
the reducer added one ``mul`` per gradient bucket.
"""

from __future__ import annotations

import torch
from stage3_testlib import GLOBAL_BATCH
from torch.utils._python_dispatch import TorchDispatchMode
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


class _CountMuls(TorchDispatchMode):
    """Multiplications and divisions whose output has more than one element."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mul", "mul_", "div", "div_") and out.numel() > 1:
            self.count += 1
        return out


def _plain_backward_muls(batch) -> int:
    model = make_model()
    counter = _CountMuls()
    loss = model(*batch)
    with counter:
        loss.backward()
    return counter.count


def _ddp_mean(world_size: int) -> dict[str, torch.Tensor]:
    """``(g0 + g1) / 2`` from the two ranks' micro-batches, in this process (whose thread count,
    which decides the order of backward's own sums, is the workers')."""
    batch = make_batches(1, GLOBAL_BATCH)[0]
    grads = []
    for rank in range(world_size):
        model = make_model()
        model(*rank_slice(batch, rank, world_size)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    return {n: (grads[0][n] + grads[1][n]) / world_size for n in grads[0]}


def _body(rank: int, world_size: int) -> dict:
    mean = _ddp_mean(world_size)
    batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    model = make_model()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    loss = model(*batch)
    counter = _CountMuls()
    with counter:
        opt.backward(loss)
    unequal = []
    for sp in opt.strategy.sharded_params():
        shard = opt.strategy.reducer.grad_shard(sp)
        if sp.name not in mean:  # `unused`: no gradient on any rank
            continue
        want = mean[sp.name].reshape(-1)[sp.start : sp.start + sp.owned_numel]
        if not torch.equal(shard[: sp.owned_numel], want):
            unequal.append(sp.name)
    return dict(unequal=unequal, muls=counter.count, plain_muls=_plain_backward_muls(batch))


def test_stage3_grads_are_ddps_mean_with_no_division_pass() -> None:
    for rank, res in enumerate(run_distributed(_body, world_size=2, timeout_s=120)):
        assert res["unequal"] == [], f"rank {rank}: shards differ from DDP's mean: {res['unequal']}"
        assert res["plain_muls"] > 0  # the counter sees the model's own multiplications
        assert res["muls"] == res["plain_muls"], (
            f"rank {rank}: backward ran {res['muls']} multiplications of tensors, the plain "
            f"model's backward {res['plain_muls']}: the reduced gradients were divided by a pass"
        )
