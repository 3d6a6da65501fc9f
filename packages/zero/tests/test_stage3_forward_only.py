"""Stage 3 without an optimizer (`zero.shard(model, None, config)`, ZeRO-Inference) on 2 gloo ranks.

- numerics: each rank's forward (TinyGPT's loss on its slice of the batch, two passes: the
  second follows the trace and prefetches) equals single-process PyTorch on the same slice, in
  fp32 and in bf16 (the reference model cast to bf16), for a model built whole and one built
  under `zero.Init`;
- memory: a rank holds its parameter shards in the model's dtype and nothing else (no fp32
  master, no gradient, no optimizer state): `zero.measure` equals
  `formulas.forward_only_state_bytes` within padding, and in bf16 is a third of what the same
  model held when sharded with an SGD of learning rate 0 that is never stepped (what the
  engine did before), whose fp32 masters are 4 of its 6 bytes per parameter;
- refusals: `backward` / `step` name the fix (pass an optimizer); `loss.backward()` raises at
  the first parameter gradient, keeps no gradient, and the next forward runs as before; an
  optimizer-less stage 0-2 or `offload_optimizer` is an error naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.memory import padding_allowance, predict

THRESHOLD = 30  # layer norms and small biases persist (gathered for good); the rest is released
CONFIG = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=THRESHOLD)


def _forward(rank: int, world_size: int, dtype: torch.dtype, under_init: bool) -> dict:
    if under_init:
        with zero.Init():
            model = make_model()
    else:
        model = make_model().to(dtype)
    precision = zero.MixedPrecision(param_dtype=dtype) if under_init else None  # None: model's
    shards = zero.shard(model, None, CONFIG, precision=precision)
    batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    with torch.no_grad():
        losses = [model(*batch) for _ in range(2)]
    out = dict(
        losses=losses,
        prefetched=shards.strategy.coordinator.stats.prefetch_calls,
        measured=zero.measure(shards, model),
        predicted=predict(shards),
        allowance=padding_allowance(shards),
        masters=[sp.master for sp in shards.sharded_params()],
        shard_dtypes={sp.shard.dtype for sp in shards.sharded_params()},
        released=sum(p.data.numel() == 0 for p in model.parameters()),
    )
    shards.close()  # collective: the model whole again
    out["closed"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("under_init", [False, True], ids=["whole", "zero_Init"])
def test_forward_only_matches_pytorch_and_keeps_the_shards_alone(dtype, under_init) -> None:
    results = run_distributed(_forward, world_size=2, args=(dtype, under_init), timeout_s=120)
    reference = make_model().to(dtype)
    for rank, res in enumerate(results):
        want = reference(*rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, 2))
        for got in res["losses"]:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert res["prefetched"] > 0  # the second pass followed the trace
        assert res["released"] > 0  # non-persistent parameters released between uses
        assert res["masters"] == [None] * len(res["masters"])
        assert res["shard_dtypes"] == {dtype}
        got, pred, slack = res["measured"], res["predicted"], res["allowance"]
        assert got.master == got.grads == got.optimizer_states == 0
        assert pred.grads == pred.optimizer == 0
        assert 0 <= got.params - pred.params <= slack.params
        for a, b in zip(res["closed"], reference.parameters(), strict=True):
            assert torch.equal(a, b.detach())


def _old_and_new_bytes(rank: int, world_size: int) -> dict:
    out = {}
    for name in ("sgd_lr0", "none"):
        model = make_model().to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.0) if name == "sgd_lr0" else None
        bf16 = zero.MixedPrecision(param_dtype=torch.bfloat16)
        shards = zero.shard(model, opt, CONFIG, precision=bf16)
        batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
        with torch.no_grad():
            model(*batch)
        out[name] = zero.measure(shards, model)
        shards.close()
    return out


def test_bf16_forward_only_holds_a_third_of_the_sgd_lr0_sharding() -> None:
    for res in run_distributed(_old_and_new_bytes, world_size=2, timeout_s=120):
        old, new = res["sgd_lr0"], res["none"]
        assert new.params == old.params  # the same bf16 shards (and persistent copies)
        assert old.master > 0 and new.master == 0  # the fp32 masters are gone
        assert new.total == new.params
        # 2 bytes per element against 2 + 4; persistent copies make it a little over a third
        assert new.total * 3 <= old.total * 1.1, (new.total, old.total)


def _refusals(rank: int, world_size: int) -> dict:
    model = make_model()
    shards = zero.shard(model, None, CONFIG)
    batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    out: dict = {}
    for what, call in (("backward", lambda: shards.backward(model(*batch))), ("step", shards.step)):
        with pytest.raises(RuntimeError) as e:
            call()
        out[what] = str(e.value)
    loss = model(*batch)  # with gradients on
    with pytest.raises(RuntimeError) as e:
        loss.backward()
    out["loss.backward"] = str(e.value)
    out["grads"] = [p.grad for p in model.parameters()]
    with torch.no_grad():
        out["after"] = model(*batch)
    shards.close()
    for section in ({"stage": 2}, {"stage": 3, "offload_optimizer": {"device": "cpu"}}):
        with pytest.raises(ValueError) as e:
            zero.shard(make_model(), None, zero.ZeroConfig.from_section(section))
        out[str(section)] = str(e.value)
    return out


def test_backward_and_step_are_refused_with_the_fix() -> None:
    for rank, res in enumerate(run_distributed(_refusals, world_size=2, timeout_s=120)):
        for what in ("backward", "step", "loss.backward"):
            assert "pass an optimizer" in res[what] and "zero.shard(model, None" in res[what]
        assert "reaches parameter" in res["loss.backward"]
        assert res["grads"] == [None] * len(res["grads"])  # the gradient was not kept
        want = make_model()(*rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, 2))
        torch.testing.assert_close(res["after"], want, rtol=0, atol=0)
        assert "needs stage 3" in res["{'stage': 2}"]
        assert "remove it" in res["{'stage': 3, 'offload_optimizer': {'device': 'cpu'}}"]
