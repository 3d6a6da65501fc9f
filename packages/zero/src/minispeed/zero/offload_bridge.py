"""ZeRO-Offload and ZeRO-Infinity: where `minispeed.zero` hands its states to `minispeed.offload`.

`minispeed.offload` is an optional extra (`pip install packages/zero[offload]`): nothing here
imports it until a config asks for a device other than `none` (Note [offload is imported
lazily]). Three pieces, applied by `zero.shard` in this order:

1. `offload_sections` / `check_offload`: DeepSpeed's `offload_optimizer`, `offload_param`
   and `aio` sections become offload's typed configs on `ZeroConfig` (read by offload's own
   classes, `ZeroConfig.from_section`);
2. `HostMasters`: a `ShardStrategy` wrapper whose masters and master gradients are host
   tensors (aliases of the strategy's own where those already live on the CPU);
3. `host_optimizer`: the user's Adam/AdamW stepped by offload's CPU Adam (`device: cpu`) or
   its `SwappedOptimizer` (`device: nvme`), Adagrad by `CPUAdagrad` and Lion by `CPULion`
   (`cpu`), over those host masters, reading the user's own
   param groups at every step (so LR schedulers keep working).

`zero.shard` applies them through `minispeed.zero.offload_setup.apply_offload`.
Stage 3's `offload_param` lives in `minispeed.zero.stage3.offloaded` (shards in host memory or
swap files, fetched before each all-gather). At stage 3, `offload_optimizer: nvme` is
ZeRO-Infinity's optimizer side, `minispeed.zero.stage3.infinity` (instead of steps 2-3 above):
the fp32 masters live in the swap files with the Adam states and the gradient shards are
written to files as they are reduced (`offload_setup.wants_masters_in_files`).

Where each byte lives, per rank (Ψ parameters, N ranks, p bytes per 16-bit parameter; Adam):

| mode                        | accelerator          | host                         | files               |
|-----------------------------|----------------------|------------------------------|---------------------|
| no offload (stage 2)        | 2Ψ + 2Ψ/N + 12Ψ/N    | -                            | -                   |
| offload_optimizer cpu       | 2Ψ + 2Ψ/N            | 4Ψ/N + 4Ψ/N (grad) + 8Ψ/N    | -                   |
| offload_optimizer nvme      | 2Ψ + 2Ψ/N            | 8Ψ/N + pool                  | 8Ψ/N                |
| stage 3, optimizer nvme     | p·Ψ/N (shards)       | pools                        | 12Ψ/N + 4Ψ/N (grad) |
| + offload_param nvme        | gathered units only  | pools                        | + p·Ψ/N             |
| offload_param cpu (stage 3) | gathered units only  | p·Ψ/N                        | -                   |

(pool = `buffer_count` buffers; see `minispeed.offload.swapper.BufferPool`.) Bytes moved per
step with `offload_optimizer`: the gradient partition down (4Ψ/N) and the master partition
up (4Ψ/N) over the host link; with `nvme`, 8Ψ/N read and 8Ψ/N written on the disk; at stage 3
(masters and gradients in files) 16Ψ/N read and 12Ψ/N written at the step, plus 4Ψ/N of
gradients written per micro-step.
On a CPU-only machine the "accelerator" is host memory: the masters are not copied at all,
only the optimizer (CPU Adam) and where the states live (memory or files) change.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.core.config import ConfigError, join_path
from minispeed.core.logging import get_logger, warn_once
from minispeed.zero.contract import StrategyWrapper

__all__ = [
    "OFFLOAD_INSTALL_HINT",
    "HostMasters",
    "check_offload",
    "check_offload_stage",
    "host_optimizer",
    "import_offload",
    "offload_sections",
]

OFFLOAD_INSTALL_HINT = "pip install packages/zero[offload]"

# Note [offload is imported lazily]
# docs/architecture.md: zero <- offload is an optional extra of zero. `import minispeed.zero` must
# work without minispeed-offload installed, so offload is imported only here, and only when a
# config names a device other than 'none': from `ZeroConfig.from_section` (to build its typed
# sections) and `zero.shard` (to build the CPU optimizer and swappers). Without the package the
# ImportError becomes an error naming the section that asked for it and the install command;
# sections whose device is 'none' are then left unread (nothing would read them).


def import_offload(asked_by: str) -> Any:
    """`minispeed.offload`, or an ImportError naming `asked_by` and the install command."""
    try:
        return importlib.import_module("minispeed.offload")
    except ImportError as exc:
        raise ImportError(
            f"{asked_by} needs the minispeed-offload package, which is not installed: "
            f"{OFFLOAD_INSTALL_HINT} (or pip install packages/offload), or set its device to "
            f"'none'"
        ) from exc


_KEYS = ("offload_optimizer", "offload_param")
_log = get_logger("zero.offload")


def _device(section: Any) -> Any:
    return section.get("device") if isinstance(section, Mapping) else None


def offload_sections(section: Any, path: str) -> Any:
    """A `zero_optimization` section ready for `ZeroConfig`'s reader: as given where
    minispeed.offload is installed (its classes read the offload sections); without it, the
    offload sections asking for no device are dropped, and one asking for a device is an
    `ImportError` naming it and the install command (after the stage check, which needs no
    package)."""
    if not isinstance(section, Mapping) or not any(k in section for k in _KEYS):
        return section
    try:
        importlib.import_module("minispeed.offload")
        return section
    except ImportError:
        pass
    devices = [_device(section.get(k)) for k in _KEYS]
    devices = ignore_offload_misfits(section.get("stage", 0), devices, path=path)
    asked = [(k, d) for k, d in zip(_KEYS, devices) if d not in (None, "none")]
    if asked:
        name, device = asked[0]
        import_offload(f"{join_path(path, name)}.device={device!r}")
    return {k: v for k, v in section.items() if k not in _KEYS}


def check_offload(config: Any) -> None:
    """Refuse offload sections the stage cannot honour (called by `ZeroConfig.__post_init__`)."""
    offload = import_offload("ZeroConfig.offload_optimizer / offload_param")
    for key, cls in (
        ("offload_optimizer", offload.OffloadOptimizerConfig),
        ("offload_param", offload.OffloadParamConfig),
        ("aio", offload.AioConfig),
    ):
        value = getattr(config, key)
        if value is not None and not isinstance(value, cls):
            raise ConfigError(
                f"ZeroConfig.{key}",
                f"must be a minispeed.offload.{cls.__name__} (or None), got "
                f"{type(value).__name__}; build it with {cls.__name__}.from_section(section)",
                field=key,
            )
    opt, par = config.offload_optimizer, config.offload_param
    check_offload_stage(
        config.stage,
        None if opt is None else opt.device,
        None if par is None else par.device,
        path="ZeroConfig",
    )


# Why a stage cannot honour an offload device, and the fix a config built in code is told.
_MISFIT = {
    "offload_optimizer": (
        "needs stage 1, 2 or 3 (the optimizer states must be partitioned to be offloaded)",
        "set stage >= 1 or device 'none'",
    ),
    "offload_param": (
        "needs stage 3 (only stage 3 partitions the parameters)",
        "set stage 3, or use offload_optimizer at stage {stage}",
    ),
}


def offload_misfits(stage: int, optimizer_device: Any, param_device: Any) -> list[tuple[str, Any]]:
    """`(key, device)` for each offload device the stage cannot honour: the optimizer's at
    stage 0 (nothing partitioned to offload), the parameters' below stage 3."""
    asked = zip(_KEYS, (optimizer_device, param_device), strict=True)
    lowest = {"offload_optimizer": 1, "offload_param": 3}
    return [(k, d) for k, d in asked if d not in (None, "none") and stage < lowest[k]]


def check_offload_stage(
    stage: int, optimizer_device: Any, param_device: Any, *, path: str = "zero_optimization"
) -> None:
    """Refuse an offload device the stage cannot honour, naming `<path>.offload_*.device`
    (a `ZeroConfig` built in code). Needs no offload package, so a stage error is reported as
    such even where minispeed-offload is not installed."""
    for key, device in offload_misfits(stage, optimizer_device, param_device):
        reason, fix = _MISFIT[key]
        raise ConfigError(f"{path}.{key}.device", f"{device!r} {reason}; {fix.format(stage=stage)}")


def ignore_offload_misfits(stage: int, devices: list[Any], *, path: str) -> list[Any]:
    """`devices` (`offload_optimizer`'s, `offload_param`'s, as a ds_config asks) with those the
    stage cannot honour dropped to None, each with a warning naming the key: DeepSpeed ignores
    them (DeepSpeed-Chat's configs ask for `offload_param` at every stage), and so does a
    ds_config read here, where the same section built in code is refused (`check_offload_stage`)."""
    out = list(devices)
    for key, device in offload_misfits(stage, *devices):
        warn_once(
            f"{path}.{key}.device: {device!r} is ignored at stage {stage}, as DeepSpeed ignores "
            f"it: it {_MISFIT[key][0]}; remove it, or raise the stage",
            _log,
        )
        out[_KEYS.index(key)] = None
    return out


# -- masters on the host ---------------------------------------------------------------------------
# Note [host masters alias the strategy's on a CPU accelerator]
# A strategy keeps its fp32 masters (and the reduced gradient partition) on the accelerator. With
# offload_optimizer they must be host tensors: the CPU Adam steps them. On a GPU, HostMasters
# keeps one (pinned, when pin_memory) host copy per master and per gradient fragment: after the
# reduction the gradient fragments are copied down (non_blocking, one synchronize), after the step
# the masters are copied up, and the strategy's own publish_params casts and gathers as always.
# On a CPU-only machine the strategy's tensors already are host tensors: HostMasters returns them
# unchanged and copies nothing, so offload there costs exactly the optimizer swap.


#: Tests only: keep separate host copies even when the strategy's masters are host tensors, so
#: that a CPU machine runs the copy-down / copy-up path a GPU takes.
ALWAYS_COPY = False


class HostMasters(StrategyWrapper):
    """A `ShardStrategy` whose `master_params` / `master_grads` are fp32 host tensors.

    Wraps the stage's strategy (everything else is delegated to it). Host bytes per rank: 4 per
    master element and 4 per gradient element, only where the strategy's live on an accelerator.
    Per step: copies 4Ψ/N bytes down (gradients) and 4Ψ/N up (masters).
    """

    def __init__(self, strategy: Any, pin_memory: bool) -> None:
        super().__init__(strategy)
        self._device_masters = strategy.master_params()
        on_host = all(m.device.type == "cpu" for ms in self._device_masters for m in ms)
        self.aliased = on_host and not ALWAYS_COPY
        if self.aliased:
            self._masters = self._device_masters
            self._grads: list[list[torch.Tensor]] | None = None
            return
        pin = pin_memory and get_accelerator().name != "cpu"

        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=torch.float32, pin_memory=pin)
            return out.copy_(t)

        self._masters = [[host(m) for m in ms] for ms in self._device_masters]
        self._grads = [[torch.empty_like(m, pin_memory=pin) for m in ms] for ms in self._masters]

    def master_params(self) -> list[list[torch.Tensor]]:
        """Per group, the host fp32 masters (the strategy's own on a CPU accelerator)."""
        return self._masters

    @torch.no_grad()
    def master_grads(self) -> list[list[torch.Tensor]]:
        """The reduced gradient fragments, copied into the host gradient buffers."""
        grads = self._inner.master_grads()
        if self._grads is None:
            return grads
        with ranges.range("zero.offload.grads_to_host"):
            for hs, ds in zip(self._grads, grads):
                for h, d in zip(hs, ds):
                    h.copy_(d, non_blocking=True)
            get_accelerator().synchronize()
        return self._grads

    @torch.no_grad()
    def publish_params(self) -> None:
        """Copy the stepped host masters up into the strategy's, then let it publish."""
        if self._grads is not None:
            with ranges.range("zero.offload.masters_to_device"):
                for ds, hs in zip(self._device_masters, self._masters):
                    for d, h in zip(ds, hs):
                        d.copy_(h, non_blocking=True)
        self._inner.publish_params()


# Note [the user's param groups are the host optimizer's]
# With offload_optimizer the inner optimizer is offload's CPU one, not the user's. Its param
# groups must still be the user's: a learning-rate scheduler attached to the user's optimizer
# (or to the ZeroOptimizer, which exposes the same groups) rewrites `lr` (OneCycleLR also
# `betas`) in those dicts every step, and checkpoints restore hyper-parameters into them. A copy
# taken at zero.shard would freeze every hyper-parameter at its first value (issue 24 §1.0).
# So the CPU optimizer is built over the user's group dicts themselves: torch.optim keeps each
# dict it is given (`add_param_group` appends it), "params" becomes this rank's masters (as in
# the un-offloaded case, where the user's optimizer steps the masters), and keys the CPU kernel
# needs are added with `setdefault`, never overriding the user's. Every step reads them afresh.


#: Lion has no torch.optim class: these class names (ours, DeepSpeed's, lion-pytorch's) are
#: taken for Lion, with its param-group keys (lr, betas, weight_decay).
LION_NAMES = ("CPULion", "Lion", "FusedLion", "DeepSpeedCPULion")


def host_kind(user: torch.optim.Optimizer, offload: Any) -> str:
    """Which CPU kernel steps ``user``'s groups: ``adam`` (torch Adam/AdamW, `CPUAdam`),
    ``adagrad`` (torch Adagrad, `CPUAdagrad`) or ``lion`` (`CPULion`, `LION_NAMES`)."""
    if isinstance(user, torch.optim.Adam | offload.CPUAdam):  # AdamW subclasses Adam
        return "adam"
    if isinstance(user, torch.optim.Adagrad | offload.CPUAdagrad):
        return "adagrad"
    if type(user).__name__ in LION_NAMES:
        return "lion"
    raise TypeError(
        f"offload_optimizer runs a CPU kernel for Adam/AdamW, Adagrad or Lion, so the optimizer "
        f"passed to zero.shard must be torch.optim.Adam, AdamW or Adagrad, or a Lion "
        f"(minispeed.offload.CPULion), got {type(user).__name__}; use one of those or set "
        f"offload_optimizer.device to 'none'"
    )


_FLAGS_OFF = {"adam": ("amsgrad", "maximize"), "adagrad": ("maximize",), "lion": ("maximize",)}
_DEFAULT_KEYS = {
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adagrad": {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
    },
    "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
}


def host_optimizer(
    user: torch.optim.Optimizer,
    masters: list[list[torch.Tensor]],
    config: Any,
    swap_masters: bool = False,
) -> torch.optim.Optimizer:
    """offload's CPU optimizer over `masters`, stepping with the hyper-parameters of `user`'s
    param groups, read at every step (the group dicts are shared: Note [the user's param groups
    are the host optimizer's]).

    Adam/AdamW: `CPUAdam` (`cpu`) or `SwappedOptimizer` (`nvme`), in AdamW mode exactly when
    the user's group says decoupled weight decay (torch AdamW, or ``decoupled_weight_decay=True``),
    so offload steps what the un-offloaded run would. Adagrad: `CPUAdagrad`; Lion: `CPULion`
    (`cpu` only: the swap files hold Adam's two states). ``swap_masters`` (stage 3,
    ZeRO-Infinity): `SwappedMastersOptimizer`, whose masters are meta handles and whose values,
    states and gradients live in its files."""
    offload = import_offload("zero_optimization.offload_optimizer")
    kind = host_kind(user, offload)
    cfg = config.offload_optimizer
    if kind != "adam" and cfg.device == "nvme":
        raise ValueError(
            f"offload_optimizer.device='nvme' swaps Adam's states only; {type(user).__name__} "
            f"is offloaded with device 'cpu' (its states in host memory), or use Adam/AdamW"
        )
    decoupled = isinstance(user, torch.optim.AdamW)
    for pg, ms in zip(user.param_groups, masters):
        for flag in _FLAGS_OFF[kind]:
            if pg.get(flag, False):
                raise ValueError(
                    f"offload_optimizer: {type(user).__name__}({flag}=True) is not supported by "
                    f"the CPU kernel; construct it with {flag}=False"
                )
        missing = [k for k in _DEFAULT_KEYS[kind] if k not in pg]
        if missing:
            raise ValueError(
                f"offload_optimizer: {type(user).__name__}'s param groups lack {missing}, which "
                f"the CPU {kind} kernel reads; build it with those hyper-parameters"
            )
        pg["params"] = list(ms)
        if kind == "adam":
            pg.setdefault("decoupled_weight_decay", decoupled)
            pg.setdefault("bias_correction", True)
    d = user.defaults
    hyper = {k: d.get(k, v) for k, v in _DEFAULT_KEYS[kind].items()}
    groups = user.param_groups
    if kind == "adagrad":
        inner = offload.CPUAdagrad(groups, **hyper)
    elif kind == "lion":
        inner = offload.CPULion(groups, **hyper)
    else:
        hyper["betas"] = tuple(hyper["betas"])
        hyper["decoupled_weight_decay"] = d.get("decoupled_weight_decay", decoupled)
        if swap_masters:
            inner = offload.SwappedMastersOptimizer(
                groups, cfg, config.aio, sub_group_numel=config.sub_group_numel, **hyper
            )
        else:
            inner = offload.offload_optimizer(
                groups, cfg, config.aio, sub_group_numel=config.sub_group_numel, **hyper
            )
    assert all(a is b for a, b in zip(inner.param_groups, user.param_groups))
    return inner


def swappers_of(strategy: Any, optimizer: Any) -> list[Any]:
    """Every `TensorSwapper` (swap directory) the offloaded strategy and optimizer write to."""
    found = [
        getattr(optimizer, "swapper", None),
        getattr(getattr(optimizer, "grads", None), "swapper", None),
        getattr(getattr(strategy, "param_home", None), "swapper", None),
    ]
    return [sw for sw in found if sw is not None]


def check_free_space(strategy: Any, optimizer: Any) -> None:
    """Every swap file of this rank fits in its file system's free space, or `OSError(ENOSPC)`
    naming the key, the directory and the fix (`minispeed.offload.check_free_space`)."""
    swappers = swappers_of(strategy, optimizer)
    if swappers:
        import_offload("zero_optimization.offload_*.nvme_path").check_free_space(swappers)
