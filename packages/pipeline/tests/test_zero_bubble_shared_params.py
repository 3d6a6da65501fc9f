"""ZB-H1 is exact when one stage uses a parameter in more than one layer: a block repeated
ALBERT-style (one `TiedLayerSpec` key used by several layers of each stage, and across stages),
and a one-stage pipeline holding both ends of a tied embedding and head. Before the fix each
layer's weight pass ran autograd back through the earlier uses of the same parameter, counting
them again (0.3–0.8 relative error), while GPipe and 1F1B were exact."""

import pytest
import torch
from pipeline_testlib import albert, reference, tiny_gpt, train_pipeline

from minispeed.core.testing import run_distributed

STEPS, BATCH = 3, 8


def _train(rank, world_size, model, stages, schedule):
    return train_pipeline(rank, world_size, stages, schedule, STEPS, BATCH, 4, model=model,
                          method="uniform")  # fmt: skip


@pytest.mark.parametrize("schedule", ["zb_h1", "1f1b"])
@pytest.mark.parametrize(
    "model,stages",
    [("albert", 2), ("gpt", 1)],
    ids=["albert-2-stages-2-uses-each", "tied-ends-on-one-stage-dp2"],
)
def test_zero_bubble_counts_each_use_of_a_shared_parameter_once(model, stages, schedule):
    layers = albert() if model == "albert" else tiny_gpt(4)
    ref_losses, ref_params = reference(layers, STEPS, BATCH)
    results = run_distributed(_train, world_size=2, args=(model, stages, schedule), timeout_s=90)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=0)
        for key, value in res["params"].items():
            torch.testing.assert_close(
                value, ref_params[key], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}"
            )
