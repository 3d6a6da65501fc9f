"""DeepSpeed's `safe_get_full_*` / `safe_set_full_*` on a ZeRO-1/2/3 engine, kept as a reference.

A script that inspects and edits sharded training state through `deepspeed.utils`: after the
backward that ends each accumulation window (2 micro-batches) and before `step`, every
parameter's `safe_get_full_grad`; after the step, `safe_get_full_fp32_param` and
`safe_get_full_optimizer_state` ("exp_avg", "exp_avg_sq"). Then `safe_set_full_fp32_param`
halves the head's weight and `safe_set_full_optimizer_state` zeroes its "exp_avg", and both are
read back. fp32, AdamW, clipping 1.0, 2 ranks with different data; per stage (1, 2, 3) it records
the losses and, rounded to 6 significant digits, every value read. (What the next step does
with a value set differs: DeepSpeed's model sees it only after that step, minispeed's at once;
tests/engine/test_engine_full_values.py checks minispeed's against plain PyTorch.)

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_full_values.py
```

which writes `tests/engine/fixtures/ds_full_values.json`. `tests/engine/test_engine_ds_api_scripts.py`
runs this same file with its import lines changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from torch import nn

IN, DIM, CLASSES, MICRO, STEPS = 5, 8, 3, 4, 2
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_full_values.json"


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def batch(rank, micro):
    g = torch.Generator().manual_seed(100 * rank + micro)
    x = torch.randn(MICRO, IN, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def rounded(t):
    return [float(f"{v:.6g}") for v in t.detach().double().reshape(-1).tolist()]


def run(stage):
    rank = dist.get_rank()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(IN, DIM), nn.Tanh(), nn.Linear(DIM, CLASSES))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(stage)
    )
    named = list(engine.module.named_parameters())
    record = {"losses": [], "grads": [], "params": [], "exp_avg": [], "exp_avg_sq": []}
    for step in range(STEPS):
        for m in range(2):
            x, y = batch(rank, 2 * step + m)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            if m == 1:  # the window's last backward: the reduced gradients exist until step()
                record["grads"].append({n: rounded(safe_get_full_grad(p)) for n, p in named})
            engine.step()
            record["losses"].append(loss.item())
        record["params"].append({n: rounded(safe_get_full_fp32_param(p)) for n, p in named})
        for key in ("exp_avg", "exp_avg_sq"):
            record[key].append(
                {n: rounded(safe_get_full_optimizer_state(p, key)) for n, p in named}
            )
    head = engine.module[2].weight
    safe_set_full_fp32_param(head, safe_get_full_fp32_param(head) * 0.5)
    safe_set_full_optimizer_state(head, torch.zeros(CLASSES, DIM), "exp_avg")
    record["head_after_set"] = rounded(safe_get_full_fp32_param(head))
    record["head_exp_avg_after_set"] = rounded(safe_get_full_optimizer_state(head, "exp_avg"))
    engine.destroy()
    return record


def main():
    return {f"stage{stage}": run(stage) for stage in (1, 2, 3)}


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = main()
    record(result, FIXTURE)
