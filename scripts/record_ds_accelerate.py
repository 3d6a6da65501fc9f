"""Accelerate's own training loop on DeepSpeed, kept as a reference (2 processes, CPU).

Written against accelerate's public API only: `Accelerator` with a DeepSpeed plugin whose
config holds the optimizer and the scheduler (so the script passes accelerate's `DummyOptim`
and `DummyScheduler`), `accelerator.prepare(model, optimizer, loader, scheduler)` (the batch
size comes from the loader: `"auto"` in the config), and the usual loop: `accumulate`,
`backward`, `clip_grad_norm_` (which returns DeepSpeed's global norm), `optimizer.step()`,
`scheduler.step()`, `zero_grad()`, then `accelerator.save_state` / `load_state` into a fresh
`Accelerator` which trains on. It records per optimizer step the loss, learning rate and
gradient norm at ZeRO-2 and ZeRO-3, and the resumed run's steps.

Two ways to start it, the same script:

- the plugin in code: `DeepSpeedPlugin(hf_ds_config=...)`, launched with torchrun;
- `accelerate launch --config_file scripts/accelerate_deepspeed.yaml scripts/record_ds_accelerate.py`
  (accelerate's launcher exports the plugin's settings, here `scripts/accelerate_ds_config.json`:
  this script's ZeRO-2 config; `Accelerator()` takes them for the ZeRO-2 run, and the ZeRO-3
  run passes its plugin in code as before).

On a CPU-only host accelerate leaves the process-group backend unset and counts one process;
the script starts accelerate's state with `backend="gloo"` first (the one CPU-specific line).

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_accelerate.py
```

which writes `tests/engine/fixtures/ds_accelerate.json`. `tests/engine/test_compat_accelerate.py`
runs this same file, unchanged, on minispeed through `packages/deepspeed_compat`, both ways.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
from torch import nn

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_accelerate.json"
IN, HIDDEN, BATCH, GAS, STEPS, SAVE_AT = 8, 32, 4, 2, 4, 2


def ds_config(stage):
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-3, "warmup_num_steps": 2},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def loader():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2 * BATCH * GAS * STEPS, IN, generator=g)
    y = x[:, :3].sum(1, keepdim=True) - x[:, 3:4]
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def prepared(stage):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    if stage is None:  # `accelerate launch --config_file`: the plugin from its environment
        accelerator = Accelerator()
    else:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(stage)))
    net = model()
    optimizer = DummyOptim(net.parameters())
    scheduler = DummyScheduler(optimizer)
    return accelerator, *accelerator.prepare(net, optimizer, loader(), scheduler)


def train(accelerator, net, optimizer, batches, scheduler, steps, skip=0):
    rows = []
    for i, (x, y) in enumerate(batches):
        if i < skip * GAS:
            continue
        with accelerator.accumulate(net):
            loss = nn.functional.mse_loss(net(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            lr = scheduler.get_last_lr()[0]
            rows.append({"loss": loss.item(), "lr": lr, "grad_norm": float(norm)})
            if len(rows) + skip == steps:
                break
    return rows


def one_run(stage, scratch):
    accelerator, net, optimizer, batches, scheduler = prepared(stage)
    name = f"z{accelerator.state.deepspeed_plugin.zero_stage}"
    steps = train(accelerator, net, optimizer, batches, scheduler, SAVE_AT)
    accelerator.save_state(str(scratch / name))
    steps += train(accelerator, net, optimizer, batches, scheduler, STEPS, skip=SAVE_AT)
    resumed_acc, net, optimizer, batches, scheduler = prepared(stage)
    resumed_acc.load_state(str(scratch / name))
    resumed = train(resumed_acc, net, optimizer, batches, scheduler, STEPS, skip=SAVE_AT)
    return name, {"steps": steps, "resumed_steps": resumed}


def main(scratch):
    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # the docstring's note: accelerate on a CPU-only host
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    # Launched by `accelerate launch`, ZeRO-2 comes from its config (accelerate_ds_config.json:
    # the same settings), ZeRO-3 from the plugin in code either way.
    return dict(one_run(stage, scratch) for stage in ([None, 3] if launched else [2, 3]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("ACCELERATE_SCRATCH", tempfile.gettempdir())) / "ds_accel_run"
    record(main(scratch), FIXTURE, scratch=scratch)
