"""Tied layers under an optimizer that reduces gradients itself (minispeed.zero stage 2 over each
stage's data-parallel group) on 2 stages × 2 replicas: the optimizer sums the tied embedding/head
over the stages inside its step (`zero.ModelParallel(shared=module.tied_grad_groups()...)`), the
executor's `ReduceTiedGrads` stands aside, and 6 steps of 1F1B and interleaved 1F1B match the
unsplit model on one process (fp32, 1e-5). Without `shared` the executor refuses the optimizer on
every rank, naming the fix. minispeed.zero is an optional dependency of this package."""

import pytest
import torch
from pipeline_testlib import data, lm_loss, reference, stage_params, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed

zero = pytest.importorskip("minispeed.zero")

STEPS, BATCH, BLOCKS, M = 6, 8, 4, 2
SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2)]


def _shard(module, v, shared):
    ties = module.tied_grad_groups()
    return zero.shard(
        module,
        torch.optim.SGD(module.parameters(), lr=0.05),
        zero.ZeroConfig(stage=2, gradient_accumulation_steps=M * v),
        group=module.grid.group("data"),
        model_parallel=zero.ModelParallel(
            groups=(module.grid.group("pipe"),),
            shared=tuple((p, g) for p, g, _ in ties) if shared else (),
        ),
    )


def _train(rank, world_size):
    out = {}
    for schedule, v in SCHEDULES:
        module = pp.partition(tiny_gpt(BLOCKS), stages=2, loss_fn=lm_loss,
                              method="type:Block$", virtual_stages=v)  # fmt: skip
        ex = pp.PipelineExecutor(module, _shard(module, v, True), micro_batches=M,
                                 schedule=schedule)  # fmt: skip
        d, per = module.grid.rank_in("data"), BATCH // 2
        losses = [
            ex.train_batch(x[d * per : (d + 1) * per], y[d * per : (d + 1) * per])
            for x, y in data(STEPS, BATCH)
        ]
        out[schedule] = {"losses": losses, "params": stage_params(module)}
    module = pp.partition(tiny_gpt(BLOCKS), stages=2, loss_fn=lm_loss, method="type:Block$")
    try:
        pp.PipelineExecutor(module, _shard(module, 1, False), micro_batches=M)
        out["refused"] = ""
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def test_zero_sums_tied_gradients_over_the_stages():
    ref_losses, ref_params = reference(tiny_gpt(BLOCKS), STEPS, BATCH)
    for rank, res in enumerate(run_distributed(_train, world_size=4, timeout_s=180)):
        for schedule, _ in SCHEDULES:
            got = res[schedule]
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=0,
                                       msg=f"{schedule} rank {rank}")  # fmt: skip
            assert any(k.startswith("tied.") for k in got["params"])
            for key, value in got["params"].items():
                torch.testing.assert_close(value, ref_params[key], rtol=1e-5, atol=1e-6,
                                           msg=f"{schedule} rank {rank} {key}")  # fmt: skip
        assert "tied layers" in res["refused"] and "tied_grad_groups" in res["refused"]
