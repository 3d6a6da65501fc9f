"""A DeepSpeed training script, written against DeepSpeed's public API only.

It runs under DeepSpeed (`USE_DEEPSPEED=1`, to record reference losses) or under minispeed: the
import below is the only line that differs. Launch with 2 processes:

    python -m torch.distributed.run --nproc_per_node 2 tests/engine/scripts/ds_gpt.py \
        --stages 0,1,2,3 --out /tmp/out

What it does per ZeRO stage: build a small GPT from seed 0; `initialize` with the optimizer
(AdamW) and scheduler (WarmupLR) from the config, gradient accumulation 2 and clipping 1.0;
train 6 steps; evaluate; save a checkpoint; train 3 more steps; then build a fresh model and
engine, load the checkpoint, evaluate (must equal the evaluation before saving) and train the
same 3 steps (must equal the uninterrupted run). Rank r writes `<out>/stage<S>_rank<r>.json`.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

if os.environ.get("USE_DEEPSPEED") == "1":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
    from ds_fixture import require_deepspeed

    require_deepspeed()  # refuses minispeed under DeepSpeed's name
    import deepspeed
else:
    import minispeed.engine as deepspeed

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 3e-3,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.01,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage},
    }


def batch(step, micro, rank, world):
    """Rank `rank`'s micro-batch `micro` of global step `step`: a fixed function of the indices."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    idx = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train(engine, steps, first, rank, world):
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, rank, world)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / engine.gradient_accumulation_steps())
    return losses


def evaluate(engine, rank):
    engine.eval()
    with torch.no_grad():
        x, y = batch(99, 0, rank, 0)
        loss = engine(x, y).item()
    engine.train()
    return loss


def build(stage):
    torch.manual_seed(0)
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(stage)
    )
    return engine


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    for stage in [int(s) for s in args.stages.split(",")]:
        engine = build(stage)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        losses = train(engine, 6, 0, rank, world)
        eval_before = evaluate(engine, rank)
        ckpt = os.path.join(args.out, f"ckpt_stage{stage}")
        engine.save_checkpoint(ckpt, client_state={"note": "hello", "step": 6})
        after = train(engine, 3, 6, rank, world)
        lr_after = engine.get_lr()
        resumed = build(stage)
        _path, client = resumed.load_checkpoint(ckpt)
        eval_loaded = evaluate(resumed, rank)
        after_loaded = train(resumed, 3, 6, rank, world)
        record = {
            "losses": losses,
            "eval_before": eval_before,
            "after": after,
            "eval_loaded": eval_loaded,
            "after_loaded": after_loaded,
            "client_state": {k: client[k] for k in ("note", "step")},
            "global_steps": resumed.global_steps,
            "lr_after": lr_after,
            "lr_after_loaded": resumed.get_lr(),
        }
        with open(os.path.join(args.out, f"stage{stage}_rank{rank}.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
