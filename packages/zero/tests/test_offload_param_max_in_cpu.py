"""`offload_param.max_in_cpu` is honoured (issue 24 §4; it was accepted and never read).

With ``device='nvme'`` the first shards, in order, holding at most ``max_in_cpu`` elements per
rank stay in host memory and only the rest get swap files (DeepSpeed keeps up to
``max_in_cpu`` parameter elements in CPU memory the same way). Without the key every shard goes
to a file. Either way the losses equal single-process PyTorch. 2 ranks, stage 3, TinyGPT, with
shards built by `zero.shard` and by `zero.Init(config)` (which writes them to files as built).
"""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH, LR, global_loss, reference_losses
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3.residency import Residency

AWAY, HERE = Residency.AWAY, Residency.HERE

pytest.importorskip("minispeed.offload")

STEPS = 4
BUDGET = 3000  # elements per rank: some of TinyGPT's shards, not all


def _run(rank: int, world_size: int, root: str, budget, under_init: bool) -> dict:
    param = {"device": "nvme", "nvme_path": root, "buffer_size": 2000}
    if budget is not None:
        param["max_in_cpu"] = budget
    section = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": param}
    config = zero.ZeroConfig.from_section(section)
    if under_init:
        with zero.Init(config=config):
            model = make_model()
    else:
        model = make_model()
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=config)
    losses = []
    for batch in make_batches(STEPS, GLOBAL_BATCH):
        loss = model(*rank_slice(batch, rank, world_size))
        losses.append(global_loss(loss, world_size))
        opt.backward(loss)
        opt.step()
    sps = opt.strategy.sharded_params()
    files = opt.strategy.param_home.files
    in_files = [sp.shard_numel for sp in sps if id(sp) in files and sp.residency is AWAY]
    in_memory = [sp.shard_numel for sp in sps if sp.residency is HERE]
    opt.close()
    return dict(losses=losses, in_files=in_files, in_memory=in_memory)


@pytest.mark.parametrize("under_init", [False, True], ids=["shard", "init"])
def test_max_in_cpu_keeps_the_first_shards_in_memory(tmp_path, under_init: bool) -> None:
    reference = reference_losses(STEPS)
    for budget in (BUDGET, None):
        per_rank = run_distributed(_run, args=(str(tmp_path), budget, under_init), timeout_s=180)
        for res in per_rank:
            torch.testing.assert_close(res["losses"], reference, rtol=1e-5, atol=0)
            if budget is None:  # every shard in a file
                assert not res["in_memory"] and res["in_files"], res
            else:
                assert 0 < sum(res["in_memory"]) <= budget, res
                assert sum(res["in_memory"]) + res["in_files"][0] > budget, (
                    res
                )  # the first left out
