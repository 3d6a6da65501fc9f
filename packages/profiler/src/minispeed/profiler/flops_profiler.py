"""The FLOPs profiler: count every operator of one step, credit it to the modules running it.

```python
from minispeed import profiler

with profiler.FlopsProfiler(model) as prof:  # one step: forward, and backward if you run it
    loss = model(x, y)[1]
    loss.backward()
result = prof.result()
print(result.table(depth=2, top_k=3))       # rich tree: params, FLOPs, MACs, latency per module
result.to_json()                            # the same as a dict
```

How (Note [counting at the operator level]): a `TorchDispatchMode` sees every aten operator
the step runs — `F.linear` inside a `forward`, an attention kernel, an operator of autograd's
backward, a recomputation under activation checkpointing — whether or not it was called through
a module. The operator table (`ops.py`) prices it; the `ModuleTracker` (`tracker.py`) says which
modules own it — in forward the modules running, in backward the modules whose forward created
the autograd node running (Note [backward belongs to the node's creator]) — and the cost is
added to each of them once (so a module's count includes its children's, a module called
several times sums its calls, and each module's rows are its own work: its exclusive shares
plus the work outside every module add up to the total). Nothing is patched: the mode and the
module hooks exist only inside the `with` block.

Which element-wise work backward counts, and to whom: every operator autograd runs, the
gradient formulas' to the module whose forward created the node; the adds that sum the k
gradients of a tensor read k times (k - 1 adds of its size), and a parameter's add into an
existing `.grad`, to the innermost module call enclosing every read (Note [who adds up a
gradient] in `tracker.py`). A module called n times is charged n times one call; the adds that
combine its calls (its weight's n gradients, an input handed to every call) are its caller's.

Phases: an operator run by autograd's engine is **backward**; one run by a forward that
re-executes inside a backward (activation checkpointing) is **recompute**, counted in backward
too and also on its own. Everything else is **forward**.

Note [the model's forward and backward]: a training step runs work that is no module's. In
forward: the optimizer's step and its gradient clipping, ZeRO's gradient bookkeeping once
backward has ended (a model whose gradients fit in one bucket has its `param.grad` copied into
the bucket then), the loss scaling, a caller's or a pipeline's loss. In backward: the backward of
that loss, and the hooks on the parameters' gradients (ZeRO's copy of each gradient into its
bucket, scaled by 1/N: Ψ FLOPs per micro-step when the gradients span several buckets; Note
[work in a gradient hook] in `tracker.py`). DeepSpeed's engine profile counts the model's
forward only (it starts counting before the module's forward and stops after it) and reports
its backward as 2 × that forward, so `StepProfiler` builds its profiler with
`outside_model=False`: an operator runs uncounted (not priced, not listed) unless it is the
model's, a module of the model running it in forward, or in backward an autograd node a module's
forward created (or the adds summing a module's gradients) and not a gradient hook. One test of
where the operator runs, so no caller has to pause the profiler around its own work. A plain
`FlopsProfiler` counts all of it, the work no module owns in the "(outside modules)" row.

Cost of profiling: one Python call per operator (the mode), two hooks per module call (each
walking the autograd nodes made since the last one) and two per autograd node in backward;
`benchmarks/profiler_overhead.py` measures it against the same step unprofiled.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, defaultdict
from typing import Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from minispeed.core.accelerator import get_accelerator
from minispeed.core.files import atomic_write
from minispeed.profiler.formulas import Cost
from minispeed.profiler.ops import matmul_shape, op_cost
from minispeed.profiler.report import (
    ModuleProfile,
    Profile,
    duration_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from minispeed.profiler.tracker import ModuleTracker, Stack, in_backward

__all__ = ["FlopsProfiler", "ProfilerState"]

OUTSIDE = "(outside modules)"
PHASES = ("forward", "backward", "recompute")


class ProfilerState(enum.Enum):
    """Where a `FlopsProfiler` is in its life; changed only by `_to_running` / `_to_stopped` /
    `_to_idle`, which refuse a move from any other state with an error naming the fix.

    | state | installed | counts |
    |---|---|---|
    | `IDLE` | nothing | empty: never started, or reset (`start_profile`, `end_profile`) |
    | `RUNNING` | the dispatch mode and the module hooks: every operator is counted | growing |
    | `STOPPED` | nothing | kept for `result()` and `get_total_*`; entering again adds to them |
    """

    IDLE = "idle"
    RUNNING = "running"
    STOPPED = "stopped"


class _CountingMode(TorchDispatchMode):
    """Prices each aten operator and hands the cost to `on_op`."""

    def __init__(self, profiler: FlopsProfiler) -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owners = self.profiler.owners_counted(args)
        if owners is None:  # the loop's own work (Note [the model's forward and backward])
            return out
        try:
            cost = op_cost(func, args, kwargs, out)
        except Exception as exc:  # a formula that cannot read these arguments: list, don't crash
            self.profiler.unknown_ops[f"{func} ({type(exc).__name__}: {exc})"] += 1
            return out
        if cost is None:
            self.profiler.unknown_ops[str(func)] += 1
        else:
            self.profiler.on_op(str(func.overloadpacket), cost, owners)
            shape = matmul_shape(func, args, kwargs)
            if shape is not None:
                self.profiler.matmul_shapes[shape] += 1
        return out


class FlopsProfiler:
    """Counts FLOPs, MACs and time per module of `model` for what runs inside `with`.

    Args:
        model: any `nn.Module`; its own hooks keep working (ours run first before and last
            after theirs, so work done in their hooks is counted in the module).
        count_ops: False times modules only (no dispatch mode: latencies without the counting
            overhead, FLOPs all zero).
        peak_flops_per_s: the machine's peak to report a fraction of: FLOP/s, or
            `"calibrated"` for the best matmul rate `python -m minispeed.profiler calibrate`
            measured (`perf_model.Machine.load()`; the error says to run it when missing);
            None leaves the fraction out.
        outside_model: count the work no module of `model` owns: in forward, what runs
            outside every module (a loss computed by the caller, an optimizer step run inside
            the block), in backward that loss's backward and the hooks on the parameters'
            gradients (ZeRO's copy into its buckets), as the "(outside modules)" row. False
            counts only the model's forward and backward, as DeepSpeed's engine profile counts
            its forward (what `StepProfiler` asks for: Note [the model's forward and
            backward]).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        count_ops: bool = True,
        peak_flops_per_s: float | str | None = None,
        outside_model: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler profiles an nn.Module, got {type(model).__name__}")
        if peak_flops_per_s == "calibrated":
            from minispeed.profiler.perf_model import Machine

            peak_flops_per_s = Machine.load().flops_per_s()
        elif isinstance(peak_flops_per_s, str) or (
            peak_flops_per_s is not None and not peak_flops_per_s > 0
        ):
            raise ValueError(
                f"peak_flops_per_s is a positive FLOP/s, 'calibrated' or None, "
                f"got {peak_flops_per_s!r}"
            )
        self.model = model
        self._ignore: tuple[type, ...] = ()
        self.count_ops = count_ops
        self.outside_model = outside_model
        self.peak_flops_per_s = peak_flops_per_s
        self._sync = get_accelerator().synchronize
        self.state = ProfilerState.IDLE
        self._mode: _CountingMode | None = None
        self._t0 = 0.0
        self.reset_profile()
        if count_ops:
            # A dispatch mode's first operator imports torch._dynamo (seconds): do it here, not
            # inside the first profiled module's latency.
            import torch._dynamo  # noqa: F401

    # ---- counting ----------------------------------------------------------------------------
    def owners_counted(self, args: tuple) -> Stack | None:
        """The modules owning the operator running now (called with `args`; `()`: no module),
        or None when it is not counted: with `outside_model` False, work no module of the model
        owns (Note [the model's forward and backward])."""
        tracker = self.tracker
        if not in_backward():
            return tuple(tracker.stack) if tracker.stack or self.outside_model else None
        if tracker.in_gradient_hook(args):
            return () if self.outside_model else None
        owners = tracker.owners_of_op(args)
        return owners if owners or self.outside_model else None

    def on_op(self, op_name: str, cost: Cost, owners: Stack) -> None:
        """Credit one priced operator to the current phase and to every module in `owners`
        (`owners_counted`: Note [backward belongs to the node's creator])."""
        self.op_calls[op_name] += 1
        if cost.flops == 0:
            return
        self.op_totals[op_name] += cost
        if in_backward():
            phases = ("backward", "recompute") if self.tracker.recomputing else ("backward",)
        else:
            phases = ("forward",)
        names = set(owners) or {OUTSIDE}
        for phase in phases:
            self.totals[phase] += cost
            for name in names:
                self.costs[name][phase] += cost

    # ---- lifetime ----------------------------------------------------------------------------
    def _to_running(self) -> None:
        if self.state is ProfilerState.RUNNING:
            raise RuntimeError(
                "this FlopsProfiler is already running: entering it again (a nested `with`, or "
                "start_profile() twice) would count every operator twice. Stop it first (leave "
                "the `with` block or call stop_profile()), or use a second FlopsProfiler"
            )
        self.state = ProfilerState.RUNNING

    def _to_stopped(self) -> None:
        if self.state is not ProfilerState.RUNNING:
            raise RuntimeError(
                f"this FlopsProfiler is not running (it is {self.state.value}): there is nothing "
                "to stop. Start it first (`with profiler:` or start_profile())"
            )
        self.state = ProfilerState.STOPPED

    def _to_idle(self) -> None:
        if self.state is ProfilerState.RUNNING:
            raise RuntimeError("stop this FlopsProfiler (stop_profile()) before resetting it")
        self.state = ProfilerState.IDLE

    def reset_profile(self) -> None:
        """Forget every count (DeepSpeed's `reset_profile`); refused while running."""
        self._to_idle()
        self.tracker = ModuleTracker(self.model, sync=self._sync, ignore=self._ignore)
        # per module name, per phase: Cost
        self.costs: dict[str, dict[str, Cost]] = defaultdict(lambda: dict.fromkeys(PHASES, Cost()))
        self.totals: dict[str, Cost] = dict.fromkeys(PHASES, Cost())
        self.op_totals: dict[str, Cost] = defaultdict(Cost)
        self.op_calls: Counter[str] = Counter()
        self.matmul_shapes: Counter[tuple[int, int, int, int]] = Counter()
        self.unknown_ops: Counter[str] = Counter()
        self.wall_s = 0.0

    def __enter__(self) -> FlopsProfiler:
        self._to_running()
        self.tracker.__enter__()
        if self.count_ops:
            self._mode = _CountingMode(self)
            self._mode.__enter__()
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._to_stopped()
        self._sync()
        self.wall_s += time.perf_counter() - self._t0
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
        finally:
            self.tracker.__exit__(*exc)

    # ---- DeepSpeed's lifecycle (`deepspeed.profiling.flops_profiler.FlopsProfiler`) ----------
    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Forget earlier counts and start counting (DeepSpeed's `start_profile`). Modules of
        the types in `ignore_list` get no row: their work is their caller's. Refused while
        running (it would count every operator twice)."""
        if self.state is ProfilerState.RUNNING:
            self._to_running()  # raises, naming the fix
        self._ignore = tuple(ignore_list or ())
        self.reset_profile()
        self.__enter__()

    def stop_profile(self) -> None:
        """Stop counting and keep the counts (DeepSpeed's `stop_profile`); refused when not
        running, where DeepSpeed does nothing."""
        self.__exit__(None, None, None)

    def end_profile(self) -> None:
        """Stop if running and forget everything (DeepSpeed's `end_profile`)."""
        if self.state is ProfilerState.RUNNING:
            self.stop_profile()
        self._ignore = ()
        self.reset_profile()

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """The model's forward FLOPs, as DeepSpeed's `get_total_flops` (forward only, work
        outside the model's `forward` not included); `result().flops` adds the backward."""
        flops = self.result().root.forward.flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """The model's forward MACs (DeepSpeed's `get_total_macs`)."""
        macs = self.result().root.forward.macs
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """The model's forward latency in seconds, summed over calls (DeepSpeed's
        `get_total_duration`)."""
        seconds = self.result().root.forward_s
        return duration_to_string(seconds) if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        """The model's parameters held by this rank, tied ones once (DeepSpeed's
        `get_total_params`)."""
        params = sum({id(p): p.numel() for p in self.model.parameters()}.values())
        return params_to_string(params) if as_string else params

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print DeepSpeed's summary lines and the module table (`Profile.render`) to stdout,
        or to `output_file`. Refused before anything was profiled."""
        if self.state is ProfilerState.IDLE:
            raise RuntimeError("nothing profiled yet: call start_profile() and run the model")
        seconds = self.get_total_duration()
        flops = self.get_total_flops()
        lines = [
            f"Flops profile at step {profile_step}:",
            f"params per rank: {self.get_total_params(as_string=True)}",
            f"fwd MACs per rank: {self.get_total_macs(as_string=True)}",
            f"fwd flops per rank: {number_to_string(flops)}",
            f"fwd latency: {number_to_string(seconds)}s",
            f"fwd FLOPS per rank: {number_to_string(flops / seconds if seconds else 0)}FLOPS",
            self.result().render(module_depth, top_modules, detailed),
        ]
        text = "\n".join(lines)
        if output_file is None:
            print(text)
            return
        atomic_write(output_file, text + "\n")

    # ---- results -----------------------------------------------------------------------------
    def result(self) -> Profile:
        """The profile of what ran inside the `with` block (a tree of `ModuleProfile`)."""
        seen: set[int] = set()

        def build(name: str, module: nn.Module) -> ModuleProfile:
            params = {id(p): p.numel() for p in module.parameters()}  # tied weights once
            children = [
                build(f"{name}.{child}" if name else child, sub)
                for child, sub in module.named_children()
                if id(sub) not in seen and not seen.add(id(sub))  # a shared module appears once
            ]
            calls = self.tracker.calls.get(name, 0)
            if calls == 0 and name not in self.costs:
                # A container never called itself (ModuleList, ModuleDict): its children's sum.
                return ModuleProfile(
                    name=name or "model",
                    type=type(module).__name__,
                    params=sum(params.values()),
                    calls=0,
                    forward=sum((c.forward for c in children), Cost()),
                    backward=sum((c.backward for c in children), Cost()),
                    recompute=sum((c.recompute for c in children), Cost()),
                    forward_s=sum(c.forward_s for c in children),
                    backward_s=sum(c.backward_s for c in children),
                    children=children,
                )
            costs = self.costs.get(name, dict.fromkeys(PHASES, Cost()))
            return ModuleProfile(
                name=name or "model",
                type=type(module).__name__,
                params=sum(params.values()),
                calls=calls,
                forward=costs["forward"],
                backward=costs["backward"],
                recompute=costs["recompute"],
                forward_s=self.tracker.forward_s.get(name, 0.0),
                backward_s=self.tracker.backward_s.get(name, 0.0),
                children=children,
            )

        seen.add(id(self.model))
        outside = self.costs.get(OUTSIDE, dict.fromkeys(PHASES, Cost()))
        return Profile(
            root=build("", self.model),
            forward=self.totals["forward"],
            backward=self.totals["backward"],
            recompute=self.totals["recompute"],
            outside_forward=outside["forward"],
            outside_backward=outside["backward"],
            wall_s=self.wall_s,
            op_totals=dict(self.op_totals),
            op_calls=dict(self.op_calls),
            matmul_shapes=dict(self.matmul_shapes),
            unknown_ops=dict(self.unknown_ops),
            peak_flops_per_s=self.peak_flops_per_s,
        )
