"""replace_mlp turns every MLP into an MoE layer the model trains through; phases are named."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import minispeed.moe as moe


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    cfg = moe.MoEConfig(num_experts=4, top_k=2, z_loss_coef=0.001)
    return moe.replace_mlp(nn.Sequential(_Block(8), _Block(8)), cfg)


def test_replace_mlp_replaces_every_mlp_and_aux_loss_sums_the_layers():
    model = _model()
    layers = moe.moe_layers(model)
    assert len(layers) == 2 and all(isinstance(b.mlp, moe.MoE) for b in model)
    assert moe.groups_of(model) is layers[0].groups is layers[1].groups
    # Layers get different expert seeds, experts within a layer differ too.
    w = [layer.experts.local_experts[0][0].weight for layer in layers]
    assert not torch.equal(w[0], w[1])
    assert not torch.equal(w[0], layers[0].experts.local_experts[1][0].weight)
    x = torch.randn(3, 5, 8)
    out = model(x)
    assert out.shape == x.shape
    total = moe.aux_loss(model)
    want = sum(0.01 * m.last_routing.aux_loss + 0.001 * m.last_routing.z_loss for m in layers)
    torch.testing.assert_close(total, want)
    (out.square().mean() + total).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_layer_keeps_the_input_dtype_and_marks_its_phases():
    model = _model()
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = model.to(torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16  # the router runs in fp32, the rest in the model's dtype
    names = {e.name for e in prof.events()}
    assert {"moe.dispatch", "moe.experts", "moe.combine"} <= names


def _layer(**kw) -> moe.MoE:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    return moe.MoE(8, mlp, moe.MoEConfig(num_experts=4, top_k=2, z_loss_coef=0.01, **kw))


@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(shape, drop):
    # Used to fail in backward (the combine's weight gradient reshaped 0 elements with -1).
    layer = _layer(drop_tokens=drop)
    x = torch.randn(shape, requires_grad=True)
    out = layer(x)
    assert out.shape == shape
    (out.sum() + layer.loss).backward()
    assert layer.loss.item() == 0.0
    assert x.grad.shape == shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


@pytest.mark.parametrize("which", ["capacity_factor", "eval_capacity_factor"])
def test_an_infinite_capacity_factor_means_no_limit(which):
    # Used to pass validation and raise OverflowError (ceil of inf) in the forward.
    x = torch.randn(3, 10, 8)
    layer = _layer(**{which: math.inf}, min_capacity=0)
    if which == "eval_capacity_factor":
        layer.eval()
    unlimited = _layer(drop_tokens=False).train(layer.training)
    out = layer(x)
    r = layer.last_routing
    assert r.capacity == 30 and r.dropped_assignments == 0  # C = S: every assignment fits
    torch.testing.assert_close(out, unlimited(x))
