"""The `flops_profiler` section's profiled step counts the model's forward, as DeepSpeed's engine
profile does: the matmuls and their biases of every micro-batch, nothing of the training loop's
own forward-phase work (the optimizer's step, gradient clipping, ZeRO's gradient bookkeeping
after backward: a model this small fits in one bucket, so its gradients are copied into the
bucket then), at ZeRO stages 0, 1 and 3. Before, that work was counted as the forward of
"(outside modules)" and the step's forward total held the Adam step's FLOPs too.

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


def _profiled(rank: int, world_size: int, template: str) -> list[bool]:
    written = []
    for stage in (0, 1, 3):
        path = template.format(stage=stage, rank=rank)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH))
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": GAS,
                "gradient_clipping": 0.5,
                "zero_optimization": {"stage": stage},
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


def test_profiled_step_forward_is_the_models_forward_at_stages_0_1_3(tmp_path) -> None:
    template = str(tmp_path / "stage{stage}_rank{rank}.json")
    results = run_distributed(_profiled, world_size=2, args=(template,), timeout_s=120)
    assert results == [[True, True, True], [False, False, False]]  # global rank 0 profiles
    # per micro-batch and layer: 2·m·k·n for the matmul, m·n for its bias
    layers = [(WIDTH, HIDDEN), (HIDDEN, WIDTH)]
    forward = GAS * sum(2 * MICRO * k * n + MICRO * n for k, n in layers)
    for stage in (0, 1, 3):
        profile = json.loads(Path(template.format(stage=stage, rank=0)).read_text())
        assert profile["forward"]["flops"] == forward, stage
        assert profile["outside_modules"]["forward_flops"] == 0, stage
        assert profile["forward"]["macs"] == GAS * sum(MICRO * k * n for k, n in layers)
        assert profile["backward"]["flops"] > forward, stage  # the backward stays counted
