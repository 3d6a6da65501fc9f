"""The executor marks its phases with minispeed.core.ranges, so a torch.profiler trace names them."""

import torch
from pipeline_testlib import data, lm_loss, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed


def _range_names(rank, world_size):
    module = pp.partition(tiny_gpt(2), stages=world_size, loss_fn=lm_loss, method="type:Block")
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.01),
                             micro_batches=2, schedule="zb_h1")  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ex.train_batch(*data(1, 4)[0])
    return sorted({e.name for e in prof.events() if e.name.startswith("pipeline.")})


def test_forward_backward_send_recv_are_named_ranges():
    stage0, stage1 = run_distributed(_range_names, world_size=2)
    common = {"pipeline.forward", "pipeline.backward_input", "pipeline.backward_weight",
              "pipeline.send", "pipeline.recv", "pipeline.reduce_tied", "pipeline.step"}  # fmt: skip
    assert common <= set(stage0) and common <= set(stage1)
