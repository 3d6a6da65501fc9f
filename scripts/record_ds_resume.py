"""A fine-tuning script that resumes: DeepSpeed's checkpoint API, kept as a reference.

Written against DeepSpeed's public API only, at ZeRO stage 2: the optimizer is a torch object
(`torch.optim.AdamW` over two param groups), the scheduler a callable
(`lr_scheduler=lambda opt: LambdaLR(opt, ...)`); 4 steps of 2 micro-batches, then
`save_checkpoint(dir, tag="epoch1", client_state={...})`; a fresh engine's
`load_checkpoint(dir)` returns `(path, client_state)` and trains on; another fresh engine loads
with `load_module_only=True` (weights only: its optimizer and scheduler start anew); and
`deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(dir)` gives the fp32
weights. It records the losses, learning rates, the returned path's last component, the client
state, the counters after each load, and the consolidated weights' names, shapes and sums.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_resume.py
```

which writes `tests/engine/fixtures/ds_resume.json`. `tests/engine/test_engine_ds_api_scripts.py`
runs this same file with its import lines changed to minispeed's and compares.
"""

import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn

IN, HIDDEN, OUT, BATCH, GAS = 10, 24, 3, 4, 2
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_resume.json"

CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "zero_optimization": {"stage": 2},
}


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.head(F.relu(self.body(x)))


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.stack([x[:, :3].sum(1), x[:, 3] * x[:, 4], x[:, 5:].mean(1)], dim=1)


def build():
    torch.manual_seed(11)
    model = Regressor()
    groups = [
        {"params": list(model.body.parameters()), "weight_decay": 0.05},
        {"params": list(model.head.parameters()), "weight_decay": 0.0, "lr": 2e-3},
    ]
    optimizer = torch.optim.AdamW(groups, lr=5e-3, betas=(0.9, 0.98))
    engine, _, _, sched = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: 1.0 / (1.0 + 0.5 * step)
        ),
        config=CONFIG,
    )
    return engine, sched


def train(engine, rank, first, steps):
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for micro in range(GAS):
            x, y = batch(rank, step, micro)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / GAS)
    return losses


def evaluate(engine, rank):
    engine.eval()
    with torch.no_grad():
        x, y = batch(rank, 99, 0)
        loss = F.mse_loss(engine(x), y).item()
    engine.train()
    return loss


def main(ckpt_root):
    rank = dist.get_rank() if dist.is_initialized() else 0
    engine, sched = build()
    record = {"scheduler_type": type(sched).__name__}
    record["losses"] = train(engine, rank, 0, 4)
    record["lr"] = engine.get_lr()
    record["eval_before"] = evaluate(engine, rank)
    engine.save_checkpoint(ckpt_root, tag="epoch1", client_state={"epoch": 1, "best": 0.25})
    record["after"] = train(engine, rank, 4, 2)

    resumed, _ = build()
    path, client = resumed.load_checkpoint(ckpt_root)
    record["load_path_tail"] = os.path.basename(os.path.normpath(path))
    record["client_state"] = {k: client[k] for k in ("epoch", "best")}
    record["resumed_global_steps"] = resumed.global_steps
    record["resumed_lr"] = resumed.get_lr()
    record["resumed_eval"] = evaluate(resumed, rank)
    record["resumed_after"] = train(resumed, rank, 4, 2)

    weights_only, _ = build()
    path, _ = weights_only.load_checkpoint(ckpt_root, tag="epoch1", load_module_only=True)
    record["module_only_global_steps"] = weights_only.global_steps
    record["module_only_lr"] = weights_only.get_lr()
    record["module_only_eval"] = evaluate(weights_only, rank)
    record["module_only_after"] = train(weights_only, rank, 4, 1)

    state = get_fp32_state_dict_from_zero_checkpoint(ckpt_root)
    record["fp32"] = {
        name: [list(t.shape), str(t.dtype), float(t.double().sum())] for name, t in state.items()
    }
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    root = Path(os.environ.get("CKPT_ROOT", "/tmp/record_ds_resume"))
    result = main(str(root))
    record(result, FIXTURE, scratch=root)
