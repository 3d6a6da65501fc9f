"""Parking a ZeroOptimizer's states between steps (`minispeed.zero.parking`, DeepSpeed's
`engine.offload_states` / `reload_states`) frees their storages and gives the same bytes back:
training continues bit for bit as without it, at every stage, fp32 and bf16, 2 gloo ranks.

On this CPU-only machine the states already live in host memory, where `park` leaves them; the
tests pass `host_too=True` so that the mechanism (copy out, resize the storage to 0 bytes, resize
back, copy in) runs on them. While parked, every storage of the chosen kinds holds 0 bytes.
"""

from __future__ import annotations

import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero import parking

CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


def _train(stage: int, dtype: str, rank: int, world_size: int, park: bool) -> dict:
    model = make_model()
    precision = zero.MixedPrecision(param_dtype=torch.bfloat16) if dtype == "bf16" else None
    cfg = zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=64)
    opt = zero.shard(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg, precision=precision
    )
    losses, parked_bytes, nonempty = [], {}, []
    reuse = None
    for batch in make_batches(3, 8):
        loss = model(*rank_slice(batch, rank, world_size))
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
        if park:
            parked = parking.park(opt, model, host_too=True, reuse=reuse)
            parked_bytes = parked.nbytes
            for kind in parking.KINDS:  # every storage of every kind is empty now
                nonempty += [
                    kind
                    for t in parking.state_tensors(opt, model, kind)
                    if t.untyped_storage().nbytes()
                ]
            parking.unpark(parked)
            reuse = parked
    masters = sum(t.numel() for ts in opt.strategy.master_params() for t in ts)
    if stage == 3:  # this rank's shards
        params = [sp.shard.float().clone() for sp in opt.strategy.sharded_params()]
    else:
        params = [p.detach().float().clone() for p in model.parameters()]
    return dict(
        losses=losses, params=params, parked=parked_bytes, nonempty=nonempty, masters=masters
    )


def _body(rank: int, world_size: int) -> list[tuple]:
    out = []
    for stage, dtype in CASES:
        plain = _train(stage, dtype, rank, world_size, park=False)
        parked = _train(stage, dtype, rank, world_size, park=True)
        out.append((stage, dtype, plain, parked))
    return out


def test_parked_states_come_back_bit_for_bit_at_every_stage() -> None:
    for rank, cases in enumerate(run_distributed(_body, world_size=2, timeout_s=240)):
        for stage, dtype, plain, parked in cases:
            where = f"rank {rank}, stage {stage} {dtype}"
            assert parked["losses"] == plain["losses"], where
            assert all(torch.equal(a, b) for a, b in zip(parked["params"], plain["params"])), where
            assert parked["nonempty"] == [], f"{where}: storages not emptied while parked"
            # Adam's two moments, fp32, over this rank's masters: at least 8 bytes an element.
            assert parked["parked"]["optim_states"] >= 8 * parked["masters"], where
            # The weights: with fp32 masters that are the parameters themselves (stage 0), their
            # storages are parked once, as hp_params (the kind named first).
            assert parked["parked"]["lp_params"] + parked["parked"]["hp_params"] > 0, where
            if dtype == "bf16":
                assert parked["parked"]["lp_params"] > 0, where
            if stage in (0, 1, 2):  # their reducers keep gradient buffers between steps
                assert parked["parked"]["lp_grads"] > 0, where


def _park_mid_window(rank: int, world_size: int) -> str:
    model = make_model()
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=zero.ZeroConfig(stage=2, gradient_accumulation_steps=2),
    )
    batch = make_batches(1, 8)[0]
    opt.backward(model(*rank_slice(batch, rank, world_size)))
    opt.step()  # micro-step 1 of 2: the window is open
    try:
        parking.park(opt, model, host_too=True)
    except RuntimeError as e:
        return str(e)
    return "parked"


def test_park_refuses_inside_an_accumulation_window() -> None:
    for msg in run_distributed(_park_mid_window, world_size=2, timeout_s=120):
        assert "accumulation window" in msg and "step()" in msg, msg
