"""Optimizers by DeepSpeed name: a ds_config `"optimizer"` section to a `torch.optim.Optimizer`.

`build_optimizer(section, model_parameters, offload=...)` makes the choice DeepSpeed 0.19.8's
`DeepSpeedEngine._configure_basic_optimizer` makes, with our classes in place of DeepSpeed's
kernels (tests compare the class and hyper-parameters with DeepSpeed's, recorded in
`tests/engine/fixtures/ds_optimizers.json`):

| type (any case) | DeepSpeed builds | minispeed builds | offloaded (DeepSpeed / minispeed) |
|---|---|---|---|
| `Adam`, `AdamW` | `FusedAdam(adam_w_mode=m)` | `torch.optim.AdamW` if m else `Adam` | `DeepSpeedCPUAdam` / `offload.CPUAdam` |
| ... `torch_adam: true` | `torch.optim.AdamW` if m else `Adam` | the same | the same |
| `SGD`, any torch.optim name | that torch class | the same | the same, on the CPU masters |
| `Adagrad` | `torch.optim.Adagrad` | the same | `DeepSpeedCPUAdagrad` / `offload.CPUAdagrad` |
| `Lion` | `FusedLion` (CUDA) | `offload.Lion` (pure PyTorch) | `DeepSpeedCPULion` / `offload.CPULion` |
| `OneBitAdam`, `OneBitLamb` | removed in 0.19.8 | `comm.optim.OnebitAdam` (run over ZeRO 0-2 by `zero.onebit`) / `OnebitLamb` (refused by `zero.shard`) | refused (as DeepSpeed did) |

`m` (AdamW mode) is `type == "AdamW" or adam_w_mode`, and `adam_w_mode` defaults to **true**:
`"Adam"` means AdamW unless `adam_w_mode: false`. Without `torch_adam`, `weight_decay` defaults
to 0 (FusedAdam's default, not torch AdamW's 0.01). Every param key DeepSpeed accepts for a type
is either passed on or refused by name (e.g. `bias_correction: false`: torch's Adam always
corrects); unknown keys and types are ValueErrors with a did-you-mean. Every error is a
`ConfigError` at the key as written (`optimizer.params.lr`), the constructor's own checks included
(`by_name.construct`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from minispeed.core.config import ConfigError, ConfigTypeError
from minispeed.engine.by_name import OptimizerSection, check_params, construct, did_you_mean

__all__ = ["OPTIMIZER_TYPES", "build_optimizer"]

OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD", "Adagrad", "Lion", "OneBitAdam", "OneBitLamb")

# DeepSpeed types we do not build, with the reason and what to use instead.
REFUSED_TYPES = {
    "lamb": "DeepSpeed's FusedLamb is a CUDA kernel minispeed does not have, and LAMB's "
    "per-tensor trust ratio cannot step ZeRO's slices; use 'AdamW', or at ZeRO stage 0 pass a "
    "LAMB instance as initialize(optimizer=...)",
    "muadam": "the mup package's MuAdam is not a minispeed dependency; pass a MuAdam instance as "
    "initialize(optimizer=...)",
    "muadamw": "the mup package's MuAdamW is not a minispeed dependency; pass a MuAdamW instance as "
    "initialize(optimizer=...)",
    "musgd": "the mup package's MuSGD is not a minispeed dependency; pass a MuSGD instance as "
    "initialize(optimizer=...)",
    "muon": "Muon (with its auxiliary Adam) is not implemented in minispeed; use 'AdamW'",
    "zerooneadam": "0/1 Adam was removed from DeepSpeed and is not in minispeed; use 'OneBitAdam'",
}


_PATH = "optimizer"


def _require(kind: str, params: dict[str, Any], key: str, allowed: Any, why: str) -> None:
    """Refuse `params[key]` unless it equals `allowed` (DeepSpeed's default we implement)."""
    if key in params:
        value = params.pop(key)
        if value != allowed:
            raise ConfigError(
                f"{_PATH}.params.{key}",
                f"{value!r}: {kind}'s {key!r} must be {allowed!r} here: {why}",
            )


def _check(kind: str, params: dict[str, Any], accepted: Any) -> None:
    check_params(params, accepted, _PATH, repr(kind))


def _accepted(cls: type, *extra: str) -> set[str]:
    """The keyword arguments of `cls.__init__` (less self and the params) plus `extra`."""
    names = set(inspect.signature(cls.__init__).parameters) - {"self", "params", "model_params"}
    return names | set(extra)


_FP32_STATES = "minispeed keeps optimizer states in fp32 (bf16 states are not implemented)"


def _build_adam(
    kind: str, params: dict[str, Any], model_parameters: Any, offload: bool
) -> torch.optim.Optimizer:
    adam_w_mode = params.pop("adam_w_mode", True)
    torch_adam = params.pop("torch_adam", False)
    for key, value in (("adam_w_mode", adam_w_mode), ("torch_adam", torch_adam)):
        if not isinstance(value, bool):
            raise ConfigError(
                f"{_PATH}.params.{key}", f"{kind}'s {key!r} must be true or false, got {value!r}"
            )
    decoupled = kind.lower() == "adamw" or adam_w_mode  # DeepSpeed's: "Adam" is AdamW by default
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    own = {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}
    if torch_adam:
        # DeepSpeed hands the remaining params to torch as they are (torch's defaults apply).
        _check(f"{kind} (torch_adam)", params, _accepted(cls) | own)
        _require(kind, params, "fp32_optimizer_states", True, _FP32_STATES)
        return construct(cls, model_parameters, params, _PATH)

    fused = {"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad"} | own
    _check(kind, params, fused if offload else fused | {"set_grad_none"})
    _require(kind, params, "fp32_optimizer_states", True, _FP32_STATES)
    _require(kind, params, "bias_correction", True, "torch's Adam always corrects the bias")
    _require(
        kind,
        params,
        "amsgrad",
        False,
        "DeepSpeed's FusedAdam and CPU Adam have no AMSGrad; set torch_adam: true for torch's",
    )
    _require(kind, params, "set_grad_none", True, "zero_grad() always sets gradients to None")
    params.setdefault("weight_decay", 0.0)  # FusedAdam's and CPU Adam's default, not AdamW's
    if not offload:
        return construct(cls, model_parameters, params, _PATH)

    from minispeed.offload import CPUAdam

    return construct(
        CPUAdam, model_parameters, {**params, "decoupled_weight_decay": decoupled}, _PATH
    )


def _build_lion(params: dict[str, Any], model_parameters: Any, offload: bool) -> Any:
    _check(
        "Lion",
        params,
        {"lr", "betas", "weight_decay", "fp32_optimizer_states"}
        | (set() if offload else {"set_grad_none"}),
    )
    _require("Lion", params, "fp32_optimizer_states", True, _FP32_STATES)
    _require("Lion", params, "set_grad_none", True, "zero_grad() always sets gradients to None")
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, **params}  # DeepSpeed's
    from minispeed.offload import CPULion, Lion

    return construct(CPULion if offload else Lion, model_parameters, hyper, _PATH)


def _build_adagrad(params: dict[str, Any], model_parameters: Any, offload: bool) -> Any:
    if not offload:
        _check("Adagrad", params, _accepted(torch.optim.Adagrad))
        return construct(torch.optim.Adagrad, model_parameters, params, _PATH)
    from minispeed.offload import CPUAdagrad

    # DeepSpeedCPUAdagrad's keys; CPUAdagrad also takes torch's (lr_decay, ...), so accept those.
    _check("Adagrad", params, _accepted(CPUAdagrad, "amsgrad", "fp32_optimizer_states") - {"simd"})
    _require("Adagrad", params, "amsgrad", False, "Adagrad has no AMSGrad variant")
    _require("Adagrad", params, "fp32_optimizer_states", True, _FP32_STATES)
    return construct(CPUAdagrad, model_parameters, params, _PATH)


# Keys of DeepSpeed's (removed) 1-bit optimizers that set something minispeed does one way only.
_ONEBIT_FIXED = {
    "bias_correction": (True, "minispeed's 1-bit optimizers always correct the bias"),
    "eps_inside_sqrt": (False, "eps is added outside the square root"),
    "amsgrad": (False, "1-bit optimizers have no AMSGrad variant"),
    "cuda_aware": (False, "minispeed communicates through torch.distributed, not MPI"),
}
# DeepSpeed's 1-bit backends: "nccl" (GPUs) and "compressed" (its CPU/other-accelerator path) both
# mean "through the process group" here; "mpi" (mpi4py + CuPy) has no counterpart.
_ONEBIT_BACKENDS = ("nccl", "compressed")


def _build_onebit(
    kind: str, params: dict[str, Any], model_parameters: Any, offload: bool, group: Any
) -> torch.optim.Optimizer:
    if offload:
        raise ConfigError(
            f"{_PATH}.type",
            f"{kind!r}: a 1-bit optimizer cannot be offloaded (DeepSpeed could not either); "
            "remove zero_optimization.offload_optimizer or use 'Adam'",
        )
    from minispeed.comm.optim import OnebitAdam, OnebitLamb

    cls = OnebitAdam if kind.lower() == "onebitadam" else OnebitLamb
    _check(kind, params, (_accepted(cls) - {"group"}) | set(_ONEBIT_FIXED) | {"comm_backend_name"})
    for key, (allowed, why) in _ONEBIT_FIXED.items():
        _require(kind, params, key, allowed, why)
    backend = params.pop("comm_backend_name", "nccl")
    if backend not in _ONEBIT_BACKENDS:
        raise ConfigError(
            f"{_PATH}.params.comm_backend_name",
            f"{kind}'s 'comm_backend_name' must be one of {list(_ONEBIT_BACKENDS)} here, got "
            f"{backend!r}: minispeed communicates through the process group's own backend (NCCL "
            "or gloo); leave the key out",
        )
    params.setdefault("freeze_step", 100000)  # DeepSpeed's default (ours is 100)
    return construct(cls, model_parameters, {**params, "group": group}, _PATH)


def _torch_optimizer_class(kind: str) -> type | None:
    """The torch.optim class named `kind` (any case), as DeepSpeed's fall-through allows."""
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        is_optimizer = isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        if name.lower() == kind.lower() and is_optimizer and cls is not torch.optim.Optimizer:
            return cls
    return None


# torch.optim's hyper-parameters that are numbers (a tensor for `lr` too), and the pairs.
_NUMBERS = ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "alpha", "rho")
_PAIRS = ("betas",)


def _check_hyperparameters(params: dict[str, Any]) -> None:
    """A number given as a string (`"lr": "3e-4"`) or a pair of the wrong length (`"betas":
    [0.9]`) fails inside torch's constructor with a bare comparison or index error: refuse it
    at its key, for every optimizer type."""
    for name in _NUMBERS:
        value = params.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float | torch.Tensor)
        ):
            raise ConfigTypeError(
                f"{_PATH}.params.{name}",
                f"must be a number, got {value!r} ({type(value).__name__}); write it unquoted, "
                "e.g. 3e-4",
            )
    for name in _PAIRS:
        value = params.get(name)
        if value is not None and not (
            isinstance(value, list | tuple)
            and len(value) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        ):
            raise ConfigTypeError(
                f"{_PATH}.params.{name}",
                f"must be two numbers, got {value!r}; e.g. [0.9, 0.999]",
            )


def build_optimizer(
    section: OptimizerSection | dict[str, Any],
    model_parameters: Iterable[Any],
    *,
    offload: bool = False,
    process_group: Any = None,
) -> torch.optim.Optimizer:
    """The optimizer of a ds_config `"optimizer"` section (module docstring for the mapping).

    `model_parameters`: parameters or param-group dicts, as DeepSpeed accepts. `offload`: the
    optimizer steps fp32 master copies on the CPU (ZeRO-Offload): offload's CPU classes where
    DeepSpeed uses its own. `process_group`: the data-parallel group 1-bit optimizers average
    over (`None`: every rank). Raises a `ConfigError` naming an unknown type or param key, a
    DeepSpeed key whose value minispeed does not implement, or a value the class refuses.
    """
    if not isinstance(section, OptimizerSection):
        section = OptimizerSection.from_section(section)
    kind, params = section.type, dict(section.params)
    if "max_grad_norm" in params:
        raise ConfigError(
            f"{_PATH}.params.max_grad_norm",
            f"'max_grad_norm' is not a param of {kind!r} (as in DeepSpeed); set the top-level "
            "'gradient_clipping' instead",
        )
    _check_hyperparameters(params)
    lower = kind.lower()
    if lower in ("adam", "adamw"):
        return _build_adam(kind, params, model_parameters, offload)
    if lower == "lion":
        return _build_lion(params, model_parameters, offload)
    if lower == "adagrad":
        return _build_adagrad(params, model_parameters, offload)
    if lower in ("onebitadam", "onebitlamb"):
        return _build_onebit(kind, params, model_parameters, offload, process_group)
    if lower in REFUSED_TYPES:
        raise ConfigError(f"{_PATH}.type", f"{kind!r} is not supported: {REFUSED_TYPES[lower]}")
    cls = _torch_optimizer_class(kind)
    if cls is None:
        raise ConfigError(
            f"{_PATH}.type",
            f"{kind!r} is unknown{did_you_mean(kind, OPTIMIZER_TYPES)}; supported: "
            f"{', '.join(OPTIMIZER_TYPES)}, or a torch.optim class name",
        )
    # SGD and the rest of torch.optim: DeepSpeed passes the params to the class as they are, and
    # keeps it when offloading (it then steps the CPU masters).
    _check(kind, params, _accepted(cls))
    return construct(cls, model_parameters, params, _PATH)
