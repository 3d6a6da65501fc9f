"""Checkpoints written by DeepSpeed itself, kept as files, with the losses of training on from them.

Written against DeepSpeed's public API only. For each case (precision and ZeRO stage), a small
regressor with two param groups (weight decay 0.01 and 0, sizes that leave DeepSpeed padding
in its flat partitions), AdamW and WarmupLR from the config, gradient clipping, 2 micro-batches
per step: 3 steps, `save_checkpoint(dir, client_state={"epoch": 2, "note": "mid-run"})` (tag
`global_step3`), then 2 more steps. It records the losses of those 2 steps, the learning rate,
the counters, the evaluation loss at the checkpoint, a fresh DeepSpeed engine's losses after its
own `load_checkpoint(dir)` (DeepSpeed's own resume: the same), the client state it returned, and
`get_fp32_state_dict_from_zero_checkpoint(dir)`'s names, shapes and sums (its error at fp32
stage 0, which writes no ZeRO files).

The checkpoint directories stay as fixtures: `tests/engine/fixtures/ds_checkpoint_<case>/`
(`latest`, `global_step3/...`; the copies of DeepSpeed's `zero_to_fp32.py` and `zero_to_torch.py`
it writes beside them are removed: DeepSpeed's code, which no test reads). Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_checkpoint_files.py
```

which writes those directories and `tests/engine/fixtures/ds_checkpoint_files.json`. It removes
the directories first, the universal folders `record_ds_universal.py` writes beside two of them
included: run that recorder again afterwards (its docstring).
`tests/engine/test_checkpoint_deepspeed_files.py` loads each directory into minispeed's engine
(this script's `build` and `train`, with the import line changed) and compares.
"""

import shutil
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn

IN, HIDDEN, OUT, BATCH, GAS = 5, 7, 3, 4, 2
FIXTURES = Path(__file__).resolve().parents[1] / "tests/engine/fixtures"
FIXTURE = FIXTURES / "ds_checkpoint_files.json"
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
}
CASES = [("fp32", 0), ("fp32", 1), ("fp32", 2), ("fp32", 3), ("bf16", 0), ("bf16", 2),
         ("bf16", 3), ("fp16", 1)]  # fmt: skip
SAVED_AT, MORE = 3, 2


def case_dir(precision, stage):
    return FIXTURES / f"ds_checkpoint_{precision}_stage{stage}"


def config(precision, stage, batch=BATCH):
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8},
        },
        "zero_optimization": {"stage": stage},
        **PRECISIONS[precision],
    }


def build(precision, stage, batch=BATCH, extra=None):
    """The regressor's engine; `extra`: more ds_config keys (`record_ds_universal.py`'s)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    groups = [
        {"params": list(model[0].parameters()), "weight_decay": 0.01},
        {"params": list(model[2].parameters()), "weight_decay": 0.0},
    ]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=groups,
        config={**config(precision, stage, batch), **(extra or {})},
    )
    return engine


def batch_of(rank, step, micro, dtype):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.stack([x[:, :2].sum(1), x[:, 2] * x[:, 3], x[:, 4]], dim=1)
    return x.to(dtype), y


def train(engine, ranks, first, steps):
    """`steps` optimizer steps from step `first`; each micro-batch is the batches of `ranks`
    side by side (one rank: its own; at world size 1, both ranks' data as one batch)."""
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for micro in range(GAS):
            xs, ys = zip(*(batch_of(r, step, micro, dtype) for r in ranks))
            loss = F.mse_loss(engine(torch.cat(xs)).float(), torch.cat(ys))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / GAS)
    return losses


def evaluate(engine):
    dtype = next(engine.module.parameters()).dtype
    with torch.no_grad():
        x, y = batch_of(7, 99, 0, dtype)
        return F.mse_loss(engine(x).float(), y).item()


def counters(engine):
    return [engine.global_steps, engine.global_samples, engine.skipped_steps]


def main():
    rank = dist.get_rank()
    record = {}
    for precision, stage in CASES:
        root = case_dir(precision, stage)
        engine = build(precision, stage)
        train(engine, [rank], 0, SAVED_AT)
        out = {"eval": evaluate(engine), "lr": engine.get_lr(), "counters": counters(engine)}
        engine.save_checkpoint(str(root), client_state={"epoch": 2, "note": "mid-run"})
        out["after"] = train(engine, [rank], SAVED_AT, MORE)
        engine.destroy()

        resumed = build(precision, stage)
        _, client = resumed.load_checkpoint(str(root))
        out["client"] = {k: client[k] for k in ("epoch", "note")}
        out["client_keys"] = sorted(client)
        out["resumed_eval"] = evaluate(resumed)
        out["resumed_after"] = train(resumed, [rank], SAVED_AT, MORE)
        resumed.destroy()
        try:  # DeepSpeed's reader needs ZeRO's files: fp32 at stage 0 has none
            state = get_fp32_state_dict_from_zero_checkpoint(str(root))
            out["fp32"] = {n: [list(t.shape), float(t.double().sum())] for n, t in state.items()}
        except TypeError as e:
            out["fp32"] = f"{type(e).__name__}: {e}"
        record[f"{precision} stage {stage}"] = out
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    # DeepSpeed refuses fp16 on a CPU without mkldnn fp16 (this machine's); its fp16 path itself
    # runs on the CPU, so the recording lets it through (as record_ds_engine_answers.py does).
    deepspeed.get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed()
    if dist.get_rank() == 0:
        for precision, stage in CASES:
            shutil.rmtree(case_dir(precision, stage), ignore_errors=True)
    dist.barrier()
    result = main()
    dist.barrier()
    if dist.get_rank() == 0:
        for precision, stage in CASES:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's, where written
                (case_dir(precision, stage) / script).unlink(missing_ok=True)
    record(result, FIXTURE)
