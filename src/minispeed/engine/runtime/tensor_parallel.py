"""`deepspeed.tp_model_init` (DeepSpeed's `deepspeed.runtime.tensor_parallel` records it): the
tensor-parallel call transformers' Trainer makes when the ds_config sets
`tensor_parallel.autotp_size` > 1, before `initialize`.

As DeepSpeed 0.19.8's, it only records: the model is cut inside `initialize`, where the record
is merged into the config (`merge_recorded`): a missing `tensor_parallel.autotp_size` is filled
from it, a different one (or a different dtype than the config's fp16 / bf16) is an error naming
both. A model recorded here is cut by the plan read from its structure,
`minispeed.tensor_parallel.auto_plan`, whatever its type: its output head gathers whole logits,
so the loss the model computes itself (`labels=`) is the unsplit model's. (Without the record,
`initialize` keeps the ready plans for minispeed's GPT, GPT-2 and LLaMA, whose logits stay split
by vocabulary for `vocab_parallel_cross_entropy`.)
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["batch_over_data", "merge_recorded", "recorded_for", "tp_model_init"]

# Models given to tp_model_init -> the tensor-parallel size and dtype it was given: a registry,
# not attributes patched onto the user's model. Weak, so it holds no model alive.
_RECORDED: weakref.WeakKeyDictionary[nn.Module, tuple[int, torch.dtype]] = (
    weakref.WeakKeyDictionary()
)


def tp_model_init(
    model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any
) -> nn.Module:
    """Record that `model` is to be cut over `tp_size` ranks by its structure (module docstring);
    returns `model`, unchanged. `tp_group=` (DeepSpeed's keyword) is refused: minispeed builds
    the tensor groups from the config's grid."""
    if kwargs.get("tp_group") is not None:
        raise NotImplementedError(
            "tp_model_init(tp_group=...) is not supported: minispeed builds the tensor-parallel "
            "groups from the config (tensor_parallel.autotp_size, tensor ranks adjacent); leave "
            "tp_group out"
        )
    if unknown := set(kwargs) - {"tp_group"}:
        raise TypeError(f"tp_model_init got unexpected keyword arguments {sorted(unknown)}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size={tp_size!r}): must be an int >= 1")
    _RECORDED[model] = (tp_size, dtype)
    return model


def recorded_for(model: nn.Module) -> bool:
    """Whether `model` was given to `tp_model_init` (so `initialize` cuts it by `auto_plan`)."""
    return model in _RECORDED


def _config_dtype(ds: Mapping[str, Any]) -> torch.dtype | None:
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = ds.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            return dtype
    return None


def merge_recorded(ds: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """The config with `model`'s `tp_model_init` record merged in, as DeepSpeed merges it:
    `tensor_parallel.autotp_size` filled when missing; a different size or dtype is a
    `ValueError` naming both (local: every rank raises it before any collective)."""
    if model not in _RECORDED:
        return ds
    tp_size, dtype = _RECORDED[model]
    section = dict(ds.get("tensor_parallel") or {})
    given = section.get("autotp_size")
    if given is not None and given != tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size is {given} in the config but tp_model_init was given "
            f"tp_size={tp_size}: make them equal"
        )
    config_dtype = _config_dtype(ds)
    if config_dtype is not None and config_dtype != dtype:
        raise ValueError(
            f"tp_model_init was given dtype={dtype} but the config enables {config_dtype}: make "
            "them equal"
        )
    section["autotp_size"] = tp_size
    return {**ds, "tensor_parallel": section}


def batch_over_data(ds: dict[str, Any], world: int, tensor: int) -> dict[str, Any]:
    """The config with a `train_batch_size` counted over every rank read as DeepSpeed reads it
    under AutoTP. DeepSpeed 0.19.8 reads the config before it builds the tensor groups, so it
    checks `train_batch_size = micro × accumulation × world` (tensor ranks counted), and
    transformers' Trainer fills `"auto"` so; the tensor ranks of a group see the same samples,
    so the batch of one step is `micro × accumulation × world / T`, what minispeed checks. A
    triple that agrees over the whole world is rewritten to that; any other is left for the
    usual check (which names the keys). Local."""
    if tensor <= 1:
        return ds
    values = [ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                  "gradient_accumulation_steps")]  # fmt: skip
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return ds
    train, micro, accumulation = values
    if train != micro * accumulation * world or world % tensor:
        return ds
    return {**ds, "train_batch_size": train // tensor}
