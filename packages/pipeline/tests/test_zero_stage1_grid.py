"""PP × DP with ZeRO stage 1 inside each data-parallel group (requirement 3's composition): on
2 stages × 2 replicas, each stage's parameters are driven by `minispeed.zero.shard(..., group=
the grid's data group)`, and 10 steps match the unsplit model on one process (fp32, 1e-5), for
GPipe, 1F1B and interleaved 1F1B. minispeed.zero is an optional dependency (the `zero`
extra); the pipeline package itself never imports it (see sharded.py)."""

import pytest
import torch
from pipeline_testlib import data, lm_loss, masked_model, reference, stage_params

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed

zero = pytest.importorskip("minispeed.zero")

STEPS, BATCH, BLOCKS, M = 10, 8, 4, 2
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


def _train(rank, world_size):
    out = {}
    for schedule, v in SCHEDULES:
        module = pp.partition(masked_model(BLOCKS), stages=2, loss_fn=lm_loss,
                              method="type:Block$", virtual_stages=v)  # fmt: skip
        opt = zero.shard(
            module,
            torch.optim.SGD(module.parameters(), lr=0.05),
            zero.ZeroConfig(stage=1, gradient_accumulation_steps=M * v),
            group=module.grid.group("data"),
        )
        ex = pp.PipelineExecutor(module, opt, micro_batches=M, schedule=schedule)
        d, per = module.grid.rank_in("data"), BATCH // 2
        losses = [
            ex.train_batch(x[d * per : (d + 1) * per], y[d * per : (d + 1) * per])
            for x, y in data(STEPS, BATCH)
        ]
        out[schedule] = {"losses": losses, "params": stage_params(module),
                         "steps": opt.global_step}  # fmt: skip
    refused = []
    for what in ("zb_h1", "window"):
        module = pp.partition(masked_model(BLOCKS), stages=2, loss_fn=lm_loss, method="type:Block$")
        opt = zero.shard(module, torch.optim.SGD(module.parameters(), lr=0.05),
                         zero.ZeroConfig(stage=1, gradient_accumulation_steps=M + (what == "window")),
                         group=module.grid.group("data"))  # fmt: skip
        with pytest.raises(ValueError) as info:
            pp.PipelineExecutor(
                module, opt, micro_batches=M, schedule="zb_h1" if what == "zb_h1" else "1f1b"
            )
        refused.append(str(info.value))
    out["refused"] = refused
    return out


def test_zero_stage1_over_the_data_group_matches_the_unsplit_model():
    ref_losses, ref_params = reference(masked_model(BLOCKS), STEPS, BATCH)
    results = run_distributed(_train, world_size=4, timeout_s=120)
    for rank, res in enumerate(results):
        for schedule, _ in SCHEDULES:
            got = res[schedule]
            assert got["steps"] == STEPS and got["params"]  # zero stepped once per batch
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=0,
                                       msg=f"{schedule} rank {rank}")  # fmt: skip
            for key, value in got["params"].items():
                torch.testing.assert_close(value, ref_params[key], rtol=1e-5, atol=1e-6,
                                           msg=f"{schedule} rank {rank} {key}")  # fmt: skip
        zb, window = res["refused"]
        assert "splits backward into two passes" in zb
        assert (
            "gradient_accumulation_steps=3" in window
            and "set gradient_accumulation_steps=2" in window
        )
