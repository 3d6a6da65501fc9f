"""``step()`` with no ``backward()`` since the last ``step()`` raises, naming the missing call.

It used to return False silently (issue 14, item 6), so a loop that called ``loss.backward()``
instead of ``opt.backward(loss)`` never trained. ``step()`` after every ``backward()`` stays the
normal pattern: inside an accumulation window it returns False, at the boundary it steps.
"""

from __future__ import annotations

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


def _error_of(fn) -> str | None:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def _shard(stage: int, accumulation: int):
    model = make_model()
    config = zero.ZeroConfig(
        stage=stage,
        gradient_accumulation_steps=accumulation,
        stage3_param_persistence_threshold_numel=0,
    )
    return model, zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def _cases(rank: int, world_size: int, stage: int) -> dict[str, object]:
    x, y = rank_slice(make_batches(1, 4)[0], rank, world_size)
    out: dict[str, object] = {}

    model, opt = _shard(stage, 1)
    out["before_any_backward"] = _error_of(opt.step)

    model, opt = _shard(stage, 1)
    opt.backward(model(x, y))
    taken = opt.step()
    out["twice_at_boundary"] = (taken, _error_of(opt.step))

    model, opt = _shard(stage, 2)
    opt.backward(model(x, y))
    inside = opt.step()  # inside the window: the normal pattern, returns False
    out["twice_inside_window"] = (inside, _error_of(opt.step))

    model, opt = _shard(stage, 2)
    results = []
    for _ in range(2):
        opt.backward(model(x, y))
        results.append(opt.step())
    out["accumulation"] = results

    model, opt = _shard(stage, 1)
    model(x, y).backward()  # the plain-PyTorch habit
    out["plain_backward"] = _error_of(opt.step)
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_step_without_backward_raises_and_accumulation_still_works(stage: int) -> None:
    per_rank = run_distributed(_cases, world_size=2, args=(stage,))
    assert per_rank[0] == per_rank[1]
    out = per_rank[0]
    assert "no backward() since the last step()" in out["before_any_backward"]
    assert "opt.backward(loss)" in out["before_any_backward"]
    taken, error = out["twice_at_boundary"]
    assert taken is True and "no backward()" in error
    inside, error = out["twice_inside_window"]
    assert inside is False and "no backward()" in error
    assert out["accumulation"] == [False, True]
    assert out["plain_backward"] is not None
