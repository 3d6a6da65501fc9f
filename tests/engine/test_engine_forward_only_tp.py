"""ZeRO-Inference on a data × tensor grid: `deepspeed.initialize(model=..., config=...)` with stage 3,
no optimizer and `tensor_parallel.autotp_size` 2 on 4 gloo ranks (2 data replicas × 2 tensor
ranks; the data axis is the smallest on which stage 3 shards anything), minispeed's GPT split
by its ready plan, each replica's loss without gradients against one process in plain PyTorch:

- stage 3 alone, and with MiCS (`mics_shard_size` 2: a shard group per data line): equal to
  1e-6 (the tensor ranks' all-reduces sum in another order);
- a ZeRO++ training config (qwZ + hpZ + qgZ): hpZ and qgZ serve backward alone, so the engine
  leaves them out and says so in `describe()` (before, hpZ's node layout over the world refused
  the grid's data group); qwZ's int8 gathers leave the loss within 1e-3;
- MiCS with an optimizer on this grid stays refused before any collective, naming the key.

zero.shard's own cases (qwZ exactly, MiCS, the hpZ / qgZ refusals) are in
packages/zero/tests/test_stage3_forward_only_zeropp_mics.py.
"""

from __future__ import annotations

import pytest

from minispeed.core.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

ZEROPP = {
    "zero_quantized_weights": True,
    "zero_hpz_partition_size": 2,
    "zero_quantized_gradients": True,
}
CASES = {"stage 3": {}, "MiCS": {"mics_shard_size": 2}, "ZeRO++": ZEROPP}


def _config(extra: dict) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "tensor_parallel": {"autotp_size": 2},
    }


def _evaluate(rank: int, world_size: int) -> dict:
    import os

    import gpt_tp

    import minispeed.engine as deepspeed
    from minispeed.core.config import ConfigError

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two emulated nodes: hpZ's size would be valid
    out: dict = {}
    for name, extra in CASES.items():
        engine, optimizer, *_ = deepspeed.initialize(
            model=gpt_tp.gpt(seed=rank), config=_config(extra)
        )
        replica = engine.grid.rank_in("data")
        out[name] = (
            replica,
            gpt_tp.evaluate(engine.module, gpt_tp.micro_batches(replica, 2), engine.grid),
        )
        out[name + " described"] = engine.describe()
        out[name + " optimizer"] = optimizer
        engine.destroy()
    training = _config({"mics_shard_size": 2}) | {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}
    }
    with pytest.raises(ConfigError) as err:
        deepspeed.initialize(model=gpt_tp.gpt(), config=training)
    out["refused"] = str(err.value)
    return out


def test_forward_only_on_a_tensor_parallel_grid_matches_one_process() -> None:
    import gpt_tp

    want = [gpt_tp.evaluate(gpt_tp.gpt(), gpt_tp.micro_batches(r, 2)) for r in range(2)]
    results = run_distributed(_evaluate, world_size=4, timeout_s=240)
    for r in results:
        for name in CASES:
            replica, got = r[name]
            rel = 1e-3 if name == "ZeRO++" else 1e-6
            assert got == pytest.approx(want[replica], rel=rel), name
            assert r[name + " optimizer"] is None
        assert r["ZeRO++"][1] != want[r["ZeRO++"][0]]  # the gathers were quantized
        described = r["ZeRO++ described"]
        assert "zero_hpz_partition_size left out" in described
        assert "zero_quantized_gradients left out" in described
        assert "zero_optimization.mics_shard_size" in r["refused"]
        assert "for training" in r["refused"] and "without an optimizer" in r["refused"]
