"""DeepSpeed's universal checkpoints both ways, with DeepSpeed's losses after resuming from them.

Written against DeepSpeed's public API and commands only, over the regressor, configs and data
of `record_ds_checkpoint_files.py` (its `build`, `train`, `evaluate`, `counters`).

1. *DeepSpeed → minispeed.* For each of `DS_CASES`, DeepSpeed's own checkpoint fixture
   `tests/engine/fixtures/ds_checkpoint_<case>/global_step3` (2 ranks wrote it) is converted by
   `python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state` into
   `global_step3_universal` beside it (with `latest_universal`; at world size 2 only, the run
   that comes first). A fresh DeepSpeed engine with `"checkpoint": {"load_universal": true}`
   loads the directory and trains the 2 steps after the save.
   At stage 3 DeepSpeed's universal load (`stage3.py`,
   `load_hp_checkpoint_state_from_checkpoint_dir_stage3`) gives every param group the
   hyper-parameters of group 0 (the regressor's second group, weight decay 0, then decays at
   0.01: `decays` records [0.01, 0.01]) and one `step` tensor object to every group, which
   torch's AdamW increments in place, once per group per step (so the groups' bias
   corrections drift). Each stage-3 case is therefore recorded twice: as DeepSpeed leaves it,
   and "regrouped": each group's weight decay set back and its step made its own tensor after
   `load_checkpoint`, which reproduces DeepSpeed's own native resume (the losses of
   `ds_checkpoint_files.json`).
2. *minispeed → DeepSpeed.* For each of `MS_CASES`, the folder minispeed's
   `minispeed consolidate --to deepspeed-universal` wrote from minispeed's checkpoint
   (`tests/engine/fixtures/ms_checkpoint_<case>/`, `scripts/write_ms_universal.py`) is loaded
   the same way, and DeepSpeed trains the 2 steps after it.

At world size 1 each micro-batch is both ranks' batches side by side (the 2-rank run's gradient).
Recorded on DeepSpeed 0.19.8, gloo on the CPU, at both sizes:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_universal.py    # ds_universal_world2.json
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 1 scripts/record_ds_universal.py    # ds_universal_world1.json
```

`tests/engine/test_checkpoint_deepspeed_universal.py` compares minispeed with these.
"""

import shutil
import subprocess
import sys

import deepspeed
import torch.distributed as dist
from record_ds_checkpoint_files import (
    BATCH,
    FIXTURES,
    MORE,
    SAVED_AT,
    build,
    case_dir,
    counters,
    evaluate,
    train,
)

DS_CASES = [("fp32", 2), ("bf16", 3)]
MS_CASES = [("fp32", 2), ("bf16", 3)]
UNIVERSAL = {"checkpoint": {"load_universal": True}}
WEIGHT_DECAYS = (0.01, 0.0)  # build()'s two param groups


def ms_case_dir(precision, stage):
    return FIXTURES / f"ms_checkpoint_{precision}_stage{stage}"


def convert(precision, stage):
    """DeepSpeed's own conversion of the fixture's tag, beside it."""
    root = case_dir(precision, stage)
    out = root / "global_step3_universal"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(root / "global_step3"), "--output_folder", str(out), "--inject_missing_state",
         "--num_extract_workers", "1", "--num_merge_workers", "1"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def resume(root, precision, stage, ranks, regroup=False):
    """A fresh engine at this world size loads `root` universally and trains on. `regroup`:
    then give each param group its own weight decay again (DeepSpeed's stage-3 universal load
    gives every group group 0's hyper-parameters; `decays` records what it left)."""
    engine = build(precision, stage, batch=BATCH * (2 // dist.get_world_size()), extra=UNIVERSAL)
    path, client = engine.load_checkpoint(str(root))
    groups = engine.optimizer.optimizer.param_groups  # the torch optimizer's, which step
    decays = [g["weight_decay"] for g in groups]
    if regroup:
        for group, decay in zip(groups, WEIGHT_DECAYS):
            group["weight_decay"] = decay
        state = engine.optimizer.optimizer.state
        for flat in engine.optimizer.fp32_partitioned_groups_flat:  # one step tensor each
            state[flat]["step"] = state[flat]["step"].clone()
    out = {
        "decays": decays,
        "path": path.split("/")[-2],
        "eval": evaluate(engine),
        "lr": engine.get_lr(),
        "counters": counters(engine),
        "client": {k: client[k] for k in ("epoch", "note")},
        "after": train(engine, ranks, SAVED_AT, MORE),
    }
    engine.destroy()
    return out


def main():
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = [rank] if world == 2 else [0, 1]
    if world == 2 and rank == 0:
        for precision, stage in DS_CASES:
            convert(precision, stage)
    dist.barrier()
    record = {}
    for source, cases, where in (
        ("deepspeed", DS_CASES, case_dir),
        ("minispeed", MS_CASES, ms_case_dir),
    ):
        for precision, stage in cases:
            name = f"{source} {precision} stage {stage}"
            record[name] = resume(where(precision, stage), precision, stage, ranks)
            if stage == 3:
                record[name + " regrouped"] = resume(
                    where(precision, stage), precision, stage, ranks, regroup=True
                )
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = main()
    record(result, FIXTURES / f"ds_universal_world{dist.get_world_size()}.json")
