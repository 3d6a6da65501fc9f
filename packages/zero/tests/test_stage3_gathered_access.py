"""Full parameters for user code (GatheredParameters), clear errors for reads without it, leaf modules.

One distributed run (2 ranks) checks:

- the ShardedParam state machine: padding layout, gather/release, transitions that refuse a wrong
  source state;
- using a released parameter where we can see it (the ``full_value`` helper, ``module.forward(x)``
  called directly, saving a ``state_dict()``) raises an error that names GatheredParameters; an
  initializer running inside zero.Init after the module was partitioned keeps its writes, with
  and without GatheredParameters;
- GatheredParameters(modifier_rank=1) keeps rank 1's change on every rank, in the shards *and* the
  fp32 masters; modifier_rank=None discards changes;
- a leaf module (zero.set_leaf_module) whose children are chosen by the data trains although ranks
  run different children, while the same model without it raises FetchOrderError.
"""

from __future__ import annotations

import io

import torch
from stage3_testlib import LateInit, MoENet
from torch import nn
from zero_testlib import make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import (
    FetchOrderError,
    GatheredParameters,
    Init,
    ParameterNotGatheredError,
    ParamState,
    set_leaf_module,
)
from minispeed.zero.stage3.access import full_value
from minispeed.zero.stage3.params import FetchUnit, all_gather_params, partition_param


def _error_of(fn) -> str:
    try:
        fn()
    except (ParameterNotGatheredError, RuntimeError, AssertionError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


def _state_machine(rank: int) -> dict:
    full = torch.arange(7.0)
    p = nn.Parameter(full.clone())
    sp = partition_param(p, None)
    out = dict(
        shard=sp.shard.tolist(),  # s = ceil(7/2) = 4; rank 1 holds 4, 5, 6 and one zero of padding
        released=(sp.state is ParamState.SHARDED, p.numel()),
        bad_release=_error_of(sp.to_sharded),
    )
    all_gather_params([sp])
    out["gathered"] = (sp.state is ParamState.GATHERED, torch.equal(p.data, full))
    out["bad_gathering"] = _error_of(lambda: sp.to_gathering(None))
    unit = FetchUnit(-1, "u", "Test", [sp])
    unit.hold()
    out["held_release"] = (unit.reshard(), sp.state is ParamState.GATHERED)  # held: kept
    unit.unhold()
    out["bad_unhold"] = _error_of(unit.unhold)  # one unhold too many: an assertion, not a clamp
    out["unit_released"] = (unit.reshard() == [sp], p.numel())
    return out


def _access_errors(model: nn.Module) -> dict:
    lin = model.blocks[0].mlp[0]
    return dict(
        read_helper=_error_of(lambda: full_value(lin.weight)),
        direct_forward=_error_of(lambda: lin.forward(torch.randn(2, 24))),
        state_dict=_error_of(lambda: torch.save(model.state_dict(), io.BytesIO())),
    )


def _late_init(gathered: bool) -> bool:
    """An initializer run after Init partitioned the layers keeps its writes, with or without
    GatheredParameters (Init gathers and writes back what it touches: init_writes.py)."""
    with Init():
        model = LateInit(gathered=gathered)
    with GatheredParameters(list(model.parameters())):
        return all(bool((lin.bias == 0.25).all()) for lin in model.layers)


def _modify(rank: int, model: nn.Module, opt) -> dict:
    w = model.blocks[1].mlp[2].weight
    sp = opt.strategy.sharded[w]
    with GatheredParameters(w, modifier_rank=1):
        if rank == 1:
            w.data.fill_(0.5)
    with GatheredParameters(w):  # read-only: rank 0's change is discarded at exit
        kept = bool((w == 0.5).all())
        if rank == 0:
            w.data.fill_(7.0)
    with GatheredParameters(w):
        discarded = bool((w == 0.5).all())
    # a module's absent bias in the list (transformers' resize_token_embeddings passes it)
    with GatheredParameters([w, None], modifier_rank=0):
        if rank == 0:
            w.data.add_(1.0)
    with GatheredParameters([None, w]):
        discarded = discarded and bool((w == 1.5).all())
    with GatheredParameters(list(model.parameters())):
        sd = model.state_dict()
        state_dict_ok = all(v.numel() > 0 for v in sd.values())
    master_ok = bool((sp.master[: sp.owned_numel] == 1.5).all())  # both modifications reached it
    return dict(
        kept=kept,
        discarded=discarded,
        master=master_ok,
        released=w.data.numel() == 0,
        sd=state_dict_ok,
    )


def _moe(rank: int, leaf: bool) -> str:
    torch.manual_seed(0)
    model = MoENet()
    if leaf:
        set_leaf_module(model.moe)
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0),
    )
    x = torch.full((4, 8), 10.0 if rank == 0 else -10.0)  # rank 0 -> expert 0, rank 1 -> expert 1
    try:
        for _ in range(3):
            opt.backward(model(x))
            opt.step()
    except FetchOrderError as err:
        return str(err)
    return ""


def _body(rank: int, world_size: int) -> dict:
    model = make_model()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    out = dict(
        state_machine=_state_machine(rank),
        errors=_access_errors(model),
        late_init_gathered=_late_init(gathered=True),
        late_init_ungathered=_late_init(gathered=False),
        modify=_modify(rank, model, opt),
        moe_leaf=_moe(rank, leaf=True),
        moe_no_leaf=_moe(rank, leaf=False),
    )
    opt.strategy.close()  # back to a plain model: full parameters, no hooks, plain dicts
    w = model.blocks[1].mlp[2].weight
    out["closed"] = (
        tuple(w.shape) == (24, 96)
        and bool((w == 1.5).all())
        and type(model.blocks[1].mlp[2]._parameters) is dict
        and all(v.numel() > 0 for v in model.state_dict().values())
    )
    return out


def test_gathered_parameters_errors_and_leaf_modules() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=120)
    for rank, res in enumerate(results):
        sm = res["state_machine"]
        assert sm["shard"] == ([0.0, 1.0, 2.0, 3.0] if rank == 0 else [4.0, 5.0, 6.0, 0.0])
        assert sm["released"] == (True, 0) and sm["gathered"] == (True, True)
        assert "to_sharded from ParamState.SHARDED" in sm["bad_release"]
        assert "to_gathering from ParamState.GATHERED" in sm["bad_gathering"]
        assert sm["held_release"] == ([], True)
        assert "released more often than held" in sm["bad_unhold"]
        assert sm["unit_released"] == (True, 0)

        for where, message in res["errors"].items():
            assert "GatheredParameters" in message, (where, message)
        assert "blocks.0.mlp.0.weight" in res["errors"]["read_helper"]
        assert "inside Linear.forward" in res["errors"]["direct_forward"]
        assert res["late_init_gathered"] and res["late_init_ungathered"]

        assert res["modify"] == dict(kept=True, discarded=True, master=True, released=True, sd=True)

        assert res["closed"]
        assert res["moe_leaf"] == ""
        assert "'moe.experts.0'" in res["moe_no_leaf"] and "'moe.experts.1'" in res["moe_no_leaf"]
