"""transformers' Trainer with DeepSpeed's AutoTP (`tensor_parallel.autotp_size: 2`), kept as a
reference (2 processes, CPU).

A user's fine-tune with `--deepspeed` and a ds_config asking for tensor parallelism: transformers'
`deepspeed_init` calls `deepspeed.tp_model_init(model, 2, dtype, config)`, accelerate gives both
ranks the same batches (one tensor group, data-parallel size 1) and `deepspeed.initialize` cuts
the model by its structure, the output head gathering whole logits, so the model's own
`labels=` loss trains. Tiny random models from a fixed seed (written once with
`save_pretrained`, loaded with `from_pretrained`): a grouped-query `LlamaForCausalLM` at ZeRO-1
and a `Qwen2ForCausalLM` (biases on q/k/v) at ZeRO-2. It records:

- per optimizer step the loss, learning rate and gradient norm the Trainer logs (6 steps of 2
  micro-batches, a checkpoint saved after step 3: the model gathered whole by `save_model` and
  the engine's `save_checkpoint`), and `trainer.evaluate()`'s loss;
- the loss of the model written by `trainer.save_model()` reloaded with `from_pretrained` in a
  plain process (no launcher, no DeepSpeed);
- the steps of a second Trainer resumed from the step-3 checkpoint, which must continue as the
  uninterrupted run.

On a CPU-only host accelerate leaves the process-group backend unset, so the script starts
accelerate's state itself with `backend="gloo"` and hands it to the Trainer
(`accelerator_config={"use_configured_state": True}`), as `record_ds_trainer.py` does.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_autotp.py
```

which writes `tests/engine/fixtures/ds_autotp.json`. `python scripts/record_ds_autotp.py --plain`
prints the same runs in one process without DeepSpeed, the reference both must equal. `tests/engine/test_compat_autotp.py` runs
this same file, unchanged, on minispeed (the `deepspeed` distribution of
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
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainingArguments,
)

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_autotp.json"
SHAPE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per key/value head
    "max_position_embeddings": 16,
    "tie_word_embeddings": False,
}
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
RUNS = [("llama", 1), ("qwen2", 2)]
SEQ, STEPS, SAVE_AT = 16, 6, 3


def ds_config(stage):
    """A Hugging Face example's ds_config, with AutoTP over 2 ranks."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        # accelerate gathers a tensor-parallel model for save_model only with this key
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "tensor_parallel": {"autotp_size": 2},
        "steps_per_print": 1000,
    }


def token_rows(n, seed):
    """Counting sequences (a random start and stride): a pattern a few steps already learn."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = torch.randint(0, 128, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        ids = (start + stride * torch.arange(SEQ)) % SHAPE["vocab_size"]
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


TRAIN, EVAL = token_rows(48, 1), token_rows(8, 2)


def trainer_for(family, stage, init, out, plain=False):
    AcceleratorState._reset_state()  # a new Trainer starts a new accelerate state
    GradientState._reset_state()
    args = TrainingArguments(
        output_dir=str(out),
        deepspeed=None if plain else ds_config(stage),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.01,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no" if plain else "steps",
        save_steps=SAVE_AT,
        seed=7,
        report_to=[],
        disable_tqdm=True,
        accelerator_config={"use_configured_state": not plain},
    )
    model = FAMILIES[family][1].from_pretrained(init)
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


def one_run(family, stage, init, scratch, plain=False):
    """Train (a checkpoint after step 3), evaluate, `save_model`; then a second Trainer
    resumed from the checkpoint, whose steps 4-6 must repeat the first's."""
    out = scratch / f"{family}-z{stage}"
    trainer = trainer_for(family, stage, init, out, plain)
    trainer.train()
    result = {"steps": logged_steps(trainer), "eval_loss": trainer.evaluate()["eval_loss"]}
    if plain:
        return result
    trainer.save_model(str(out / "final"))  # the tensor-parallel model gathered whole
    resumed = trainer_for(family, stage, init, out)
    resumed.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}"))
    result["resumed_steps"] = logged_steps(resumed)[-(STEPS - SAVE_AT) :]
    return result


def plain_eval_losses(folders):
    """The evaluation loss of the saved model in each folder, from one plain process (no
    launcher, no DeepSpeed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, __file__, "--plain-eval", *map(str, folders)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def plain_eval(folders):
    batch = torch.stack([r["input_ids"] for r in EVAL])
    losses = []
    for folder in folders:
        family = Path(folder).parent.name.split("-")[0]
        model = FAMILIES[family][1].from_pretrained(folder).eval()
        with torch.no_grad():
            losses.append(model(input_ids=batch, labels=batch).loss.item())
    print(json.dumps(losses))


def main(scratch):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # as record_ds_trainer.py: accelerate on a CPU-only host
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        for family, (config, model) in FAMILIES.items():
            torch.manual_seed(0)
            model(config(**SHAPE)).save_pretrained(scratch / f"init-{family}")
    dist.barrier()
    runs = {
        f"{family}-z{stage}": one_run(family, stage, scratch / f"init-{family}", scratch)
        for family, stage in RUNS
    }
    first = dist.get_rank() == 0
    saved = plain_eval_losses([scratch / name / "final" for name in runs]) if first else None
    for i, run in enumerate(runs.values()):
        run["saved_model_eval_loss"] = None if saved is None else saved[i]
    return runs


def plain(scratch):
    """The same runs in one process without DeepSpeed (`--plain`): the reference AutoTP must
    equal (printed, not recorded)."""
    for family, (config, model) in FAMILIES.items():
        torch.manual_seed(0)
        model(config(**SHAPE)).save_pretrained(scratch / f"init-{family}")
    for family, stage in RUNS:
        run = one_run(family, stage, scratch / f"init-{family}", scratch, plain=True)
        print(f"{family}-z{stage}", [s["loss"] for s in run["steps"]], run["eval_loss"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain-eval"]:
        plain_eval(sys.argv[2:])
        sys.exit(0)
    if sys.argv[1:2] == ["--plain"]:
        plain(Path(tempfile.mkdtemp()))
        sys.exit(0)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("TRAINER_SCRATCH", tempfile.gettempdir())) / "ds_autotp_run"
    record(main(scratch), FIXTURE, scratch=scratch)
