"""Reading a released stage-3 parameter gives the right answer or ParameterNotGatheredError.

Before, a released parameter answered with its empty ``.data``: ``p.norm()`` was 0.0, ``p.shape``
``(0,)``, ``p.detach().cpu().numpy()`` empty, so logging and export code carried on with wrong
numbers. Now (stage3/released.py) its shape queries give the full parameter's, as FSDP2's sharded
parameters do, and every read of its values outside forward and ``GatheredParameters`` raises,
naming the parameter and the fix. One 2-rank run checks each kind of read on a model trained by
``zero.shard`` and on one only built under ``zero.Init``; the right answers are compared with the
same model built by one process from the same seed.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import (
    GatheredParameters,
    Init,
    ParameterNotGatheredError,
    register_param_attribute,
)

WIDTH = 8


class Net(nn.Module):
    """Two Linear layers and a 1-element gain: a scalar parameter for ``item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 1)
        self.gain = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.out(torch.tanh(self.inp(x))) * self.gain).pow(2).mean()


class StaleRef(nn.Module):
    """Its forward uses a weight through a reference kept in a list, never by attribute: inside
    forward the guard fetches it (a demand fetch) instead of computing with an empty tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.kept = [self.lin.weight, self.lin.bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, *self.kept).pow(2).mean()


def _plain_and_sharded(cls: type) -> tuple[nn.Module, nn.Module]:
    """Two equal `cls()`, the second partitioned by stage 3 (no parameter kept whole)."""
    torch.manual_seed(0)
    plain = cls()
    torch.manual_seed(0)
    model = cls()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    return plain, model


def _stale_losses() -> tuple[float, float]:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    plain, model = _plain_and_sharded(StaleRef)
    return model(x).item(), plain(x).item()


def _error(fn: Callable[[], Any]) -> str:
    """The ParameterNotGatheredError's message, or a description of what came back instead."""
    try:
        got = fn()
    except ParameterNotGatheredError as err:
        return str(err)
    return f"no error: returned {got!r}"


READS: dict[str, Callable[[nn.Module], Any]] = {
    "norm": lambda m: m.inp.weight.norm(),
    "sum": lambda m: m.inp.weight.sum(),
    "numpy": lambda m: m.inp.weight.detach().cpu().numpy(),
    "item": lambda m: m.gain.item(),
    "index": lambda m: m.inp.weight[0],
    "tolist": lambda m: m.inp.weight.tolist(),
    "function": lambda m: torch.add(m.inp.weight, 1.0),
    "in_list": lambda m: torch.cat([m.inp.bias, m.out.bias]),
    "inplace": lambda m: m.inp.weight.zero_(),
    "state_dict": lambda m: torch.save(m.state_dict(), io.BytesIO()),  # placeholders refuse
    "deepcopy": lambda m: copy.deepcopy(m.inp.weight),
    "pickle": lambda m: pickle.dumps(m.inp.weight),
}


def _shapes(m: nn.Module) -> dict:
    w = m.inp.weight
    return dict(
        shape=tuple(w.shape),
        size=tuple(w.size()),
        size1=w.size(1),
        numel=w.numel(),
        dim=(w.dim(), w.ndim),
        len=len(w),
        gain=(tuple(m.gain.shape), m.gain.numel()),
    )


def _values(m: nn.Module) -> dict:
    return dict(
        norm=m.inp.weight.norm().item(),
        numpy=m.inp.weight.detach().cpu().numpy().tolist(),
        item=m.gain.item(),
        index=m.inp.weight[0].tolist(),
    )


def _reads(model: nn.Module) -> dict:
    errors = {name: _error(lambda read=read: read(model)) for name, read in READS.items()}
    with GatheredParameters(list(model.parameters())):
        gathered = _values(model)
    return dict(
        shapes=_shapes(model),
        errors=errors,
        gathered=gathered,
        repr=repr(model.inp.weight),
        is_parameter=isinstance(model.inp.weight, nn.Parameter),
    )


def _body(rank: int, world_size: int) -> dict:
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    torch.manual_seed(0)
    with Init():
        built = Net()
    out = dict(init=_reads(built))

    torch.manual_seed(0)
    model = Net()
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    opt.backward(model(x))  # forward and backward still see gathered values
    opt.step()
    out["shard"] = _reads(model)
    # an attribute registered for code written for another ZeRO-3 (the engine registers
    # DeepSpeed's), answered from the parameter's partitioning while stage 3 owns it
    register_param_attribute("test_full_numel", lambda sp: (sp.numel, sp.state.name))
    out["attribute"] = model.inp.weight.test_full_numel
    with GatheredParameters([model.inp.weight]):
        out["attribute_gathered"] = model.inp.weight.test_full_numel
    try:
        register_param_attribute("shape", lambda sp: 0)
        out["refused"] = "no error"
    except ValueError as err:
        out["refused"] = str(err)
    opt.strategy.close()  # a plain model again: plain class, full values, no errors
    out["attribute_closed"] = hasattr(model.inp.weight, "test_full_numel")
    out["stale"] = _stale_losses()
    out["closed"] = dict(
        plain=type(model.inp.weight) is nn.Parameter, values=_values(model), shapes=_shapes(model)
    )
    return out


def _reference() -> tuple[dict, dict]:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        return _shapes(net), _values(net)


def test_released_parameters_answer_or_raise() -> None:
    shapes, values = _reference()
    results = run_distributed(_body, world_size=2, timeout_s=120)
    for rank, res in enumerate(results):
        for case in ("init", "shard"):
            got = res[case]
            assert got["shapes"] == shapes, (rank, case, got["shapes"])
            for read, message in got["errors"].items():
                assert message.startswith("stage-3 parameter"), (rank, case, read, message)
                assert "GatheredParameters" in message, (rank, case, read, message)
                # the parameter read (saving a state_dict names the first released one it meets)
                param = {"item": "gain", "in_list": "bias", "state_dict": ""}.get(read, "weight")
                assert param in message.split("'")[1], (rank, case, read, message)
            assert "released stage-3 parameter" in got["repr"] and "(8, 8)" in got["repr"]
            assert got["is_parameter"]
        # Values inside GatheredParameters: built under Init, the single-process model's.
        init = res["init"]["gathered"]
        assert init["numpy"] == values["numpy"] and init["item"] == values["item"]
        assert abs(init["norm"] - values["norm"]) <= 1e-6 * values["norm"]
        # After one SGD step, every rank reads the same values (the group's, not its shard).
        assert res["shard"]["gathered"] == results[0]["shard"]["gathered"]
        assert res["closed"]["plain"] and res["closed"]["shapes"] == shapes
        assert res["attribute"] == (64, "SHARDED") and res["attribute_gathered"] == (64, "GATHERED")
        assert "attribute of every tensor" in res["refused"] and not res["attribute_closed"]
        assert res["closed"]["values"] == res["shard"]["gathered"]
        stale, plain = res["stale"]
        assert abs(stale - plain) <= 1e-6 * abs(plain), res["stale"]


class FeedForward(nn.Module):
    """Parameter-less, as T5's: checks its output layer's dtype before calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if h.dtype != self.out.weight.dtype:  # metadata of a released parameter
            h = h.to(self.out.weight.dtype)
        return self.out(h)


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(FeedForward(), FeedForward())
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)).pow(2).mean()


def _encoder_alone(rank: int, world_size: int) -> dict:
    """`generate` runs an encoder-decoder's encoder alone, outside the root's forward."""
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(2))
    plain, model = _plain_and_sharded(EncoderDecoder)
    with torch.no_grad():
        alone = model.encoder(x)
        direct = _error(lambda: model.encoder[0].out.forward(x.repeat(1, 2)))
        return dict(
            equal=torch.equal(alone, plain.encoder(x)),
            released=model.encoder[0].out.weight.data.numel() == 0,
            direct=direct,
        )


def test_a_submodule_run_alone_may_read_a_childs_metadata() -> None:
    """A parameter-less module run outside the model's forward reads a child's dtype (released:
    the answer is the full parameter's) and then calls the child, which gathers it; a value
    read from a forward the hooks did not start names that forward."""
    for res in run_distributed(_encoder_alone, world_size=2, timeout_s=120):
        assert res["equal"] and res["released"]
        assert "by linear() inside Linear.forward, which ran without the stage-3" in res["direct"]
