"""The config keys that observe a run have their effect with a `PipelineModule` too, as with any
model (tests/engine/test_engine_loop.py): `comms_logger` records every collective of each
`train_batch` under its step, `wall_clock_breakdown` and `steps_per_print` print forward,
backward and step times with the learning rate on rank 0, and `flops_profiler` profiles the
configured step on global rank 0 (its stage) and writes its report when that step ends.

Before, the pipeline engine read these keys, checked them, and did nothing with them.

The pipeline is scripts/record_ds_pipe_profile.py's: three bias-free `Linear(8, 8)` with a plain
function (a `lambda`) after the first, cut uniformly, so stage 0 holds a `Linear` and the lambda.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from minispeed.core.testing import run_distributed

WIDTH, MICRO, GAS = 8, 2, 2


FIXTURE = Path(__file__).parent / "fixtures" / "ds_pipe_profile.json"


def _engine(config: dict):
    import minispeed.engine as deepspeed
    from minispeed.engine.pipe import LayerSpec, PipelineModule

    linear = LayerSpec(nn.Linear, WIDTH, WIDTH, bias=False)
    layers = [linear, lambda x: torch.mul(nn.functional.relu(x), 2.0), linear, linear]
    model = PipelineModule(
        layers, num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True,
        partition_method="uniform",
    )  # fmt: skip
    base = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=base | config
    )
    return engine


def _batches(step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g))
            for _ in range(GAS)]  # fmt: skip


def _observed(rank: int, world_size: int) -> dict:
    engine = _engine(
        {"comms_logger": {"enabled": True}, "wall_clock_breakdown": True, "steps_per_print": 2}
    )
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("minispeed.engine").addHandler(handler)
    for step in range(2):
        engine.train_batch(iter(_batches(step)))
    logging.getLogger("minispeed.engine").removeHandler(handler)
    records = engine.comms_logger.records
    engine.destroy()
    return {
        "ops": sorted({r.op for r in records}),
        "steps": sorted({r.step for r in records}),
        "log": lines,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
    }


def test_comms_logger_timers_and_steps_per_print_with_a_pipeline() -> None:
    results = run_distributed(_observed, world_size=2, timeout_s=180)
    for r in results:
        assert r["global_steps"] == 2 and r["micro_steps"] == 2 * GAS
        assert {"send", "recv"} <= set(r["ops"]), r["ops"]  # the stages' activations
        assert r["steps"] == [0, 1]  # one logger step per train_batch
    (line,) = [m for m in results[0]["log"] if m.startswith("step=2")]
    assert "forward=" in line and "backward=" in line and "step=" in line and "lr=[0.1]" in line
    assert "loss=" in line and "samples/s" in line, line  # DeepSpeed's pipeline line: the loss
    assert results[1]["log"] == []  # rank 0 prints


def _profiled(rank: int, world_size: int, path: str) -> dict:
    path = path.format(rank=rank)
    engine = _engine({"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": path}})
    written = []
    for step in range(3):
        engine.train_batch(iter(_batches(step)))
        written.append(Path(path).exists())
    return {"written": written, "stage": engine.stage_id, "parts": engine.module.parts}


def test_flops_profiler_profiles_the_configured_pipeline_step(tmp_path) -> None:
    """Step 1 (counting from 0) is profiled on global rank 0, stage 0: the forward of its
    `Linear` and of its plain-function layer (a `lambda`: relu, then ×2), for each of the step's
    two micro-batches, as DeepSpeed 0.19.8 counts one forward of that stage (recorded), and
    nothing of the loop's own work. Before, the lambda's work ran while no module of the model
    ran and was left out (256 of 288 FLOPs per micro-batch)."""
    template = str(tmp_path / "profile_{rank}.json")
    results = run_distributed(_profiled, world_size=2, args=(template,), timeout_s=180)
    assert [r["written"] for r in results] == [[False, True, True], [False, False, False]]
    (recorded, _) = json.loads(FIXTURE.read_text())["ranks"]
    assert (results[0]["stage"], results[0]["parts"]) == (recorded["stage"], recorded["parts"])
    profile = json.loads(Path(template.format(rank=0)).read_text())
    # Per micro-batch: the Linear's 2·m·k·n, the lambda's relu and mul (m·k each). DeepSpeed's
    # engine profile restarts at every forward (start_profile resets), so it reports one
    # micro-batch; minispeed's is the step's, GAS micro-batches.
    m, k = MICRO, WIDTH
    assert recorded["forward_flops"] == 2 * m * k * k + 2 * m * k
    assert profile["forward"]["flops"] == GAS * recorded["forward_flops"]
    assert profile["forward"]["macs"] == GAS * recorded["forward_macs"]
    # The model's forward and nothing else: ZeRO's gradient bookkeeping and the optimizer's step
    # run outside every module and are not the model's forward (DeepSpeed's profile neither).
    assert profile["outside_modules"]["forward_flops"] == 0
    # The stage's backward: the weight's gradient (the input needs none), relu's and ×2's.
    assert profile["backward"]["flops"] == GAS * (2 * m * k * k + 2 * m * k)
