"""`deepspeed.runtime.zero.partition_parameters`: stage 3's construction and gathering contexts
(`Init`, `GatheredParameters`, `register_external_parameter`, from `minispeed.engine.zero`),
`ZeroParamStatus`, and the names transformers reaches into while it builds a model.

`ZeroParamStatus` is DeepSpeed's enum of where a partitioned parameter's full value is
(`AVAILABLE` = minispeed's `ParamState.GATHERED`, `NOT_AVAILABLE` = `SHARDED`, `INFLIGHT` =
`GATHERING`). minispeed keeps that state on its own `ShardedParam`; while stage 3 owns a
parameter, DeepSpeed's attributes read it from there (`minispeed.engine.zero`): `ds_status`,
`ds_numel` and `ds_shape` (the full parameter's), `ds_tensor` (this rank's shard), `ds_persist`
and `ds_id`. They are read-only, and gone once the engine releases the model.

DeepSpeed's `Init` wraps torch's tensor constructors to build parameters in the config's dtype;
transformers swaps that wrapper (`zero_wrapper_for_fp_tensor_constructor`) around `from_pretrained`
to keep `torch.arange`'s dtype. minispeed's `Init` builds in the model's own dtype and wraps no
constructor, so the wrapper here is the identity and `_orig_torch_arange` is torch's
`arange`: the swap is accepted and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minispeed.engine.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., Any], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., Any]:
    """DeepSpeed's constructor wrapper: `fn` itself, since minispeed's `Init` casts nothing
    (module docstring)."""
    return fn
