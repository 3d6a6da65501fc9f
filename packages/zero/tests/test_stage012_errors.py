"""Bad input to ``zero.shard`` and to the training loop: a clear error naming the fix, never a hang.

The checks that need a process group run in one 2-rank run; each case returns the exception it
raised (type and message), and one test per case asserts on it.
"""

from __future__ import annotations

import pytest
import torch
from stage012_testlib import micro_batches
from zero_testlib import make_batches, make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc)
    return None


def _foreign_param():
    model = make_model()
    stranger = torch.nn.Parameter(torch.zeros(3))
    zero.shard(model, torch.optim.SGD([*model.parameters(), stranger], lr=0.1))


def _lbfgs():
    model = make_model()
    zero.shard(model, torch.optim.LBFGS(model.parameters()))


def _fp16_capturable():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    zero.shard(model, opt, precision=zero.MixedPrecision(param_dtype=torch.float16))


def _shard_twice():
    model = make_model()
    zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _stepped_optimizer():
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    model(*make_batches(1, 2)[0]).backward()
    opt.step()
    zero.shard(model, opt)


def _backward_outside_optimizer(rank, world_size):
    model = make_model()
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), zero.ZeroConfig(stage=2))
    ((x, y),) = micro_batches(make_batches(1, 8)[0], rank, world_size, 1)
    model(x, y).backward()  # plain backward: hooks fill the buckets, nobody finishes them
    opt.backward(model(x, y))


def _unused_not_ignored(rank, world_size):
    model = make_model()
    config = zero.ZeroConfig(stage=1, ignore_unused_parameters=False)
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    ((x, y),) = micro_batches(make_batches(1, 8)[0], rank, world_size, 1)
    opt.backward(model(x, y))
    opt.step()


def _zero_grad_mid_window(rank, world_size):
    model = make_model()
    config = zero.ZeroConfig(stage=0, gradient_accumulation_steps=2)
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    (x, y), _ = micro_batches(make_batches(1, 8)[0], rank, world_size, 2)
    opt.backward(model(x, y))
    opt.step()  # not a boundary: does nothing
    opt.zero_grad()  # would throw away the first micro-batch


def _backward_after_boundary_without_step(rank, world_size):
    model = make_model()
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), zero.ZeroConfig(stage=1))
    (x, y), _ = micro_batches(make_batches(1, 8)[0], rank, world_size, 2)
    opt.backward(model(x, y))  # a boundary (no accumulation): step() is due
    opt.backward(model(x, y))  # would add the next window onto reduced gradients


def _errors(rank: int, world_size: int):
    return {
        "foreign_param": _error_of(_foreign_param),
        "lbfgs": _error_of(_lbfgs),
        "fp16_capturable": _error_of(_fp16_capturable),
        "shard_twice": _error_of(_shard_twice),
        "stepped_optimizer": _error_of(_stepped_optimizer),
        "backward_outside": _error_of(lambda: _backward_outside_optimizer(rank, world_size)),
        "unused_not_ignored": _error_of(lambda: _unused_not_ignored(rank, world_size)),
        "zero_grad_mid_window": _error_of(lambda: _zero_grad_mid_window(rank, world_size)),
        "backward_without_step": _error_of(
            lambda: _backward_after_boundary_without_step(rank, world_size)
        ),
    }


@pytest.fixture(scope="module")
def errors():
    per_rank = run_distributed(_errors, world_size=2, timeout_s=120)
    assert per_rank[0] == per_rank[1], "both ranks must fail the same way"
    return per_rank[0]


def test_optimizer_with_parameter_not_in_model(errors) -> None:
    kind, msg = errors["foreign_param"]
    assert kind == "ValueError"
    assert "param_groups[0]['params'][30]" in msg and "model.parameters()" in msg


def test_lbfgs_is_refused(errors) -> None:
    kind, msg = errors["lbfgs"]
    assert kind == "TypeError" and "LBFGS" in msg and "elementwise optimizer" in msg


def test_fp16_with_an_optimizer_that_cannot_take_our_loss_scale(errors) -> None:
    kind, msg = errors["fp16_capturable"]
    assert kind == "ValueError" and "capturable=False" in msg


def test_sharding_a_model_twice(errors) -> None:
    kind, msg = errors["shard_twice"]
    assert kind == "RuntimeError" and "already passed to shard()" in msg


def test_optimizer_that_already_stepped(errors) -> None:
    kind, msg = errors["stepped_optimizer"]
    assert kind == "ValueError" and "fresh optimizer" in msg


def test_backward_not_driven_by_the_optimizer(errors) -> None:
    kind, msg = errors["backward_outside"]
    assert kind == "RuntimeError" and "ZeroOptimizer.backward(loss)" in msg


def test_unused_parameter_when_not_ignored(errors) -> None:
    kind, msg = errors["unused_not_ignored"]
    assert kind == "RuntimeError" and "'unused'" in msg and "ignore_unused_parameters=True" in msg


def test_zero_grad_inside_an_accumulation_window(errors) -> None:
    kind, msg = errors["zero_grad_mid_window"]
    assert kind == "RuntimeError" and "micro-step 1 of 2" in msg and "only after step()" in msg


def test_backward_after_a_boundary_without_step(errors) -> None:
    kind, msg = errors["backward_without_step"]
    assert kind == "RuntimeError" and "without step()" in msg and "call opt.step()" in msg


def test_shard_without_a_process_group() -> None:
    model = make_model()
    with pytest.raises(RuntimeError, match="init_distributed"):
        zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_bucket_of_zero_elements() -> None:
    with pytest.raises(ValueError, match=r"^ZeroConfig.reduce_bucket_numel: must be >= 1"):
        zero.ZeroConfig(reduce_bucket_numel=0)
    with pytest.raises(
        ValueError,
        match=r"^zero_optimization.reduce_bucket_size: must be >= 1, got 0.*"
        r"\(ZeroConfig.reduce_bucket_numel\)",
    ):
        zero.ZeroConfig.from_section({"reduce_bucket_size": 0})
