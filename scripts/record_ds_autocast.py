"""DeepSpeed's `torch_autocast` section: losses per step, ZeRO stages 0-3, bf16 and fp16.

Two processes train a tiny model (Linear, LayerNorm, Tanh, Linear) with AdamW for 3 optimizer
steps under `torch_autocast`, each rank on its own data. Cases: bf16 at stages 0-3 (the default
lower-precision-safe modules, Linear and the Convs); bf16 at stage 2 with 2 accumulation steps;
bf16 at stage 1 with `lower_precision_safe_modules: ["torch.nn.LayerNorm"]`; fp16 at stages 0
and 2 (DeepSpeed scales the loss with a torch.amp.GradScaler there; at stage 2 without
clipping, see `CASES`). Recorded per case: the
loss of every micro-step, each parameter's sum after the last step, the dtype DeepSpeed
communicates each parameter's gradient in (`get_comm_dtype`; "none": not marked, its own),
and `engine.torch_autocast_dtype()` / `torch_autocast_lower_precision_safe_modules()`. Then the
configs DeepSpeed refuses at `initialize` (a class path that does not import; autocast with
`zero_quantized_weights`), by exception type. Last, bf16 autocast on a 2-stage `PipelineModule`
(Linear, Tanh, LayerNorm | Linear, Tanh, Linear; each rank one stage) at ZeRO stages 0 and 1, 3
`train_batch` steps of 2 micro-batches, clipping off: each stage's losses, parameter sums and
comm dtypes.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_autocast.py
```

which writes `tests/engine/fixtures/ds_autocast.json`. `tests/engine/test_engine_autocast.py`
runs this same file with its import line changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.torch_autocast import get_comm_dtype, has_comm_dtype
from torch import nn

DIM, STEPS = 8, 3
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_autocast.json"
BF16 = {"enabled": True, "dtype": "bfloat16"}
FP16 = {"enabled": True, "dtype": "float16"}

# fp16 at stage 2 without clipping: DeepSpeed 0.19.8's ZeRO optimizer clips the loss-scaled
# gradients there (its norm is the scaled one, 2^16 times too large), a bug minispeed does not
# copy; without clipping the two agree.
CASES = [
    (0, BF16, 1),
    (1, BF16, 1),
    (2, BF16, 1),
    (3, BF16, 1),
    (2, BF16, 2),
    (1, {**BF16, "lower_precision_safe_modules": ["torch.nn.LayerNorm"]}, 1),
    (0, FP16, 1),
    (2, FP16, 1, {"gradient_clipping": 0.0}),
]

REFUSED = [
    (2, {**BF16, "lower_precision_safe_modules": ["torch.nn.NoSuchModule"]}, {}),
    (3, BF16, {"zero_quantized_weights": True}),
]


def config(stage, autocast, gas, extra=None, zero=None):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, **(zero or {})},
        "torch_autocast": autocast,
        **(extra or {}),
    }


def model_and_optimizer():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Tanh(), nn.Linear(DIM, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def run_case(rank, stage, autocast, gas, extra=None):
    model, optimizer = model_and_optimizer()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(stage, autocast, gas, extra)
    )
    record = {"case": [stage, autocast, gas, extra], "losses": []}
    for step in range(STEPS * gas):
        g = torch.Generator().manual_seed(100 * rank + step)
        loss = engine(torch.randn(2, DIM, generator=g)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        record["losses"].append(loss.item())
    record["comm_dtypes"] = [
        str(get_comm_dtype(p)) if has_comm_dtype(p) else "none" for p in engine.module.parameters()
    ]
    record["autocast_dtype"] = str(engine.torch_autocast_dtype())
    record["safe_modules"] = engine.torch_autocast_lower_precision_safe_modules()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        record["params"] = [float(p.detach().double().sum()) for p in engine.module.parameters()]
    engine.destroy()
    return record


def refusal(stage, autocast, zero):
    model, optimizer = model_and_optimizer()
    try:
        deepspeed.initialize(
            model=model, optimizer=optimizer, config=config(stage, autocast, 1, zero=zero)
        )
    except (ValueError, AssertionError) as e:
        return type(e).__name__
    return None


def pipe_loss(out, labels):
    return (out.float() - labels).pow(2).mean()


def run_pipe(stage):
    """bf16 autocast on a 2-stage pipeline (the 2 ranks; data-parallel size 1), ZeRO `stage`,
    3 `train_batch` steps of 2 micro-batches; clipping off (the pipeline's clipping norm is a
    documented difference, docs/engine/deepspeed-compat.md)."""
    torch.manual_seed(7)
    layers = [nn.Linear(DIM, DIM), nn.Tanh(), nn.LayerNorm(DIM), nn.Linear(DIM, DIM)]
    layers += [nn.Tanh(), nn.Linear(DIM, 1)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=pipe_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ds = config(stage, BF16, 2, {"gradient_clipping": 0.0})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    g = torch.Generator().manual_seed(11)
    data = [(torch.randn(2, DIM, generator=g), torch.randn(2, 1, generator=g)) for _ in range(6)]
    batches = iter(data)
    losses = [float(engine.train_batch(batches)) for _ in range(STEPS)]
    params = list(engine.module.parameters())
    record = {
        "case": [stage, BF16, 2, "pipeline"],
        "losses": losses,
        "comm_dtypes": [str(get_comm_dtype(p)) if has_comm_dtype(p) else "none" for p in params],
        "params": [float(p.detach().double().sum()) for p in params],
    }
    engine.destroy()
    return record


def main():
    rank = dist.get_rank()
    return {
        "runs": [run_case(rank, *case) for case in CASES],
        "refused": [refusal(*case) for case in REFUSED],
        "pipe": [run_pipe(stage) for stage in (0, 1)],
    }


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    record(main(), FIXTURE)
