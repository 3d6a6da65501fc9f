"""One parameter's whole fp32 value, gradient or optimizer state, from a sharded optimizer.

Under ZeRO a rank holds only its fragment (`ParamFragment`) of each parameter's fp32 master, of
its reduced gradient and of each per-element optimizer state (Adam's `exp_avg`, ...). These
functions put one parameter's whole value together, or write one back, for code that inspects
or edits training state: per-layer gradient norms, a weight surgery between steps, a debugging
print. They are what DeepSpeed calls `safe_get_full_fp32_param`, `safe_get_full_grad`,
`safe_get_full_optimizer_state`, ... (`minispeed.engine.utils` has those names).

| function | gives | communication |
|---|---|---|
| `full_fp32_param(p)` | the fp32 master, `p`'s shape | one all-reduce of `4·n_p` bytes (stages 1-3) |
| `full_grad(p)` | the reduced fp32 gradient | the same |
| `full_optimizer_state(p, key)` | state `key`, `p`'s shape | the same |
| `set_full_fp32_param(p, value)` | - | none; stage 3: one all-gather and one broadcast of `p` |
| `set_full_optimizer_state(p, value, key)` | - | none |
| `set_full_grad(p, value)` | - | none |
| `local_fp32_param(p)`, `local_grad(p)`, `local_optimizer_state(p, key)` | this rank's fragment, flat | none |
| `set_local_grad(p, value)`, `set_local_optimizer_state(p, value, key)` | - | none |

`n_p` is the parameter's element count. Each rank writes its fragment into a zeroed fp32 buffer
of `n_p` elements and one all-reduce (sum) over the parameter's process group completes it:
`2(N-1)/N · 4·n_p` bytes sent per rank by a ring, `4·n_p` bytes kept for the result. At stage 0
every rank holds whole masters and nothing is sent. The `full_*` getters are collective at
stages 1-3: every rank of the group calls them for the same parameters in the same order. So
do the setters, each rank passing the whole `value`: each copies its own fragment of it.

When values exist: masters and states always; the gradient from the `backward` that ends an
accumulation window until `step` (`full_grad` gives None at other times: stage 1 reduces only at
the boundary and stage 2 holds a partial sum inside a window), which is also the only time
`set_full_grad` / `set_local_grad` may change what `step` applies (its clipping and overflow
check then see the value set). A gradient set is refused where the step reads a copy
(`offload_optimizer`: the device's gradients are copied to the host inside `step`). Gradients are returned unscaled:
under fp16 the loss scale is divided out (DeepSpeed returns them still scaled). Each function
takes the optimizer from the parameter (`optimizer_of`), or `opt=` names it; a parameter no
open `ZeroOptimizer` steps gives None from the getters and an error from the setters.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import minispeed.comm as comm
from minispeed.comm.validation import group_ranks
from minispeed.zero.contract import ParamFragment, StrategyWrapper
from minispeed.zero.optimizer import ZeroOptimizer
from minispeed.zero.replica_groups import ReplicaGroupedStrategy
from minispeed.zero.stage3.init import GatheredParameters
from minispeed.zero.stage3.params import REGISTRY
from minispeed.zero.stage3.strategy import Stage3Strategy

__all__ = [
    "full_fp32_param",
    "full_grad",
    "full_optimizer_state",
    "local_fp32_param",
    "local_grad",
    "local_optimizer_state",
    "record_stepper",
    "set_full_fp32_param",
    "set_full_grad",
    "set_full_optimizer_state",
    "set_local_grad",
    "set_local_optimizer_state",
]


def full_fp32_param(param: nn.Parameter, opt: ZeroOptimizer | None = None) -> torch.Tensor | None:
    """The fp32 master of `param`, whole, in its shape (collective at stages 1-3)."""
    return _read(param, opt, lambda o, f: _whole(o, f, _master(o, f)))


def full_grad(param: nn.Parameter, opt: ZeroOptimizer | None = None) -> torch.Tensor | None:
    """The gradient of `param` reduced over the data-parallel ranks and averaged over the
    window's micro-batches, fp32, unscaled, in its shape; None outside the time between the
    window's last `backward` and `step` (collective at stages 1-3 either way)."""
    return _read(param, opt, lambda o, f: _whole(o, f, _grad(o, f)))


def full_optimizer_state(
    param: nn.Parameter, key: str, opt: ZeroOptimizer | None = None
) -> torch.Tensor | None:
    """Per-element optimizer state `key` of `param` (`"exp_avg"`, `"exp_avg_sq"`,
    `"momentum_buffer"`...), whole, in its shape; None before the first step made it."""
    return _read(param, opt, lambda o, f: _whole(o, f, _state(o, f, key)))


def set_full_fp32_param(
    param: nn.Parameter, value: torch.Tensor, opt: ZeroOptimizer | None = None
) -> None:
    """Make `value` (`param`'s whole shape, the same on every rank) the parameter's value: the
    model's parameter now (in its dtype) and this rank's fp32 master fragment. Every rank of
    the group calls it: local at stages 0-2, collective at stage 3 (Note [a set value reaches
    the model now])."""
    opt, f = _found_for_write(param, opt, value, "set_full_fp32_param")
    sp = REGISTRY.get(param)  # stage 3: every holder takes the first's value (MiCS: replicas too)
    first = None if sp is None else group_ranks(sp.data_group)[0]
    with torch.no_grad(), GatheredParameters(param, modifier_rank=first):
        param.data.copy_(value)  # stages 0-2: the parameter itself; stage 3: gathered, kept
    _write(f, _master(opt, f), value)  # the exact fp32 value (stage 3 kept the cast one)


def set_full_optimizer_state(
    param: nn.Parameter, value: torch.Tensor, key: str, opt: ZeroOptimizer | None = None
) -> None:
    """Write `value` (`param`'s whole shape) into this rank's fragment of optimizer state
    `key`. Local."""
    opt, f = _found_for_write(param, opt, value, "set_full_optimizer_state")
    _write(f, _state_for_write(opt, f, key, "set_full_optimizer_state"), value)


def set_full_grad(
    param: nn.Parameter, value: torch.Tensor, opt: ZeroOptimizer | None = None
) -> None:
    """Make `value` (`param`'s whole shape, unscaled, the same on every rank) the reduced
    gradient the coming `step` applies: this rank's fragment of it, times the loss scale.
    Between the window's last `backward` and `step` only. Local."""
    opt, f = _found_for_write(param, opt, value, "set_full_grad")
    _set_grad(opt, f, value.detach().reshape(-1)[f.start : f.start + f.numel], "set_full_grad")


def set_local_grad(
    param: nn.Parameter, value: torch.Tensor, opt: ZeroOptimizer | None = None
) -> None:
    """Make `value` (this rank's fragment, flat, as `local_grad` gives it, unscaled) this rank's
    part of the reduced gradient the coming `step` applies; when every rank does it, the whole.
    Between the window's last `backward` and `step` only. Local."""
    opt, f = _found_for_write(param, opt, value, "set_local_grad", local=True)
    _set_grad(opt, f, value.detach().reshape(-1), "set_local_grad")


def set_local_optimizer_state(
    param: nn.Parameter, value: torch.Tensor, key: str, opt: ZeroOptimizer | None = None
) -> None:
    """Write `value` (this rank's fragment, flat, as `local_optimizer_state` gives it) into
    this rank's fragment of optimizer state `key`. Local."""
    opt, f = _found_for_write(param, opt, value, "set_local_optimizer_state", local=True)
    _write_fragment(f, _state_for_write(opt, f, key, "set_local_optimizer_state"), value)


def local_fp32_param(param: nn.Parameter, opt: ZeroOptimizer | None = None) -> torch.Tensor | None:
    """This rank's fragment of the fp32 master, flat (`fragment.numel` elements; may be 0)."""
    return _read(param, opt, lambda o, f: _mine(f, _master(o, f)))


def local_grad(param: nn.Parameter, opt: ZeroOptimizer | None = None) -> torch.Tensor | None:
    """This rank's fragment of the reduced fp32 gradient, flat and unscaled; None outside the
    time between the window's last `backward` and `step`."""
    return _read(param, opt, lambda o, f: _mine(f, _grad(o, f)))


def local_optimizer_state(
    param: nn.Parameter, key: str, opt: ZeroOptimizer | None = None
) -> torch.Tensor | None:
    """This rank's fragment of optimizer state `key`, flat; None before the first step."""
    return _read(param, opt, lambda o, f: _mine(f, _state(o, f, key)))


# Which open ZeroOptimizer steps each model parameter, held weakly on both sides (dropping the
# model or the optimizer drops the entry): how the functions here answer for a parameter alone.
# (torch's WeakIdKeyDictionary: weakref.WeakKeyDictionary compares tensors with ==.)
_STEPPED_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()


def record_stepper(opt: ZeroOptimizer, params: list[nn.Parameter]) -> None:
    """`zero.shard`: `opt` steps `params` (what `optimizer_of` answers for each)."""
    me = weakref.ref(opt)
    for p in params:
        _STEPPED_BY[p] = me


def optimizer_of(param: nn.Parameter) -> ZeroOptimizer | None:
    """The open `ZeroOptimizer` that steps `param`, or None (not sharded, or closed since)."""
    ref = _STEPPED_BY.get(param)
    opt = None if ref is None else ref()
    return None if opt is None or opt.closed else opt


# Note [a set value reaches the model now]
# DeepSpeed's safe_set_full_fp32_param writes the fp32 master fragment only: the model's
# parameter keeps its old value until the next step publishes the masters. Here that would be
# worse than late: at stages 1-2 in fp32 a rank's master fragment is a view of the model's flat
# parameter buffer, so the rank holding the fragment would see the new value at once and the
# others not, and the replicas would disagree for a step. So the setter writes the whole
# parameter on every rank (stages 0-2: the value is in every rank's hand; stage 3: through
# GatheredParameters, which re-partitions it), then the exact fp32 master fragment. The next
# forward uses the new value everywhere, as after an in-place edit in plain PyTorch.


# -- the pieces ------------------------------------------------------------------------------------
def _find(param: nn.Parameter, opt: ZeroOptimizer | None) -> tuple[ZeroOptimizer, Any] | None:
    opt = opt if opt is not None else optimizer_of(param)
    if opt is None:
        return None
    f = opt.fragment_of(param)
    return None if f is None else (opt, f)


def _found_for_write(
    param: nn.Parameter,
    opt: ZeroOptimizer | None,
    value: torch.Tensor,
    what: str,
    local: bool = False,
) -> tuple[ZeroOptimizer, ParamFragment]:
    """The optimizer and fragment a setter writes, after every check (before any collective);
    `local`: `value` is this rank's fragment, flat."""
    found = _find(param, opt)
    if found is None:
        raise ValueError(
            f"{what}: this parameter is not stepped by an open ZeroOptimizer (frozen, not part "
            "of a sharded model, or its optimizer was closed); nothing holds its fp32 master"
        )
    if hasattr(found[0].optimizer, "states_in_memory"):
        raise NotImplementedError(
            f"{what}: with offload_optimizer on nvme the masters and states live in swap files, "
            "which this does not write; use offload_optimizer device 'cpu' for such edits"
        )
    f = found[1]
    if local and value.numel() != f.numel:
        raise ValueError(
            f"{f.name}: value has {value.numel()} elements, this rank's fragment {f.numel} "
            "(a local value is the fragment local_* gives, flat)"
        )
    if not local and tuple(value.shape) != tuple(f.shape):
        raise ValueError(
            f"{f.name}: value has shape {tuple(value.shape)}, expected {tuple(f.shape)}"
        )
    return found


def _read(
    param: nn.Parameter,
    opt: ZeroOptimizer | None,
    take: Callable[[ZeroOptimizer, ParamFragment], torch.Tensor | None],
) -> torch.Tensor | None:
    """`take(opt, fragment)` with masters and states resident; None for a parameter no open
    optimizer steps."""
    found = _find(param, opt)
    if found is None:
        return None
    with _resident(found[0]):
        return take(*found)


def _grad(opt: ZeroOptimizer, f: ParamFragment) -> torch.Tensor | None:
    """This rank's reduced gradient for `f`, flat fp32 and unscaled; None outside the window's
    boundary (the only time a reduced gradient exists: before step(), after the last backward)."""
    buffer = _grad_buffer(opt, f)
    return None if buffer is None else buffer[: f.numel].float() / opt.loss_scaler.scale


def _grad_buffer(opt: ZeroOptimizer, f: ParamFragment) -> torch.Tensor | None:
    """The flat, scaled reduced gradient `step` reads for `f` (None outside the boundary)."""
    if opt.strategy.grads_in_files:
        raise NotImplementedError(
            f"{f.name}: the gradients are in swap files (ZeRO-Infinity, offload to nvme), read "
            "back only inside step(); inspect them with offload_optimizer on the cpu instead"
        )
    if not opt.at_boundary:
        return None
    return opt.strategy.master_grads()[f.group][f.master_index].reshape(-1)


@torch.no_grad()
def _set_grad(opt: ZeroOptimizer, f: ParamFragment, mine: torch.Tensor, what: str) -> None:
    """`mine` (this rank's fragment, unscaled) into the gradient `step` reads; refused on
    every rank where `step` reads a copy made inside it."""
    if _step_reads_a_copy(opt):
        raise NotImplementedError(
            f"{what}: {f.name}'s gradient is copied for the step (offload_optimizer), so a value "
            "set here would be lost; change the loss instead, or set it without offload"
        )
    buffer = _grad_buffer(opt, f)
    if buffer is None:
        raise RuntimeError(
            f"{what}: {f.name} has no reduced gradient now; call it after the backward that ends "
            "the accumulation window and before step()"
        )
    scaled = mine.to(buffer.dtype) * opt.loss_scaler.scale
    buffer[: f.numel].copy_(scaled)
    again = _grad_buffer(opt, f)  # the buffer `step` reads holds it (no other copy is made)
    assert again is not None and torch.equal(again[: f.numel], scaled), f.name


def _step_reads_a_copy(opt: ZeroOptimizer) -> bool:
    """Whether `step` reads a host copy of the reduced gradients (offload's `HostMasters` when
    the masters are not the strategy's own), which it makes again inside `step`."""
    strategy = opt.strategy
    while True:
        if getattr(strategy, "aliased", True) is False:
            return True
        if not isinstance(strategy, StrategyWrapper):
            return False
        strategy = strategy.strategy


def _mine(f: ParamFragment, flat: torch.Tensor | None) -> torch.Tensor | None:
    return None if flat is None else flat[: f.numel].clone()


def _resident(opt: ZeroOptimizer) -> Any:
    """offload_optimizer nvme: masters and states read back from their swap files meanwhile."""
    return getattr(opt.optimizer, "states_in_memory", contextlib.nullcontext)()


def _master_of(opt: ZeroOptimizer, f: ParamFragment) -> torch.Tensor:
    """The inner optimizer's master tensor holding `f` (at offset 0: Note [one master per
    fragment]); its optimizer state is keyed by it."""
    return opt.optimizer.param_groups[f.group]["params"][f.master_index]


def _master(opt: ZeroOptimizer, f: ParamFragment) -> torch.Tensor:
    """That master, flat."""
    return _master_of(opt, f).detach().reshape(-1)


def _state_for_write(opt: ZeroOptimizer, f: ParamFragment, key: str, what: str) -> torch.Tensor:
    state = _state(opt, f, key)
    if state is None:
        raise RuntimeError(
            f"{what}: {f.name} has no optimizer state yet; take one step first (the optimizer "
            "makes its state at its first step)"
        )
    return state


def _state(opt: ZeroOptimizer, f: ParamFragment, key: str) -> torch.Tensor | None:
    master = _master_of(opt, f)
    state = opt.optimizer.state.get(master, {})
    if not state:
        return None
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.numel() != master.numel():
        per_element = sorted(
            k
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.numel() == master.numel()
        )
        raise KeyError(
            f"{f.name}: {type(opt.optimizer).__name__} keeps no per-element state {key!r}; "
            f"it keeps {per_element}"
        )
    return value.detach().reshape(-1)


def _group(opt: ZeroOptimizer, f: ParamFragment) -> Any:
    """The process group `f`'s parameter is partitioned over (MoE experts: their own)."""
    strategy = opt.strategy
    while isinstance(strategy, StrategyWrapper):
        strategy = strategy.strategy
    if isinstance(strategy, ReplicaGroupedStrategy):
        return strategy.process_group_of(f.group)
    if isinstance(strategy, Stage3Strategy):  # its own group: MiCS's shard group (mics.py),
        return strategy.group  # whose S fragments make the whole value; replicas hold the same
    return opt.comm_group


def _whole(opt: ZeroOptimizer, f: ParamFragment, flat: torch.Tensor | None) -> torch.Tensor | None:
    """The whole value from every rank's fragment: a copy at stage 0, else one all-reduce."""
    if flat is None:
        return None
    if opt.config.stage == 0:
        return flat[: f.numel].float().clone().reshape(f.shape)
    group = _group(opt, f)
    whole = torch.zeros(f.shape.numel(), dtype=torch.float32, device=comm.tensor_device(group))
    whole[f.start : f.start + f.numel].copy_(flat.reshape(-1)[: f.numel])
    comm.all_reduce(whole, group=group)
    return whole.reshape(f.shape)


@torch.no_grad()
def _write(f: ParamFragment, flat: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's fragment of `value` (shape checked by `_found_for_write`) into `flat`."""
    _write_fragment(f, flat, value.detach().reshape(-1)[f.start : f.start + f.numel])


@torch.no_grad()
def _write_fragment(f: ParamFragment, flat: torch.Tensor, mine: torch.Tensor) -> None:
    """This rank's fragment `mine` (flat, `f.numel` elements) into `flat`."""
    flat[: f.numel].copy_(mine.detach().reshape(-1))
