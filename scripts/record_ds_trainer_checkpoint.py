"""A Trainer checkpoint DeepSpeed wrote, kept as files, and the steps of resuming from it.

Written against transformers' and accelerate's public API only (the set-up of
`record_ds_trainer.py`, on a smaller `LlamaForCausalLM` so the files stay small): at ZeRO-2 and
ZeRO-3 a Trainer trains 5 steps of 2 micro-batches, saving `checkpoint-3/` (the Trainer's
files, with DeepSpeed's `global_step3/` inside). The recording keeps each `checkpoint-3/` as a
fixture, `tests/engine/fixtures/ds_trainer_checkpoint_z<stage>/checkpoint-3/` (the copies of
DeepSpeed's `zero_to_fp32.py` and `zero_to_torch.py` removed, and `training_args.bin`, a pickle
of the arguments that resuming does not read), and records the logged steps 4-5 of the
uninterrupted run.

`main(scratch)` copies each fixture and resumes a fresh Trainer from it
(`train(resume_from_checkpoint=...)`), recording steps 4-5: on DeepSpeed they are its own
resume; `tests/engine/test_compat_trainer_checkpoint.py` runs this same file, unchanged, on
minispeed (the `deepspeed` of `packages/deepspeed_compat`), which must resume from DeepSpeed's
files with DeepSpeed's steps.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_trainer_checkpoint.py
```

which writes those directories and `tests/engine/fixtures/ds_trainer_checkpoint.json`.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState, GradientState
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

FIXTURES = Path(__file__).resolve().parents[1] / "tests/engine/fixtures"
FIXTURE = FIXTURES / "ds_trainer_checkpoint.json"
LLAMA = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 8,
    "tie_word_embeddings": False,
}
SEQ, STEPS, SAVE_AT, STAGES = 8, 5, 3, (2, 3)


def ds_config(stage):
    """A Hugging Face example's ds_config: everything the Trainer knows is "auto"."""
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
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }


def token_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = torch.randint(0, LLAMA["vocab_size"], (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        ids = (start + stride * torch.arange(SEQ)) % LLAMA["vocab_size"]
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


TRAIN = token_rows(40, 1)


def trainer_for(out, stage, init):
    AcceleratorState._reset_state()  # a new Trainer starts a new accelerate state
    GradientState._reset_state()
    args = TrainingArguments(
        output_dir=str(out),
        deepspeed=ds_config(stage),
        per_device_train_batch_size=2,
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
    model = LlamaForCausalLM.from_pretrained(init)
    return Trainer(model=model, args=args, train_dataset=TRAIN)


def logged_steps(trainer):
    keys = {"step": "step", "loss": "loss", "lr": "learning_rate", "grad_norm": "grad_norm"}
    history = trainer.state.log_history
    return [{k: h[v] for k, v in keys.items()} for h in history if "loss" in h]


def fixture_dir(stage):
    return FIXTURES / f"ds_trainer_checkpoint_z{stage}"


def init_model(scratch):
    init = scratch / "init"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(init)
    dist.barrier()
    return init


def main(scratch):
    """Resume from each kept checkpoint; the logged steps after it."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # accelerate on a CPU-only host (record_ds_trainer.py)
    init = init_model(scratch)
    record = {}
    for stage in STAGES:
        out = scratch / f"z{stage}"
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(fixture_dir(stage), out)
        dist.barrier()
        resumed = trainer_for(out, stage, init)
        resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}"))
        record[f"z{stage}"] = logged_steps(resumed)[-(STEPS - SAVE_AT) :]
    return record


def write_checkpoints(scratch):
    """DeepSpeed's run: train, keep `checkpoint-3/` as the fixture; the steps after it."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    init = init_model(scratch)
    steps = {}
    for stage in STAGES:
        out = scratch / f"write-z{stage}"
        trainer = trainer_for(out, stage, init)
        trainer.train()
        steps[f"z{stage}"] = logged_steps(trainer)[-(STEPS - SAVE_AT) :]
        dist.barrier()
        if dist.get_rank() == 0:
            kept = fixture_dir(stage) / f"checkpoint-{SAVE_AT}"
            shutil.rmtree(fixture_dir(stage), ignore_errors=True)
            shutil.copytree(out / f"checkpoint-{SAVE_AT}", kept)
            for name in ("zero_to_fp32.py", "zero_to_torch.py", "training_args.bin"):
                (kept / name).unlink(missing_ok=True)
        dist.barrier()
    return steps


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(tempfile.gettempdir()) / "ds_trainer_checkpoint_run"
    if int(os.environ["RANK"]) == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    uninterrupted = write_checkpoints(scratch)
    resumed = main(scratch)
    record({"uninterrupted": uninterrupted, "resumed": resumed}, FIXTURE, scratch=scratch)
