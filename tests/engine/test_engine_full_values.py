"""DeepSpeed's `safe_get_full_*` / `safe_set_full_*` (`minispeed.engine.utils`, over
`minispeed.zero.full_values`) on 2 gloo ranks.

- `scripts/record_ds_full_values.py`, run with its imports changed, against what DeepSpeed
  0.19.8 recorded: every parameter's full gradient at each window's boundary, full fp32 master
  and Adam moments after each step, at ZeRO stages 1, 2 and 3, and the values read back after a
  set.
- What a set does next (Note [a set value reaches the model now] in zero/full_values.py): a
  halved head weight and a zeroed Adam moment, set between steps, give the losses plain PyTorch
  gives with the same in-place edits on its own model and optimizer, at every stage; so do
  gradients set between the last backward and the step (`safe_set_full_grad`,
  `safe_set_local_grad` on every rank, `safe_update_full_grad_vectorized`) and a doubled second
  moment written fragment by fragment (`safe_set_local_optimizer_state`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_full_values.json"
IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.utils import (\n": "from minispeed.engine.utils import (\n",
}


def _script(rank, world_size):
    return ds_scripts.load("record_ds_full_values.py", IMPORTS).main()


def test_full_values_script_matches_deepspeed():
    runs = run_distributed(_script, world_size=2, timeout_s=300)
    for ours, ref in zip(runs, json.loads(FIXTURE.read_text())["ranks"], strict=True):
        ds_scripts.assert_matches(ours, ref, rel=2e-5)  # values kept to 6 significant digits


IN, DIM, CLASSES, MICRO, STEPS, EDIT_AFTER = 5, 8, 3, 4, 5, 1


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + step)
    x = torch.randn(MICRO, IN, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(IN, DIM), nn.Tanh(), nn.Linear(DIM, CLASSES))


def _edited_training(rank: int, world_size: int, stage: int) -> list[float]:
    import minispeed.engine as deepspeed
    from minispeed.engine.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_grad,
        safe_set_local_optimizer_state,
        safe_update_full_grad_vectorized,
    )

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    model = _model()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    head = engine.module[2].weight
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        if step == EDIT_AFTER + 1:  # gradients, before the step's clipping sees them
            safe_set_full_grad(head, safe_get_full_grad(head) * 0.5)
            bias = engine.module[2].bias
            safe_set_local_grad(bias, torch.zeros_like(safe_get_local_grad(bias)))
        if step == EDIT_AFTER + 2:
            safe_update_full_grad_vectorized([engine.module[0].weight], lambda g, p: g * 3)
        norms.append(float(safe_get_full_grad(head).norm()))
        engine.step()
        assert safe_get_full_grad(head) is None  # after step(): no reduced gradient exists
        losses.append(loss.item())
        if step == EDIT_AFTER:
            safe_set_full_fp32_param(head, safe_get_full_fp32_param(head) * 0.5)
            safe_set_full_optimizer_state(head, torch.zeros(CLASSES, DIM), "exp_avg")
            second = safe_get_local_optimizer_state(head, "exp_avg_sq")
            safe_set_local_optimizer_state(head, second * 2, "exp_avg_sq")
    engine.destroy()
    return losses + norms


def _plain(world_size: int) -> list[float]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    losses, norms = [[0.0] * STEPS for _ in range(world_size)], []
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world_size):
            x, y = _batch(rank, step)
            loss = F.cross_entropy(model(x), y)
            (loss / world_size).backward()
            losses[rank][step] = loss.item()
        if step == EDIT_AFTER + 1:
            model[2].weight.grad.mul_(0.5)
            model[2].bias.grad.zero_()
        if step == EDIT_AFTER + 2:
            model[0].weight.grad.mul_(3)
        norms.append(float(model[2].weight.grad.norm()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == EDIT_AFTER:
            with torch.no_grad():
                model[2].weight.mul_(0.5)
            opt.state[model[2].weight]["exp_avg"].zero_()
            opt.state[model[2].weight]["exp_avg_sq"].mul_(2)
    return [ls + norms for ls in losses]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_value_set_between_steps_trains_as_the_same_edit_in_plain_pytorch(stage):
    got = run_distributed(_edited_training, world_size=2, args=(stage,), timeout_s=240)
    for ours, plain in zip(got, _plain(2), strict=True):
        assert ours == pytest.approx(plain, rel=1e-5, abs=1e-6), (ours, plain)


def test_bf16_gradients_and_masters_come_back_in_fp32():
    """bf16 parameters, fp32 masters: the full gradient is the fp32 reduced one and the set
    value reaches both the bf16 parameter (rounded) and the master (exact)."""
    got = run_distributed(_bf16_body, world_size=2, timeout_s=240)
    assert got[0] == got[1]


def _adamw(model: nn.Module, zero: dict, **config) -> object:
    """The engine of `model`'s trainable parameters under AdamW (lr 0.01) and ZeRO `zero`."""
    import minispeed.engine as deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": zero,
            **config,
        },
    )
    return engine


def _bf16_body(rank: int, world_size: int) -> list:
    from minispeed.engine.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    engine = _adamw(_model(), {"stage": 2}, bf16={"enabled": True})
    head = engine.module[2].weight
    value = torch.linspace(-1, 1, CLASSES * DIM).reshape(CLASSES, DIM) / 3
    safe_set_full_fp32_param(head, value)
    master = safe_get_full_fp32_param(head)
    assert master.dtype == torch.float32 and torch.equal(master, value)
    assert head.dtype == torch.bfloat16 and torch.equal(head.detach(), value.bfloat16())
    engine.destroy()
    return master.tolist()


def _bad_input(rank: int, world_size: int) -> list[str]:
    from minispeed.engine.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
    )

    model = _model()
    model[0].bias.requires_grad_(False)
    engine = _adamw(model, {"stage": 2})
    head = engine.module[2].weight
    errors = []
    assert safe_get_full_fp32_param(model[0].bias) is None  # frozen: no master
    assert safe_get_full_optimizer_state(head, "exp_avg") is None  # before the first step
    for call in (
        lambda: safe_set_full_fp32_param(model[0].bias, torch.zeros(DIM)),
        lambda: safe_set_full_fp32_param(head, torch.zeros(DIM, CLASSES)),
    ):
        with pytest.raises(ValueError) as err:
            call()
        errors.append(str(err.value))
    with pytest.raises(RuntimeError) as err:  # no reduced gradient before backward
        safe_set_full_grad(head, torch.zeros(CLASSES, DIM))
    errors.append(str(err.value))
    x, y = _batch(rank, 0)
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()
    with pytest.raises(KeyError) as err:
        safe_get_full_optimizer_state(head, "momentum_buffer")
    errors.append(str(err.value))
    engine.destroy()
    import minispeed.zero.offload_bridge as bridge

    bridge.ALWAYS_COPY = True  # the host copies a GPU's offload makes, on the CPU
    try:
        engine = _adamw(_model(), {"stage": 2, "offload_optimizer": {"device": "cpu"}})
    finally:
        bridge.ALWAYS_COPY = False  # the worker process serves later tests too
    engine.backward(F.cross_entropy(engine(x), y))
    with pytest.raises(NotImplementedError) as err:  # the step reads a host copy
        safe_set_full_grad(engine.module[2].weight, torch.zeros(CLASSES, DIM))
    errors.append(str(err.value))
    engine.destroy()
    return errors


def test_bad_input_names_the_problem():
    frozen, shape, early, key, offload = run_distributed(_bad_input, world_size=2, timeout_s=240)[0]
    assert "not stepped by an open ZeroOptimizer" in frozen
    assert "expected (3, 8)" in shape and "(8, 3)" in shape
    assert "no reduced gradient now" in early and "before step()" in early
    assert "'momentum_buffer'" in key and "exp_avg" in key
    assert "offload_optimizer" in offload and "would be lost" in offload
