"""DeepSpeed's `deepspeed.zero` import path: `Init` and `GatheredParameters` over
`minispeed.zero`'s stage-3 contexts.

```python
import minispeed.engine as deepspeed
with deepspeed.zero.Init(config_dict_or_path=ds_config):      # each rank builds Ψ/N
    model = GPT(cfg)
with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
    ...                                                          # full values; rank 0's edits kept
```

`Init` takes DeepSpeed's arguments and builds `minispeed.zero.Init(config, group, enabled)`:
`data_parallel_group` is the group; `config_dict_or_path` / `config` (a ds_config dict or a
JSON path) gives the `zero_optimization` section (read for `offload_param`, ZeRO-Infinity's
NVMe shards; entries still `"auto"`, a Hugging Face config not yet filled in, are left out);
`remote_device`, when it names a device, must agree with that section's `offload_param.device`
(left at `None` it follows the config, as under DeepSpeed).
Parameters are built in the dtype the model creates them in (fp32), and `minispeed.zero.shard`
casts them when the engine applies the config's precision: DeepSpeed casts them to the config's
fp16/bf16 inside `Init` already, so its fp32 master weights start from rounded values where
minispeed's start from the exact ones. `dtype` other than fp32 is therefore refused, as are
`module=` (converting a built model), `mpu`, quantized weights, sequence-parallel and
parameter-parallel groups, and a `param_swapper`. `mem_efficient_linear` and `pin_memory` are
accepted and have no effect (memory for linears is already bounded by the gather hooks; pinning
follows the offload config).

`GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)` is
`minispeed.zero.GatheredParameters`; `fwd_module` (registering external parameters) is refused.
`register_external_parameter(module, parameter)` / `unregister_external_parameter` check their
arguments and change nothing: minispeed's stage 3 finds a module's reads of another module's
parameter itself (the first read by attribute of a released parameter fetches it and lists it
with the reading module, `stage3/coordinator.py`), so scripts that register them run unchanged.
Costs: those of the package's contexts (one broadcast per parameter in `Init`; one all-gather
on entry and, with a modifier, one broadcast on exit in `GatheredParameters`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.zero.stage3 import ParamState, register_param_attribute

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "ZeroParamType",
    "register_external_parameter",
    "unregister_external_parameter",
]


class ZeroParamStatus(enum.Enum):
    """Where a ZeRO-3 parameter's full value is (DeepSpeed's names and values)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


# DeepSpeed's per-parameter attributes, answered by every stage-3 parameter while stage 3 owns
# it (minispeed.zero.stage3.register_param_attribute). TRL gathers a head only where
# `p.ds_status != ZeroParamStatus.AVAILABLE`; transformers and PEFT count parameters with
# `ds_numel`.
_DS_STATUS = {
    ParamState.GATHERED: ZeroParamStatus.AVAILABLE,
    ParamState.GATHERING: ZeroParamStatus.INFLIGHT,
    ParamState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
}
for _name, _answer in {
    "ds_status": lambda sp: _DS_STATUS[sp.state],
    "ds_numel": lambda sp: sp.numel,
    "ds_shape": lambda sp: sp.shape,
    "ds_tensor": lambda sp: sp.shard,
    "ds_persist": lambda sp: sp.persistent,
    "ds_id": id,
    # the modules using it, by DeepSpeed's count; minispeed counts holders (ShardedParam.holds),
    # not modules, so a new empty set: TRL clears it before generating, which changes nothing
    "ds_active_sub_modules": lambda sp: set(),
}.items():
    register_param_attribute(_name, _answer)


class ZeroParamType(enum.Enum):
    """How a parameter is held (DeepSpeed's names and values): minispeed's ZeRO-3 parameters
    are `PARTITIONED`."""

    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


def _ds_config(config_dict_or_path: Any, config: Any) -> dict[str, Any] | None:
    if config_dict_or_path is not None and config is not None:
        raise ValueError("zero.Init: give config_dict_or_path or config, not both")
    given = config_dict_or_path if config_dict_or_path is not None else config
    if given is None or isinstance(given, dict):
        return given
    if isinstance(given, (str, Path)):
        return json.loads(Path(given).read_text())
    raise TypeError(f"zero.Init: config must be a dict or a JSON path, got {type(given).__name__}")


class Init(zero.Init):
    """DeepSpeed's `deepspeed.zero.Init` (see the module docstring for what is kept, refused,
    and different). Collective: every rank of the group enters it and builds the same modules."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        refused = {
            "module": module is not None,
            "mpu": mpu is not None,
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "zero_quantized_weights": bool(zero_quantized_weights),
            "zero_quantized_nontrainable_weights": bool(zero_quantized_nontrainable_weights),
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
            "param_swapper": param_swapper is not None,
            "dtype": dtype not in (None, torch.float32),
        }
        for name, bad in refused.items():
            if bad:
                raise NotImplementedError(
                    f"zero.Init({name}=...) is not supported by minispeed (see "
                    "docs/engine/deepspeed-paths.md); leave it at its default"
                )
        ds_config = _ds_config(config_dict_or_path, config)
        zero_config = (
            zero.ZeroConfig.from_section(
                ds_config.get("zero_optimization"), aio=ds_config.get("aio")
            )
            if ds_config
            else None
        )
        offload = getattr(zero_config, "offload_param", None)
        configured = None if offload is None else offload.device
        # None / "none" (DeepSpeed's defaults) follow the config, as DeepSpeed's config
        # overrides the argument; a device named here must be the config's.
        if remote_device not in ("none", None) and remote_device != configured:
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}) but the config's "
                f"zero_optimization.offload_param.device is {configured!r}; make them agree "
                "(minispeed places the shards as the config says)"
            )
        if enabled and not comm.is_initialized():
            # DeepSpeed's Init starts the process group itself (torchrun's environment, or one
            # process), so scripts build models under it before calling initialize().
            comm.init_distributed()
        super().__init__(config=zero_config, group=data_parallel_group, enabled=enabled)


class GatheredParameters(zero.GatheredParameters):
    """DeepSpeed's `deepspeed.zero.GatheredParameters`: the full values of `params` inside the
    context; with `modifier_rank`, that rank's changes kept on every rank. Collective."""

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None:
            raise NotImplementedError(
                "GatheredParameters(fwd_module=...) (registering external parameters) is not "
                "supported by minispeed; leave it None"
            )
        super().__init__(params, modifier_rank=modifier_rank, enabled=enabled)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's declaration that `module`'s forward reads `parameter`, which another module
    owns. Checked, otherwise nothing to do: stage 3 discovers such reads itself (module
    docstring)."""
    _check_external("register_external_parameter", module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """The inverse of `register_external_parameter`: checked, nothing to undo."""
    _check_external("unregister_external_parameter", module, parameter)


def _check_external(what: str, module: Any, parameter: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"{what}: parameter must be an nn.Parameter, got {type(parameter).__name__}"
        )
