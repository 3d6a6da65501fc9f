"""ZB-H1 is exact when one stage uses a parameter in more than one layer: a block repeated
ALBERT-style (one `TiedLayerSpec` key used by several layers of each stage, and across stages),
and a one-stage pipeline holding both ends of a tied embedding and head. Before the fix each
layer's weight pass ran autograd back through the earlier uses of the same parameter, counting
them again (0.3–0.8 relative error), while GPipe and 1F1B were exact."""

import pytest
import torch
from pipeline_testlib import (
    VOCAB,
    WIDTH,
    albert,
    data,
    lm_loss,
    reference,
    tiny_gpt,
    train_pipeline,
)

import minispeed.pipeline as pp
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


class AddBiasInPlace(torch.nn.Module):
    """Writes into its input: fine for 1F1B (add's backward needs neither operand), but ZB-H1's
    cut makes the input a leaf, which autograd refuses to modify."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return x.add_(self.bias)


def _in_place(rank, world_size, schedule):
    layers = [pp.LayerSpec(torch.nn.Embedding, (VOCAB, WIDTH)),
              pp.LayerSpec(AddBiasInPlace, (WIDTH,)),
              pp.LayerSpec(torch.nn.Linear, (WIDTH, VOCAB))]  # fmt: skip
    module = pp.partition(layers, stages=1, loss_fn=lm_loss)
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1),
                             micro_batches=2, schedule=schedule)  # fmt: skip
    try:
        return ex.train_batch(*data(1, 4)[0])
    except RuntimeError as exc:
        return str(exc)


def test_a_layer_writing_into_its_input_is_named_under_zb_h1():
    (text,) = run_distributed(_in_place, world_size=1, args=("zb_h1",), timeout_s=60)
    assert "layer 1 (AddBiasInPlace) writes into its input in place" in text
    assert "schedule='1f1b'" in text
    (loss,) = run_distributed(_in_place, world_size=1, args=("1f1b",), timeout_s=60)
    assert isinstance(loss, float)
