"""`engine.compile()` at ZeRO-3: what DeepSpeed trains, eager and compiled, on a tiny model.

Two processes train `Linear-Tanh-Linear-Tanh-Linear` at ZeRO-3 (every parameter partitioned and
released after its use: `stage3_param_persistence_threshold: 0`, `stage3_max_reuse_distance: 0`) for 3 steps with AdamW, once eagerly and once after
`engine.compile(backend="aot_eager")` (AOTAutograd traces forward and backward, no code
generated), each rank its own batch. Per run: `is_compiled`, per step the loss and
`get_global_grad_norm()`, and each parameter's sum after training. (What stage 3 holds after a
forward is not compared: DeepSpeed's `p.data` still holds every parameter of this model after
it, where minispeed's holds none; test_engine_compile.py checks minispeed's own.)

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_compile_z3.py
```

which writes `tests/engine/fixtures/ds_compile_z3.json`. `tests/engine/test_engine_compile.py`
runs this same file with its import line changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

DIM, STEPS = 8, 3
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_compile_z3.json"
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
    },
}


def model():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, 2 * DIM), nn.Tanh(),
        nn.Linear(2 * DIM, 1),
    )  # fmt: skip


def run(rank, compiled, backend="aot_eager"):
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=CONFIG)
    if compiled:
        engine.compile(backend=backend)
    record = {"compiled": engine.is_compiled, "steps": []}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        loss = engine(torch.randn(2, DIM, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        record["steps"].append(
            {"loss": loss.item(), "grad_norm": float(engine.get_global_grad_norm())}
        )
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        record["params"] = [float(p.detach().double().sum()) for p in engine.module.parameters()]
    engine.destroy()
    return record


def main():
    rank = dist.get_rank()
    return {"eager": run(rank, False), "compiled": run(rank, True)}


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    record(main(), FIXTURE)
