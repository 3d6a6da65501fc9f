"""DeepSpeed's documented surface that scripts and tests written against DeepSpeed use, on 2 gloo
ranks: each answers with DeepSpeed's meaning (or refuses by name, on every rank).

- `init_distributed(dist_backend, init_method="file://...", rank=r, world_size=n)`;
- `engine.backward` returns `loss / gradient_accumulation_steps` (`scale_wrt_gas=False`: the
  loss as given, the caller having divided it, as the Trainer does);
- `set_gradient_accumulation_boundary`: a window ended early (an epoch's last, short window,
  as accelerate ends it) steps with the gradients it has, each divided by the accumulation
  steps as DeepSpeed divides them: equal to plain PyTorch doing the same;
- `engine.no_sync()` at stage 1 (and `step()` inside it refused), refused at stage 2;
- `checkpoint.tag_validation`: `FAIL` raises on every rank when the ranks name different tags,
  `WARN` warns, `IGNORE` does not check (either way the save then refuses a tag directory not
  every rank shares, naming it: DeepSpeed would write one per rank); another value is a config
  error;
- `get_accelerator().device_count()` is the number of processes on the node on the CPU;
- `save_checkpoint(None)` / `save_checkpoint("")` are `ValueError`s and write nothing;
- `unwrap_model_for_generation` holds a ZeRO-3 model gathered inside, released after.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from minispeed.core.testing import run_distributed

LR = 0.1


def _rendezvous(rank: int, world_size: int, path: str) -> float:
    import torch.distributed as dist

    import minispeed.engine as deepspeed

    dist.destroy_process_group()  # the harness's group: rendezvous again, by file
    deepspeed.init_distributed(
        "gloo", init_method=f"file://{path}", rank=rank, world_size=world_size
    )
    t = torch.tensor([rank + 1.0])
    deepspeed.comm.all_reduce(t)
    return t.item()


def test_init_distributed_with_an_explicit_file_rendezvous(tmp_path) -> None:
    got = run_distributed(_rendezvous, world_size=2, args=(str(tmp_path / "rdzv"),), timeout_s=120)
    assert got == [3.0, 3.0]


def _engine(stage: int, **extra):
    import minispeed.engine as deepspeed

    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _loop(rank: int, world_size: int, root: str) -> dict:
    from minispeed.engine.accelerator import get_accelerator

    out: dict = {"device_count": get_accelerator().device_count()}
    x = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]])  # the same batch on every rank
    engine = _engine(1)
    w0 = engine.module.weight.detach().clone()
    loss = engine(x).pow(2).sum()
    out["returned"] = [engine.backward(loss).item(), loss.item()]
    engine.step()
    with engine.no_sync():  # stage 1 reduces at the window's end anyway
        engine.backward(engine(x).pow(2).sum())
        out["step_in_no_sync"] = _error(engine.step)
    engine.step()  # the second micro-step: a step of SGD on the mean of both gradients
    # A window ended after one micro-step, as accelerate ends an epoch's last window.
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(2 * x).pow(2).sum())
    engine.step()
    out["steps"] = engine.global_steps
    ref = w0.clone().requires_grad_()
    for batch in ([x, x], [2 * x]):  # plain PyTorch: each loss divided by the 2 steps
        ref.grad = None
        sum((b @ ref.t()).pow(2).sum() / 2 for b in batch).backward()
        with torch.no_grad():
            ref -= LR * ref.grad
    out["weights_equal"] = torch.allclose(engine.module.weight.detach(), ref.detach(), atol=1e-6)
    out["unscaled"] = _unscaled(x)
    out["no_sync_stage2"] = _error(lambda: _engine(2).no_sync().__enter__())
    out["none_dir"] = _error(lambda: engine.save_checkpoint(None))
    out["empty_dir"] = _error(lambda: engine.save_checkpoint(""))
    out["written_here"] = os.path.exists("latest") or os.path.exists("global_step2")
    out["tags"] = {mode: _tags(mode, root, f"rank{rank}") for mode in ("FAIL", "Warn", "ignore")}
    out["same_tag"] = _tags("FAIL", root, "same")
    out["bad_mode"] = _error(lambda: _engine(1, checkpoint={"tag_validation": "Strict"}))
    out["generation"] = _generation()
    return out


def _generation() -> list[bool]:
    """`unwrap_model_for_generation`: the whole ZeRO-3 model gathered inside, released after."""
    from minispeed.engine.runtime.zero import unwrap_model_for_generation

    engine = _engine(3)  # persistence threshold 0 below: every parameter is partitioned
    engine.module.weight.numel()  # a shape query: full size even while released
    before = engine.module.weight.data.numel() == 0
    with unwrap_model_for_generation(engine) as model:
        inside = all(p.data.numel() == p.numel() for p in model.parameters())
    after = engine.module.weight.data.numel() == 0
    return [before, inside, after]


def _unscaled(x: torch.Tensor) -> list[float]:
    engine = _engine(0)
    loss = engine(x).pow(2).sum() / 2  # divided by the caller
    return [engine.backward(loss, scale_wrt_gas=False).item(), loss.item()]


def _tags(mode: str, root: str, tag: str) -> list:
    engine = _engine(0, checkpoint={"tag_validation": mode})
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    engine.backward(engine(torch.ones(2, 3)).sum())
    engine.step()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("minispeed")
    logger.addHandler(handler)
    try:
        error = _error(lambda: engine.save_checkpoint(f"{root}/{mode}", tag=tag))
    finally:
        logger.removeHandler(handler)
    return [error, any("different tags" in m for m in seen)]


def test_loop_and_checkpoint_calls_answer_as_deepspeed(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the workers inherit nothing; save_checkpoint("") is checked below
    for res in run_distributed(_loop, world_size=2, args=(str(tmp_path),), timeout_s=240):
        assert res["device_count"] == 2
        returned, loss = res["returned"]
        assert returned == pytest.approx(loss / 2)
        assert res["unscaled"][0] == pytest.approx(res["unscaled"][1])
        assert res["weights_equal"] and res["steps"] == 2
        assert "inside engine.no_sync()" in res["step_in_no_sync"]
        assert "no_sync() cannot be used at ZeRO stage 2" in res["no_sync_stage2"]
        assert res["none_dir"].startswith("ValueError") and "save_dir=None" in res["none_dir"]
        assert res["empty_dir"].startswith("ValueError") and "save_dir=''" in res["empty_dir"]
        assert not res["written_here"]
        fail, warn, ignore = (res["tags"][m] for m in ("FAIL", "Warn", "ignore"))
        assert fail[0].startswith("ValueError") and "different tags" in fail[0]
        # WARN warns as DeepSpeed does; then (as with IGNORE) minispeed's layout refuses a tag
        # directory that not every rank shares, naming it, where DeepSpeed writes one per rank.
        assert warn[1] and not ignore[1]
        assert all(
            e[0].startswith("CheckpointError") and "not shared" in e[0] for e in (warn, ignore)
        )
        assert res["same_tag"] == ["", False]
        assert "checkpoint.tag_validation" in res["bad_mode"] and "Strict" in res["bad_mode"]
        assert res["generation"] == [True, True, True]
    assert not (tmp_path / "latest").exists()
