"""hpZ's secondary partition in the memory ledger: each rank holds exactly the formula's
``Σ (N/k)·ceil(n/N)·p`` bytes more, and `zero.memory.predict` includes it."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice
from zeropp_testlib import GLOBAL_BATCH, NODE_SIZE, THRESHOLD, build, emulate_nodes

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.memory import hpz_secondary_bytes, measure, padding_allowance, predict


def _body(rank: int, world_size: int, dtype: torch.dtype) -> dict:
    emulate_nodes()
    precision = zero.MixedPrecision(param_dtype=dtype)
    out = {}
    for hpz in (False, True):
        model, opt = build((False, hpz, False), precision=precision)
        batch = rank_slice(make_batches(2, GLOBAL_BATCH)[0], rank, world_size)
        opt.backward(model(*batch))
        opt.step()  # optimizer state exists
        opt.backward(model(*batch))
        got = measure(opt, model)  # before the step: every model state exists
        secondary = (
            sum(t.untyped_storage().nbytes() for t in opt.strategy.zeropp.secondary_shards.values())
            if hpz
            else 0
        )
        out[hpz] = (got.params, got.grads, got.optimizer, predict(opt), padding_allowance(opt))
        out[hpz] += (secondary,)
        opt.step()
        opt.close()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hpz_secondary_partition_is_in_the_memory_ledger(dtype):
    numels = [p.numel() for p in make_model().parameters()]
    want = hpz_secondary_bytes(
        numels, 4, NODE_SIZE, param_bytes=dtype.itemsize, persistence_threshold_numel=THRESHOLD
    )
    assert want > 0
    for result in run_distributed(_body, world_size=4, args=(dtype,), timeout_s=180):
        off, on = result[False], result[True]
        assert on[5] == want  # the secondary shards: exactly the formula
        assert on[0] - off[0] == want  # and that is all hpZ adds to the parameters column
        assert (on[1], on[2]) == (off[1], off[2])
        params, grads, optimizer, predicted, slack, _ = on
        assert abs(params - predicted.params) <= slack.params, (params, predicted)
        assert abs(grads - predicted.grads) <= slack.grads
        assert abs(optimizer - predicted.optimizer) <= slack.optimizer
        assert predicted.params - off[3].params == want  # predict() adds the same formula
