"""The profiler's step-time model charges a gradient hook where minispeed.zero registers one: at
stages 0-2 only when the gradients span more than one bucket (a model within one bucket has its
`param.grad` collected once backward ends: Note [a model in one bucket has no gradient hooks] in
zero's reducer.py), at stage 3 always. Both read `core.gradient_buckets.hooks_each_gradient`;
this checks the model against the hooks the code really registers, every hook on the gradient
path at stages 0-2: the reducer's, and no marker of the optimizer's own (Note [the reducer marks
the used parameters]; before, stages 1 and 2 hooked every gradient with one, unpriced, even
within one bucket). Before that, the model charged one hook per parameter tensor at every size.
"""

from __future__ import annotations

import torch
from torch import nn

from minispeed.core.testing import run_distributed

A, T_HOOK = 2, 1e-5


def _hooks(rank: int, world_size: int) -> list[tuple[int, int, int, int]]:
    import minispeed.zero as zero
    from minispeed.profiler import Machine, predict_step

    machine = Machine({64: 1e9}, hook_s_per_grad=T_HOOK)
    rows = []
    for stage, bucket_numel in ((0, 10_000), (0, 100), (1, 10_000), (1, 100), (2, 10_000),
                                (2, 100), (3, 10_000)):  # fmt: skip
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # 4 tensors, 144 elements
        cfg = zero.ZeroConfig(stage=stage, reduce_bucket_numel=bucket_numel)
        opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        hooks = [
            len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) for p in model.parameters()
        ]
        opt.close()
        numel = sum(p.numel() for p in model.parameters())
        pred = predict_step(
            machine, flops_per_step=1.0, num_params=numel, num_tensors=4, stage=stage,
            world_size=world_size, micro_steps=A, bucket_numel=bucket_numel,
        )  # fmt: skip
        charged = round(pred.hooks_s / (A * T_HOOK))
        rows.append((stage, sum(1 for h in hooks if h), sum(hooks), charged))
    return rows


def test_the_model_charges_the_gradient_hooks_zero_registers() -> None:
    (rows,) = run_distributed(_hooks, world_size=1, timeout_s=60)
    # (stage, parameters hooked, hooks on them, hooks per micro-step the model charges); stage
    # 3 also marks a used parameter with the optimizer's own hook (a byte written, unpriced)
    assert rows == [(0, 0, 0, 0), (0, 4, 4, 4), (1, 0, 0, 0), (1, 4, 4, 4), (2, 0, 0, 0),
                    (2, 4, 4, 4), (3, 4, 8, 4)]  # fmt: skip


def _default_bucket(rank: int, world_size: int) -> tuple[int, int, int, int]:
    import minispeed.zero as zero
    from minispeed.profiler import Machine, perf_model, predict_step

    machine = Machine({64: 1e9}, hook_s_per_grad=T_HOOK)
    model = nn.Linear(800, 800)  # 640,800 elements: over 500,000, within zero's 6,553,600
    numel = sum(p.numel() for p in model.parameters())
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1))  # zero's defaults
    hooked = sum(1 for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None))
    opt.close()
    pred = predict_step(
        machine, flops_per_step=1.0, num_params=numel, num_tensors=2, stage=0,
        world_size=world_size, micro_steps=A,
    )  # fmt: skip
    planned = zero.ZeroConfig().bucket_numel(4)
    return planned, perf_model.default_bucket_numel(4), hooked, round(pred.hooks_s / T_HOOK)


def test_with_no_bucket_given_the_model_uses_zeros_default_plan() -> None:
    """`predict_step` without `bucket_numel` prices zero's own default buckets (5e8 elements
    capped at 25 MiB: 6,553,600 fp32), by the rule zero plans them with
    (`core.gradient_buckets.planned_bucket_numel`). Before, it assumed 500,000 elements and
    charged hooks zero does not register for a model between the two."""
    ((planned, modelled, hooked, charged),) = run_distributed(
        _default_bucket, world_size=1, timeout_s=60
    )
    assert planned == modelled == 6_553_600
    assert hooked == charged == 0
