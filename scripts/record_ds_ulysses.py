"""A Megatron-DeepSpeed-style GPT with DeepSpeed-Ulysses sequence parallelism, kept as a reference.

A tiny GPT whose self-attention runs in `deepspeed.sequence.layer.DistributedAttention`
(Megatron's layout: [s, b, h, d], `batch_dim_idx=1`), its groups from
`deepspeed.runtime.sequence_parallel.parallel_state_sp` passed as `mpu=` with
`sequence_parallel_size: 2` in the config: 2 ranks, one sequence group, each rank given its half
of every sequence (positions offset by its sequence rank) and taking the mean loss of its own
tokens, as Megatron does. SGD (so the size of the gradient shows in the weights), no clipping,
fp32, ZeRO stages 0 to 3; per stage it records the losses of 3 steps and every parameter's full
gradient at the first step (6 significant digits).

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_ulysses.py
```

which writes `tests/engine/fixtures/ds_ulysses.json`. `tests/engine/test_engine_ulysses.py` runs
this same file with its import lines changed to minispeed's and compares, and checks the model
against single-process PyTorch on the whole sequence.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
from deepspeed.sequence.layer import DistributedAttention
from deepspeed.utils import safe_get_full_grad
from torch import nn

VOCAB, SEQ, BATCH, HEADS, HEAD_DIM, STEPS = 32, 8, 2, 4, 4, 3
HIDDEN = HEADS * HEAD_DIM
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_ulysses.json"


class CoreAttention(nn.Module):
    """Causal softmax attention over [s, b, h, d]: the whole sequence, the heads it is given."""

    def forward(self, q, k, v):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)


class SelfAttention(nn.Module):
    def __init__(self, sp_group):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.core_attention = CoreAttention()
        self.dist_attn = None
        if sp_group is not None:
            self.dist_attn = DistributedAttention(self.core_attention, sp_group)

    def forward(self, x):  # [s, b, H]
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, HEADS, HEAD_DIM).unbind(2)
        if self.dist_attn is None:
            context = self.core_attention(q, k, v)
        else:
            context = self.dist_attn(q, k, v, 1)  # batch_dim_idx: Megatron's [s, b, ...]
        return self.dense(context.reshape(s, b, HIDDEN))


class GPT(nn.Module):
    def __init__(self, sp_group=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(SEQ, HIDDEN)
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attention = SelfAttention(sp_group)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, labels, first_position):
        """Per-token losses [b, s] of this rank's tokens, which start at `first_position`."""
        positions = torch.arange(first_position, first_position + tokens.shape[1])
        x = (self.embed(tokens) + self.position(positions)).transpose(0, 1)  # [s, b, H]
        x = x + self.attention(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        logits = self.head(x).transpose(0, 1)  # [b, s, V]
        return F.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
        ).view(labels.shape)


def data(step):
    """The whole batch of step `step`: inputs and next-token labels, [b, SEQ] each."""
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "sequence_parallel_size": 2,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def rounded(t):
    return [float(f"{v:.6g}") for v in t.detach().double().reshape(-1).tolist()]


def run(stage):
    sp_rank, sp_size = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()
    torch.manual_seed(3)
    model = GPT(mpu.get_sequence_parallel_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(stage), mpu=mpu
    )
    local = SEQ // sp_size
    mine = slice(sp_rank * local, (sp_rank + 1) * local)
    record = {"losses": [], "grads": {}}
    for step in range(STEPS):
        tokens, labels = data(step)
        loss = engine(tokens[:, mine], labels[:, mine], sp_rank * local).mean()
        engine.backward(loss)
        if step == 0:
            named = engine.module.named_parameters()
            record["grads"] = {n: rounded(safe_get_full_grad(p)) for n, p in named}
        engine.step()
        record["losses"].append(loss.item())
    engine.destroy()
    return record


def main():
    mpu.initialize_sequence_parallel(2)
    return {f"stage{stage}": run(stage) for stage in (0, 1, 2, 3)}


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = main()
    record(result, FIXTURE)
    dist.barrier()
