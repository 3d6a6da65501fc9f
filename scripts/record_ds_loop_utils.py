"""A loop over DeepSpeed's helpers, kept as a reference: `deepspeed.runtime.lr_schedules.WarmupLR`
built by the script on its own torch optimizer and passed to `initialize` as an object;
`deepspeed.utils.RepeatingLoader` around a short DataLoader (it wraps mid-run) and
`deepspeed.utils.log_dist`; ZeRO stage 0 (plain data parallelism), 5 steps. It records per
step the loss, `engine.get_lr()` and the scheduler's `get_last_lr()`, and the batches seen.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_loop_utils.py
```

which writes `tests/engine/fixtures/ds_loop_utils.json`.
`tests/engine/test_engine_ds_api_scripts.py` runs this same file with its import lines changed to
minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.lr_schedules import WarmupLR
from deepspeed.utils import RepeatingLoader, log_dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_loop_utils.json"
CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000}


def main():
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 5, generator=g)
    data = TensorDataset(x, x @ torch.linspace(-1, 1, 5) + 0.1)
    loader = RepeatingLoader(DataLoader(data, batch_size=2, shuffle=False))
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = WarmupLR(optimizer, warmup_max_lr=0.01, warmup_num_steps=3, warmup_type="linear")
    engine, _, _, returned = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=CONFIG
    )
    record = {"scheduler_returned": returned is scheduler, "steps": []}
    for step, (xb, yb) in zip(range(5), loader):
        loss = F.mse_loss(engine(xb).squeeze(-1), yb)
        engine.backward(loss)
        engine.step()
        log_dist(f"step {step} loss {loss.item():.4f}", ranks=[0])
        record["steps"].append(
            {
                "loss": loss.item(),
                "lr": engine.get_lr(),
                "last_lr": scheduler.get_last_lr(),
                "first_x": xb[0, 0].item(),
            }
        )
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = main()
    record(result, FIXTURE)
