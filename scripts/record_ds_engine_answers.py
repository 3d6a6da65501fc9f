"""What DeepSpeed's engine answers a script, kept as a reference: `get_global_grad_norm()` with
`gradient_clipping` 0 and the first value of `load_checkpoint`.

Written against DeepSpeed's public API only. For every precision (fp32, bf16, fp16) and ZeRO
stage 0-3 with `gradient_clipping: 0`, two optimizer steps of a small regressor; it records
`get_global_grad_norm()` before the first step and after each (fp32 at stage 0 also with
`gradient_clipping: 1.0`). Then, at stages 2 and 3, `save_checkpoint(dir, tag="t1")` and a
fresh engine's `load_checkpoint`: the returned path relative to `dir`, from `latest` and from
`tag="t1"`; and `load_checkpoint` of a directory with no `latest` file.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_engine_answers.py
```

which writes `tests/engine/fixtures/ds_engine_answers.json`.
The recording block lets fp16 through on a CPU whose mkldnn has no fp16 (DeepSpeed's check
refuses it there; the fp16 path itself runs). `tests/engine/test_engine_ds_answers.py` runs this
same file with its import line changed to
minispeed's and compares.
"""

import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, OUT, BATCH = 6, 16, 2, 4
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_engine_answers.json"
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
}


def config(precision, stage, clipping):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": clipping,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        **PRECISIONS[precision],
    }


def build(precision, stage, clipping):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(precision, stage, clipping),
    )
    return engine


def norms(engine, rank):
    dtype = next(engine.parameters()).dtype
    seen = [engine.get_global_grad_norm()]
    for step in range(2):
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(BATCH, IN, generator=g).to(dtype)
        y = torch.randn(BATCH, OUT, generator=g).to(dtype)
        engine.backward(F.mse_loss(engine(x).float(), y.float()))
        engine.step()
        norm = engine.get_global_grad_norm()
        seen.append(None if norm is None else float(norm))
    return seen


def relative(path, root):
    return None if path is None else os.path.relpath(path, root)


def main(root):
    rank = dist.get_rank()
    record = {"norms": {}, "load": {}}
    cases = [(p, s, 0.0) for p in PRECISIONS for s in range(4)] + [("fp32", 0, 1.0)]
    for precision, stage, clipping in cases:
        engine = build(precision, stage, clipping)
        record["norms"][f"{precision} stage {stage} clipping {clipping}"] = norms(engine, rank)
        engine.destroy()
    for stage in (2, 3):
        ckpt = os.path.join(root, f"stage{stage}")
        engine = build("fp32", stage, 0.0)
        norms(engine, rank)
        engine.save_checkpoint(ckpt, tag="t1", client_state={"epoch": 3})
        path, client = build("fp32", stage, 0.0).load_checkpoint(ckpt)
        tagged, _ = build("fp32", stage, 0.0).load_checkpoint(ckpt, tag="t1")
        record["load"][f"stage {stage}"] = {
            "latest": relative(path, ckpt),
            "tag": relative(tagged, ckpt),
            "client_epoch": client["epoch"],
        }
    empty = os.path.join(root, "empty")
    os.makedirs(empty, exist_ok=True)
    record["load"]["no latest"] = list(build("fp32", 2, 0.0).load_checkpoint(empty))
    return record


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    # DeepSpeed refuses fp16 on a CPU without mkldnn fp16 (this machine's); its fp16 path itself
    # runs on the CPU (torch has the half kernels), so the recording lets it through.
    deepspeed.get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed()
    root = Path(os.environ.get("CKPT_ROOT", "/tmp/record_ds_engine_answers"))
    result = main(str(root))
    record(result, FIXTURE, scratch=root)
