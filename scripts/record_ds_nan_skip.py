"""A NaN in one rank's gradients at one step: what DeepSpeed does, per ZeRO stage and dtype.

Two processes train a tiny model for 4 steps with AdamW and a WarmupLR scheduler; at step 2
rank 1's loss is multiplied by NaN, so every gradient on that rank is NaN. For each case
(stage 0-3, fp32 and bf16; bf16 at stage 2 also with `bf16.check_grad_overflow: false`) it
records per step the loss, `get_global_grad_norm()`, `was_step_applied()` and `get_lr()`, then
`skipped_steps`, `global_steps`, the optimizer's `overflow`, and each parameter's sum (NaN is
written as the string "nan").

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_nan_skip.py
```

which writes `tests/engine/fixtures/ds_nan_skip.json`. `tests/engine/test_engine_nan_skip.py`
runs this same file with its import line changed to minispeed's and compares.
"""

import math
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

DIM, STEPS, BAD_STEP, BAD_RANK = 8, 4, 2, 1
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_nan_skip.json"

CASES = [
    (stage, dtype, check)
    for stage in (0, 1, 2, 3)
    for dtype, check in (("fp32", None), ("bf16", None))
] + [(2, "bf16", False)]


def config(stage, dtype, check):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
    }
    if dtype == "bf16":
        cfg["bf16"] = (
            {"enabled": True} if check is None else {"enabled": True, "check_grad_overflow": check}
        )
    return cfg


def finite(x):
    return x if x is None or math.isfinite(x) else str(x)


def run_case(rank, stage, dtype, check):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(stage, dtype, check)
    )
    record = {"case": [stage, dtype, check], "steps": []}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(2, DIM, generator=g).to(engine.module[0].weight.dtype)
        loss = engine(x).float().pow(2).mean()
        if step == BAD_STEP and rank == BAD_RANK:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        record["steps"].append(
            {
                "loss": finite(loss.item()),
                "grad_norm": None if norm is None else finite(float(norm)),
                "applied": engine.was_step_applied(),
                "lr": engine.get_lr(),
            }
        )
    record["skipped_steps"] = engine.skipped_steps
    record["global_steps"] = engine.global_steps
    record["overflow"] = bool(getattr(engine.optimizer, "overflow", False))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        record["params"] = [
            finite(float(p.detach().double().sum())) for p in engine.module.parameters()
        ]
    engine.destroy()
    return record


def main():
    rank = dist.get_rank()
    return [run_case(rank, *case) for case in CASES]


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    record(main(), FIXTURE)
