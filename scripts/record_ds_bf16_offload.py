"""A Hugging Face-style fine-tuning loop in bf16 with ZeRO-2 and CPU offload, kept as a reference.

Written against DeepSpeed's public API only: the model takes keyword arguments and returns a dict
with `loss` and `logits`, as a `transformers` model does; the config gives `train_batch_size` and
`train_micro_batch_size_per_gpu` only (accumulation is derived: 2), `bf16`, ZeRO-2 with
`offload_optimizer` on the CPU, `zero_force_ds_cpu_optimizer: false` with a torch AdamW object,
`WarmupCosineLR` by name and `gradient_clipping: 0.0` (off). Per boundary it records the loss,
`get_lr()` and `get_global_grad_norm()`; then the evaluation loss, and the names, dtypes and sums
of what `save_16bit_model` writes.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_bf16_offload.py
```

which writes `tests/engine/fixtures/ds_bf16_offload.json`.
`tests/engine/test_engine_ds_api_scripts.py` runs this same file with its import lines changed to
minispeed's and compares.
"""

import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, MICRO, STEPS = 32, 8, 16, 2, 4
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_bf16_offload.json"

CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_clipping": 0.0,
    "steps_per_print": 1000,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
    },
    "zero_force_ds_cpu_optimizer": False,
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_min_ratio": 0.1},
    },
}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = torch.tanh(self.mix(self.embed(input_ids)))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.lm_head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
        return out


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 + 100 * rank + 10 * step + micro)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    mask = torch.ones(MICRO, SEQ, dtype=torch.long)
    mask[:, -2:] = 0
    return {"input_ids": ids[:, :-1], "attention_mask": mask, "labels": ids[:, 1:]}


def main(out_dir):
    rank = dist.get_rank()
    torch.manual_seed(21)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=CONFIG
    )
    record = {
        "gas": engine.gradient_accumulation_steps(),
        "scheduler": type(scheduler).__name__,
        "lr_at_start": engine.get_lr(),
        "steps": [],
    }
    for step in range(STEPS):
        losses = []
        for micro in range(engine.gradient_accumulation_steps()):
            outputs = engine(**batch(rank, step, micro))
            engine.backward(outputs["loss"])
            engine.step()
            losses.append(outputs["loss"].item())
        norm = engine.get_global_grad_norm()
        record["steps"].append(
            {
                "loss": sum(losses) / len(losses),
                "lr": engine.get_lr(),
                "grad_norm": None if norm is None else float(norm),
                "logits_dtype": str(outputs["logits"].dtype),
            }
        )
    engine.eval()
    with torch.no_grad():
        record["eval_loss"] = engine(**batch(rank, 99, 0))["loss"].item()
    engine.save_16bit_model(out_dir, "model.bin")
    dist.barrier()
    state = torch.load(os.path.join(out_dir, "model.bin"), map_location="cpu")
    record["saved"] = {k: [str(v.dtype), float(v.double().sum())] for k, v in state.items()}
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    root = Path(os.environ.get("CKPT_ROOT", "/tmp/record_ds_bf16_offload"))
    result = main(str(root))
    record(result, FIXTURE, scratch=root)
