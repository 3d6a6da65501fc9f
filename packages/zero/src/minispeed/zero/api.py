"""`zero.shard(model, optimizer, ...)`: apply a ZeRO stage to a model and its optimizer.

```python
import minispeed.zero as zero
opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                 config=zero.ZeroConfig(stage=2), precision=zero.MixedPrecision(torch.bfloat16))
for x, y in batches:
    opt.backward(model(x, y))
    opt.step()
```

What it does, in order: check the inputs (each problem is an error naming the fix); broadcast
rank 0's parameters so every rank starts equal (stages 0-2; Ψ·4 bytes once); build the stage's
`ShardStrategy` (which casts the parameters to `param_dtype`, lays out flat buffers and
installs gradient hooks on `model` in place); cast the model's remaining floating-point
buffers; and wrap the user's optimizer in a `ZeroOptimizer` stepping fp32 masters.

Without an optimizer (``zero.shard(model, None, ZeroConfig(stage=3))``, ZeRO-Inference) stage 3
is built over no trained parameters and returned as a `ForwardOnly`: the parameter shards and
their gathers, no masters, no gradients (stage3/forward_only.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.comm.optim import CompressedMomentumOptimizer
from minispeed.core.accelerator import get_accelerator
from minispeed.zero import full_values
from minispeed.zero.bucketed_setup import bucketed_strategy, check_onebit, onebit_parts
from minispeed.zero.config import ZeroConfig
from minispeed.zero.model_parallel import ModelParallel
from minispeed.zero.offload_setup import apply_offload
from minispeed.zero.optimizer import ShardStrategy, ZeroOptimizer, param_names
from minispeed.zero.precision import MixedPrecision
from minispeed.zero.replica_groups import check_replica_groups
from minispeed.zero.stage3.assemble import assemble as assemble_stage3
from minispeed.zero.stage3.forward_only import ForwardOnly, check_forward_only, model_precision
from minispeed.zero.stage3.mics import MicsStrategy, mics_stage3
from minispeed.zero.stage3.mics_groups import MicsGroups, mics_enabled

__all__ = ["shard"]

# Optimizers whose update of one element reads other elements (a line search, factored or
# orthogonalized second moments, sparse rows): a partition of a flat buffer would change them.
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon", "SparseAdam")
# Optimizers known to update every element independently (any subclass of them counts).
_ELEMENTWISE = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
)

_sharded_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ZeroConfig | None = None,
    precision: MixedPrecision | None = None,
    group: Any = None,
    *,
    model_parallel: ModelParallel | None = None,
    replica_groups: Sequence[Any] | None = None,
    mics_groups: MicsGroups | None = None,
    allow_untested_optimizer: bool = False,
) -> ZeroOptimizer | ForwardOnly:
    """Apply ZeRO `config.stage` to `model` (in place) and return the wrapping optimizer.

    `optimizer` must be a fresh torch.optim optimizer (no state yet) over parameters of
    `model`; its param groups and hyper-parameters are kept. `None` (stage 3 only): forward
    only, ZeRO-Inference; returns a `ForwardOnly` keeping each rank's parameter shards in
    `precision.param_dtype` (default: the model's own dtype) and nothing else, ``p·Ψ/N``
    bytes (stage3/forward_only.py). `group` is the data-parallel
    process group (`None`: all ranks); the process group must be initialized
    (`minispeed.comm.init_distributed()`; a single process works too).

    `model_parallel`: under pipeline or tensor parallelism, the grid's other axes
    (`zero.ModelParallel`): the gradient norm and the fp16 overflow decision are then reduced
    over them too, and tied parameters' gradients summed over their holders, so clipping uses
    the whole model's norm (see `minispeed.zero.model_parallel`; a few scalar all-reduces per
    step). Collective like the rest: every rank of the grid passes its own groups.

    `replica_groups` (stages 0-2): one entry per optimizer param group, the process group of the
    ranks holding copies of that group's parameters (`None`: `group`), e.g. the expert-data
    group for MoE experts; that group's gradients are reduced and its state partitioned over it,
    and divided by the size of `group` (Note [replica groups] in replica_groups.py).

    `mics_groups` (stage 3 with `ZeroConfig.mics_shard_size`): the shard and replica groups
    (`zero.MicsGroups.build`), when the caller's grid built them; `None` takes those `zero.Init`
    partitioned the model over, or builds them over `group`, which must then be the world
    (stage3/mics.py).

    `allow_untested_optimizer`: at stages 1-3 an optimizer not known to update each element
    independently is refused (Note [which optimizers can step a slice]); True accepts it, as
    DeepSpeed's `"zero_allow_untested_optimizer": true` does.
    """
    config = config if config is not None else ZeroConfig()
    if precision is None:  # forward only: the model's own dtype (a 16-bit one is not widened)
        precision = MixedPrecision() if optimizer is not None else model_precision(model)
    _check_inputs(model, optimizer, config, precision, allow_untested_optimizer)
    if precision.autocast is not None:
        precision.autocast.mark(model)  # each safe parameter's wire dtype (autocast.py)
    if optimizer is None:  # Note [stage 3 without an optimizer] (stage3/forward_only.py)
        check_forward_only(config, model_parallel=model_parallel, replica_groups=replica_groups)
    # 1-bit Adam runs its own phases over stages 0-2 (Note [1-bit Adam under zero])
    onebit = isinstance(optimizer, CompressedMomentumOptimizer)
    if onebit:
        check_onebit(
            optimizer,
            config,
            precision,
            model_parallel=model_parallel,
            replica_groups=replica_groups,
        )
    given = optimizer.param_groups if optimizer is not None else []  # forward only: none
    param_groups = [list(pg["params"]) for pg in given]
    _check_grid(model_parallel, replica_groups, param_groups, config)

    strategy: ShardStrategy
    mics = None
    if config.stage == 3 and mics_enabled(config):  # over shard groups: stage3/mics.py
        strategy, mics = mics_stage3(
            model, config, precision, group, param_groups, groups=mics_groups,
            replica_groups=replica_groups, model_parallel=model_parallel,
        )  # fmt: skip
    elif config.stage == 3:
        strategy = assemble_stage3(model, config, precision, group, param_groups=param_groups)
    else:  # the first rank's weights broadcast, replica groups: bucketed_setup.py
        strategy = bucketed_strategy(model, config, precision, group, param_groups, replica_groups)
    user_optimizer = optimizer
    if config.offload_optimizer is not None or config.offload_param is not None:
        # minispeed.offload is an optional extra, loaded only now (Note [offload is imported
        # lazily] in offload_bridge.py).
        strategy, optimizer = apply_offload(strategy, optimizer, config, group)
    if mics is not None:  # the optimizer over all N ranks, each shard counted once
        strategy = MicsStrategy(strategy, mics)
    if model_parallel is not None:
        model_parallel.check_strategy(strategy)
    _cast_rest(model, {p for ps in param_groups for p in ps}, precision.param_dtype, config.stage)
    _sharded_models.add(model)
    on_close = functools.partial(_forget_model, weakref.ref(model))
    if optimizer is None:
        return ForwardOnly(strategy, config, precision, group, on_close=on_close)
    kind, extra = ZeroOptimizer, {"model_parallel": model_parallel}
    if onebit:
        kind, extra, optimizer, strategy = onebit_parts(optimizer, strategy, group)
    params = [p for ps in param_groups for p in ps]
    _step_masters(optimizer, strategy.master_params())
    opt = kind(
        optimizer,
        strategy,
        config,
        precision,
        params,
        param_names(model),
        group,
        on_close=on_close,
        user_optimizer=user_optimizer,
        **extra,
    )
    full_values.record_stepper(opt, params)  # safe_get_full_*(param) finds opt from param
    return opt


def _step_masters(optimizer: torch.optim.Optimizer, masters: list[list[torch.Tensor]]) -> None:
    """Make `optimizer` step this rank's fp32 masters: each param group's tensors become its
    masters (its hyper-parameters stay), with no state yet (Adagrad's made again, as its
    constructor makes it)."""
    if len(masters) != len(optimizer.param_groups):
        raise RuntimeError(
            f"strategy returned masters for {len(masters)} param groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    for pg, ms in zip(optimizer.param_groups, masters):
        pg["params"] = list(ms)
    optimizer.state.clear()
    if type(optimizer) is torch.optim.Adagrad:  # it makes its state at construction only
        for pg in optimizer.param_groups:
            for m in pg["params"]:
                optimizer.state[m] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.full_like(m, pg["initial_accumulator_value"]),
                }


def _forget_model(model_ref: weakref.ref[nn.Module]) -> None:
    """After `ZeroOptimizer.close()`: the model carries no hooks, it may be sharded again."""
    model = model_ref()
    if model is not None:
        _sharded_models.discard(model)


def _check_inputs(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ZeroConfig,
    precision: MixedPrecision,
    allow_untested_optimizer: bool,
) -> None:
    """Every input checked, locally, before any collective; `optimizer` None: forward only."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() needs the nn.Module to train, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"shard() needs a torch.optim.Optimizer, got {type(optimizer).__name__}; build one over "
            f"model.parameters(), e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)"
        )
    if isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            "shard() got a ZeroOptimizer, which is already sharded; pass the model's own "
            "torch.optim optimizer (a fresh one), or keep using this ZeroOptimizer"
        )
    if not isinstance(config, ZeroConfig):
        raise TypeError(
            f"config must be a ZeroConfig (see ZeroConfig.from_section), got {type(config).__name__}"
        )
    if not isinstance(precision, MixedPrecision):
        raise TypeError(f"precision must be a MixedPrecision, got {type(precision).__name__}")
    if not comm.is_initialized():
        raise RuntimeError(
            "shard() needs a process group: call minispeed.comm.init_distributed() first "
            "(it starts a single-process group when not launched by torchrun)"
        )
    if model in _sharded_models:
        raise RuntimeError(
            "this model was already passed to shard() and carries its gradient hooks; keep using the "
            "ZeroOptimizer that shard() returned, call its close() first, or build a new model"
        )
    if optimizer is not None:
        _check_optimizer_of(model, optimizer, config.stage > 0 and not allow_untested_optimizer)
    if precision.param_dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
        raise RuntimeError(
            "this accelerator has no bf16 support; use param_dtype=torch.float16 or float32"
        )
    if precision.param_dtype == torch.float16 and not get_accelerator().is_fp16_supported():
        raise RuntimeError(
            "this accelerator has no fp16 support; use param_dtype=torch.bfloat16 or float32"
        )


def _check_optimizer_of(
    model: nn.Module, optimizer: torch.optim.Optimizer, stepped_in_slices: bool
) -> None:
    """A fresh optimizer of a kind ZeRO can step, over parameters of `model`."""
    _check_optimizer_kind(optimizer, stepped_in_slices=stepped_in_slices)
    # Adagrad makes its state (step 0) at construction: only a step count > 0 means "stepped".
    if any(len(s) and float(s.get("step", 1)) != 0 for s in optimizer.state.values()):
        raise ValueError(
            "the optimizer already has state (it has stepped); pass a fresh optimizer to shard() "
            "and restore state with minispeed.zero.load_checkpoint"
        )
    owned = {id(p) for p in model.parameters()}
    for g, pg in enumerate(optimizer.param_groups):
        for i, p in enumerate(pg["params"]):
            if id(p) not in owned:
                raise ValueError(
                    f"optimizer.param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}) is not a "
                    f"parameter of the model passed to shard(); build the optimizer from that "
                    f"model's parameters (model.parameters())"
                )


def _check_grid(
    model_parallel: ModelParallel | None,
    replica_groups: Sequence[Any] | None,
    param_groups: list[list[nn.Parameter]],
    config: ZeroConfig,
) -> None:
    """The grid's other axes and the param groups' own process groups, before any hook."""
    if model_parallel is not None and replica_groups is not None:
        raise NotImplementedError(
            "zero.shard with both model_parallel (pipeline/tensor axes) and replica_groups (MoE "
            "experts) is not supported yet: the clipping norm would count expert copies on one "
            "axis only; use one of the two"
        )
    if model_parallel is not None:
        if not isinstance(model_parallel, ModelParallel):
            raise TypeError(
                f"model_parallel must be a zero.ModelParallel, got {type(model_parallel).__name__}"
            )
        model_parallel.check([p for ps in param_groups for p in ps])
    if replica_groups is not None:  # See Note [replica groups]
        check_replica_groups(replica_groups, len(param_groups), config)


# Note [which optimizers can step a slice]
# Stages 1-3 step each rank's slice of a parameter (its fragment), flattened. An update that
# reads only its own element (SGD, the Adam family, Adagrad, Lion...) gives the same numbers on
# a slice as on the whole tensor; one that reads others does not (LAMB's and LARS's per-tensor
# trust ratio, Adafactor's factored moments, Shampoo's preconditioners, blockwise-quantized
# states), and the difference is silent. So at stages 1-3 an optimizer must be known to be
# elementwise: a subclass of one of torch's in `_ELEMENTWISE`, or a class that says so with
# `elementwise = True` (minispeed's own CPU optimizers and Lion do). Anything else is refused
# unless the caller vouches for it (`allow_untested_optimizer=True`; DeepSpeed's
# `zero_allow_untested_optimizer`, which DeepSpeed also requires for such optimizers). Stage 0
# steps whole parameters and accepts any optimizer but the ones named in `_NOT_ELEMENTWISE`.


def _check_optimizer_kind(optimizer: torch.optim.Optimizer, stepped_in_slices: bool) -> None:
    """Refuse optimizers that cannot step a partition of a flat buffer, or take our loss scale.

    fp16: minispeed unscales the fp32 master gradients and skips overflowing steps *before* the
    inner optimizer runs, so the inner step always sees true gradients and never needs the scale.
    What cannot work is an optimizer that keeps its own view of scaling or of steps on the device
    (`capturable=True`: CUDA-graph paths with device-side `step`/`found_inf`) or that
    differentiates through the step (`differentiable=True`).
    """
    kind = type(optimizer)
    if isinstance(optimizer, CompressedMomentumOptimizer):
        return  # checked by check_onebit (Note [1-bit Adam under zero] in bucketed_setup.py)
    for name in _NOT_ELEMENTWISE:
        cls = getattr(torch.optim, name, None)
        if cls is not None and isinstance(optimizer, cls):
            raise TypeError(
                f"{kind.__name__} does not update each element independently, so it cannot step a "
                f"partition of a flat buffer; use an elementwise optimizer ({', '.join(_ELEMENTWISE)})"
            )
    for flag in ("capturable", "differentiable"):
        if any(pg.get(flag, False) for pg in optimizer.param_groups):
            raise ValueError(
                f"{kind.__name__}({flag}=True) is not supported: minispeed runs the optimizer step "
                f"eagerly and applies the fp16 loss scale itself; construct it with {flag}=False"
            )
    known = tuple(c for c in (getattr(torch.optim, n, None) for n in _ELEMENTWISE) if c is not None)
    if stepped_in_slices and not (
        isinstance(optimizer, known) or getattr(kind, "elementwise", False)
    ):
        raise TypeError(
            f"{kind.__name__} is not known to update each element independently, and ZeRO stages "
            f"1-3 step a slice of each parameter, which silently changes any update that reads "
            f"other elements (a per-tensor norm, a factored moment): Note [which optimizers can "
            f"step a slice]. If its update is elementwise, pass zero.shard(..., "
            f'allow_untested_optimizer=True) (ds_config: "zero_allow_untested_optimizer": true) '
            f"or set `elementwise = True` on the class; otherwise use stage 0"
        )


@torch.no_grad()
def _cast_rest(
    model: nn.Module, managed: set[nn.Parameter], dtype: torch.dtype, stage: int
) -> None:
    """Cast floating-point buffers (and, stages 0-2, unmanaged parameters) to `dtype`.

    Managed parameters were cast by the strategy; stage 3 owns all parameter storage itself.
    """
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != dtype:
                setattr(module, name, buf.to(dtype))
    if stage == 3:
        return
    for p in model.parameters():
        if p not in managed and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
