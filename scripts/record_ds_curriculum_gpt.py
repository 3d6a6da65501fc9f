"""Sequence-length curriculum the way a DeepSpeed 0.19.8 script has to write it, kept as a
reference: DeepSpeed 0.19.8 refuses the legacy `curriculum_learning` section (the engine no
longer passes `curriculum_seqlen=` itself), so the loop asks
`deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler` for each step's
difficulty and passes it to the model, a tiny Megatron-style GPT whose forward truncates the
batch to `curriculum_seqlen`. ZeRO stage 1, 2 micro-batches per step, 6 steps; per step it
records the sequence length and the loss. `pipeline()` is Megatron-DeepSpeed's pipeline form
of the same curriculum: the loop truncates each micro-batch before `train_batch` and calls
`engine.reset_activation_shape()` whenever the length changes (the stages exchange activations
of a new shape), on a 2-stage `PipelineModule`.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_curriculum_gpt.py
```

which writes `tests/engine/fixtures/ds_curriculum_gpt.json`. `tests/engine/test_curriculum.py`
runs this same file with its import lines changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from torch import nn

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_curriculum_gpt.json"
VOCAB, WIDTH, SEQ, MICRO, STEPS = 32, 16, 16, 2, 6
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1000,
}
CURRICULUM = {
    "min_difficulty": 4,
    "max_difficulty": SEQ,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4},
}


class TinyGPT(nn.Module):
    """Embedding, one causal self-attention block, a head; `curriculum_seqlen` keeps the first
    tokens of every sequence (Megatron-DeepSpeed's GPT does the same)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, labels, curriculum_seqlen=None):
        if curriculum_seqlen is not None and curriculum_seqlen < tokens.shape[1]:
            tokens, labels = tokens[:, :curriculum_seqlen], labels[:, :curriculum_seqlen]
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]  # (B, t, C)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = h + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def main():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyGPT()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )
    scheduler = CurriculumScheduler(CURRICULUM)
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.randint(0, VOCAB, (STEPS * 2, MICRO, SEQ + 1), generator=g)
    record = []
    for step in range(STEPS):
        seqlen = scheduler.update_difficulty(engine.global_steps + 1)
        losses = []
        for micro in data[2 * step : 2 * step + 2]:
            loss = engine(micro[:, :-1], micro[:, 1:], curriculum_seqlen=seqlen)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        record.append({"seqlen": seqlen, "losses": losses, "global_steps": engine.global_steps})
    return {"steps": record, "state": scheduler.state}


class Block(nn.Module):
    """A pre-norm MLP block with a residual (a pipeline stage's layer)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def pipeline():
    torch.manual_seed(0)
    layers = [LayerSpec(nn.Embedding, VOCAB, WIDTH), LayerSpec(Block), LayerSpec(Block),
              LayerSpec(nn.Linear, WIDTH, VOCAB)]  # fmt: skip
    model = PipelineModule(
        layers, num_stages=2, loss_fn=lm_loss, partition_method="uniform", seed_layers=True,
        base_seed=1234,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {k: v for k, v in CONFIG.items() if k not in ("optimizer", "zero_optimization")}
    # Clipping off: DeepSpeed 0.19.8's pipeline clips every stage by stage 0's gradient norm,
    # minispeed by the whole model's (docs/engine/migration.md), and the default clips at 1.0.
    config["gradient_clipping"] = 0.0
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    scheduler = CurriculumScheduler(CURRICULUM)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (STEPS * 2, MICRO, SEQ + 1), generator=g)
    record, current = [], None
    for step in range(STEPS):
        seqlen = scheduler.update_difficulty(engine.global_steps + 1)
        if seqlen != current:  # the activations between stages change shape
            engine.reset_activation_shape()
            current = seqlen
        micro = [(m[:, :seqlen], m[:, 1 : seqlen + 1]) for m in data[2 * step : 2 * step + 2]]
        loss = engine.train_batch(iter(micro))
        record.append({"seqlen": seqlen, "loss": float(loss)})
    return {"steps": record, "stage": engine.stage_id}


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = {"zero1": main(), "pipeline": pipeline()}
    record(result, FIXTURE)
