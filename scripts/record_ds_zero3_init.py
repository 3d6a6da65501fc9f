"""A ZeRO-3 script that builds its model inside `deepspeed.zero.Init`, kept as a reference.

Written against DeepSpeed's public API only: the model is built under
`deepspeed.zero.Init(config_dict_or_path=config)` (each rank holds a shard of every parameter);
rank 0 edits the head's parameters inside `deepspeed.zero.GatheredParameters(...,
modifier_rank=0)` (the edit reaches every rank); the blocks run through
`deepspeed.checkpointing.checkpoint` after `deepspeed.checkpointing.configure(None,
deepspeed_config=config)`; the optimizer is a callable of the parameters
(`optimizer=lambda params: torch.optim.SGD(params, ...)`); `gradient_clipping` is left out
(DeepSpeed's default, 1.0). It records per step the loss, `get_global_grad_norm()` and
`get_lr()`, and, gathered, each parameter's sum and sum of squares after the edit and after
training.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_zero3_init.py
```

which writes `tests/engine/fixtures/ds_zero3_init.json`. `tests/engine/test_engine_ds_api_scripts.py`
runs this same file with its import lines changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IN, DIM, CLASSES, BATCH, STEPS = 6, 16, 3, 4, 5
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_zero3_init.json"

CONFIG = {
    "train_batch_size": 2 * BATCH,
    "steps_per_print": 1000,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = deepspeed.checkpointing.checkpoint(block, h)
        return F.cross_entropy(self.head(h), y)


def batch(rank, step):
    g = torch.Generator().manual_seed(50 * rank + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def sums(model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {
            n: [float(p.detach().double().sum()), float(p.detach().double().square().sum())]
            for n, p in model.named_parameters()
        }


def main():
    rank = dist.get_rank()
    torch.manual_seed(5)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = Net()
    with deepspeed.zero.GatheredParameters(list(model.head.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.head.bias.zero_()
                model.head.weight.mul_(0.5)
    deepspeed.checkpointing.configure(None, deepspeed_config=CONFIG)
    record = {"after_edit": sums(model)}
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        config=CONFIG,
    )
    record["module_is_model"] = engine.module is model
    record["stage"] = engine.zero_optimization_stage()
    record["gas"] = engine.gradient_accumulation_steps()
    record["steps"] = []
    for step in range(STEPS):
        loss = engine(*batch(rank, step))
        engine.backward(loss)
        engine.step()
        record["steps"].append(
            {
                "loss": loss.item(),
                "grad_norm": float(engine.get_global_grad_norm()),
                "lr": engine.get_lr(),
                "global_steps": engine.global_steps,
            }
        )
    record["after_training"] = sums(engine.module)
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = main()
    record(result, FIXTURE)
