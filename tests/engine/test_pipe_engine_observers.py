"""The config keys that observe a run have their effect with a `PipelineModule` too, as with any
model (tests/engine/test_engine_loop.py): `comms_logger` records every collective of each
`train_batch` under its step, `wall_clock_breakdown` and `steps_per_print` print forward,
backward and step times with the learning rate on rank 0, and `flops_profiler` profiles the
configured step on global rank 0 (its stage) and writes its report when that step ends.

Before, the pipeline engine read these keys, checked them, and did nothing with them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from minispeed.core.testing import run_distributed

WIDTH, MICRO, GAS = 8, 2, 2


def _engine(config: dict):
    import minispeed.engine as deepspeed
    from minispeed.engine.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(nn.Linear, WIDTH, WIDTH) for _ in range(4)]
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


def _profiled(rank: int, world_size: int, path: str) -> list[bool]:
    path = path.format(rank=rank)
    engine = _engine({"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": path}})
    written = []
    for step in range(3):
        engine.train_batch(iter(_batches(step)))
        written.append(Path(path).exists())
    return written


def test_flops_profiler_profiles_the_configured_pipeline_step(tmp_path) -> None:
    """Step 1 (counting from 0) is profiled on global rank 0, stage 0: its two linear layers'
    forward FLOPs for the step's two micro-batches, 2·MICRO·WIDTH² multiply-adds each, plus
    their biases, and nothing of the loop's own work."""
    template = str(tmp_path / "profile_{rank}.json")
    results = run_distributed(_profiled, world_size=2, args=(template,), timeout_s=180)
    assert results == [[False, True, True], [False, False, False]]
    profile = json.loads(Path(template.format(rank=0)).read_text())
    matmuls = GAS * 2 * (2 * MICRO * WIDTH * WIDTH)  # micro-batches x layers x 2·m·k·n
    # The layers' forward and nothing else: ZeRO's gradient bookkeeping and the optimizer's step
    # run outside every module and are not the model's forward (DeepSpeed's profile neither).
    assert profile["forward"]["flops"] == matmuls + GAS * 2 * MICRO * WIDTH  # + the biases' adds
    assert profile["outside_modules"]["forward_flops"] == 0
    assert profile["backward"]["flops"] > 0
