"""DeepSpeed's monitor section: the CSV files (and TensorBoard events) a run writes, and when.

Two processes train tiny models for a few steps with `csv_monitor` (and, where the
`tensorboard` package is installed, `tensorboard`) on: the plain engine in fp32 with a WarmupLR
schedule and `wall_clock_breakdown` (the timer events), with gradient accumulation, in bf16 and
in fp16 (the loss-scale events), a second run into the same job (the files are appended to,
with a second header), and a two-stage pipeline with `train_batch` and `eval_batch`; each run
also writes one event of its own through `engine.monitor`, and a client's own `MonitorMaster`
(`get_monitor_config` of the sections) writes a few. Each rank
returns every file under the output path: its rows for a CSV file, `(tag, step, value)` per
event for a TensorBoard event file.

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU (with `pip install tensorboard`):

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_monitor.py
```

which writes `tests/engine/fixtures/ds_monitor.json`. `tests/engine/test_monitor.py` runs this
same file with its import lines changed to minispeed's and compares.
"""

import csv
import os
import tempfile
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.monitor.config import get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

DIM, STEPS = 8, 3
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_monitor.json"
# case: (ds_config changes, run it twice into the same job)
CASES = {
    "fp32": ({"wall_clock_breakdown": True}, False),
    "accumulation": ({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}, False),
    "bf16": ({"bf16": {"enabled": True}}, False),
    "fp16": ({"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}}, False),
    "again": ({}, True),
}


def has_tensorboard():
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def monitors(root, job):
    """Each rank names its own folder (the monitors' paths may differ per rank): only rank 0's
    gets files."""
    mine = root / f"rank{dist.get_rank()}"
    cfg = {"csv_monitor": {"enabled": True, "output_path": str(mine / "csv"), "job_name": job}}
    if has_tensorboard():
        cfg["tensorboard"] = {"enabled": True, "output_path": str(mine / "tb"), "job_name": job}
    return cfg


def config(root, job, changes):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        **monitors(root, job),
    }
    cfg.update(changes)
    return cfg


def train(rank, cfg):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    dtype = engine.module[0].weight.dtype
    for step in range(STEPS * engine.gradient_accumulation_steps()):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(2, DIM, generator=g).to(dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    # a client's own event, through the engine's monitor
    engine.monitor.write_events(
        [("Client/global_steps", engine.global_steps, engine.global_samples)]
    )
    engine.destroy()


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def train_pipeline(rank, root):
    torch.manual_seed(7)
    layers = [LayerSpec(Block, DIM) for _ in range(4)] + [LayerSpec(nn.Linear, DIM, 1)]
    model = PipelineModule(
        layers=layers,
        num_stages=2,
        loss_fn=lambda y, t: F.mse_loss(y, t),
        partition_method="uniform",
    )
    # no clipping: DeepSpeed 0.19.8's pipeline clips each stage by stage 0's norm alone
    # (scripts/record_ds_pipe.py), which is not what this recording is about
    cfg = config(root, "pipe", {"gradient_accumulation_steps": 2, "gradient_clipping": 0.0})
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    g = torch.Generator().manual_seed(11)
    data = [(torch.randn(2, DIM, generator=g), torch.randn(2, 1, generator=g)) for _ in range(8)]
    for step in range(STEPS):
        engine.train_batch(iter(data[2 * step : 2 * step + 2]))
    engine.eval_batch(iter(data[6:8]))


def client_monitor(root):
    """A client's own MonitorMaster, from a ds_config's monitor sections."""
    master = MonitorMaster(get_monitor_config(monitors(root, "client")))
    master.write_events([("Client/accuracy", 0.75, 3), ("Client/accuracy", 0.5, 6)])
    master.write_events([("epoch", 1, 6)])


def read_events(path):
    """A TensorBoard event file as `[tag, step, value]` per scalar, in the order written."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    events = []
    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            events.append([value.tag, event.step, float(value.tensor.float_val[0])])
    return events


def files_under(root):
    """Every file under `root` by its path relative to it: a CSV file's rows, an event file's
    events under the job's directory (its name carries a time stamp and the host)."""
    found = {}
    if not root.exists():
        return found
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(root)
        if path.suffix == ".csv":
            with open(path, newline="") as f:
                found[str(rel)] = list(csv.reader(f))
        elif path.name.startswith("events.out.tfevents"):
            found.setdefault(str(rel.parent / "events"), []).extend(read_events(path))
        else:
            found[str(rel)] = "unexpected file"
    return found


def main(root=None):
    """The files each case leaves on this rank, by case; `root` is a folder every rank shares
    (default: a scratch folder under the system's temporary one)."""
    rank = dist.get_rank()
    base = Path(root) if root is not None else Path(tempfile.gettempdir()) / "ds_monitor_record"
    result = {"tensorboard": has_tensorboard(), "cases": {}}
    for name, (changes, twice) in CASES.items():
        for _ in range(2 if twice else 1):
            train(rank, config(base / name, name, changes))
        dist.barrier()
        result["cases"][name] = files_under(base / name)
    train_pipeline(rank, base / "pipe")
    dist.barrier()
    result["cases"]["pipe"] = files_under(base / "pipe")
    client_monitor(base / "client")
    dist.barrier()
    result["cases"]["client"] = files_under(base / "client")
    return result


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    # DeepSpeed refuses fp16 on a CPU without mkldnn fp16 (this machine's); its fp16 path itself
    # runs on the CPU (torch has the half kernels), so the recording lets it through.
    deepspeed.get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    scratch = Path(tempfile.gettempdir()) / f"ds_monitor_record_{os.environ.get('MASTER_PORT', '')}"
    record(main(scratch), FIXTURE, scratch=scratch)
