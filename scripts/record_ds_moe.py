"""A DeepSpeed MoE script, kept as the reference for minispeed's MoE adapters.

Written against DeepSpeed's public API: `deepspeed.moe.layer.MoE(ep_size=2, k=1,
drop_tokens=True, use_rts=False)` between two dense layers, the optimizer's groups from
`split_params_into_different_moe_groups_for_optimizer`, loss = task loss + 0.01 · l_aux, and
the gradients reduced as DeepSpeed's engine reduces them at ZeRO stage 0 (dense parameters
averaged over the data-parallel world, expert parameters summed over their expert-data group
and divided by the data-parallel size), written out in plain torch. Recorded on DeepSpeed
0.19.8, 2 processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_moe.py
```

which writes `tests/engine/fixtures/moe_ep2_top1.json`. `tests/engine/test_adapters_moe_ds_script.py`
runs this same file with its import lines changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

IN, DIM, CLASSES, EXPERTS, BATCH, SEQ, STEPS = 8, 16, 5, 4, 4, 6, 8
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/moe_ep2_top1.json"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.moe = MoE(
            hidden_size=DIM,
            expert=expert,
            num_experts=EXPERTS,
            ep_size=2,
            k=1,
            min_capacity=2,
            drop_tokens=True,
            use_rts=False,
        )
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        out, l_aux, exp_counts = self.moe(torch.tanh(self.embed(x)))
        return self.head(out), l_aux, exp_counts


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, SEQ, IN, generator=g)
    return x, (x.sum(-1) > 0).long() + 2 * (x[..., 0] > 1).long()


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    model = Net()
    model.moe.set_deepspeed_parallelism()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params", "weight_decay": 0.01}
    )
    optimizer = torch.optim.AdamW(groups, lr=5e-3)
    losses, aux, counts = [], [], []
    for step in range(STEPS):
        x, y = batch(rank, step)
        logits, l_aux, exp_counts = model(x)
        loss = F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1)) + 0.01 * l_aux
        loss.backward()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not group.get("moe", False):  # dense: averaged over the world
                    dist.all_reduce(p.grad)
                # experts: their expert-data group is one rank when ep_size == world
                p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        aux.append(float(l_aux.detach()))
        counts.append([int(c) for c in exp_counts])
    model.eval()
    with torch.no_grad():
        x, y = batch(rank, 999)
        logits, _, _ = model(x)
        eval_loss = float(F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1)))
    # the same helper with small groups: experts split every 600 elements, as DeepSpeed splits
    small = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "small", "lr": 1e-3}], max_group_size=600
    )
    return {
        "small_groups": [
            {
                "name": g["name"],
                "moe": g.get("moe", False),
                "lr": g["lr"],
                "numel": [p.numel() for p in g["params"]],
            }
            for g in small
        ],
        "groups": [
            {
                "name": g["name"],
                "moe": g.get("moe", False),
                "shapes": [list(p.shape) for p in g["params"]],
            }
            for g in optimizer.param_groups
        ],
        "losses": losses,
        "l_aux": aux,
        "exp_counts": counts,
        "eval_loss": eval_loss,
    }


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    result = main()
    record(result, FIXTURE)
