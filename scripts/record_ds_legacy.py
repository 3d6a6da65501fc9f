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
(`progressive_layer_drop=True, pld_theta=...` and `curriculum_seqlen=...`; the custom schedule's
function is given to `engine.curriculum_scheduler_legacy`): it scales each
layer's residual branch by `pld_theta` and truncates the sequences to `curriculum_seqlen`.
`STEPS` steps of 2 micro-batches (SGD, ZeRO stage 0, fp32); per micro-step it records the
keyword arguments the forward received and the loss, per step `engine.get_pld_theta()`, and
after training the arguments of one forward in eval mode (none). Then `elasticity`:
`compute_elastic_config`'s answer for each of `ELASTIC_CASES` (the batch, the valid world sizes
and the micro-batch, or the error's type) and the engine's batch triple from an elastic section
at 2 ranks (and its errors for a world size outside the section and for batch keys beside it).
`tests/engine/test_legacy.py` runs this file with its import lines changed to minispeed's and
compares.
"""

import json
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.elasticity import compute_elastic_config
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
    "seqlen_fixed_discrete": seqlen(
        "fixed_discrete", {"difficulty": [4, 8, 16], "max_step": [3, 6]}
    ),
    "seqlen_custom": seqlen("custom", {}),
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
    if name == "seqlen_custom":  # the custom schedule's function, on the engine's scheduler
        engine.curriculum_scheduler_legacy.set_custom_get_difficulty(
            lambda step: 16 - 4 * (step % 3)
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


def elastic(**section):
    return {"elasticity": {"enabled": True, "max_train_batch_size": 2000,
                           "micro_batch_sizes": [2, 4, 6], **section}}  # fmt: skip


# (name, ds_config, compute_elastic_config's keyword arguments, the key an error names)
ELASTIC_CASES = [
    ("v01", elastic(version=0.1), {}, None),
    ("v01_range", elastic(version=0.1, min_gpus=2, max_gpus=16), {}, None),
    ("v01_smaller", elastic(version=0.1, prefer_larger_batch=False, max_gpus=64), {}, None),
    ("v01_world", elastic(version=0.1, max_train_batch_size=100, micro_batch_sizes=[3, 5]),
     {"world_size": 5}, None),
    ("v02_world", elastic(max_gpus=64), {"world_size": 8}, None),
    ("v02_outside", elastic(max_train_batch_size=50, min_gpus=1, max_gpus=4),
     {"world_size": 7}, None),
    ("v02_nodes", elastic(num_gpus_per_node=4, model_parallel_size=2, max_gpus=64),
     {"world_size": 16, "return_microbatch": True}, None),
    ("no_section", {"train_batch_size": 8}, {}, "elasticity"),
    ("disabled", {"elasticity": {"enabled": False}}, {}, "enabled"),
    ("no_max", {"elasticity": {"enabled": True, "micro_batch_sizes": [2]}}, {},
     "max_train_batch_size"),
    ("no_micro", {"elasticity": {"enabled": True, "max_train_batch_size": 8}}, {},
     "micro_batch_sizes"),
    ("micro_not_list", elastic(micro_batch_sizes=4), {}, "micro_batch_sizes"),
    ("micro_zero", elastic(micro_batch_sizes=[0, 2]), {}, "micro_batch_sizes"),
    ("micro_above_max", elastic(version=0.1, micro_batch_sizes=[4000]), {}, "micro_batch_sizes"),
    ("min_above_max", elastic(min_gpus=8, max_gpus=4), {}, "min_gpus"),
    ("mp_zero", elastic(model_parallel_size=0), {}, "model_parallel_size"),
    ("mp_v01", elastic(version=0.1, model_parallel_size=2), {}, "model_parallel_size"),
    ("gpn_not_mp", elastic(num_gpus_per_node=3, model_parallel_size=2), {"world_size": 6},
     "num_gpus_per_node"),
    ("min_time", elastic(min_time=-1), {}, "min_time"),
    ("version_03", elastic(version=0.3), {}, "version"),
    ("old_target", elastic(version=0.1), {"target_deepspeed_version": "0.3.0"},
     "target_deepspeed_version"),
    ("world_invalid", elastic(version=0.1, max_gpus=4), {"world_size": 7}, "max_gpus"),
]  # fmt: skip


def elastic_table():
    out = {}
    for name, ds_config, kwargs, _ in ELASTIC_CASES:
        kwargs = {"target_deepspeed_version": "0.17.6", **kwargs}
        try:
            answer = compute_elastic_config(ds_config, **kwargs)
            out[name] = json.loads(json.dumps(answer, default=int))  # numpy ints to plain
        except Exception as e:
            out[name] = {"error": type(e).__name__}
    return out


def elastic_engine():
    """The engine's batch triple from an elastic section at this world size, and the errors of
    a world size outside it and of batch keys beside it."""
    section = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3],
               "max_gpus": 4, "version": 0.1}  # fmt: skip
    base = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000}
    out = {}
    for name, config in {
        "adopted": {**base, "elasticity": section},
        "ignored_batch_keys": {**base, "train_batch_size": 8,
                               "elasticity": {**section, "ignore_non_elastic_batch_info": True}},
        "world_invalid": {**base, "elasticity": {**section, "min_gpus": 3}},
        "batch_keys": {**base, "train_batch_size": 8, "elasticity": section},
    }.items():  # fmt: skip
        model = nn.Linear(2, 2)
        try:
            engine, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
            out[name] = [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                         engine.gradient_accumulation_steps()]  # fmt: skip
            engine.destroy()
        except Exception as e:
            out[name] = {"error": type(e).__name__}
    return out


def main():
    rank = dist.get_rank()
    records = [run_case(rank, name) for name in CASES]
    return [*records, {"case": "elastic_table", "answers": elastic_table()},
            {"case": "elastic_engine", "answers": elastic_engine()}]  # fmt: skip


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    record(main(), FIXTURE)
