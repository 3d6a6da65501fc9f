"""DeepSpeed names scripts test against or call at the end of a run: `deepspeed.DeepSpeedEngine`
(isinstance) and `deepspeed.comm.log_summary`, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minispeed.core.testing import run_distributed


def _body(rank: int, world_size: int, logged: bool) -> dict:
    import minispeed.engine as deepspeed
    from minispeed.engine import comm as dist

    model = nn.Linear(4, 2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "comms_logger": {"enabled": logged},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    for _ in range(3):
        x = torch.randn(2, 4)
        t = x.sum().reshape(1)
        dist.all_reduce(t)  # the script's own collective, logged too
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    stats = dist.log_summary(return_dict=True)
    with pytest.raises(NotImplementedError, match="show_straggler"):
        dist.log_summary(show_straggler=True)
    engine.destroy()
    return {"is_engine": isinstance(engine, deepspeed.DeepSpeedEngine), "stats": stats}


@pytest.mark.parametrize("logged", [True, False])
def test_engine_is_a_deepspeed_engine_and_log_summary_reports_the_log(logged):
    for res in run_distributed(_body, world_size=2, args=(logged,), timeout_s=180):
        assert res["is_engine"]
        if not logged:
            assert res["stats"] is None  # no comms_logger section: nothing recorded
            continue
        ops = res["stats"]["summary"]
        # the script's three 4-byte all-reduces, in DeepSpeed's layout
        mine = ops["all_reduce"][4]
        assert mine["count"] == 3 and mine["msg_size_bytes"] == 4
        assert mine["avg_latency_ms"] > 0 and mine["busbw_avg_gbps"] >= 0
        assert res["stats"]["metadata"]["world_size"] == 2
