"""Fine-tune a 125M-parameter LLaMA-architecture model with Hugging Face's Trainer on minispeed:
ZeRO-3 with the optimizer and the parameters offloaded to the CPU, 2 processes, no GPU.

```bash
pip install packages/deepspeed_compat     # the `deepspeed` the Trainer looks for (minispeed)
python -m torch.distributed.run --nproc_per_node 2 examples/hf_trainer_zero3.py
python -m torch.distributed.run --nproc_per_node 2 examples/hf_trainer_zero3.py \
    --deepspeed examples/hf_zero3_offload_template.json
```

Without `--deepspeed` the script hands the Trainer its own ds_config (ZeRO-3, offload to the
CPU, everything the Trainer knows `"auto"`); with it, the file's (the template that fixes most
out-of-memory errors: docs/tutorials/hf-trainer.md explains each key). The model is built from
a config with random weights (no download) after the `TrainingArguments`, so under ZeRO-3 each
rank holds only its shard from the start (`zero.Init`, driven by `HfDeepSpeedConfig`). The data
is synthetic counting sequences, which a few steps already learn.

After training, each rank prints the model-state bytes it held inside the second accumulation
window (parameters, gradient shards and optimizer state all present), measured on the engine's
optimizer (`minispeed.zero.memory.measure`), against minispeed's formula for this stage and
these dtypes (`minispeed.zero.memory.predict`) and against `minispeed estimate`'s figures for the
same mode (DeepSpeed's estimator, `minispeed.zero.memory.estimate_modes`).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from accelerate import PartialState
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import minispeed.zero.memory as memory

SEQ, VOCAB = 128, 32000
LLAMA = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,  # grouped-query attention, as LLaMA 2 70B and LLaMA 3
    max_position_embeddings=SEQ,
    tie_word_embeddings=False,
)
# The script's own config: what a Hugging Face example ships, at ZeRO-3 with CPU offload.
CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
GIB = 1024**3


def counting_rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


class MeasureInWindow(TrainerCallback):
    """Measures the engine's model states after the first micro-step of the second window: the
    optimizer state exists (Adam creates it at the first step) and so do the gradient shards
    (the next step consumes and frees them)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.measured: memory.MeasuredBytes | None = None

    def on_substep_end(self, args, state, control, **kwargs):
        if self.measured is None and state.global_step >= 1:
            engine = self.trainer.model_wrapped
            self.measured = memory.measure(engine.optimizer, engine.module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", default=None, help="a ds_config JSON (default: CONFIG)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="/tmp/hf_trainer_zero3")
    cli = parser.parse_args()
    # accelerate leaves the backend unset on a CPU-only host and counts one process; start its
    # state on gloo for the Trainer (docs/engine/deepspeed-compat.md, "On a CPU-only machine").
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    args = TrainingArguments(
        output_dir=cli.out,
        deepspeed=cli.deepspeed or CONFIG,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=cli.steps,
        learning_rate=2e-3,
        warmup_steps=1,
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LLAMA)  # under ZeRO-3: built partitioned
    probe = MeasureInWindow()
    trainer = Trainer(model=model, args=args, train_dataset=counting_rows(64, 1), callbacks=[probe])
    probe.trainer = trainer
    trainer.train()
    engine = trainer.model_wrapped  # the minispeed engine the Trainer drove
    measured = probe.measured
    formula = memory.predict(engine.optimizer)
    world = dist.get_world_size()
    row = next(
        r
        for r in memory.estimate_modes(engine.module, gpus_per_node=world)
        if r.stage == 3 and r.offload is memory.Offload.PARAMS_CPU and r.zero_init
    )
    psi = sum(p.numel() for p in engine.module.parameters())  # full sizes, even when released
    lines = [
        f"[rank {dist.get_rank()}] {psi / 1e6:.1f}M parameters, ZeRO-3, optimizer+params->cpu",
        f"  measured  params {measured.params / GIB:.3f} GiB, grads {measured.grads / GIB:.3f} "
        f"GiB, optimizer {measured.optimizer / GIB:.3f} GiB, total {measured.total / GIB:.3f} GiB",
        f"  formula   params {formula.params / GIB:.3f} GiB, grads {formula.grads / GIB:.3f} "
        f"GiB, optimizer {formula.optimizer / GIB:.3f} GiB, total {formula.total / GIB:.3f} GiB",
        f"  estimate  per device {row.gpu_bytes / GIB:.3f} GiB, CPU per node "
        f"{row.cpu_bytes_per_node / GIB:.3f} GiB ({row.cpu_bytes_per_node / world / GIB:.3f} GiB "
        f"per rank)",
    ]
    for rank in range(world):  # one rank at a time, so the lines do not interleave
        if rank == dist.get_rank():
            print("\n".join(lines), flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
