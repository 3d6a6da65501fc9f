"""Where a released stage-3 shard lives is `ShardedParam.residency`, moved only by its home.

Issue 21 §1: the shard's place used to be tracked by writing ``sp.shard`` / ``sp.residency``
from outside the parameter. Now `Residency` (HERE / AWAY / FETCHED) changes only in the
parameter's asserting ``to_*`` methods, called by its `ShardHome`; stage 3 calls the home
without asking whether offload is on. 2 ranks, stage 3, ``offload_param: nvme``:

- after `zero.shard` and after each step every offloaded shard is AWAY (0 bytes here) and every
  other one HERE with `STAYS_HERE` as its home;
- while a module runs its parameters are GATHERED and their shards AWAY again (evicted as soon
  as the all-gather landed);
- an illegal move raises `AssertionError` naming the state;
- the offload wrappers pass on only what `ShardStrategy` names: a stage-3 attribute is reached
  through ``.stage``, never by delegation.
"""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH, LR, global_loss, reference_losses
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3.params import REGISTRY, ParamState
from minispeed.zero.stage3.residency import STAYS_HERE, Residency

pytest.importorskip("minispeed.offload")

STEPS = 2


def _run(rank: int, world_size: int, root: str) -> dict:
    section = {
        "stage": 3,
        "stage3_param_persistence_threshold": 100,
        "offload_param": {"device": "nvme", "nvme_path": root, "buffer_size": 4000},
        "offload_optimizer": {"device": "cpu"},
    }
    config = zero.ZeroConfig.from_section(section)
    model = make_model()
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=config)
    stage = opt.strategy.stage
    sps = stage.sharded_params()
    offloaded = {id(sp) for sp in stage.offloaded}

    def places() -> list[tuple[str, int, bool]]:
        return [(sp.residency.name, sp.shard.numel(), sp.home is STAYS_HERE) for sp in sps]

    seen_in_forward = []

    def look(module: torch.nn.Module, args: tuple) -> None:  # after stage 3's pre-hook
        for p in module.parameters(recurse=False):
            sp = REGISTRY[p]
            if not sp.persistent:  # the bias stays gathered and HERE
                seen_in_forward.append((sp.state.name, sp.residency.name))

    handle = model.blocks[0].mlp[0].register_forward_pre_hook(look)
    after_shard = places()
    losses, after_steps = [], []
    for batch in make_batches(STEPS, GLOBAL_BATCH):
        loss = model(*rank_slice(batch, rank, world_size))
        losses.append(global_loss(loss, world_size))
        opt.backward(loss)
        opt.step()
        after_steps.append(places())
    handle.remove()

    errors = []
    away = next(sp for sp in sps if id(sp) in offloaded)
    here = next(sp for sp in sps if sp.persistent)
    shard = torch.zeros(here.shard_numel)
    for move in (away.to_here, away.to_away, lambda: here.to_fetched(shard)):
        try:
            move()
            errors.append(None)
        except AssertionError as error:
            errors.append(str(error))
    wrapper_has_coordinator = hasattr(opt.strategy, "coordinator")
    opt.close()
    return dict(
        losses=losses,
        persistent=[sp.persistent for sp in sps],
        offloaded=[id(sp) in offloaded for sp in sps],
        after_shard=after_shard,
        after_steps=after_steps,
        seen_in_forward=seen_in_forward,
        errors=errors,
        wrapper_has_coordinator=wrapper_has_coordinator,
        stage_type=type(stage).__name__,
    )


def test_residency_is_moved_only_by_the_home(tmp_path) -> None:
    reference = reference_losses(STEPS)
    for res in run_distributed(_run, args=(str(tmp_path),), timeout_s=180):
        torch.testing.assert_close(res["losses"], reference, rtol=1e-5, atol=0)
        assert res["stage_type"] == "Stage3Strategy"
        assert any(res["offloaded"]) and any(res["persistent"])
        for places in [res["after_shard"], *res["after_steps"]]:
            for (state, numel, stays), off in zip(places, res["offloaded"]):
                if off:  # in its file: nothing here, a home of its own
                    assert (state, numel, stays) == ("AWAY", 0, False)
                else:
                    assert state == "HERE" and numel > 0 and stays
        assert res["seen_in_forward"]
        for state, residency in res["seen_in_forward"]:
            assert (state, residency) == (ParamState.GATHERED.name, Residency.AWAY.name)
        assert all(e is not None and "from" in e for e in res["errors"]), res["errors"]
        assert not res["wrapper_has_coordinator"]
