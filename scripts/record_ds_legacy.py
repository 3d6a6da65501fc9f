"""Megatron-DeepSpeed's legacy engine sections, `progressive_layer_drop` and the legacy
`curriculum_learning` (`curriculum_type: "seqlen"`), as DeepSpeed 0.17.6's engine runs them:
what minispeed must reproduce.

DeepSpeed 0.19.8 removed both (it refuses the sections at every value), so this records on
DeepSpeed 0.17.6, in the venv `scripts/record_ds_compression.py`'s docstring describes:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /tmp/ds-old/venv17/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_legacy.py
```

which writes `tests/engine/fixtures/ds_legacy.json`. For each case, two gloo ranks train a tiny
GPT whose forward takes the keyword arguments 0.17.6's engine adds in training mode
(`progressive_layer_drop=True, pld_theta=...` and `curriculum_seqlen=...`): it scales each
layer's residual branch by `pld_theta` and truncates the sequences to `curriculum_seqlen`.
`STEPS` steps of 2 micro-batches (SGD, ZeRO stage 0, fp32); per micro-step it records the
keyword arguments the forward received and the loss, per step `engine.get_pld_theta()`, and
after training the arguments of one forward in eval mode (none). `tests/engine/test_legacy.py`
runs this file with its import line changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM, LAYERS, SEQ, MICRO, STEPS = 16, 8, 2, 16, 2, 5
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_legacy.json"


def seqlen(schedule_type, schedule_config):
    return {"curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": 16,
        "schedule_type": schedule_type, "schedule_config": schedule_config}}  # fmt: skip


CASES = {
    "pld": {"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.25}},
    "seqlen_fixed_linear": seqlen(
        "fixed_linear", {"total_curriculum_step": 6, "difficulty_step": 4}
    ),
    "seqlen_fixed_root": seqlen(
        "fixed_root", {"total_curriculum_step": 6, "difficulty_step": 4, "root_degree": 2}
    ),
    "seqlen_fixed_discrete": seqlen("fixed_discrete", {"difficulty": [4, 8, 16], "max_step": [3, 6]}),
}


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)
        self.seen = []  # the keyword arguments of each forward

    def forward(self, tokens, **kwargs):
        self.seen.append(dict(sorted(kwargs.items())))
        if kwargs.get("curriculum_seqlen") is not None:
            tokens = tokens[:, : kwargs["curriculum_seqlen"]]
        scale = kwargs["pld_theta"] if kwargs.get("progressive_layer_drop") else 1.0
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = x + scale * torch.tanh(layer(x))
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def run_case(rank, name):
    torch.manual_seed(0)
    model = Gpt()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 0}, "steps_per_print": 1000, **CASES[name]}  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    generator = torch.Generator().manual_seed(100 + rank)
    losses, thetas = [], [engine.get_pld_theta()]
    for _ in range(STEPS):
        for _ in range(2):
            tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        thetas.append(engine.get_pld_theta())
    seen = list(engine.module.seen)
    engine.eval()
    engine(torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator))
    return {"case": name, "losses": losses, "pld_theta": thetas, "forward_kwargs": seen,
            "eval_kwargs": engine.module.seen[-1]}  # fmt: skip


def main():
    rank = dist.get_rank()
    return [run_case(rank, name) for name in CASES]


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    record(main(), FIXTURE)
