"""A DeepSpeedExamples-style training script (the cifar/bing_bert shape), kept as a reference.

Written against DeepSpeed's public API only: `deepspeed.add_config_arguments(parser)` with
`--deepspeed_config ds.json` and `--local_rank`; `deepspeed.init_distributed()`;
`deepspeed.comm` (`get_rank`, `get_world_size`, `all_reduce`, `barrier`, `all_gather_object`);
`initialize(args=..., training_data=..., collate_fn=...)` returning the distributed dataloader;
`model_parameters` as two param-group dicts with different weight decay; AdamW and
WarmupDecayLR by name from the config file; 2 micro-batches per step with `engine.backward` /
`engine.step` each micro-step and the model called with keyword arguments. Per boundary it
records the loss, `get_lr()`, `get_global_grad_norm()`, `was_step_applied()` and
`global_steps`; once, the engine's sizes, ranks, device, its config queries (`fp16_enabled()`,
`zero_optimization()`, `gradient_clipping()`, `get_mom()`, ...), the loader's length and what
`save_fp16_model` writes.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_classic.py
```

which writes `tests/engine/fixtures/ds_classic.json`. `tests/engine/test_engine_ds_api_scripts.py`
runs this same file with its import lines changed to minispeed's and compares.
"""

import argparse
import json
import os
import tempfile
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed import comm as dist
from torch import nn
from torch.utils.data import Dataset

IN, HIDDEN, CLASSES, SAMPLES, EPOCHS = 12, 32, 4, 40, 2
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_classic.json"

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "steps_per_print": 1000,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 2,
            "total_num_steps": 12,
            "warmup_type": "linear",
        },
    },
    "zero_optimization": {"stage": 1},
}


class Samples(Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(IN, generator=g)
        return x, int(x[:3].sum() > 0) + 2 * int(x[3] > 0.5)


def collate(items):
    """A dict batch, as Hugging Face collators return."""
    return {
        "features": torch.stack([x for x, _ in items]),
        "labels": torch.tensor([y for _, y in items]),
    }


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, features, labels=None):
        logits = self.fc2(self.norm(F.gelu(self.fc1(features))))
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


def param_groups(model):
    """Weight decay on the matrices only, as most fine-tuning scripts group them."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def main(argv=None):
    parser = argparse.ArgumentParser(description="classifier")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "ds_config.json")
        Path(config_path).write_text(json.dumps(DS_CONFIG))
        args = parser.parse_args((argv or []) + ["--deepspeed", "--deepspeed_config", config_path])
        deepspeed.init_distributed()
        torch.manual_seed(3)
        model = Classifier()
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            args=args,
            model=model,
            model_parameters=param_groups(model),
            training_data=Samples(),
            collate_fn=collate,
        )
    first = next(iter(loader))
    record = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "engine_local_rank": engine.local_rank,
        "engine_global_rank": engine.global_rank,
        "engine_world_size": engine.world_size,
        "device": str(engine.device),
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(),
        "stage": engine.zero_optimization_stage(),
        "zero_optimization": engine.zero_optimization(),
        "fp16_enabled": engine.fp16_enabled(),
        "bf16_enabled": engine.bfloat16_enabled(),
        "gradient_clipping": engine.gradient_clipping(),
        "wall_clock_breakdown": engine.wall_clock_breakdown(),
        "dp_world_size": engine.dp_world_size,
        "mom": [list(m) for m in engine.get_mom()],
        "loader_len": len(loader),
        "first_batch": {k: list(v.shape) for k, v in first.items()},
        "first_labels": first["labels"].tolist(),
        "scheduler_is_none": scheduler is None,
        "optimizer_is_none": optimizer is None,
        "lr_at_start": engine.get_lr(),
        "steps": [],
    }
    engine.train()
    losses = []
    for epoch in range(EPOCHS):
        for batch in loader:
            loss = engine(**batch)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            losses.append(loss.item())
            if boundary:
                record["steps"].append(
                    {
                        "epoch": epoch,
                        "loss": sum(losses) / len(losses),
                        "lr": engine.get_lr(),
                        "grad_norm": float(engine.get_global_grad_norm()),
                        "applied": engine.was_step_applied(),
                        "global_steps": engine.global_steps,
                        "global_samples": engine.global_samples,
                    }
                )
                losses = []
    engine.eval()
    with torch.no_grad():
        logits = engine(torch.ones(2, IN))
    record["eval_logits_shape"] = list(logits.shape)
    with tempfile.TemporaryDirectory() as tmp:
        dist.barrier()  # every rank's directory exists before rank 0 writes into its own
        engine.save_fp16_model(tmp, "model.bin")
        saved = os.path.join(tmp, "model.bin")
        record["fp16_model_keys"] = sorted(torch.load(saved)) if os.path.exists(saved) else None
        dist.barrier()
    total = torch.tensor([record["steps"][-1]["loss"]])
    dist.all_reduce(total)
    record["loss_sum_over_ranks"] = total.item()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record["steps"][0]["loss"])
    record["first_losses_gathered"] = gathered
    dist.barrier()
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    result = main()
    record(result, FIXTURE)
