"""A DeepSpeed pipeline script fed by `initialize(training_data=...)`, kept as a reference.

The shape of DeepSpeed's own pipeline example (`training/pipeline_parallelism/train.py` in
DeepSpeedExamples): the script hands `initialize` a dataset and `model_parameters`, the
optimizer comes from the config, and the loop calls `engine.train_batch()` with no iterator;
the engine reads its own repeating loader (a `DistributedSampler` over the data-parallel
replicas, not shuffled). An `eval_batch` between steps must not disturb that loader, and
`set_batch_fn` post-processes every micro-batch a stage reads. Recorded on DeepSpeed 0.19.8,
4 processes on the CPU (2 stages x 2 data-parallel replicas):

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 4 scripts/record_ds_pipe_data.py
```

which writes `tests/engine/fixtures/pipe_training_data.json`;
`tests/engine/test_pipe_engine_training_data.py` runs this file with its import lines changed.
"""

import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

DIM, CLASSES, SAMPLES, MICRO, GAS, STEPS = 8, 4, 20, 2, 3, 5
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "steps_per_print": 10**6,
}
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/pipe_training_data.json"


def dataset():
    """SAMPLES labelled points from a fixed generator: sample i's features and class."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, DIM, generator=g)
    y = (x[:, :CLASSES].argmax(dim=1) + torch.arange(SAMPLES)) % CLASSES
    return torch.utils.data.TensorDataset(x, y)


def scale_inputs(batch):
    """A batch function: the stage's micro-batch with its inputs doubled."""
    x, y = batch
    return 2.0 * x, y


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers = [
        LayerSpec(nn.Linear, DIM, 16),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.Linear, 16, 16),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.Linear, 16, CLASSES),
    ]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.CrossEntropyLoss())
    engine, _, loader, _ = deepspeed.initialize(
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=dataset(),
        config=CONFIG,
    )
    losses = [float(engine.train_batch()) for _ in range(STEPS)]
    held_out = [(torch.ones(MICRO, DIM), torch.zeros(MICRO, dtype=torch.long))] * GAS
    evaluated = float(engine.eval_batch(iter(held_out)))
    losses += [float(engine.train_batch()) for _ in range(2)]
    engine.set_batch_fn(scale_inputs)
    losses += [float(engine.train_batch()) for _ in range(2)]
    return {
        "stage": engine.stage_id,
        "losses": losses,
        "evaluated": evaluated,
        "global_steps": engine.global_steps,
        "loader": type(loader).__name__,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record  # refuses minispeed under DeepSpeed's name

    record(main(), FIXTURE)
