"""The `flops_profiler` section's profiled step counts the model's forward and backward, as
DeepSpeed's engine profile counts the forward: the matmuls and their biases of every
micro-batch, and their gradients, nothing of the training loop's own work, at ZeRO stages 0, 1
and 3. Not the optimizer's step, gradient clipping, or ZeRO's gradient bookkeeping: after
backward when the gradients fit in one bucket (they are copied into the bucket then), in a hook
on each gradient when they span several (copied and scaled by 1/N there: Ψ FLOPs per micro-step,
counted as the modules' backward before), as at stage 3; nor the caller's loss and its backward.
Before, that work was counted as the forward of "(outside modules)", the step's forward total
held the Adam step's FLOPs, and the backward ZeRO's averaging and the loss's backward.

DeepSpeed reports no measured backward: its profile prints 2 × the forward for it.

The pipeline's case is tests/engine/test_pipe_engine_observers.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import minispeed.engine as deepspeed
from minispeed.core.testing import run_distributed

WIDTH, HIDDEN, MICRO, GAS = 8, 16, 2, 2


# (ZeRO stage, reduce_bucket_size): None is zero's default, one bucket for this model; 100
# elements cut its 280 into three, so stages 0 and 1 hook each gradient (stage 3 always does).
CASES = ((0, None), (0, 100), (1, None), (1, 100), (3, None))


def _profiled(rank: int, world_size: int, template: str) -> list[bool]:
    written = []
    for stage, bucket in CASES:
        path = template.format(stage=stage, bucket=bucket, rank=rank)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH))
        zero = {"stage": stage} | ({} if bucket is None else {"reduce_bucket_size": bucket})
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": GAS,
                "gradient_clipping": 0.5,
                "zero_optimization": zero,
                "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": path},
            },
        )
        g = torch.Generator().manual_seed(rank)
        for _ in range(2 * GAS):  # steps 0 and 1
            x, y = torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)
            loss = (engine(x) - y).pow(2).mean()  # the caller's loss: outside the model
            engine.backward(loss)
            engine.step()
        engine.destroy()
        written.append(Path(path).exists())
    return written


def test_profiled_step_is_the_models_forward_and_backward_at_stages_0_1_3(tmp_path) -> None:
    template = str(tmp_path / "stage{stage}_bucket{bucket}_rank{rank}.json")
    results = run_distributed(_profiled, world_size=2, args=(template,), timeout_s=180)
    assert results == [[True] * len(CASES), [False] * len(CASES)]  # global rank 0 profiles
    # per micro-batch and layer (m·k input, k -> n): 2·m·k·n for the matmul, m·n for its bias;
    # backward: the weight's gradient 2·m·k·n, the bias's m·n (a sum over the batch), and the
    # input's 2·m·k·n except the first layer's (x needs no gradient)
    layers = [(WIDTH, HIDDEN), (HIDDEN, WIDTH)]
    m = MICRO
    forward = GAS * sum(2 * m * k * n + m * n for k, n in layers)
    backward = GAS * sum(2 * m * k * n + m * n + (2 * m * k * n if i else 0)
                         for i, (k, n) in enumerate(layers))  # fmt: skip
    for stage, bucket in CASES:
        profile = json.loads(Path(template.format(stage=stage, bucket=bucket, rank=0)).read_text())
        assert profile["forward"]["flops"] == forward, (stage, bucket)
        assert profile["outside_modules"]["forward_flops"] == 0, (stage, bucket)
        assert profile["forward"]["macs"] == GAS * sum(m * k * n for k, n in layers)
        assert profile["backward"]["flops"] == backward, (stage, bucket)
        assert profile["outside_modules"]["backward_flops"] == 0, (stage, bucket)
