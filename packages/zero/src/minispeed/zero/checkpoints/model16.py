"""The model's weights as one plain 16-bit `state_dict` file, gathered across ranks.

DeepSpeed's `save_16bit_model` writes the model's parameters in their training dtype (fp16 or
bf16 under mixed precision) as one ordinary `torch.save` file that loads into the model without
DeepSpeed: the file users publish or serve. `save_16bit_model` here does the same:

1. per module, the module's own parameters are gathered (`GatheredParameters`: an all-gather of
   their shards under stage 3, nothing for stages 0-2, whose parameters are whole on every rank),
   and rank 0 copies them to the CPU;
2. rank 0 writes the `state_dict` (every key of `model.state_dict()`, tied aliases sharing one
   tensor, persistent buffers included) atomically (temp file, fsync, rename:
   Note [atomic checkpoint] in layout.py).

Under stage 3 the gather is the cost DeepSpeed guards with
`stage3_gather_16bit_weights_on_model_save`: without it, `save_16bit_model` is refused there, as
DeepSpeed refuses it (DeepSpeed warns and writes nothing; we raise). With it, `save_checkpoint`
also writes the file into every tag (`<tag>/pytorch_model.bin`).

Costs: bytes sent, stage 3: one all-gather of every released parameter, Σ N·s·p bytes (s = shard
elements); rank 0 holds the whole state_dict, Ψ·p bytes of host memory (the file's size), every
other rank at most one module's gathered parameters at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core import ranges
from minispeed.zero.checkpoints.agree import together
from minispeed.zero.checkpoints.layout import atomic_save
from minispeed.zero.stage3.init import GatheredParameters

__all__ = ["MODEL_16BIT_FILE", "gather_16bit_state_dict", "gather_full", "save_16bit_model"]

#: DeepSpeed's default file name for `save_16bit_model`.
MODEL_16BIT_FILE = "pytorch_model.bin"


def gather_full(
    model: nn.Module, want: Callable[[str], bool], *, keep: bool
) -> dict[str, torch.Tensor]:
    """`{name: full value on the CPU}` of the parameters whose first name passes `want`.

    Collective under stage 3 (every rank calls it with the same `want`): each module's own
    parameters are gathered together, then released. Only ranks with `keep` copy anything; the
    values are new tensors the caller owns.
    """
    first_name = {id(p): name for name, p in model.named_parameters()}
    done: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for module in model.modules():
        own = []
        for p in dict.values(module._parameters):  # plain dict read: no stage-3 access guard
            if p is not None and id(p) not in done and want(first_name[id(p)]):
                done.add(id(p))
                own.append(p)
        if not own:
            continue
        with GatheredParameters(own):
            if keep:
                for p in own:
                    out[first_name[id(p)]] = p.detach().to("cpu", copy=True)
    return {name: out[name] for name in first_name.values() if name in out} if keep else {}


def gather_16bit_state_dict(model: nn.Module, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """`model.state_dict()` with full parameters in their training dtype, on the CPU, on the
    ranks with `keep` (None elsewhere). Collective under stage 3 (see `gather_full`)."""
    values = gather_full(model, lambda name: True, keep=keep)
    if not keep:
        return None
    first_name = {id(p): name for name, p in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for key, tensor, is_param in _state_dict_entries(model):
        state[key] = values[first_name[id(tensor)]] if is_param else tensor.detach().cpu().clone()
    return state


def _state_dict_entries(module: nn.Module, prefix: str = ""):
    """(key, tensor, is_parameter) in `module.state_dict()` order, without reading through the
    stage-3 access guard."""
    for name, p in dict.items(module._parameters):
        if p is not None:
            yield prefix + name, p, True
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, b, False
    for name, child in module._modules.items():
        if child is not None:
            yield from _state_dict_entries(child, prefix + name + ".")


@ranges.range("zero.checkpoint.save_16bit_model")
def save_16bit_model(
    opt: Any,
    model: nn.Module,
    save_dir: str | os.PathLike,
    filename: str = MODEL_16BIT_FILE,
) -> Path:
    """Write `model`'s weights as one plain `state_dict` file `save_dir/filename` (rank 0 writes).

    Collective: every rank of the optimizer's group calls it. The parameters are saved in their
    training dtype (`MixedPrecision.param_dtype`: 16-bit under mixed precision, as DeepSpeed's
    `save_16bit_model`); `torch.load` of the file goes straight into `model.load_state_dict` of
    a plain model. Stage 3 needs `ZeroConfig(stage3_gather_16bit_weights_on_model_save=True)`
    (DeepSpeed's key), since it gathers the whole model. An error on any rank is raised on every
    rank. Returns the file's path.
    """
    group = opt.comm_group
    rank = comm.get_rank(group)
    path = Path(save_dir) / filename
    if opt.config.stage == 3 and not opt.config.stage3_gather_16bit_weights_on_model_save:
        raise ValueError(
            "save_16bit_model under stage 3 gathers the whole model (Ψ·p bytes on rank 0), which "
            "DeepSpeed allows only with stage3_gather_16bit_weights_on_model_save; set "
            "ZeroConfig(stage3_gather_16bit_weights_on_model_save=True) (or the key in "
            "zero_optimization), or save a sharded checkpoint and consolidate it"
        )
    state = gather_16bit_state_dict(model, keep=rank == 0)

    def write() -> None:
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_save(state, path)

    together(group, f"save_16bit_model to {path}", write)
    return path
