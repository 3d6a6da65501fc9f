"""`fp16.auto_cast`: the engine casts the floating-point tensors among `forward`'s positional
arguments to fp16, as DeepSpeed's engine does, and leaves keyword arguments and integer tensors
as given; a pipeline casts its first stage's inputs (DeepSpeed's pipeline runs them through
the engine's forward). accelerate writes the key whenever `mixed_precision="fp16"` meets a config without an
`fp16` section (the `accelerate config` path, compared with DeepSpeed in test_compat_clients.py);
minispeed refused it before."""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch
from torch import nn

import minispeed.engine as deepspeed
from minispeed.core.testing import run_distributed

Pair = namedtuple("Pair", "x scale")


class Probe(nn.Module):
    """Records the dtypes it is called with; computes in fp16 like the engine's fp16 model."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.seen: list = []

    def forward(self, pair, extras, ids, *, side):
        self.seen.append((pair.x.dtype, pair.scale.dtype, extras["w"].dtype, ids.dtype, side.dtype))
        assert isinstance(pair, Pair) and isinstance(extras, dict)
        return (self.linear(pair.x) * pair.scale).float().square().mean()


def _config(auto_cast: bool | None) -> dict:
    fp16 = {"enabled": True, "initial_scale_power": 8}
    if auto_cast is not None:
        fp16["auto_cast"] = auto_cast
    return {"train_micro_batch_size_per_gpu": 2, "fp16": fp16, "steps_per_print": 10**9}


def _run(rank: int, world_size: int, auto_cast: bool | None) -> list:
    torch.manual_seed(0)
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config(auto_cast))
    pair = Pair(torch.randn(2, 4), torch.tensor(2.0))
    args = (pair, {"w": torch.ones(2)}, torch.arange(2))
    if auto_cast:
        loss = engine(*args, side=torch.zeros(2))
        engine.backward(loss)
        engine.step()
        assert engine.fp16_auto_cast() is True
        assert pair.x.dtype == torch.float32  # the caller's tensors are not changed in place
    else:
        with pytest.raises(RuntimeError, match="dtype"):  # fp32 input into the fp16 model
            engine(*args, side=torch.zeros(2))
        assert engine.fp16_auto_cast() is False
    return model.seen


def test_auto_cast_casts_floating_positional_inputs_only() -> None:
    seen = run_distributed(_run, world_size=1, args=(True,), timeout_s=120)[0]
    half, f32 = torch.float16, torch.float32
    assert seen == [(half, half, half, torch.int64, f32)]


@pytest.mark.parametrize("auto_cast", [None, False])
def test_without_auto_cast_the_inputs_pass_as_given(auto_cast) -> None:
    seen = run_distributed(_run, world_size=1, args=(auto_cast,), timeout_s=120)[0]
    assert seen == [(torch.float32, torch.float32, torch.float32, torch.int64, torch.float32)]


def _pipeline_run(rank: int, world_size: int, auto_cast: bool) -> list:
    import minispeed.engine.pipe as pipe
    from minispeed.engine.pipe_engine import PipelineEngine

    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)]
    model = pipe.PipelineModule(
        layers, num_stages=2, loss_fn=lambda out, y: (out.float() - y).square().mean()
    )
    config = {**_config(auto_cast), "gradient_accumulation_steps": 2}
    engine = PipelineEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(4)]
    if not auto_cast:  # fp32 inputs into the fp16 first stage; the other stage stops with it
        with pytest.raises(RuntimeError, match=r"dtype|stage 0 .* failed in forward"):
            engine.train_batch(iter(data))
        return []
    return [float(engine.train_batch(iter(data[:2]))), float(engine.train_batch(iter(data[2:])))]


def test_a_pipeline_casts_the_first_stages_inputs() -> None:
    """DeepSpeed's pipeline runs each micro-batch's inputs through the engine's forward, which
    casts them under `auto_cast`; the labels reach the loss as given (fp32 here)."""
    for losses in run_distributed(_pipeline_run, world_size=2, args=(True,), timeout_s=120):
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
        assert losses[1] < losses[0]
    run_distributed(_pipeline_run, world_size=2, args=(False,), timeout_s=120)
