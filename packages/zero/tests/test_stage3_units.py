"""Fetch units (assemble.py's `build_units`): a module gets one, with its hooks, only when it owns
a parameter that is gathered and released; a module whose parameters all persist (a LayerNorm
under the persistence threshold) has nothing to fetch, so it gets no unit and no hooks, and its
gradients are still reduced like every other's (losses equal single-process PyTorch's).
"""

from __future__ import annotations

from stage3_testlib import reference_losses, train_stage3

from minispeed.core.testing import run_distributed

STEPS = 3


def _body(rank: int, world_size: int) -> dict:
    losses, opt, _ = train_stage3(rank, world_size, STEPS)
    strategy = opt.strategy
    model = strategy.model
    all_persistent = [
        name
        for name, m in model.named_modules()
        if m is not model
        and list(m.parameters(recurse=False))
        and all(strategy.sharded[p].persistent for p in m.parameters(recurse=False))
    ]
    hooked = [
        name
        for name, m in model.named_modules()
        if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks
    ]
    return dict(
        losses=losses,
        all_persistent=all_persistent,
        units=sorted(u.name for u in strategy.units.values()),
        hooked=sorted(hooked),
    )


def test_modules_whose_parameters_all_persist_get_no_unit_and_still_train() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=90)
    result = results[0]
    assert result["all_persistent"], "the model needs a module whose parameters all persist"
    assert not set(result["all_persistent"]) & set(result["units"]), result["units"]
    assert not set(result["all_persistent"]) & set(result["hooked"]), result["hooked"]
    assert "" in result["units"]  # the root always has one: it begins and ends each pass
    for r in results:
        for ours, ref in zip(r["losses"], reference_losses(STEPS)):
            assert abs(ours - ref) < 1e-5, (r["losses"], reference_losses(STEPS))
