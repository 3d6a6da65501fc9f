"""A DeepSpeed MoE training script through `deepspeed.initialize`, kept as a reference.

Written against DeepSpeed's public API only: `deepspeed.moe.layer.MoE(ep_size=2, k=1,
drop_tokens=True, use_rts=False)` between two dense layers; the optimizer's groups from
`split_params_into_different_moe_groups_for_optimizer`, handed to `deepspeed.initialize` as
`model_parameters` with the optimizer (AdamW) built by name from the config; loss = task loss +
0.01 · l_aux; `engine.backward` / `engine.step` with 2 micro-batches per step, at ZeRO stages 0
and 2. After 5 steps it evaluates, saves a checkpoint, builds a fresh model and engine, loads the
checkpoint and evaluates again (DeepSpeed's evaluations before and after are equal), then trains
2 more steps from the loaded state. Last, 3 steps at stage 2 with `model.parameters()` as given,
not split: DeepSpeed splits them itself for the optimizer it builds from the config.

`gradient_clipping` is set to 0.0 (off) on purpose: DeepSpeed clips at 1.0 when the key is left
out, and with expert parallelism its norm is not the global norm of the gradients (stage 0
averages the ranks' local norms, stage 2 averages the expert groups' norms over their expert-data
group), so a clipped run would record that quirk rather than the training. minispeed clips by
the true global norm (tests/engine/test_engine_moe.py checks it against PyTorch).

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_moe_engine.py
```

which writes `tests/engine/fixtures/moe_engine_ep2.json`. `tests/engine/test_engine_moe.py` runs
this same file with its import lines changed to minispeed's and compares.
"""

import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

IN, DIM, CLASSES, EXPERTS, BATCH, SEQ = 8, 16, 5, 4, 4, 6
STEPS, MORE, GAS, STAGES = 5, 2, 2, (0, 2)
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/moe_engine_ep2.json"


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

    def forward(self, x, y):
        out, l_aux, _ = self.moe(torch.tanh(self.embed(x)))
        logits = self.head(out)
        return F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1)) + 0.01 * l_aux


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 5e-3, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
    }


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(BATCH, SEQ, IN, generator=g)
    return x, (x.sum(-1) > 0).long() + 2 * (x[..., 0] > 1).long()


def build(stage, split=True):
    torch.manual_seed(7)
    model = Net()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups if split else model.parameters(), config=config(stage)
    )
    return engine


def train(engine, rank, first, steps):
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for micro in range(GAS):
            loss = engine(*batch(rank, step, micro))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        losses.append(total / GAS)
    return losses


def evaluate(engine, rank):
    engine.eval()
    with torch.no_grad():
        loss = float(engine(*batch(rank, 999, 0)))
    engine.train()
    return loss


def main(ckpt_root):
    """Per stage: this rank's losses, evaluations around a save/load round trip, and the
    losses of training on from the loaded checkpoint."""
    runs = {}
    for stage in STAGES:
        engine = build(stage)
        rank = dist.get_rank()
        losses = train(engine, rank, 0, STEPS)
        eval_before = evaluate(engine, rank)
        ckpt = os.path.join(ckpt_root, f"stage{stage}")
        engine.save_checkpoint(ckpt, tag="t")
        resumed = build(stage)
        resumed.load_checkpoint(ckpt, tag="t")
        eval_loaded = evaluate(resumed, rank)
        runs[f"stage{stage}"] = {
            "losses": losses,
            "eval_before": eval_before,
            "eval_loaded": eval_loaded,
            "after_loaded": train(resumed, rank, STEPS, MORE),
        }
        del engine, resumed
    # The parameters as the model gives them, not split: DeepSpeed splits them itself for the
    # optimizer it builds from the config (dense, then the experts' group).
    engine = build(2, split=False)
    runs["unsplit_stage2"] = {
        "losses": train(engine, dist.get_rank(), 0, 3),
        "groups": [g["name"] for g in engine.optimizer.param_groups],
    }
    return runs


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    root = Path(os.environ.get("CKPT_ROOT", "/tmp/record_ds_moe_engine"))
    result = main(str(root))
    record(result, FIXTURE, scratch=root)
