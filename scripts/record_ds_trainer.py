"""A Hugging Face Trainer fine-tune on DeepSpeed, kept as a reference (2 processes, CPU).

Written against transformers' and accelerate's public API only, as a user fine-tuning with
`--deepspeed`: a tiny `LlamaForCausalLM` (grouped-query attention, random weights from a fixed
seed, written once with `save_pretrained` and loaded with `from_pretrained` after the
`TrainingArguments`, so under ZeRO-3 it is built partitioned), and a Hugging Face-style
ds_config whose batch sizes, optimizer, scheduler and clipping are all `"auto"` (the Trainer
fills them in). For each of ZeRO-2 and ZeRO-3, offload `none` and `cpu`, it records:

- per optimizer step the loss, learning rate and gradient norm the Trainer logs (6 steps of 2
  micro-batches, a checkpoint saved after step 3);
- `trainer.evaluate()`'s loss, and the loss of the model written by `trainer.save_model()`
  reloaded with `from_pretrained` in a plain process (no launcher, no DeepSpeed; one process
  evaluates the four models at the end);
- the steps of a second Trainer that resumes from the step-3 checkpoint
  (`train(resume_from_checkpoint=...)`), which must continue as the uninterrupted run.

On a CPU-only host accelerate leaves the process-group backend unset and counts one process
(so the Trainer's `"auto"` train_batch_size would be 1× where DeepSpeed sees 2 ranks); the
script therefore starts accelerate's state itself with `backend="gloo"` and hands it to the
Trainer (`accelerator_config={"use_configured_state": True}`): the only CPU-specific line.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_trainer.py
```

which writes `tests/engine/fixtures/ds_trainer.json`. `tests/engine/test_compat_trainer.py`
runs this same file, unchanged, on minispeed (the `deepspeed` distribution of
`packages/deepspeed_compat`) and compares.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState, GradientState
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_trainer.json"
LLAMA = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per key/value head
    "max_position_embeddings": 16,
    "tie_word_embeddings": False,
}
SEQ, STEPS, SAVE_AT = 16, 6, 3
RUNS = [(2, "none"), (2, "cpu"), (3, "none"), (3, "cpu")]


def ds_config(stage, offload):
    """The ds_config a Hugging Face example ships: everything the Trainer knows is "auto"."""
    zero = {
        "stage": stage,
        "offload_optimizer": {"device": offload},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    }
    if stage == 3:
        zero.update(
            offload_param={"device": offload},
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            stage3_gather_16bit_weights_on_model_save=True,
        )
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


def token_rows(n, seed):
    """Counting sequences (a random start and stride): a pattern a few steps already learn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start, stride = (
            torch.randint(0, 128, (1,), generator=g),
            torch.randint(1, 4, (1,), generator=g),
        )
        ids = (start + stride * torch.arange(SEQ)) % LLAMA["vocab_size"]
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


TRAIN, EVAL = token_rows(48, 1), token_rows(8, 2)


def arguments(out, stage, offload):
    return TrainingArguments(
        output_dir=str(out),
        deepspeed=ds_config(stage, offload),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        warmup_steps=2,
        weight_decay=0.01,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        seed=7,
        report_to=[],
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
    )


def trainer_for(out, stage, offload, init):
    # A new Trainer starts a new accelerate state on the configured process group.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    args = arguments(out, stage, offload)
    model = LlamaForCausalLM.from_pretrained(init)  # under ZeRO-3: built partitioned
    return Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL)


def logged_steps(trainer):
    return [
        {
            "step": h["step"],
            "loss": h["loss"],
            "lr": h["learning_rate"],
            "grad_norm": h["grad_norm"],
        }
        for h in trainer.state.log_history
        if "loss" in h
    ]


def plain_eval_losses(folders):
    """The evaluation loss of the model in each folder, from one plain process (no launcher,
    no DeepSpeed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, __file__, "--plain-eval", *map(str, folders)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def plain_eval(folders):
    batch = torch.stack([r["input_ids"] for r in EVAL])
    losses = []
    for folder in folders:
        model = LlamaForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            losses.append(model(input_ids=batch, labels=batch).loss.item())
    print(json.dumps(losses))


def one_run(stage, offload, init, scratch):
    out = scratch / f"z{stage}-{offload}"
    trainer = trainer_for(out, stage, offload, init)
    trainer.train()
    steps = logged_steps(trainer)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(out / "final"))
    resumed = trainer_for(out, stage, offload, init)
    resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}"))
    return {
        "steps": steps,
        "resumed_steps": logged_steps(resumed)[-(STEPS - SAVE_AT) :],
        "eval_loss": eval_loss,
    }


def main(scratch):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # Note above: accelerate on a CPU-only host
    init = scratch / "init"
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)  # a run killed half-way leaves its checkpoints
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(init)
    dist.barrier()
    runs = {f"z{s}-{o}": one_run(s, o, init, scratch) for s, o in RUNS}
    first = dist.get_rank() == 0
    saved = plain_eval_losses([scratch / name / "final" for name in runs]) if first else None
    for i, run in enumerate(runs.values()):
        run["saved_model_eval_loss"] = None if saved is None else saved[i]
    return runs


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain-eval"]:
        plain_eval(sys.argv[2:])
        sys.exit(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("TRAINER_SCRATCH", tempfile.gettempdir())) / "ds_trainer_run"
    record(main(scratch), FIXTURE, scratch=scratch)
