"""`minispeed.engine.checkpointing` (DeepSpeed's `deepspeed.checkpointing`): gradients equal plain
autograd's (dropout included: the RNG is replayed), kwargs travel, the ds_config section and the
arguments configure it, parameters get gradients when no input requires grad, and what is not
implemented is refused by name."""

import logging

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


def test_checkpoint_function_collects_every_output_and_returns_the_tensors():
    """DeepSpeed's `CheckpointFunction.apply(function, all_outputs, *args)`: `all_outputs` gets
    every output, non-tensors too; gradients equal plain autograd's, dropout included."""
    checkpointing.configure(None)

    def run(use_function):
        torch.manual_seed(0)
        block = Block()
        x = torch.randn(4, 8, requires_grad=True)
        torch.manual_seed(1)
        if use_function:
            outputs = []
            returned = checkpointing.CheckpointFunction.apply(
                lambda t: (block(t), "tag"), outputs, x
            )
            assert outputs[1] == "tag" and returned[0] is outputs[0]
            out = outputs[0]
        else:
            out = block(x)
        out.square().sum().backward()
        return x.grad, block.lin.weight.grad

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_module_flags_answer_the_settings():
    """The module-level names Megatron-era code reads, on both DeepSpeed paths."""
    from minispeed.engine.runtime.activation_checkpointing import checkpointing as long_path

    checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
    try:
        for module in (checkpointing, long_path):
            assert module.PARTITION_ACTIVATIONS and module.CPU_CHECKPOINT
            assert module.mp_size == 1 and module.deepspeed_checkpointing_enabled
            assert module._CUDA_RNG_STATE_TRACKER is module.get_cuda_rng_tracker()
            assert module._MODEL_PARALLEL_RNG_TRACKER_NAME == "model-parallel-rng"
        checkpointing.partition_activations_in_checkpoint(False)
        assert not long_path.PARTITION_ACTIVATIONS and long_path.CPU_CHECKPOINT
    finally:
        checkpointing.configure(None)


@pytest.mark.parametrize("via", ["checkpoint", "CheckpointFunction"])
def test_profile_logs_the_forward_and_the_recomputation(via):
    """`profile` (Megatron-DeepSpeed's `--profile-backward`): one timing line per checkpointed
    forward and one per recomputation, on both forms."""
    from minispeed.core.logging import get_logger

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}})
    try:
        assert checkpointing.PROFILE_TIME
        x = torch.randn(2, 8, requires_grad=True)
        if via == "checkpoint":
            out = checkpointing.checkpoint(Block(), x)
        else:
            out = checkpointing.CheckpointFunction.apply(Block(), [], x)
        out.sum().backward()
    finally:
        get_logger().removeHandler(handler)
        checkpointing.configure(None)
    lines = [r.getMessage() for r in records]
    assert [line.split(":")[0] for line in lines] == [
        "activation checkpointing forward",
        "activation checkpointing recomputation",
    ]
    assert all(line.endswith(" ms") for line in lines)
