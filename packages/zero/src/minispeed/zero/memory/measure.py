"""Measure what a live ZeRO optimizer and its model hold per rank, and put it beside the formula.

`measure` finds every tensor reachable from the model (parameters, their ``.grad``,
buffers), the inner optimizer (master tensors and their state) and the ZeRO objects
(``opt`` and ``opt.strategy``: flat buffers, gradient partitions, stage-3 shards...), and adds up
the bytes of their *storages*, each storage once (views of one flat buffer, a master that is the
parameter itself, a gradient partition that is also the averaged fp32 gradient: counted once,
under the first column that claims it). Cost: one walk over those objects; no tensor is copied.

Columns, claimed in this order:

1. ``optimizer_states``: per-element tensors in ``optimizer.state`` (exp_avg, exp_avg_sq...);
2. ``params``: every parameter's ``.data``; ``grads``: every parameter's ``.grad``;
3. tensors found on ``opt``/``opt.strategy``, by the last attribute name on their path: one
   mentioning ``grad`` (or anything under a ``reducer``) -> ``grads``; ``param``, ``shard``,
   ``full`` or ``flat`` -> ``params``;
4. ``master``: the tensors in ``optimizer.param_groups`` not claimed yet (an fp32 master that
   *is* the parameter or its shard counts as a parameter: formulas.py, difference 1);
5. ``other``: the rest (scalar optimizer state, model buffers, flags).

``opt`` may also be stage 3 without an optimizer (`zero.shard(model, None, ...)`'s
`ForwardOnly`, whose ``optimizer`` is None): its columns but ``params`` are then 0, and
`predict` is `formulas.forward_only_state_bytes`.

`predict` is `formulas.minispeed_state_bytes` for the same optimizer, and
`padding_allowance` the most that padding can add to each column; the tests assert
``|measured - predicted| <= allowance`` for every stage.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from minispeed.zero.memory.formulas import (
    MASTER_BYTES,
    ModelStateBytes,
    forward_only_state_bytes,
    hpz_secondary_bytes,
    minispeed_state_bytes,
    optimizer_bytes_per_param,
)

__all__ = ["MeasuredBytes", "ledger_table", "measure", "padding_allowance", "predict"]

_PARAM_WORDS = ("param", "shard", "full", "flat")


@dataclass(frozen=True)
class MeasuredBytes:
    """Bytes of distinct storages this rank holds, by column (see the module docstring)."""

    params: int
    grads: int
    master: int
    optimizer_states: int
    other: int
    #: Where each counted storage was found first (attribute path -> bytes), for debugging.
    where: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def optimizer(self) -> int:
        """Master weights plus optimizer state: the formula's K·Ψ column."""
        return self.master + self.optimizer_states

    @property
    def total(self) -> int:
        """Every counted byte."""
        return self.params + self.grads + self.optimizer + self.other


class _Counter:
    """Adds each storage once, to the first column that claims it."""

    def __init__(self) -> None:
        self.columns: dict[str, int] = dict.fromkeys(
            ("params", "grads", "master", "optimizer_states", "other"), 0
        )
        self.seen: set[int] = set()
        self.where: dict[str, int] = {}

    def add(self, tensor: torch.Tensor, column: str, path: str) -> None:
        if tensor.device.type == "meta":  # no bytes: ZeRO-Infinity's master handles
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.columns[column] += nbytes
        self.where[path] = nbytes


def _walk(
    obj: Any, path: str, visit: Callable[[str, torch.Tensor], None], seen: set[int], depth: int = 0
) -> None:
    """Visit every tensor reachable from ``obj`` through containers and minispeed objects."""
    if depth > 10 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        visit(path, obj)
    elif isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        return  # counted through their parameters / state above
    elif isinstance(obj, dict):
        for i, (key, value) in enumerate(obj.items()):
            _walk(key, f"{path}[{i}].key", visit, seen, depth + 1)
            _walk(
                value,
                f"{path}[{key if isinstance(key, (str, int)) else i}]",
                visit,
                seen,
                depth + 1,
            )
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", visit, seen, depth + 1)
    elif type(obj).__module__.startswith("minispeed.") and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            _walk(value, f"{path}.{name}", visit, seen, depth + 1)


def _column_by_name(path: str) -> str | None:
    """``grads``/``params`` from an attribute path (its last attribute name decides), else None."""
    last = re.sub(r"\[[^\]]*\]", "", path).rsplit(".", 1)[-1].lower()
    if "grad" in last or ".reducer." in f".{path.lower()}.":
        return "grads"
    if any(w in last for w in _PARAM_WORDS):
        return "params"
    return None


def measure(opt: Any, model: nn.Module) -> MeasuredBytes:
    """Count the bytes ``opt`` (a ZeroOptimizer, or a ForwardOnly) and ``model`` hold on this
    rank, by column.

    Measure at a step boundary (after ``opt.step()`` returned True) to compare with
    `predict`: between micro-steps stage 2 also holds its in-flight staging buckets.
    """
    counter = _Counter()
    groups, state = _param_groups_and_state(opt.optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    _walk(opt.strategy, "strategy", lambda path, t: found.append((path, t)), seen)
    rest = {k: v for k, v in vars(opt).items() if k != "strategy"}
    _walk(rest, "opt", lambda path, t: found.append((path, t)), seen)

    # 1. per-element optimizer state
    for g, pg in enumerate(groups):
        for i, master in enumerate(pg["params"]):
            for key, value in state.get(master, {}).items():
                if isinstance(value, torch.Tensor) and value.numel() == master.numel():
                    counter.add(value, "optimizer_states", f"optimizer.state[{g}][{i}].{key}")
    # 2. the model's parameters and gradients
    for p in model.parameters():
        counter.add(p.data, "params", f"model.{names[id(p)]}")
        if p.grad is not None:
            counter.add(p.grad, "grads", f"model.{names[id(p)]}.grad")
    # 3. parameter and gradient buffers of the ZeRO objects (flat buffers, stage-3 shards)
    for path, t in found:
        column = _column_by_name(path)
        if column is not None:
            counter.add(t, column, path)
    # 4. masters that are not also a parameter or its shard (See formulas.py, difference 1)
    for g, pg in enumerate(groups):
        for i, master in enumerate(pg["params"]):
            counter.add(master, "master", f"optimizer.param_groups[{g}].params[{i}]")
    # 5. everything else: scalar optimizer state, model buffers, flags
    for g, pg in enumerate(groups):
        for i, master in enumerate(pg["params"]):
            for key, value in state.get(master, {}).items():
                if isinstance(value, torch.Tensor):
                    counter.add(value, "other", f"optimizer.state[{g}][{i}].{key}")
    for name, b in model.named_buffers():
        counter.add(b, "other", f"model.{name}")
    for path, t in found:
        counter.add(t, "other", path)
    return MeasuredBytes(**counter.columns, where=counter.where)


def _param_groups_and_state(inner: Any) -> tuple[list[dict], dict]:
    """The inner optimizer's param groups and state; none for stage 3 without an optimizer."""
    return ([], {}) if inner is None else (inner.param_groups, inner.state)


def _optimized_shapes(opt: Any) -> dict[str, int]:
    """Element count of each optimized parameter, by name (from the fragments: stage-3 safe);
    without an optimizer, of every parameter stage 3 keeps shards of."""
    if opt.optimizer is None:
        return {sp.name: sp.numel for sp in opt.strategy.sharded_params()}
    numels = {}
    for f in opt.fragments():
        n = 1
        for d in f.shape:
            n *= d
        numels[f.name] = n
    return numels


def predict(opt: Any) -> ModelStateBytes:
    """`formulas.minispeed_state_bytes` for this optimizer's model, stage and dtypes."""
    numels = _optimized_shapes(opt)
    stage = opt.config.stage
    persistent = 0
    if stage == 3:
        threshold = opt.config.stage3_param_persistence_threshold_numel
        persistent = sum(n for n in numels.values() if n <= threshold)
    if opt.optimizer is None:  # stage 3 without an optimizer: the shards alone
        return forward_only_state_bytes(
            sum(numels.values()),
            _partition_size(opt),
            param_bytes=opt.precision.param_dtype.itemsize,
            persistent_params=persistent,
        )
    got = minispeed_state_bytes(
        sum(numels.values()),
        _partition_size(opt),
        stage,
        param_bytes=opt.precision.param_dtype.itemsize,
        grad_bytes=opt.precision.grad_accum_dtype.itemsize,
        state_bytes=optimizer_bytes_per_param(opt.optimizer) - MASTER_BYTES,
        persistent_params=persistent,
    )
    if stage == 3 and opt.config.hpz_partition_size > 1:  # ZeRO++ hpZ's secondary partition
        secondary = hpz_secondary_bytes(
            list(numels.values()),
            _world_size(opt),
            opt.config.hpz_partition_size,
            param_bytes=opt.precision.param_dtype.itemsize,
            persistence_threshold_numel=opt.config.stage3_param_persistence_threshold_numel,
        )
        got = ModelStateBytes(
            stage, got.world_size, got.params + secondary, got.grads, got.optimizer
        )
    return got


def padding_allowance(opt: Any) -> ModelStateBytes:
    """Most bytes padding can add to each column: N elements per parameter tensor.

    (Each padded split adds < N elements to a whole buffer and < 1 to a rank's share; a stage-3
    persistent parameter has both a padded shard and a padded whole copy.)
    """
    n = len(_optimized_shapes(opt)) * _partition_size(opt)
    p, g = opt.precision.param_dtype.itemsize, opt.precision.grad_accum_dtype.itemsize
    if opt.optimizer is None:  # stage 3 without an optimizer: no gradient, master or state
        return ModelStateBytes(opt.config.stage, _partition_size(opt), n * p, 0, 0)
    k = optimizer_bytes_per_param(opt.optimizer)
    return ModelStateBytes(opt.config.stage, _partition_size(opt), n * p, n * g, n * k)


def _partition_size(opt: Any) -> int:
    """Ranks each model state is cut over: the data-parallel N, or MiCS's shard size S
    (stage3/mics.py: Ψ/S per rank, not Ψ/N)."""
    mics = opt.config.mics_shard_size
    return mics if opt.config.stage == 3 and mics > 0 else _world_size(opt)


def _world_size(opt: Any) -> int:
    import minispeed.comm as comm

    return comm.get_world_size(opt.comm_group)


def ledger_table(opt: Any, model: nn.Module):
    """A rich table: predicted (formula) vs measured bytes per column, for this rank."""
    from rich.table import Table

    pred, got = predict(opt), measure(opt, model)
    table = Table(title=f"ZeRO stage {opt.config.stage} memory ledger (this rank, bytes)")
    for col in ("column", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="right")
    for name, a, b in (
        ("params", pred.params, got.params),
        ("grads", pred.grads, got.grads),
        ("optimizer (master + state)", pred.optimizer, got.optimizer),
        ("total", pred.total, got.params + got.grads + got.optimizer),
    ):
        table.add_row(name, f"{a:,}", f"{b:,}", f"{b / a:.4f}" if a else "-")
    table.add_row("other (buffers, flags)", "-", f"{got.other:,}", "-")
    if opt.config.offload_optimizer is not None or opt.config.offload_param is not None:
        from minispeed.zero.memory.offload import measure_offload, predict_offload

        po, mo = predict_offload(opt), measure_offload(opt)
        for name, a, b in (
            ("in swap files (offload)", po.files, mo.files),
            ("swap pools (host)", po.pool, mo.pool),
        ):
            table.add_row(name, f"{a:,}", f"{b:,}", f"{b / a:.4f}" if a else "-")
    return table
