"""`minispeed.engine.checkpointing` (DeepSpeed's `deepspeed.checkpointing`): gradients equal plain
autograd's (dropout included: the RNG is replayed), kwargs travel, the ds_config section and the
arguments configure it, parameters get gradients when no input requires grad, and what is not
implemented is refused by name."""

import pytest
import torch
from torch import nn

import minispeed.engine.checkpointing as checkpointing


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, scale=1.0):
        return self.drop(torch.tanh(self.lin(x))) * scale


def _grads(use_checkpoint):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    run = checkpointing.checkpoint if use_checkpoint else (lambda f, *a, **k: f(*a, **k))
    out = run(block, x, scale=2.0)
    out.square().sum().backward()
    return out.detach(), x.grad, block.lin.weight.grad, torch.rand(3)


@pytest.mark.parametrize(
    "config",
    [None, {"activation_checkpointing": {"cpu_checkpointing": True}}],
    ids=["plain", "cpu"],
)
def test_checkpoint_equals_plain_autograd_with_dropout(config):
    checkpointing.configure(None, deepspeed_config=config)
    assert checkpointing.is_configured()
    for got, want in zip(_grads(True), _grads(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_parameters_get_gradients_when_no_input_requires_grad():
    checkpointing.configure(None)
    lin = nn.Linear(4, 4)
    checkpointing.checkpoint(lin, torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"profile": True}, "profile"),
        (
            {"deepspeed_config": {"activation_checkpointing": {"cpu_checkpoint": True}}},
            "cpu_checkpoint",
        ),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(kwargs, word):
    checkpointing.configure(None, contiguous_checkpointing=True)  # a layout: accepted
    with pytest.raises((NotImplementedError, ValueError), match=word):
        checkpointing.configure(None, **kwargs)
