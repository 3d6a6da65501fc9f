"""DeepSpeed MoE layers beyond top-1 through the engine, kept as a reference: top-2 with a
residual MLP (PR-MoE) and no token dropping, top-2 dropping past a capacity factor, top-3
dropping (DeepSpeed's `topkgating`). Each: 6 micro-steps with accumulation 2, loss = task loss
+ 0.01 · l_aux, an AdamW over `split_params_into_different_moe_groups_for_optimizer`'s groups,
then one forward in eval mode (`eval_capacity_factor`; top-2 samples its second choice there
too). Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU (ep_size 2):

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_moe_variants.py
```

which writes `tests/engine/fixtures/ds_moe_variants.json`;
`tests/engine/test_engine_moe.py` runs this file with its import lines changed.
"""

import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_moe_variants.json"
CASES = {  # name: (k, use_residual, drop_tokens)
    "top2_residual_no_drop": (2, True, False),
    "top2_drop": (2, False, True),
    "top3_drop": (3, False, True),
}


class Net(nn.Module):
    def __init__(self, k, residual, drop):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        expert = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.moe = MoE(
            hidden_size=16, expert=expert, num_experts=4, ep_size=2, k=k, capacity_factor=1.25,
            eval_capacity_factor=2.0, min_capacity=2, drop_tokens=drop, use_residual=residual,
            use_rts=False,
        )  # fmt: skip
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        out, l_aux, _ = self.moe(torch.tanh(self.embed(x)))
        return self.head(out), l_aux


def run(k, residual, drop):
    torch.manual_seed(0)
    net = Net(k, residual, drop)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "p"}
    )
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=config
    )
    losses = []
    for step in range(6):
        g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
        x = torch.randn(4, 6, 8, generator=g)
        logits, l_aux = engine(x)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, 5), (x.sum(-1) > 0).long().reshape(-1)
        )
        loss = loss + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        evaluated = engine(torch.ones(4, 6, 8))[0].double().sum().item()
    return {"losses": losses, "eval_sum": evaluated}


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    return {name: run(*case) for name, case in CASES.items()}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record  # refuses minispeed under DeepSpeed's name

    record(main(), FIXTURE)
