"""DeepSpeed's flops count of a pipeline stage's forward when the stage holds a plain function.

A `PipelineModule` of three bias-free `Linear(8, 8)` layers with a `lambda` between the first two
(`torch.mul(F.relu(x), 2.0)`: two functions DeepSpeed's profiler patches), cut uniformly, so
stage 0 holds the first `Linear` and the lambda, stage 1 the other two. Each rank counts one
forward of its stage (a micro-batch of 2) with DeepSpeed's `FlopsProfiler`, started before the
module's forward and stopped after it, as DeepSpeed's engine does for the `flops_profiler`
section (`_forward_prologue` / `_forward_epilogue`). The engine's own path cannot be recorded:
DeepSpeed 0.19.8's pipeline engine with `flops_profiler` enabled (which turns the timers on)
fails its first backward with "AssertionError: bwd_microstep timer has already been started"
(its `_exec_backward_pass` starts that timer, then the backward hook's `_backward_prologue`
starts it again). Recorded on DeepSpeed 0.19.8, 2 processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_pipe_profile.py
```

which writes `tests/engine/fixtures/ds_pipe_profile.json` (per rank: its stage, the layer cut,
`get_total_flops()` and `get_total_macs()` of one forward).
`tests/engine/test_pipe_engine_observers.py` compares minispeed's profiled pipeline step.
"""

import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.profiling.flops_profiler import FlopsProfiler
from torch import nn

WIDTH, MICRO = 8, 2
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_pipe_profile.json"


def layers():
    return [
        LayerSpec(nn.Linear, WIDTH, WIDTH, bias=False),
        lambda x: torch.mul(F.relu(x), 2.0),
        LayerSpec(nn.Linear, WIDTH, WIDTH, bias=False),
        LayerSpec(nn.Linear, WIDTH, WIDTH, bias=False),
    ]


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers(), num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")
    x = torch.randn(MICRO, WIDTH, generator=torch.Generator().manual_seed(0))
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.stop_profile()
    flops, macs = prof.get_total_flops(), prof.get_total_macs()
    prof.end_profile()
    return {
        "stage": model.stage_id,
        "parts": [int(p) for p in model.parts],
        "micro_batch": MICRO,
        "width": WIDTH,
        "forward_flops": flops,
        "forward_macs": macs,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record  # refuses minispeed under DeepSpeed's name

    record(main(), FIXTURE)
