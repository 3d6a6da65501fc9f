"""The config's sections reach the packages: the same engine loop under mixed precision, CPU and
NVMe offload and ZeRO++ trains what the fp32 run trains (2 gloo ranks, one run for every row)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ds_gpt import GPT, batch
from torch import nn

import minispeed.engine as deepspeed
from minispeed.core.testing import run_distributed

STEPS = 4


def _rows(nvme: str) -> dict[str, dict]:
    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    return {
        "stage2 fp32": {**base, "zero_optimization": {"stage": 2}},
        "stage2 offload cpu": {
            **base,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "zero_force_ds_cpu_optimizer": False,  # offload steps the torch AdamW below
        },
        "stage3 offload nvme": {
            **base,
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                "offload_param": {"device": "cpu"},
            },
        },
        "stage3 qwZ": {**base, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
        "stage1 bf16": {**base, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
        "stage3 fp16": {
            **base,
            "zero_optimization": {"stage": 3},
            "fp16": {"enabled": True, "initial_scale_power": 12},
        },
    }


def _train(rank: int, world_size: int, nvme: str) -> dict[str, list[float]]:
    out = {}
    Path(f"{nvme}/rank{rank}").mkdir(parents=True, exist_ok=True)
    for name, config in _rows(f"{nvme}/rank{rank}").items():
        torch.manual_seed(0)
        model = GPT()
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
            config=config,
        )
        losses = []
        for step in range(STEPS):
            for micro in range(2):
                x, y = batch(step, micro, rank, world_size)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.float().item())
        out[name] = {
            "losses": losses,
            "stage": engine.zero_optimization_stage(),
            "skipped": engine.skipped_steps,
        }
        engine.destroy()
    return out


def test_every_section_trains_what_fp32_trains(tmp_path) -> None:
    results = run_distributed(_train, world_size=2, args=(str(tmp_path),), timeout_s=400)
    for r in results:
        ref = r["stage2 fp32"]["losses"]
        for name, row in r.items():
            assert row["skipped"] == 0, name
            # Offload steps the same fp32 masters: equal. qwZ quantizes the gathered weights
            # (int8 blocks), bf16/fp16 round the model (a bf16 loss near 4 is a multiple of
            # 2**-5): close.
            tol = {"offload": 1e-5, "qwZ": 2e-2, "bf16": 5e-2, "fp16": 1e-2}
            atol = next((t for key, t in tol.items() if key in name), 1e-6)
            torch.testing.assert_close(row["losses"], ref, rtol=0, atol=atol, msg=name)
        assert r["stage3 offload nvme"]["stage"] == 3


@pytest.mark.parametrize("bad", ["nvme_missing", "nvme_path_type"])
def test_offload_sections_are_checked_before_any_collective(bad: str) -> None:
    from minispeed.core.config import ConfigError
    from minispeed.engine.config import EngineConfig

    section = (
        {"stage": 2, "offload_optimizer": {"device": "nvme"}}
        if bad == "nvme_missing"
        else {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": 7}}
    )
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_ds_config({"train_batch_size": 2, "zero_optimization": section})
    assert e.value.path == (  # the key to fix, as written
        "zero_optimization.offload_optimizer.nvme_path"
        if bad == "nvme_missing"
        else "zero_optimization.offload_param.nvme_path"
    )


def test_an_offload_the_stage_cannot_honour_is_dropped_as_deepspeed_drops_it() -> None:
    from minispeed.engine.config import EngineConfig

    section = {"stage": 1, "offload_param": {"device": "cpu"}}
    cfg = EngineConfig.from_ds_config({"train_batch_size": 2, "zero_optimization": section})
    assert cfg.zero.offload_param is None


def _client_optimizer_run(rank: int, world_size: int) -> dict[str, str]:
    from minispeed.core.config import ConfigError
    from minispeed.engine.ops.adam import DeepSpeedCPUAdam

    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    rows = {
        "torch AdamW": ({}, torch.optim.AdamW),
        "torch AdamW, forcing off": ({"zero_force_ds_cpu_optimizer": False}, torch.optim.AdamW),
        "DeepSpeedCPUAdam": ({}, DeepSpeedCPUAdam),
    }
    out = {}
    for name, (extra, make) in rows.items():
        model = nn.Linear(4, 4)
        config = {"train_batch_size": 2, "zero_optimization": offload, **extra}
        try:
            engine, _, _, _ = deepspeed.initialize(
                model=model, optimizer=make(model.parameters(), lr=0.1), config=config
            )
        except ConfigError as e:
            out[name] = f"{e.path}: {e.reason}"
            continue
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        out[name] = type(engine.optimizer.optimizer).__name__
        engine.destroy()
    return out


def test_offload_refuses_a_client_torch_optimizer_unless_zero_force_ds_cpu_optimizer_is_false():
    """DeepSpeed's `zero_force_ds_cpu_optimizer` (true by default): under ZeRO-Offload an
    optimizer the script passes must be a CPU optimizer; false lets offload step torch's."""
    (out,) = run_distributed(_client_optimizer_run, world_size=1, timeout_s=120)
    refused = out["torch AdamW"]
    assert refused.startswith("zero_force_ds_cpu_optimizer: true (DeepSpeed's default) refuses")
    assert "AdamW" in refused and "set zero_force_ds_cpu_optimizer to false" in refused
    assert out["torch AdamW, forcing off"] != refused and out["DeepSpeedCPUAdam"] != refused
