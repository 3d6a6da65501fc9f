"""A Megatron-DeepSpeed-style GPT with DeepSpeed-Ulysses sequence parallelism, kept as a reference.

A tiny GPT whose self-attention runs in `deepspeed.sequence.layer.DistributedAttention`
(Megatron's layout: [s, b, h, d], `batch_dim_idx=1`), its groups from
`deepspeed.runtime.sequence_parallel.parallel_state_sp` passed as `mpu=` with
`sequence_parallel_size: 2` in the config: 2 ranks, one sequence group, each rank given its half
of every sequence (positions offset by its sequence rank) and taking the mean loss of its own
tokens, as Megatron does. SGD (so the size of the gradient shows in the weights), ZeRO stages 0
to 3. Per stage, 3 steps of each case, recording each micro-batch's loss, each step's
`get_global_grad_norm()` and, at the first step, every parameter's full gradient in 4 numbers
(sum, norm, first and last element, 6 significant digits):

- `stage<n>`: fp32, no clipping; `clip-stage<n>`: `gradient_clipping: 0.05` (every step
  clipped); `gas2-stage<n>`: 2 micro-batches per step, clipped; `bf16-stage<n>`: bf16, clipped
  (DeepSpeed refuses fp16 on the CPU: "Type fp16 is not supported on your device");
- `resume-stage<n>`: momentum SGD, 4 steps straight, and 2 steps, `save_checkpoint`, a fresh
  engine from other weights, `load_checkpoint`, 2 steps: both runs' losses;
- at stage 0, uneven heads: `heads3` (3 heads over 2 ranks), `heads6-kv3` (grouped-query, 6
  query over 3 key/value heads), and `kv1-refused` (1 key/value head for 2 ranks: refused).

Stage 3 runs last: DeepSpeed's ZeRO-3 replaces `torch.nn.functional.linear` for the rest of the
process, which changes bf16 results of later runs at other stages.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_ulysses.py
```

which writes `tests/engine/fixtures/ds_ulysses.json`. `tests/engine/test_engine_ulysses.py` runs
this same file with its import lines changed to minispeed's and compares, and checks the model
against single-process PyTorch on the whole sequence.
"""

import shutil
import tempfile
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
    """Causal softmax attention over [s, b, h, d]: the whole sequence, the heads it is given
    (grouped-query when k and v have fewer heads than q)."""

    def forward(self, q, k, v):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)


class SelfAttention(nn.Module):
    def __init__(self, sp_group, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.qkv = nn.Linear(HIDDEN, (heads + 2 * kv_heads) * HEAD_DIM)
        self.dense = nn.Linear(heads * HEAD_DIM, HIDDEN)
        self.core_attention = CoreAttention()
        self.dist_attn = None
        if sp_group is not None:
            self.dist_attn = DistributedAttention(self.core_attention, sp_group)

    def forward(self, x):  # [s, b, H]
        s, b, _ = x.shape
        sizes = (self.heads, self.kv_heads, self.kv_heads)
        q, k, v = self.qkv(x).view(s, b, -1, HEAD_DIM).split(sizes, dim=2)
        if self.dist_attn is None:
            context = self.core_attention(q, k, v)
        else:
            context = self.dist_attn(q, k, v, 1)  # batch_dim_idx: Megatron's [s, b, ...]
        return self.dense(context.reshape(s, b, -1))


class GPT(nn.Module):
    def __init__(self, sp_group=None, heads=HEADS, kv_heads=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(SEQ, HIDDEN)
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attention = SelfAttention(sp_group, heads, kv_heads or heads)
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
            logits.reshape(-1, VOCAB).float(), labels.reshape(-1), reduction="none"
        ).view(labels.shape)


def data(step):
    """The whole batch of step `step`: inputs and next-token labels, [b, SEQ] each."""
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def config(stage, clip=0.0, gas=1, dtype=None, sequence=2):
    ds = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "sequence_parallel_size": sequence,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    return ds


def summary(t):
    """A gradient in 4 numbers (6 significant digits): its sum, its norm, its first 2 elements."""
    flat = t.detach().double().reshape(-1)
    picked = [flat.sum(), flat.norm(), flat[0], flat[-1]]
    return [float(f"{float(v):.6g}") for v in picked]


def engine_for(stage, *, heads=HEADS, kv_heads=None, momentum=0.0, **options):
    torch.manual_seed(3)
    model = GPT(mpu.get_sequence_parallel_group(), heads, kv_heads)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(stage, **options), mpu=mpu
    )
    return engine


def train(engine, steps, first=0, record=None):
    """`steps` optimizer steps of `gas` micro-batches each (micro-batch i reads `data(i)`), each
    rank its half of every sequence, the mean loss of its own tokens. Appends each micro-batch's
    loss and each step's global gradient norm to `record`; at the first step's last backward records every
    gradient's `summary`."""
    sp_rank, sp_size = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()
    local = SEQ // sp_size
    mine = slice(sp_rank * local, (sp_rank + 1) * local)
    record = record if record is not None else {"losses": [], "norms": [], "grads": {}}
    gas = engine.gradient_accumulation_steps()
    for micro in range(first * gas, (first + steps) * gas):
        tokens, labels = data(micro)
        loss = engine(tokens[:, mine], labels[:, mine], sp_rank * local).mean()
        engine.backward(loss)
        if micro == gas - 1:  # the first step's gradients, accumulated
            named = engine.module.named_parameters()
            record["grads"] = {n: summary(safe_get_full_grad(p)) for n, p in named}
        engine.step()
        record["losses"].append(loss.item())
        if (micro + 1) % gas == 0:
            norm = engine.get_global_grad_norm()
            record["norms"].append(None if norm is None else float(norm))
    return record


def run(stage, **options):
    engine = engine_for(stage, **options)
    record = train(engine, STEPS)
    engine.destroy()
    return record


def resumed(stage, folder):
    """4 steps (momentum SGD) straight through, and 2 steps, `save_checkpoint`, a fresh engine
    (other initial weights) that `load_checkpoint`s and runs the last 2: the losses of both."""
    straight = train(engine_for(stage, momentum=0.9), 4)["losses"]
    first = engine_for(stage, momentum=0.9)
    record = train(first, 2)
    first.save_checkpoint(folder, tag=f"stage{stage}")
    first.destroy()
    torch.manual_seed(4)
    second = engine_for(stage, momentum=0.9)
    second.load_checkpoint(folder, tag=f"stage{stage}")
    train(second, 2, first=2, record=record)
    second.destroy()
    return {"straight": straight, "resumed": record["losses"]}


def refused(**options):
    """Whether building the engine and one step fails (DeepSpeed asserts)."""
    try:
        run(0, **options)
    except (AssertionError, ValueError):  # DeepSpeed asserts, minispeed raises ValueError
        return True
    return False


def main():
    mpu.initialize_sequence_parallel(2)
    folder = [tempfile.mkdtemp(prefix="ds_ulysses_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    # uneven heads: 3 heads over 2 ranks, and grouped-query 6 heads over 3 key/value heads
    result = {
        "heads3": run(0, heads=3),
        "heads6-kv3": run(0, heads=6, kv_heads=3),
        "kv1-refused": refused(kv_heads=1),
    }
    # stage 3 last: DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear for the rest of the
    # process (matmul, then the bias added: another rounding in bf16)
    for stage in (0, 1, 2, 3):
        result[f"stage{stage}"] = run(stage)
        result[f"clip-stage{stage}"] = run(stage, clip=0.05)
        result[f"gas2-stage{stage}"] = run(stage, gas=2, clip=0.05)
        result[f"bf16-stage{stage}"] = run(stage, dtype="bf16", clip=0.05)
        result[f"resume-stage{stage}"] = resumed(stage, folder[0])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    return result


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = main()
    record(result, FIXTURE)
    dist.barrier()
