"""Predict a data-parallel training step's time, split into compute and communication per ZeRO stage.

Inputs: the step's FLOPs, MACs and operator calls (from the FLOPs profiler), Ψ parameters,
N ranks, the ZeRO stage, and the machine as measured by `python -m minispeed.profiler
calibrate`: R, the matmul throughput (FLOP/s), S, the memory rate of element-wise work, t_op,
the fixed cost of an operator call, t_adam and t_tensor, AdamW's seconds per parameter and per
parameter tensor, t_hook, the cost of one gradient hook, and per collective
a latency α (s per call) and a bandwidth β (bytes each rank sends per second), fitted to
timings at several message sizes.

Equations (Note [the step-time model]), per optimizer step, per rank, A micro-steps,
g / p bytes per gradient / parameter element on the wire, `r = (N-1)/N`:

    T_compute  = 2·MACs / R                     matrix products of the A micro-steps (or
                                                   Σ_shapes calls·2bmkn / R(shape), each
                                                   shape at its own measured rate)
    T_memory   = 12·(F - 2·MACs) / S               element-wise FLOPs (12 bytes each), S the
                                                   measured memory rate
    T_overhead = ops · t_op                        operator calls × measured per-call cost
    T_optim    = Ψ_owned · t_adam + n · t_tensor   AdamW on the parameters a rank owns:
                                                   Ψ_owned = Ψ, or Ψ/N from stage 1, plus its
                                                   fixed cost per tensor (n parameter tensors:
                                                   every rank steps one fragment of each)
    T_hooks    = A · n · t_hook                    ZeRO's gradient hook, once per tensor and
                                                   micro-step (copy into the bucket, bookkeeping);
                                                   0 at stages 0-2 when the Ψ gradients fit in
                                                   one bucket: no hook is registered then
                                                   (`core.gradient_buckets.hooks_each_gradient`)
    T_units    = A · U · t_unit                    stage 3 only: the fixed cost of fetching and
                                                   releasing each of U modules with parameters
                                                   in forward and backward (module hooks, state
                                                   changes), measured on one rank (t_unit: a
                                                   property of minispeed.zero, not the machine;
                                                   given by the caller)
    T_params   = A·(2·Ψ·p + Ψ·g) / D              the parameters streamed from DRAM: read in
                                                   forward and in backward, gradients written
                                                   (the matmul rates are measured with operands
                                                   in cache); D the measured DRAM rate (bytes
                                                   read + written per second)
    T_unpack   = 2·A·3·Ψ·p / D                     stage 3 only: each pass's coalesced gather
                                                   copied into the parameters (read + write),
                                                   and its fresh buffer of Ψ·p bytes zeroed by
                                                   the kernel on first touch
    T_comm     = Σ_calls (α_op + bytes_call / β_op)
    T_step     = T_compute + T_memory + T_overhead + T_optim + T_hooks + T_units
                 + T_params + T_unpack + (1 - overlap) · T_comm

Bytes each rank sends, the dominant terms of minispeed.zero's ledgers (restated here: the
profiler depends on minispeed.core only):

| stage | collectives per step                     | bytes sent per rank            |
|-------|------------------------------------------|--------------------------------|
| 0     | all-reduce of the gradients              | 2r·Ψ·g                          |
| 1     | reduce-scatter, all-gather after step    | r·Ψ·g + r·Ψ·p                   |
| 2     | reduce-scatter each micro-step, all-gather | A·r·Ψ·g + r·Ψ·p               |
| 3     | per micro-step: all-gather in forward and in backward, reduce-scatter | A·(r·Ψ·g + 2r·Ψ·p) |

Calls: gradients go in buckets of `bucket_numel` elements (one call each; by default zero's own
plan at its default bound, `core.gradient_buckets.planned_bucket_numel`: 6,553,600 elements of
4 bytes, 25 MiB); stage 3 gathers in
`stage3_gather_calls` calls per pass: with minispeed.zero's prefetcher, the first module's
blocking gather plus one prefetch of everything else when the model fits in the prefetch window
(the budget, at most a 4M-element chunk), else about one call per module with parameters.

`overlap` (0 by default) is the fraction of communication hidden behind compute; on a CPU
with gloo the transfer and the arithmetic share cores, so little is hidden.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minispeed.core.gradient_buckets import (
    DEFAULT_BUCKET_NUMEL,
    hooks_each_gradient,
    planned_bucket_numel,
)

__all__ = [
    "CALIBRATION_FILE",
    "LinkCost",
    "Machine",
    "StepPrediction",
    "default_bucket_numel",
    "matmul_seconds",
    "predict_step",
    "stage3_gather_calls",
    "stage_collectives",
]

CALIBRATION_FILE = Path(os.path.expanduser("~/.cache/minispeed/profiler/calibration.json"))


def default_bucket_numel(grad_bytes: int = 4) -> int:
    """Elements per gradient bucket when the caller gives no `bucket_numel`: zero's plan at its
    default bound (`planned_bucket_numel(DEFAULT_BUCKET_NUMEL, grad_bytes)`, the one rule zero
    cuts its buckets by): 6,553,600 for 4-byte gradients."""
    return planned_bucket_numel(DEFAULT_BUCKET_NUMEL, grad_bytes)


@dataclass(frozen=True)
class LinkCost:
    """One collective's cost: `alpha_s` per call plus bytes sent per rank over `busbw_bytes_per_s`."""

    alpha_s: float
    busbw_bytes_per_s: float

    def time_s(self, wire_bytes: float) -> float:
        """Seconds for one call in which each rank sends `wire_bytes`."""
        return self.alpha_s + wire_bytes / self.busbw_bytes_per_s


@dataclass(frozen=True)
class Machine:
    """What `calibrate` measured: matmul FLOP/s by square size, and each collective's cost."""

    matmul_flops_per_s: dict[int, float]
    """Measured FLOP/s of an n×n @ n×n float32 matmul, by n."""
    links: dict[str, LinkCost] = field(default_factory=dict)
    """`all_reduce`, `all_gather`, `reduce_scatter` -> cost, measured on `world_size` ranks."""
    world_size: int = 2
    stream_bytes_per_s: float | None = None
    """Memory rate of element-wise work (bytes read + written per second)."""
    op_overhead_s: float = 0.0
    """Fixed cost of one operator call (dispatch, Python), seconds."""
    adam_s_per_param: float | None = None
    """Seconds of `torch.optim.AdamW.step` per parameter (None: priced from the memory rate)."""
    dram_bytes_per_s: float | None = None
    """DRAM rate: bytes read + written per second by a copy beyond the cache."""
    adam_s_per_tensor: float = 0.0
    """Fixed seconds of `torch.optim.AdamW.step` per parameter tensor (its ~10 operator calls)."""
    hook_s_per_grad: float = 0.0
    """Seconds of one ZeRO-style gradient hook (slot lookup, copy into the bucket, bookkeeping)."""

    def flops_per_s(self, size: int | None = None) -> float:
        """Throughput at the measured size nearest `size` (log scale); the best one if None."""
        if size is None:
            return max(self.matmul_flops_per_s.values())
        nearest = min(self.matmul_flops_per_s, key=lambda n: abs(math.log(n / size)))
        return self.matmul_flops_per_s[nearest]

    def to_json(self) -> dict:
        """Plain data for the calibration file."""
        return {
            "matmul_flops_per_s": {str(k): v for k, v in self.matmul_flops_per_s.items()},
            "links": {k: asdict(v) for k, v in self.links.items()},
            "world_size": self.world_size,
            "stream_bytes_per_s": self.stream_bytes_per_s,
            "op_overhead_s": self.op_overhead_s,
            "adam_s_per_param": self.adam_s_per_param,
            "dram_bytes_per_s": self.dram_bytes_per_s,
            "adam_s_per_tensor": self.adam_s_per_tensor,
            "hook_s_per_grad": self.hook_s_per_grad,
        }

    @classmethod
    def from_json(cls, data: dict) -> Machine:
        """The inverse of `to_json`."""
        return cls(
            matmul_flops_per_s={int(k): float(v) for k, v in data["matmul_flops_per_s"].items()},
            links={k: LinkCost(**v) for k, v in data.get("links", {}).items()},
            world_size=int(data.get("world_size", 2)),
            stream_bytes_per_s=data.get("stream_bytes_per_s"),
            op_overhead_s=float(data.get("op_overhead_s", 0.0)),
            adam_s_per_param=data.get("adam_s_per_param"),
            dram_bytes_per_s=data.get("dram_bytes_per_s"),
            adam_s_per_tensor=float(data.get("adam_s_per_tensor", 0.0)),
            hook_s_per_grad=float(data.get("hook_s_per_grad", 0.0)),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> Machine:
        """Read a calibration file (default `CALIBRATION_FILE`); the error says how to make one."""
        path = CALIBRATION_FILE if path is None else path
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no calibration at {path}: run `python -m minispeed.profiler calibrate` first"
            ) from None


@dataclass(frozen=True)
class Collective:
    """One collective call of a step: its op and the bytes each rank sends in it."""

    op: str
    wire_bytes: float


def stage_collectives(
    stage: int,
    num_params: int,
    world_size: int,
    *,
    grad_bytes: int = 4,
    param_bytes: int = 4,
    micro_steps: int = 1,
    bucket_numel: int | None = None,
    gather_calls: int | None = None,
) -> list[Collective]:
    """The collectives of one optimizer step (the table of the module docstring), cut into
    calls of at most `bucket_numel` elements (None: `default_bucket_numel(grad_bytes)`, zero's
    plan); stage 3 gathers in `gather_calls` calls per pass (one per module with parameters;
    default: buckets of `bucket_numel`)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n, psi, a = world_size, num_params, micro_steps
    if n == 1:
        return []
    r = (n - 1) / n
    if bucket_numel is None:
        bucket_numel = default_bucket_numel(grad_bytes)
    buckets = max(1, math.ceil(psi / bucket_numel))

    def split(op: str, total_bytes: float, calls: int) -> list[Collective]:
        return [Collective(op, total_bytes / calls)] * calls

    if stage == 0:
        return split("all_reduce", 2 * r * psi * grad_bytes, buckets)
    if stage in (1, 2):
        times = a if stage == 2 else 1
        reduce = [
            c for _ in range(times) for c in split("reduce_scatter", r * psi * grad_bytes, buckets)
        ]
        return reduce + split("all_gather", r * psi * param_bytes, buckets)
    gathers = gather_calls or buckets
    per_micro = (
        split("all_gather", r * psi * param_bytes, gathers)  # forward
        + split("all_gather", r * psi * param_bytes, gathers)  # backward
        + split("reduce_scatter", r * psi * grad_bytes, buckets)
    )
    return per_micro * a


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds of one optimizer step, by term (Note [the step-time model])."""

    compute_s: float
    """Matrix products: `2·macs / R` (all FLOPs over R when MACs are not given)."""
    memory_s: float
    """Element-wise work at the memory rate."""
    overhead_s: float
    """Operator calls × the per-call overhead."""
    optimizer_s: float
    """AdamW on the parameters this rank owns, plus its fixed cost per parameter tensor."""
    hooks_s: float
    """ZeRO's gradient hooks: one per parameter tensor per micro-step where zero registers them
    (stage 3; stages 0-2 beyond one bucket)."""
    units_s: float
    """Stage 3: the fixed cost per module with parameters per micro-step (fetch, release)."""
    params_s: float
    """Streaming the parameters from DRAM: read in forward and backward, gradients written."""
    unpack_s: float
    """Stage 3: copying each pass's gathered parameters out of the collective's (fresh) buffer."""
    comm_s: float
    overlap: float
    wire_bytes: float
    calls: int

    @property
    def step_s(self) -> float:
        """The local terms (compute, memory, overhead, optimizer, hooks, units, params, unpack) plus
        `(1 - overlap) · comm_s`."""
        local = self.compute_s + self.memory_s + self.overhead_s + self.optimizer_s + self.hooks_s
        local += self.units_s
        return local + self.params_s + self.unpack_s + (1.0 - self.overlap) * self.comm_s


BYTES_PER_ELEMENTWISE_FLOP = 12
"""An element-wise FLOP reads two float32 values and writes one."""
OPTIMIZER_BYTES_PER_PARAM = 64
"""Without a measured `adam_s_per_param`: AdamW touches parameter, gradient and two moments
(read and write, float32) plus its temporaries, about 16 float32 values per parameter it owns.
(torch's AdamW on a CPU measures 3-4x that on a loaded machine: ~10 passes over the data.)"""


def stage3_gather_calls(
    num_params: int, units: int, prefetch_numel: int, chunk_numel: int = 1 << 22
) -> int:
    """All-gather calls of one stage-3 pass (forward, or backward) under minispeed.zero's
    prefetcher with a budget of `prefetch_numel` elements: the first of `units` modules with
    parameters gathers blocking; the prefetch gathers the rest of the pass when it fits
    `min(prefetch_numel, chunk_numel)` elements, else one unit ahead (zero's Note [a prefetch
    stays one chunk ahead]: 4M elements), so a model that fits is one more call, and otherwise
    about every unit starts a top-up call."""
    if units <= 1:
        return units
    if num_params <= min(prefetch_numel, chunk_numel):
        return 2
    return units


def matmul_seconds(
    shapes: dict[tuple[int, int, int, int], int], rates: dict[tuple[int, int, int, int], float]
) -> tuple[float, float]:
    """Seconds and FLOPs of the matrix products `shapes` (`(batch, m, k, n)` -> calls, from
    `Profile.matmul_shapes`) at the FLOP/s measured for each shape
    (`calibrate.measure_matmul_shapes`): `Σ calls · 2·b·m·k·n / R(shape)`."""
    seconds = flops = 0.0
    for shape, calls in shapes.items():
        f = 2 * math.prod(shape) * calls
        seconds += f / rates[shape]
        flops += f
    return seconds, flops


def predict_step(
    machine: Machine,
    *,
    flops_per_step: float,
    num_params: int,
    stage: int,
    world_size: int,
    macs_per_step: float | None = None,
    ops_per_step: int = 0,
    num_tensors: int = 0,
    stage3_units: int = 0,
    stage3_unit_s: float = 0.0,
    matmul_size: int | None = None,
    matmul_shape_s: tuple[float, float] | None = None,
    overlap: float = 0.0,
    **collective_kwargs: int,
) -> StepPrediction:
    """Predict one optimizer step (module docstring).

    `flops_per_step` and `macs_per_step` (from `FlopsProfiler`: forward + backward of every
    micro-step) split the work into matrix products at R and element-wise FLOPs at the memory
    rate; `ops_per_step` operator calls cost `op_overhead_s` each. The optimizer step costs
    `adam_s_per_param` per parameter a rank owns (Ψ, or Ψ/N from stage 1), or, uncalibrated,
    moves `OPTIMIZER_BYTES_PER_PARAM` per parameter at the memory rate. `num_tensors`, the
    model's parameter tensors, adds AdamW's fixed cost per tensor (every rank steps one fragment
    per tensor, empty or not, at every stage) and one gradient hook per tensor and micro-step,
    where minispeed.zero registers them: at stage 3, and at stages 0-2 only for gradients
    spanning more than one bucket of `bucket_numel` (`hooks_each_gradient`, the rule zero's
    reducer follows; no `bucket_numel` given: zero's default plan, `default_bucket_numel`).
    At stage 3, `stage3_units` modules with parameters cost `stage3_unit_s` each per micro-step
    (minispeed.zero's fixed cost of fetching and releasing a module, measured by the caller on one
    rank: the profiler does not run zero).
    `matmul_size` picks the calibrated throughput nearest the model's typical matmul (e.g. the
    hidden size); `matmul_shape_s` (`matmul_seconds(...)` of the step's shapes) prices those
    products at their own measured rate instead, the other MACs (attention, convolutions)
    staying at the square rate; `collective_kwargs` go to `stage_collectives`.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap is a fraction in [0, 1], got {overlap}")
    bucket = collective_kwargs.get("bucket_numel")
    if bucket is None:
        bucket = default_bucket_numel(collective_kwargs.get("grad_bytes", 4))
    calls = stage_collectives(
        stage, num_params, world_size, **{**collective_kwargs, "bucket_numel": bucket}
    )
    missing = sorted({c.op for c in calls} - set(machine.links))
    if missing:
        raise ValueError(
            f"the calibration has no link cost for {missing}: rerun "
            "`python -m minispeed.profiler calibrate` with minispeed-comm installed"
        )
    comm = sum(machine.links[c.op].time_s(c.wire_bytes) for c in calls)
    rate = machine.flops_per_s(matmul_size)
    matmul_flops = flops_per_step if macs_per_step is None else 2 * macs_per_step
    memory = optimizer = 0.0
    owned = num_params if stage == 0 else num_params / world_size
    if machine.stream_bytes_per_s:
        moved = (flops_per_step - matmul_flops) * BYTES_PER_ELEMENTWISE_FLOP
        memory = moved / machine.stream_bytes_per_s
        optimizer = OPTIMIZER_BYTES_PER_PARAM * owned / machine.stream_bytes_per_s
    if machine.adam_s_per_param is not None:
        optimizer = owned * machine.adam_s_per_param
    optimizer += num_tensors * machine.adam_s_per_tensor
    a = collective_kwargs.get("micro_steps", 1)
    hooked = num_tensors if stage == 3 or hooks_each_gradient(num_params, bucket) else 0
    params = unpack = 0.0
    if machine.dram_bytes_per_s:
        p, g = collective_kwargs.get("param_bytes", 4), collective_kwargs.get("grad_bytes", 4)
        params = a * (2 * p + g) * num_params / machine.dram_bytes_per_s
        if stage == 3 and world_size > 1:  # per pass: copy out (read + write), fresh buffer
            unpack = 2 * a * 3 * p * num_params / machine.dram_bytes_per_s
    compute = matmul_flops / rate
    if matmul_shape_s is not None:
        shaped_s, shaped_flops = matmul_shape_s
        compute = shaped_s + max(matmul_flops - shaped_flops, 0.0) / rate
    return StepPrediction(
        compute_s=compute,
        memory_s=memory,
        overhead_s=ops_per_step * machine.op_overhead_s,
        optimizer_s=optimizer,
        hooks_s=a * hooked * machine.hook_s_per_grad,
        units_s=a * stage3_units * stage3_unit_s if stage == 3 else 0.0,
        params_s=params,
        unpack_s=unpack,
        comm_s=comm,
        overlap=overlap,
        wire_bytes=sum(c.wire_bytes for c in calls),
        calls=len(calls),
    )
