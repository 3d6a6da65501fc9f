"""DeepSpeed's `engine.offload_states()` / `reload_states()` / `empty_partition_cache()`, which
RLHF frameworks call around their generation phase, on 2 gloo ranks at stages 1 and 3.

Training with the three calls after every step must give the losses of the same run without
them; between `offload_states` and `reload_states`, `forward`, `backward` and `step` raise,
naming the fix (on a GPU their states would be gone; DeepSpeed lets the model run into freed
memory). The arguments are DeepSpeed's: `OffloadStateTypeEnum` members or their names,
`OffloadDeviceEnum.cpu`, `pin_memory`, `non_blocking`. On this CPU-only machine the states are
already in host memory and stay there, as DeepSpeed leaves them; the storage mechanism itself is
tested with its states moved (packages/zero/tests/test_parking.py).
"""

from __future__ import annotations

import pytest
import torch
from ds_gpt import GPT, batch

import minispeed.engine as deepspeed
from minispeed.core.testing import run_distributed
from minispeed.engine.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum


def _run(rank: int, world_size: int, stage: int, offload: bool) -> dict:
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(
        model=GPT(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}},
    )
    losses, refused = [], []
    for step in range(3):
        x, y = batch(step, 0, rank, world_size)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if offload:
            engine.empty_partition_cache()
            include = [OffloadStateTypeEnum.optim_states, "hp_params"] if step == 1 else None
            engine.offload_states(
                include=include, device=OffloadDeviceEnum.cpu, non_blocking=step == 2
            )
            for call in (lambda: engine(x, y), engine.step):  # noqa: B023 (called at once)
                try:
                    call()
                except RuntimeError as e:
                    refused.append(str(e))
            engine.reload_states()
    bad = []
    for kwargs in ({"device": "nvme"}, {"include": ["moments"]}):
        try:
            engine.offload_states(**kwargs)
        except ValueError as e:
            bad.append(str(e))
    return dict(losses=losses, refused=refused, bad=bad)


def _body(rank: int, world_size: int, stage: int) -> tuple[dict, dict]:
    return _run(rank, world_size, stage, False), _run(rank, world_size, stage, True)


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_and_reload_states_leave_training_unchanged(stage: int) -> None:
    for plain, offloaded in run_distributed(_body, world_size=2, timeout_s=180, args=(stage,)):
        assert offloaded["losses"] == plain["losses"]
        assert len(offloaded["refused"]) == 6  # forward and step, after each of 3 steps
        assert all("reload_states()" in m for m in offloaded["refused"]), offloaded["refused"]
        nvme, unknown = offloaded["bad"]
        assert "'cpu' only" in nvme
        assert "'moments'" in unknown and "optim_states" in unknown


def _pipeline_parked(rank: int, world_size: int) -> list[str]:
    from minispeed.engine.pipe import PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(
        layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)],
        num_stages=2,
        loss_fn=torch.nn.functional.mse_loss,
    )
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
    )
    data = iter([(torch.randn(2, 4), torch.randn(2, 2))] * 4)
    engine.train_batch(data)
    engine.offload_states()
    refused = []
    for call in (lambda: engine.train_batch(data), lambda: engine.eval_batch(data)):
        try:
            call()
        except RuntimeError as e:
            refused.append(str(e))
    engine.reload_states()
    engine.train_batch(data)  # trains again
    return refused


def test_a_pipeline_refuses_to_run_while_its_states_are_offloaded() -> None:
    for refused in run_distributed(_pipeline_parked, world_size=2, timeout_s=120):
        assert len(refused) == 2 and all("reload_states()" in m for m in refused), refused
