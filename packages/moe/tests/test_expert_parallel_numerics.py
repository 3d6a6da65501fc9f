"""Expert parallelism changes where experts run, not what the model computes.

On W = 2 and 4 gloo processes with E_p = 2 and 4 (and W = 4 with E_p = 2, where expert
gradients are summed over expert-data groups of 2), 10 SGD steps of a model with one top-2 MoE
layer give every rank's loss and every gradient equal to one process holding all experts that
runs each rank's batch in turn (fp32, relative error <= 1e-5), with dropping on (equal-split
all-to-all) and off (uneven splits).
"""

from __future__ import annotations

import pytest
import torch
from _models import batch, build, config, loss_of, named_grads

import minispeed.moe as moe
from minispeed.core.testing import run_distributed

STEPS = 10
LR = 0.1


def _assert_rel_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).norm() / want.norm().clamp(min=1e-12)
    assert err <= 1e-5, f"{what}: relative error {err:.3g} > 1e-5"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)


def _train_distributed(rank: int, world_size: int, ep: int) -> dict:
    groups = moe.ExpertGroups(ep)
    result = {}
    for drop in (True, False):
        model = build(config(ep, drop), groups)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, grads, uneven = [], [], False
        for step in range(STEPS):
            x, y = batch(step, rank)
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            moe.reduce_gradients(model, groups)
            losses.append(loss.item())
            grads.append(named_grads(model))
            counts = model.mlp.last_routing.kept_counts
            uneven |= len(set(counts.tolist())) > 1
            opt.step()
        result[drop] = (losses, grads, uneven)
    return result


def _train_one_process(world_size: int, drop: bool) -> tuple[list[list[float]], list[dict]]:
    model = build(config(1, drop))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = [loss_of(model, *batch(step, r)) for r in range(world_size)]
        # Each rank's batch is routed on its own (capacity is per rank), then averaged as DP does.
        torch.stack(per_rank).mean().backward()
        losses.append([loss.item() for loss in per_rank])
        grads.append(named_grads(model))
        opt.step()
    return losses, grads


@pytest.mark.parametrize(("world_size", "ep"), [(2, 2), (4, 4), (4, 2)])
def test_expert_parallel_matches_one_process(world_size: int, ep: int):
    results = run_distributed(_train_distributed, world_size=world_size, args=(ep,), timeout_s=240)
    for drop in (True, False):
        ref_losses, ref_grads = _train_one_process(world_size, drop)
        for rank, res in enumerate(results):
            losses, grads, uneven = res[drop]
            if not drop:
                assert uneven, "no-drop run never had uneven expert counts: the test lost its point"
            for step in range(STEPS):
                got, want = torch.tensor(losses[step]), torch.tensor(ref_losses[step][rank])
                _assert_rel_close(got, want, f"drop={drop} rank {rank} step {step} loss")
                for name, g in grads[step].items():
                    _assert_rel_close(
                        g, ref_grads[step][name], f"drop={drop} rank {rank} step {step} {name}"
                    )
