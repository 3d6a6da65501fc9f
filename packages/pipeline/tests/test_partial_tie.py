"""A tie that shares only some of a module's parameters (`TiedLayerSpec.tied_attrs`, DeepSpeed's
`tied_weight_attr`): the named ones are one parameter across the stages, the others stay each
stage copy's own. Two stages holding a Linear tied by its weight only must train exactly like one
process where the two Linears share their weight and keep separate biases (a whole-module tie
would sum the biases' gradients and keep them equal)."""

import dataclasses

import torch
from pipeline_testlib import VOCAB, WIDTH, Block, data, lm_loss, stage_params
from torch import nn

import minispeed.pipeline as pipeline
from minispeed.core.testing import run_distributed
from minispeed.pipeline import LayerSpec, TiedLayerSpec

STEPS, BATCH, LR = 5, 8, 0.05


def _layers() -> list:
    tie = dict(key="w", tied_attrs=("weight",))
    return [
        LayerSpec(nn.Embedding, (VOCAB, WIDTH)),
        TiedLayerSpec(nn.Linear, (WIDTH, WIDTH), **tie),  # stage 0
        LayerSpec(Block, (WIDTH,)),
        LayerSpec(Block, (WIDTH,)),
        TiedLayerSpec(nn.Linear, (WIDTH, WIDTH), **tie),  # stage 1
        LayerSpec(nn.Linear, (WIDTH, VOCAB)),
    ]


def _train(rank: int, world_size: int) -> dict:
    module = pipeline.partition(_layers(), stages=2, loss_fn=lm_loss, method="uniform", seed=0)
    ex = pipeline.PipelineExecutor(
        module, torch.optim.SGD(module.parameters(), lr=LR), micro_batches=2, schedule="1f1b"
    )
    losses = [ex.train_batch(x, y) for x, y in data(STEPS, BATCH)]
    return {"losses": losses, "params": stage_params(module)}


def _reference() -> tuple[list[float], nn.Linear, nn.Linear]:
    built = []
    for i, spec in enumerate(_layers()):
        torch.manual_seed(i if i != 4 else 1)  # a tied module is built under its first index
        built.append(spec.build())
    first, second = built[1], built[4]
    second.weight = first.weight  # one weight, two biases
    model = nn.Sequential(*built)
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # the shared weight is listed once
    losses = []
    for x, y in data(STEPS, BATCH):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, second


def test_a_tie_by_weight_shares_the_weight_and_keeps_each_copys_bias() -> None:
    ref_losses, first, second = _reference()
    assert not torch.equal(first.bias, second.bias)  # the case is one a full tie gets wrong
    results = run_distributed(_train, world_size=2)
    for res in results:
        torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(res["params"]["tied.w.weight"], first.weight.detach())
    torch.testing.assert_close(results[0]["params"]["tied.w.bias"], first.bias.detach())
    torch.testing.assert_close(results[1]["params"]["tied.w.bias"], second.bias.detach())


def _misnamed(rank: int, world_size: int) -> str:
    layers = _layers()
    for i in (1, 4):
        layers[i] = dataclasses.replace(layers[i], tied_attrs=("wieght",))
    try:
        pipeline.partition(layers, stages=2, loss_fn=lm_loss, method="uniform", seed=0)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_tied_attribute_the_module_lacks_is_named_on_every_rank() -> None:
    for msg in run_distributed(_misnamed, world_size=2):
        assert "'wieght'" in msg and "['weight', 'bias']" in msg, msg
