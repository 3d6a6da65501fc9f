"""The profiler's step-time model charges a gradient hook where minispeed.zero registers one: at
stages 0-2 only when the gradients span more than one bucket (a model within one bucket has its
`param.grad` collected once backward ends: Note [a model in one bucket has no gradient hooks] in
zero's reducer.py), at stage 3 always. Both read `core.gradient_buckets.hooks_each_gradient`;
this checks the model against the hooks the code really registers. Before, the model charged
one hook per parameter tensor at every size."""

from __future__ import annotations

import torch
from torch import nn

from minispeed.core.testing import run_distributed

A, T_HOOK = 2, 1e-5


def _hooks(rank: int, world_size: int) -> list[tuple[int, int, int]]:
    import minispeed.zero as zero
    from minispeed.profiler import Machine, predict_step

    machine = Machine({64: 1e9}, hook_s_per_grad=T_HOOK)
    rows = []
    for stage, bucket_numel in ((0, 10_000), (0, 100), (3, 10_000)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # 4 tensors, 144 elements
        cfg = zero.ZeroConfig(stage=stage, reduce_bucket_numel=bucket_numel)
        opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        # Hooks on the gradient path (zero's ZeroOptimizer marks a used parameter with a hook of
        # its own at some stages: a byte written, which the model does not price).
        hooked = sum(
            1 for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None)
        )
        opt.close()
        numel = sum(p.numel() for p in model.parameters())
        pred = predict_step(
            machine, flops_per_step=1.0, num_params=numel, num_tensors=4, stage=stage,
            world_size=world_size, micro_steps=A, bucket_numel=bucket_numel,
        )  # fmt: skip
        rows.append((stage, hooked, round(pred.hooks_s / (A * T_HOOK))))
    return rows


def test_the_model_charges_the_gradient_hooks_zero_registers() -> None:
    (rows,) = run_distributed(_hooks, world_size=1, timeout_s=60)
    # (stage, parameters zero hooks, hooks per micro-step the model charges)
    assert rows == [(0, 0, 0), (0, 4, 4), (3, 4, 4)]
