"""The engine's loop on 2 gloo ranks against single-process PyTorch on the same global batch, and
DeepSpeed's loop semantics: counters, boundaries, the scheduler skipping fp16 overflows, callables
for the optimizer and scheduler, `--deepspeed_config`, the training data loader."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from ds_gpt import GPT, batch
from torch import nn

import minispeed.engine as deepspeed
from minispeed.core.config import ConfigError
from minispeed.core.testing import run_distributed

GAS, STEPS, LR = 2, 4, 3e-3


def _lambda(step: int) -> float:
    return 1.0 / (1 + step)


def _config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage},
        **extra,
    }


def _engine_run(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _lambda),
        config=_config(stage),
    )
    losses, boundaries = [], []
    for step in range(STEPS):
        for micro in range(GAS):
            boundaries.append(engine.is_gradient_accumulation_boundary())
            x, y = batch(step, micro, rank, world_size)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return {
        "losses": losses,
        "boundaries": boundaries,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "lr": engine.get_lr(),
        "norm": engine.get_global_grad_norm(),
        "stage": engine.zero_optimization_stage(),
        "sizes": (engine.train_batch_size(), engine.gradient_accumulation_steps()),
    }


def _torch_reference(world_size: int) -> tuple[list[list[float]], list[float]]:
    """Plain PyTorch: the same global batch (every rank's micro-batches) in one process."""
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    per_rank: list[list[float]] = [[] for _ in range(world_size)]
    for step in range(STEPS):
        for micro in range(GAS):
            for rank in range(world_size):
                x, y = batch(step, micro, rank, world_size)
                loss = model(x, y)
                (loss / (GAS * world_size)).backward()
                per_rank[rank].append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
    return per_rank, sched.get_last_lr()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_matches_pytorch(stage: int) -> None:
    results = run_distributed(_engine_run, world_size=2, args=(stage,), timeout_s=180)
    ref, ref_lr = _torch_reference(2)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["losses"], ref[rank], rtol=1e-5, atol=1e-6)
        assert r["boundaries"] == [False, True] * STEPS
        assert r["global_steps"] == STEPS and r["global_samples"] == STEPS * 4 * GAS * 2
        assert r["lr"] == pytest.approx(ref_lr, rel=1e-12)
        assert r["norm"] is not None and r["norm"] > 0
        assert r["stage"] == stage and r["sizes"] == (16, GAS)


def _overflow_run(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = GPT()
    counted = []

    def blow_up(grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf") if not counted else grad

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "fp16": {"enabled": True, "initial_scale_power": 8},
        },
    )
    handle = model.head.weight.register_hook(blow_up)
    x, y = batch(0, 0, rank, world_size)
    engine.backward(engine(x, y))
    engine.step()  # overflow: skipped, the scheduler must not move
    counted.append(1)
    after_overflow = (engine.global_steps, engine.skipped_steps, engine.get_lr())
    # what accelerate reads: `optimizer.overflow` (optimizer_step_was_skipped) and the norm
    # the Trainer logs, infinite as DeepSpeed's optimizers report it
    skipped = (engine.optimizer.overflow, engine.get_global_grad_norm())
    engine.backward(engine(x, y))
    engine.step()
    handle.remove()
    stepped = (engine.optimizer.overflow, engine.get_global_grad_norm())
    return {
        "after_overflow": after_overflow,
        "after_step": (engine.global_steps, engine.get_lr()),
        "skipped": skipped,
        "stepped": stepped,
    }


def test_scheduler_does_not_step_on_fp16_overflow() -> None:
    r = run_distributed(_overflow_run, world_size=2, timeout_s=120)[0]
    assert r["after_overflow"] == (1, 1, [0.1])
    assert r["after_step"][0] == 2 and r["after_step"][1] == pytest.approx([0.05])
    assert r["skipped"] == (True, math.inf)
    assert r["stepped"][0] is False and 0 < r["stepped"][1] < math.inf


def _args_run(rank: int, world_size: int, path: str) -> dict:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    model = nn.Linear(4, 2)
    engine, _, loader, _ = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=model.parameters(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        training_data=torch.utils.data.TensorDataset(torch.arange(20.0).view(10, 2)),
    )
    seen = [b[0][:, 0].tolist() for b in loader]
    with pytest.raises(ConfigError, match="given twice"):
        deepspeed.initialize(args=args, model=nn.Linear(4, 2), config={"train_batch_size": 2})
    return {"train_batch": engine.train_batch_size(), "seen": seen}


def test_deepspeed_config_argument_and_training_data(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    results = run_distributed(_args_run, world_size=2, args=(str(path),), timeout_s=120)
    assert all(r["train_batch"] == 6 for r in results)
    # Each rank gets its own half of the 10 samples, in micro-batches of 3 (DistributedSampler).
    seen = [sorted(x for b in r["seen"] for x in b) for r in results]
    assert sorted(seen[0] + seen[1]) == [float(2 * i) for i in range(10)]
    assert [len(b) for b in results[0]["seen"]] == [3, 2]


def _sgd_engine(config: dict):
    """The GPT from seed 0 under SGD(lr=0.1), built by `initialize` from `config`."""
    torch.manual_seed(0)
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    return engine


def _observers_run(rank: int, world_size: int) -> dict:
    engine = _sgd_engine(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 1},
            "comms_logger": {"enabled": True},
            "wall_clock_breakdown": True,
            "steps_per_print": 2,
        }
    )
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("minispeed.engine").addHandler(handler)
    for step in range(2):
        x, y = batch(step, 0, rank, world_size)
        engine.backward(engine(x, y))
        engine.step()
    logging.getLogger("minispeed.engine").removeHandler(handler)
    steps = {r.step for r in engine.comms_logger.records}
    engine.destroy()
    return {
        "ops": sorted({r.op for r in engine.comms_logger.records}),
        "steps": steps,
        "log": records,
    }


def test_comms_logger_timers_and_steps_per_print() -> None:
    results = run_distributed(_observers_run, world_size=2, timeout_s=120)
    assert results[0]["ops"], "the comms logger recorded no collective"
    assert {0, 1} <= results[0]["steps"]  # one logger step per optimizer step
    (line,) = [m for m in results[0]["log"] if m.startswith("step=2")]
    assert "forward=" in line and "backward=" in line and "lr=[0.1]" in line
    # DeepSpeed's progress and throughput lines: momenta, samples/s, memory
    assert "mom=[0]" in line and "samples/s" in line and "GiB (peak" in line, line
    assert results[1]["log"] == []  # rank 0 prints


def _profiled_run(rank: int, world_size: int, path: str) -> bool:
    path = path.format(rank=rank)
    engine = _sgd_engine(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": path},
        }
    )
    written_after = []
    for step in range(3):
        for micro in range(2):
            x, y = batch(step, micro, rank, world_size)
            engine.backward(engine(x, y))
            engine.step()
        written_after.append(Path(path).exists())
    return written_after


def test_flops_profiler_profiles_the_configured_step(tmp_path) -> None:
    """`flops_profiler.profile_step: 1` profiles optimizer step 1 (counting from 0), both of its
    micro-batches, and writes the report when that step ends, on rank 0 only (DeepSpeed's
    engine profiles global rank 0 alone: one report, not one per rank)."""
    template = str(tmp_path / "profile_{rank}.json")
    results = run_distributed(_profiled_run, world_size=2, args=(template,), timeout_s=120)
    assert results == [[False, True, True], [False, False, False]]
    path = Path(template.format(rank=0))
    profile = json.loads(path.read_text())
    # Both micro-batches of the step: twice one forward's matmul FLOPs (torch's own counter)
    # plus the elementwise work torch's counter leaves out (softmax, norms, GELU: under 1/2).
    from torch.utils.flop_counter import FlopCounterMode

    x, y = batch(0, 0, 0, 2)
    with FlopCounterMode(display=False) as counter:
        GPT()(x, y)
    matmuls = counter.get_total_flops()
    assert 2 * matmuls <= profile["forward"]["flops"] < 3 * matmuls
    assert profile["backward"]["flops"] > profile["forward"]["flops"]


def _checkpointing_run(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    from minispeed.engine import checkpointing

    before = checkpointing.is_configured()
    deepspeed.initialize(
        model=nn.Linear(2, 2),
        config={
            "train_batch_size": 2,
            "activation_checkpointing": {"cpu_checkpointing": True},
        },
    )
    return before, checkpointing.is_configured(), checkpointing._SETTINGS.cpu_checkpointing


def test_activation_checkpointing_section_configures_deepspeeds_checkpointing() -> None:
    for before, after, cpu in run_distributed(_checkpointing_run, world_size=1, timeout_s=60):
        assert (before, after, cpu) == (False, True, True)


def _not_callable(rank: int, world_size: int) -> list[str]:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD"}}
    errors = []
    for given in ({"optimizer": 3}, {"lr_scheduler": "warmup"}):
        model = torch.nn.Linear(2, 2)
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                 **given)  # fmt: skip
        except TypeError as e:
            errors.append(str(e))
    return errors


def test_optimizer_and_scheduler_arguments_that_are_not_callable_are_refused_by_name() -> None:
    (errors,) = run_distributed(_not_callable, world_size=1, timeout_s=60)
    assert errors == [
        "optimizer= must be a torch.optim.Optimizer or a callable of the model parameters, got int",
        "lr_scheduler= must be a scheduler or a callable of the optimizer, got str",
    ]


def _compile_refused_run(rank: int, world_size: int) -> tuple[str, str, str]:
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_config(3)
    )
    refused = []
    for asked in ({"schedule": [(0, [])]}, {"compiled_autograd_enabled": True}):
        with pytest.raises(NotImplementedError) as error:
            engine.compile(backend="eager", **asked)
        refused.append(str(error.value))
    assert not engine.is_compiled
    import minispeed.engine.pipe as pipe

    stages = pipe.PipelineModule([pipe.LayerSpec(nn.Linear, 4, 4) for _ in range(2)], num_stages=2)
    engine, _, _, _ = deepspeed.initialize(
        model=stages, optimizer=torch.optim.SGD(stages.parameters(), lr=0.1),
        config={"train_batch_size": 2},
    )  # fmt: skip
    with pytest.raises(NotImplementedError) as pipeline_refused:
        engine.compile()
    return refused[0], refused[1], str(pipeline_refused.value)


def test_compile_is_refused_by_name_for_deepcompile_and_on_a_pipeline() -> None:
    """engine.compile (the Trainer's torch_compile=True) works at every stage
    (test_compat_clients.py's compile_z2 and compile_z3, test_engine_compile.py); a deepcompile
    schedule, compiled autograd and a pipeline say why not, naming what the user asked for."""
    runs = run_distributed(_compile_refused_run, world_size=2, timeout_s=120)
    for schedule, compiled_autograd, pipeline in runs:
        assert "engine.compile(schedule=...)" in schedule
        assert "compile.deepcompile" in schedule
        assert "engine.compile(compiled_autograd_enabled=True)" in compiled_autograd
        assert "torch_compile=False" in compiled_autograd
        assert "pipeline schedule" in pipeline
