"""Under MiCS a value changed on one rank reaches every rank holding the shard, not only the
changing rank's shard group: 4 gloo ranks as shard groups [0 1] [2 3], against plain ZeRO-3 on
the same ranks (where the shard group is every rank).

One distributed run, each kind in turn: TinyGPT with its position embedding frozen trains a
step; rank 0 halves the tied embedding under ``GatheredParameters(modifier_rank=0)``; every rank
sets a weight with ``full_values.set_full_fp32_param`` and reads it back; a checkpoint is saved
and loaded into a fresh model built from other values (its frozen parameter comes from the
checkpoint, through ``GatheredParameters``), which trains on. The weights, the reads and the
losses must equal plain ZeRO-3's on every rank, and ``full_state_dict(rank0_only=True)`` keeps
them on global rank 0 only. Then ``zero.Init`` with the MiCS config: parameters partitioned over
the shard group at construction, an initialiser run after partitioning (nanoGPT's
``self.apply(init_fn)``) written back to every replica from the first rank whatever each rank's
seed, and training equal to MiCS without Init. (Before, rank 0's change was broadcast inside
shard group [0 1] only: ranks 2 and 3 failed with it as source, and zero.Init ignored MiCS.)
"""

from __future__ import annotations

import torch
from stage3_testlib import GLOBAL_BATCH, LR, train_losses
from torch import nn
from zero_testlib import TinyGPT, make_batches, make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero import full_values

SMALL = dict(stage3_param_persistence_threshold_numel=30, reduce_bucket_numel=6000)


def _config(shard_size: int) -> zero.ZeroConfig:
    return zero.ZeroConfig(stage=3, mics_shard_size=shard_size, **SMALL)


def _build(shard_size: int, seed: int):
    model = make_model(seed)
    model.wpe.weight.requires_grad_(False)  # frozen: saved whole, loaded through a modifier
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = zero.shard(model, torch.optim.AdamW(trained, lr=LR), config=_config(shard_size))
    return model, opt


def _edits(rank: int, world_size: int, tmp: str, shard_size: int) -> dict:
    batches = make_batches(2, GLOBAL_BATCH)
    out: dict = {}
    model, opt = _build(shard_size, seed=0)
    out["losses"] = train_losses(model, opt, rank, world_size, batches[:1])
    weight = model.wte.weight
    with torch.no_grad(), zero.GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            weight.mul_(0.5)  # rank 0 only: every rank must keep it
    target = model.blocks[0].mlp[0].weight
    value = torch.linspace(-0.1, 0.1, target.numel()).reshape(target.shape)
    full_values.set_full_fp32_param(target, value)
    out["set"] = full_values.full_fp32_param(target)
    out["weights"] = zero.full_state_dict(model)
    zero.save_checkpoint(opt, model, tmp, tag=f"s{shard_size}")
    out["losses"] += train_losses(model, opt, rank, world_size, batches[1:])
    opt.close()

    model, opt = _build(shard_size, seed=7)  # other values, the frozen embedding's included
    zero.load_checkpoint(opt, model, tmp, tag=f"s{shard_size}")
    out["loaded"] = zero.full_state_dict(model, rank0_only=True)
    out["resumed"] = train_losses(model, opt, rank, world_size, batches[1:])
    out["shards"] = {sp.world_size for sp in opt.strategy.sharded_params()}
    opt.close()
    return out


class LateInitGPT(TinyGPT):
    """TinyGPT whose linear weights are drawn again at the end of ``__init__``, after
    ``zero.Init`` partitioned its blocks (nanoGPT's ``self.apply(self._init_weights)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.apply(_redraw)


def _redraw(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.05)


def _built_under_init(rank: int, world_size: int) -> dict:
    out: dict = {}
    batches = make_batches(2, GLOBAL_BATCH)
    cfg = _config(2)
    torch.manual_seed(100 + rank)  # each rank its own draws: the first rank's must win
    with zero.Init(config=cfg) as init:
        model = LateInitGPT()
    out["init_shards"] = {sp.world_size for sp in init.sharded}
    out["init_weights"] = zero.full_state_dict(model)
    grid = zero.MicsGroups.build(2)  # as the engine's grid builds them: the same ranks
    opt = zero.shard(
        model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg, mics_groups=grid
    )
    out["groups_reused"] = opt.strategy.groups is init.mics_groups
    out["init_losses"] = train_losses(model, opt, rank, world_size, batches)
    opt.close()
    torch.manual_seed(100 + rank)
    model = LateInitGPT()  # built whole: partitioned by zero.shard from the first rank
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
    out["losses"] = train_losses(model, opt, rank, world_size, batches)
    opt.close()
    # Init and shard must agree on MiCS: refused by name, on every rank, before a collective.
    out["refused"] = []
    for init_size, shard_size in [(2, -1), (2, 4), (-1, 2)]:
        with zero.Init(config=_config(init_size)):
            model = nn.Linear(4, 4)
        try:
            zero.shard(model, torch.optim.SGD(model.parameters(), lr=LR), _config(shard_size))
        except ValueError as exc:
            out["refused"].append(str(exc))
    return out


def _body(rank: int, world_size: int, tmp: str) -> dict:
    return {
        "mics": _edits(rank, world_size, tmp, 2),
        "zero3": _edits(rank, world_size, tmp, -1),
        "init": _built_under_init(rank, world_size),
    }


def test_a_value_changed_on_one_rank_reaches_every_replica_as_under_plain_zero3(tmp_path):
    results = run_distributed(_body, world_size=4, timeout_s=240, args=(str(tmp_path),))
    close = dict(rtol=0, atol=1e-6)
    for rank, r in enumerate(results):
        mics, plain = r["mics"], r["zero3"]
        assert mics["shards"] == {2} and plain["shards"] == {4}
        assert mics["weights"].keys() == plain["weights"].keys()
        for name, value in plain["weights"].items():
            torch.testing.assert_close(mics["weights"][name], value, **close, msg=name)
        torch.testing.assert_close(mics["set"], plain["set"], **close)
        torch.testing.assert_close(mics["losses"], plain["losses"], **close)
        torch.testing.assert_close(mics["resumed"], mics["losses"][1:], **close)
        for kind in (mics, plain):  # the checkpoint's values, frozen embedding included
            if rank == 0:
                for name, value in kind["weights"].items():
                    torch.testing.assert_close(kind["loaded"][name], value, rtol=0, atol=0)
            else:
                assert kind["loaded"] == {}
    first = results[0]["mics"]["weights"]
    trained_once = {k: v.clone() for k, v in first.items()}
    for r in results[1:]:  # every replica holds rank 0's change
        for name, value in r["mics"]["weights"].items():
            torch.testing.assert_close(value, trained_once[name], rtol=0, atol=0, msg=name)

    torch.manual_seed(100)
    reference = LateInitGPT().state_dict()  # one process, the first rank's seed
    for r in results:
        init = r["init"]
        assert init["init_shards"] == {2} and init["groups_reused"]
        for name, value in reference.items():
            torch.testing.assert_close(init["init_weights"][name], value, rtol=0, atol=0)
        torch.testing.assert_close(init["init_losses"], init["losses"], rtol=0, atol=0)
        assert len(init["refused"]) == 3, init["refused"]
        for message in (init["refused"][0], init["refused"][2]):
            assert "partitioned by zero.Init over" in message, message
            assert "same ZeroConfig (mics_shard_size)" in message, message
        assert "MiCS shard groups of 2 ranks" in init["refused"][1], init["refused"][1]

    # The checkpoint saved under MiCS consolidates offline into the weights it was saved from.
    consolidated = tmp_path / "mics.pt"
    zero.consolidate(tmp_path, consolidated, tag="s2")
    for name, value in torch.load(consolidated).items():
        torch.testing.assert_close(value, results[0]["mics"]["weights"][name], rtol=0, atol=0)
