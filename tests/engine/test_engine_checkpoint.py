"""Engine checkpoints: saved on 2 ranks, loaded on 1 (another data-parallel size) with the same
evaluation and the scheduler mid-schedule; `latest`, `client_state`, `load_module_only`, and a
checkpoint of another model refused by name."""

from __future__ import annotations

import pytest
import torch
from ds_gpt import GPT, batch

import minispeed.engine as deepspeed
from minispeed.core.testing import run_distributed


def _engine(stage: int, world_size: int):
    torch.manual_seed(0)
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        config={"train_batch_size": 4, "zero_optimization": {"stage": stage}},
    )
    return engine


def _evaluate(engine) -> float:
    engine.eval()
    with torch.no_grad():
        x, y = batch(99, 0, 0, 1)
        loss = engine(x, y).item()
    engine.train()
    return loss


def _save(rank: int, world_size: int, stage: int, path: str) -> dict:
    engine = _engine(stage, world_size)
    for step in range(3):
        x, y = batch(step, 0, rank, world_size)
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(path, client_state={"epoch": 7})
    engine.save_checkpoint(path, tag="not_latest", save_latest=False)
    return {"eval": _evaluate(engine), "lr": engine.get_lr(), "steps": engine.global_steps}


def _load(rank: int, world_size: int, stage: int, path: str) -> dict:
    engine = _engine(stage, world_size)
    fresh = _evaluate(engine)
    where, client = engine.load_checkpoint(path)
    out = {
        "fresh": fresh,
        "eval": _evaluate(engine),
        "lr": engine.get_lr(),
        "steps": engine.global_steps,
        "where": where,
        "client": client,
    }
    only = _engine(stage, world_size)
    only.load_checkpoint(path, load_module_only=True)
    out["module_only"] = (_evaluate(only), only.global_steps, only.get_lr())
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_saved_on_two_ranks_loads_on_one(tmp_path, stage: int) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, world_size=2, args=(stage, path), timeout_s=120)[0]
    (loaded,) = run_distributed(_load, world_size=1, args=(stage, path), timeout_s=120)
    assert loaded["fresh"] != pytest.approx(saved["eval"], abs=1e-4)  # training changed the model
    assert loaded["eval"] == pytest.approx(saved["eval"], abs=1e-5)
    assert loaded["lr"] == pytest.approx(saved["lr"]) and saved["lr"] == pytest.approx([5e-3])
    assert loaded["steps"] == saved["steps"] == 3
    # `latest`, not the tag saved without it; the file's name is DeepSpeed's (stage 3: by rank)
    states = "zero_pp_rank_0_mp_rank_00" if stage == 3 else "mp_rank_00"
    assert loaded["where"] == f"{path}/global_step3/{states}_model_states.pt"
    assert loaded["client"] == {"epoch": 7}
    module_eval, module_steps, module_lr = loaded["module_only"]
    assert module_eval == pytest.approx(saved["eval"], abs=1e-5)
    assert module_steps == 0 and module_lr == pytest.approx([1e-2])  # counters, scheduler kept


def _other_model(rank: int, world_size: int, path: str) -> str:
    model = torch.nn.Linear(3, 3)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={"train_batch_size": 2},
    )
    assert engine.load_checkpoint(path + "_missing") == (None, None)  # no `latest`: a warning
    with pytest.raises(Exception) as e:
        engine.load_checkpoint(path)
    return str(e.value)


def test_checkpoint_of_another_model_is_refused_by_name(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save, world_size=2, args=(1, path), timeout_s=120)
    messages = run_distributed(_other_model, world_size=2, args=(path,), timeout_s=120)
    for message in messages:
        assert "weight" in message or "tok" in message, message


def _sixteen_bit(rank: int, world_size: int, path: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)  # frozen: left out by exclude_frozen_parameters
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        config={"train_batch_size": 4, "zero_optimization": {"stage": 3}},
    )  # stage3_gather_16bit_weights_on_model_save left false
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        whole = {k: v.clone() for k, v in engine.module.state_dict().items()}
    return {
        "saved": engine.save_16bit_model(path),
        "state": None if state is None else {k: torch.equal(v, whole[k]) for k, v in state.items()},
    }


def test_zero3_16bit_state_dict_and_save_as_deepspeed(tmp_path) -> None:
    """Without `stage3_gather_16bit_weights_on_model_save`, DeepSpeed's
    `_zero3_consolidated_16bit_state_dict` still gathers (the Trainer calls it to save a PEFT
    adapter under ZeRO-3), rank 0 holding every parameter and the others None, while
    `save_16bit_model` writes nothing and returns False."""
    ranks = run_distributed(_sixteen_bit, world_size=2, args=(str(tmp_path),), timeout_s=120)
    assert ranks[1]["state"] is None
    assert ranks[0]["state"] == {"0.weight": True, "1.weight": True, "1.bias": True}
    assert [r["saved"] for r in ranks] == [False, False]
    assert not any(tmp_path.iterdir())
