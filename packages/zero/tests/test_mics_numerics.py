"""MiCS trains exactly like single-process PyTorch, on 4 gloo ranks as 2 shard groups of 2.

One distributed run covers: 6 optimizer steps of TinyGPT (tied embeddings, a parameter used
twice, an unused one) with gradient accumulation 2 and clipping, every parameter partitioned over
its shard group of 2 (not over 4), the same shard held by both replicas; a checkpoint saved at
S = 2 loads into plain ZeRO-3 (over all 4 ranks), S = 1 and back at S = 2 with the same
masters; ZeRO++'s quantized weights and gradients inside the shard groups train within ZeRO++'s
tolerance (2 % per step); a shard size that does not divide the world is refused on every rank.
"""

from __future__ import annotations

import functools

import torch
from stage3_testlib import GLOBAL_BATCH, LR, reference_losses, train_losses
from zero_testlib import make_batches, make_model

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

STEPS, ACCUM, CLIP = 6, 2, 0.5
SMALL = dict(stage3_param_persistence_threshold_numel=30, reduce_bucket_numel=6000)


@functools.cache
def _reference() -> list[float]:
    return reference_losses(STEPS, ACCUM, CLIP)


def _build(shard_size: int, **extra):
    model = make_model()
    cfg = zero.ZeroConfig(
        stage=3,
        mics_shard_size=shard_size,
        gradient_accumulation_steps=ACCUM,
        max_grad_norm=CLIP,
        **{**SMALL, **extra},
    )
    return model, zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)


def _weights(model) -> dict[str, torch.Tensor]:
    """fp32 training: the gathered parameters are the fp32 masters."""
    return zero.full_state_dict(model)


def _body(rank: int, world_size: int, tmp: str) -> dict:
    out = {}
    model, opt = _build(2)
    strategy = opt.strategy.stage
    out["shard_world"] = {sp.world_size for sp in strategy.sharded_params()}
    out["losses"] = train_losses(
        model, opt, rank, world_size, make_batches(STEPS * ACCUM, GLOBAL_BATCH)
    )
    # Replicas hold the same shard: rank r and r + 2 agree element for element.
    mine = torch.cat([sp.master for sp in strategy.trained])
    other = mine.clone()
    comm.broadcast(other, src=rank % 2, group=opt.strategy.groups.replica_group)
    out["replicas_equal"] = torch.equal(mine, other)
    zero.save_checkpoint(opt, model, tmp, tag="s2")
    saved = _weights(model)
    opt.close()
    # Load at S = 4 (plain ZeRO-3 over every rank), at S = 1 (each rank holds everything), and
    # back at S = 2: the same fp32 masters each time, and training goes on identically.
    out["reloaded"] = {}
    for s in (-1, 1, 2):  # -1: MiCS off
        model, opt = _build(s)
        zero.load_checkpoint(opt, model, tmp, tag="s2")
        got = _weights(model)
        out["reloaded"][s] = all(torch.equal(got[k], saved[k]) for k in saved)
        out.setdefault("next", {})[s] = train_losses(
            model, opt, rank, world_size, make_batches(ACCUM, GLOBAL_BATCH, seed=9)
        )
        opt.close()
    # qwZ + qgZ inside the shard groups: uint8 gathers on the group, gradients quantized in
    # hop 1 only; within ZeRO++'s tolerance of the exact run.
    model, opt = _build(2, quantized_weights=True, quantized_gradients=True, quant_block_numel=64)
    batches = make_batches(STEPS * ACCUM, GLOBAL_BATCH)
    with comm.CommsLogger() as log:
        out["quantized"] = train_losses(model, opt, rank, world_size, batches)
    out["quantized_ops"] = {
        (r.op, r.dtype, len(r.ranks))
        for r in log.records
        if r.op.startswith(("all_gather", "all_to"))
    }
    opt.close()
    # A shard size that does not divide the 4 ranks: refused on every rank, before a collective.
    try:
        _build(3)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_mics_trains_like_pytorch_and_its_checkpoints_load_at_any_shard_size(tmp_path):
    results = run_distributed(_body, world_size=4, timeout_s=240, args=(str(tmp_path),))
    reference = _reference()
    for r in results:
        assert r["shard_world"] == {2}  # partitioned over the shard group, not the world
        torch.testing.assert_close(r["losses"], reference, rtol=0, atol=1e-5)
        assert r["replicas_equal"]
        assert r["reloaded"] == {-1: True, 1: True, 2: True}
        assert "mics_shard_size=3 does not divide the data-parallel size 4" in r["refused"]
        for a, b in zip(r["quantized"], reference):
            assert abs(a - b) <= 0.02 * b, (a, b)
        ops = r["quantized_ops"]  # (op, dtype, group size): quantized, inside a shard group
        assert any(
            op.startswith("all_gather") and d == "torch.uint8" and n == 2 for op, d, n in ops
        )
        assert any(
            op.startswith("all_to_all") and d == "torch.uint8" and n == 2 for op, d, n in ops
        )
    nexts = results[0]["next"]
    torch.testing.assert_close(nexts[1], nexts[-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(nexts[2], nexts[-1], rtol=0, atol=1e-5)
