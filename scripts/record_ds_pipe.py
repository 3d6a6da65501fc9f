"""A two-stage DeepSpeed pipeline script, kept as the reference for minispeed's pipeline adapters.

Written against DeepSpeed's public API only: a tied embedding / output head (`TiedLayerSpec`
with a `forward_fn`), `LayerSpec` blocks with dropout, `seed_layers=True` (which also reseeds
before every layer's forward, so the dropout masks are DeepSpeed's to reproduce), an AdamW built by the script,
gradient clipping, `train_batch` with a data iterator, `eval_batch` (also with
`return_logits=True`, `compute_loss=False`, `reduce_output=None`, `bcast_loss=False` and
`num_micro_batches`). Recorded on DeepSpeed 0.19.8, 2 processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_pipe.py
```

which writes `tests/engine/fixtures/pipe_two_stage.json`. `tests/engine/test_pipe_engine_ds_script.py`
runs this same file with its two import lines changed to minispeed's and compares.
"""

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

VOCAB, DIM, SEQ, MICRO, GAS, STEPS = 32, 16, 8, 2, 4, 6
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    # above this model's gradient norms (4 to 8), so it does not clip: DeepSpeed 0.19.8's
    # pipeline clips every stage by the norm of stage 0's gradients alone, minispeed by the
    # whole model's (tests/engine/test_pipe_engine_clipping.py checks that one against PyTorch)
    "gradient_clipping": 10.0,
    "steps_per_print": 10**6,
}
# The micro-batches main() evaluates before training: seed_layers reseeds by the count of
# forwards so far, so a reference that replays the training needs it (5 evaluations of GAS
# micro-batches and one of 2).
FORWARDS_BEFORE_TRAINING = 5 * GAS + 2
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/pipe_two_stage.json"


class Block(nn.Module):
    """A pre-norm MLP block with a residual."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, h):
        return h + self.drop(self.down(F.gelu(self.up(self.norm(h)))))


def head(embedding, h):
    """The output projection: the input embedding's weight, transposed."""
    return h @ embedding.weight.t()


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def micro_batches(seed, count):
    """(tokens, next tokens) micro-batches from a fixed generator (not the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        yield x, (x * 3 + 1) % VOCAB


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    layers = [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        *[LayerSpec(Block, DIM) for _ in range(4)],
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head),
    ]
    model = PipelineModule(
        layers=layers,
        num_stages=2,
        loss_fn=lm_loss,
        seed_layers=True,
        base_seed=1234,
        # DeepSpeed 0.19.8 cannot seed layers after a 'parameters' or 'type:' cut: its
        # partition_balanced returns numpy ints and random.seed(numpy.int64) raises TypeError
        partition_method="uniform",
    )
    drawn_after_build = torch.rand(4).tolist()  # the global RNG as the build left it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)

    eval_data = list(micro_batches(1, GAS))
    # eval_batch's other forms, before training: DeepSpeed 0.19.8 raises on compute_loss=False
    # after a train_batch (its running total loss keeps the training loss's shape).
    forms = {
        "outputs_each": _summary(
            engine.eval_batch(iter(eval_data), compute_loss=False, reduce_output=None)
        ),
        "outputs_avg": _summary(engine.eval_batch(iter(eval_data), compute_loss=False)),
        "loss_last_stage_only": _summary(engine.eval_batch(iter(eval_data), bcast_loss=False)),
        "loss_two_micro_batches": _summary(engine.eval_batch(iter(eval_data), num_micro_batches=2)),
        "losses_each": _summary(
            engine.eval_batch(iter(eval_data), reduce_output=None, bcast_loss=False)
        ),
    }
    eval_before = float(engine.eval_batch(iter(eval_data)))
    train_iter = micro_batches(0, STEPS * GAS)
    losses = [float(engine.train_batch(train_iter)) for _ in range(STEPS)]
    eval_after, logits = engine.eval_batch(iter(eval_data), return_logits=True)
    return {
        "parts": [int(p) for p in model.parts],
        "drawn_after_build": drawn_after_build,
        "eval_before": eval_before,
        "losses": losses,
        "eval_after": float(eval_after),
        "global_steps": engine.global_steps,
        "first_stage": engine.is_first_stage(),
        "last_stage": engine.is_last_stage(),
        "logits_sum": None if logits is None else float(logits.double().sum()),
        "logits_shape": None if logits is None else list(logits.shape),
        "eval_forms": forms,
    }


def _summary(value):
    """An eval_batch result as JSON: None, a list, or a tensor's [shape, sum] (a one-element
    tensor's shape as "scalar": DeepSpeed broadcasts the loss as shape [1])."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value]
    shape = "scalar" if value.numel() == 1 else list(value.shape)
    return [shape, float(value.double().sum())]


def unseeded_build():
    """The same layers without seed_layers, cut by parameter count: every rank seeds torch alike,
    and the weights are whatever the global RNG gives in DeepSpeed's build order (its partition
    builds every layer once to count parameters, then the stage builds its own)."""
    torch.manual_seed(42)
    layers = [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        *[LayerSpec(Block, DIM) for _ in range(4)],
        LayerSpec(nn.LayerNorm, DIM),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head),
    ]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=lm_loss, seed_layers=False)
    return {
        "parts": [int(p) for p in model.parts],
        "param_sums": sorted(float(p.detach().double().sum()) for p in model.parameters()),
        "drawn_after_build": torch.rand(4).tolist(),
    }


PARTITION_CASES = [
    ([1, 1, 1, 1, 1, 1, 1], 2),
    ([1, 1, 1, 1, 1, 1, 1], 3),
    ([512, 816, 816, 816, 816, 32, 512], 2),
    ([512, 816, 816, 816, 816, 32, 512], 3),
    ([0, 1, 1, 0, 1, 1, 0, 1, 0], 2),
    ([0, 1, 1, 0, 1, 1, 0, 1, 0], 4),
    ([5, 1, 1, 1, 1, 9, 2, 2], 3),
    ([3, 3, 3], 3),
]


def record_partitions():
    """DeepSpeed's partition arithmetic on a few weight lists (no processes needed):
    `python scripts/record_ds_pipe.py --partitions` writes fixtures/pipe_partitions.json."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    cases = [
        {
            "weights": w,
            "parts": k,
            "balanced": [int(b) for b in partition_balanced(w, k)],
            "uniform": [int(b) for b in partition_uniform(len(w), k)],
        }
        for w, k in PARTITION_CASES
    ]
    out = FIXTURE.with_name("pipe_partitions.json")
    out.write_text(json.dumps({"deepspeed": deepspeed.__version__, "cases": cases}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import require_deepspeed

    require_deepspeed()  # refuses minispeed under DeepSpeed's name
if __name__ == "__main__" and "--partitions" in sys.argv:
    record_partitions()
elif __name__ == "__main__":
    result = main()
    result["unseeded"] = unseeded_build()
    rank = int(os.environ["RANK"])
    out = Path(os.environ.get("FIXTURE_OUT", FIXTURE))
    per_rank = out.with_suffix(f".rank{rank}.json")
    per_rank.write_text(json.dumps(result))
    torch.distributed.barrier()
    if rank == 0:
        ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
        out.write_text(json.dumps({"deepspeed": deepspeed.__version__, "ranks": ranks}, indent=1))
        for r in range(2):
            out.with_suffix(f".rank{r}.json").unlink()
