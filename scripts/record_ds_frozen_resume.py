"""Adapters on a frozen base (a LoRA written in plain torch), checkpointed without the frozen
weights and resumed, kept as a reference.

What the Trainer does with a PEFT model under DeepSpeed: `save_checkpoint(dir,
exclude_frozen_parameters=True)` keeps only the trainable adapters (and their optimizer state),
and the resumed run loads with `load_module_strict=False`, the frozen base coming from the model
as built. At ZeRO 2 and 3: 3 steps, save, 3 more (the uninterrupted losses), then a fresh engine
loads and trains the same 3; also whether `load_module_strict=True` refuses the tag, and the
keys `get_fp32_state_dict_from_zero_checkpoint(..., exclude_frozen_parameters=True)` gives.
Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_frozen_resume.py
```

which writes `tests/engine/fixtures/ds_frozen_resume.json`;
`tests/engine/test_engine_ds_api_scripts.py` runs this file with its import lines changed.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn

DIM, RANK, BATCH = 16, 2, 4
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_frozen_resume.json"


class LoraLinear(nn.Module):
    """A frozen linear plus a trainable low-rank update, `W x + B A x`."""

    def __init__(self, dim):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(dim, RANK))

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


def build(stage):
    torch.manual_seed(3)
    model = nn.Sequential(LoraLinear(DIM), nn.GELU(), LoraLinear(DIM))
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}},
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    return engine


def train(engine, first, count):
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        x = torch.randn(BATCH, DIM, generator=g)
        loss = (engine(x) - x.flip(1)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def run(stage, root):
    engine = build(stage)
    train(engine, 0, 3)
    engine.save_checkpoint(root, tag="t", exclude_frozen_parameters=True)
    uninterrupted = train(engine, 3, 3)
    strict = build(stage)
    try:
        strict.load_checkpoint(root, tag="t")
        strict_refused = False
    except Exception:  # DeepSpeed: the missing frozen keys; minispeed: names the argument
        strict_refused = True
    resumed = build(stage)
    resumed.load_checkpoint(root, tag="t", load_module_strict=False)
    fp32 = get_fp32_state_dict_from_zero_checkpoint(root, tag="t", exclude_frozen_parameters=True)
    return {
        "uninterrupted": uninterrupted,
        "resumed": train(resumed, 3, 3),
        "strict_refused": strict_refused,
        "fp32_keys": sorted(fp32),
    }


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for stage in (2, 3):
        root = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(root)
        out[f"stage{stage}"] = run(stage, root[0])
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root[0])
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record  # refuses minispeed under DeepSpeed's name

    record(main(), FIXTURE)
