"""`Engine`: DeepSpeed's training loop surface over a model sharded by `minispeed.zero`, or over a
pipeline executor (`pipe_engine.PipelineEngine`, the same engine with `train_batch`).

```python
engine, optimizer, _, scheduler = minispeed.engine.initialize(model=model, config="ds.json",
                                                              model_parameters=model.parameters())
for x, y in loader:
    loss = engine(x, y)      # forward (inputs moved to the engine's device)
    engine.backward(loss)    # scaled by the fp16 loss scale / gradient_accumulation_steps
    engine.step()            # steps the optimizer and scheduler at accumulation boundaries
```

The engine only orders calls; each feature's knowledge lives in its package:
`minispeed.zero.ZeroOptimizer` does accumulation, loss scaling, clipping and the sharded step;
`minispeed.zero` saves and loads checkpoints; the profiler and the comms logger record.

Counters follow DeepSpeed: `global_steps` counts accumulation boundaries (an fp16 overflow
that skips its step still counts, and also counts in `skipped_steps`); `global_samples` adds
`train_batch_size()` per boundary; the scheduler steps only when the optimizer really stepped.
What happens at a boundary (`_end_of_step`: counters, scheduler, the profiled step's report, the
comms logger's step, the monitors' events, `steps_per_print`'s line, the step observers) is the
same for a pipeline's `train_batch`.

Cost over calling `zero.shard` directly: a few Python attribute reads per call, plus what the
config turns on (timers synchronize the device three times per micro-step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.engine.checkpoint.background as ckpt_async
import minispeed.engine.checkpoint.grid as ckpt
import minispeed.zero as zero
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.core.logging import get_logger, warn_once
from minispeed.core.nested import map_tensors
from minispeed.engine.checkpoint.calls import CheckpointCalls, Restore
from minispeed.engine.composition import Composition
from minispeed.engine.config import EngineConfig
from minispeed.engine.legacy import ForwardArguments
from minispeed.engine.queries import DeepSpeedQueries
from minispeed.engine.sequence_groups import sequence_gradient_factor
from minispeed.engine.surface import DeepSpeedSurface
from minispeed.profiler import monitor as monitors

__all__ = ["Engine", "StepObserver", "zero_config_for"]

_log = get_logger("engine")
# steps_per_print's running average of samples/s starts after this many steps (DeepSpeed's
# ThroughputTimer(start_step=2): the first steps build buffers and warm caches up).
_WARM_UP_STEPS = 2

# The keys the engine adds to a checkpoint's client_state (the user's own stays under "client").
_ENGINE_STATE = ckpt.ENGINE_STATE


class StepObserver(Protocol):
    """Told of every accumulation boundary, after the optimizer step and the counters (e.g.
    `minispeed tune`'s `TrialRecorder`, which `initialize` hands the engine: the engine itself
    knows no trial)."""

    def on_boundary(self, engine: Engine) -> None:
        """Called by `Engine.step` at each accumulation boundary."""


class Engine(DeepSpeedQueries, DeepSpeedSurface, CheckpointCalls, nn.Module):
    """A model, its `ZeroOptimizer` and its scheduler, stepped with DeepSpeed's semantics.

    Built by `minispeed.engine.initialize`. `module` is the user's model (sharded in place by
    `zero.shard`); `optimizer` the `ZeroOptimizer`; `lr_scheduler` the scheduler or `None`.
    Being an `nn.Module`, `engine.parameters()` and `engine.state_dict()` (keys prefixed by
    `module.`, as DeepSpeed's) work. `describe()` tells what `initialize` did to the model.
    Every other public name of DeepSpeed's engine answers, or is declined by name
    (`surface.py`).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: zero.ZeroOptimizer | None,
        config: EngineConfig,
        lr_scheduler: Any = None,
        training_dataloader: Any = None,
        observers: Sequence[StepObserver] = (),
        grid: comm.ProcessGrid | None = None,
        composition: Composition | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        # The data × tensor grid under tensor parallelism (engine/grid.py), a pipeline's own grid,
        # else None: the world is the data axis. Its "tensor" axis is the group the loss takes
        # (`vocab_parallel_cross_entropy(logits, targets, engine.grid)`).
        self.grid = grid
        # What initialize did, step by step, as it ran (composition.py; `describe()`).
        self.composition = composition if composition is not None else Composition()
        self.optimizer = optimizer
        # stage 3 built without an optimizer: the forward-only sharding (Note [stage 3 without
        # an optimizer] in minispeed/engine/__init__.py)
        self.forward_only_zero: zero.ForwardOnly | None = None
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.config = config
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._step_applied = False  # whether the last boundary's optimizer step was taken
        # set_gradient_accumulation_boundary's value (None: every gradient_accumulation_steps).
        self._boundary: bool | None = None
        self._no_sync = False  # inside no_sync()
        # DeepSpeed 0.17.6's keyword arguments for training forwards (progressive layer drop,
        # the seqlen curriculum: engine/legacy.py), set by initialize; None: none.
        self.forward_arguments: ForwardArguments | None = None
        self._half_inputs = config.fp16.enabled and config.fp16.auto_cast
        self._sequence_factor = sequence_gradient_factor(config.zero, self.sequence_parallel_size)
        self.device = get_accelerator().device()
        self.timers: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        # offload_states()'s parked storages (zero/parking.py) until reload_states(); the host
        # buffers of the last reload, reused by the next offload_states().
        self._parked: Any = None
        self._park_buffers: Any = None
        self._stack = contextlib.ExitStack()  # the step being profiled, while it runs
        self._profiling = False
        self._step_started = time.perf_counter()
        self._warm_since: float | None = None  # steps_per_print's running average starts here
        self.comms_logger: comm.CommsLogger | None = None
        if config.comms_logger.enabled:
            self.comms_logger = comm.CommsLogger.from_config(config.comms_logger)
            self.comms_logger.__enter__()
        # DeepSpeed's monitors (tensorboard, csv_monitor, wandb, comet): backends on rank 0 only.
        self.monitor = monitors.MonitorMaster(config.monitor, rank=comm.get_rank())
        self._monitoring = bool(self.monitor.monitors)  # this rank writes events
        # backward_allreduce, apart from the backward: the optimizer's end-of-backward reduction
        self._reduce_timer: ranges.Timer | None = None
        if self._monitoring and optimizer is not None and config.wall_clock_breakdown:
            self._reduce_timer = ranges.Timer("zero.backward_done")
        self._timers_at_boundary = self._timer_totals()  # when the last window ended
        # Told of every boundary (a `minispeed tune` trial's recorder: engine/tune/trial.py).
        self._observers = tuple(observers)
        self._step_profiler = None
        profile = config.flops_profiler.enabled
        if profile and comm.get_rank() == 0:
            # DeepSpeed profiles and reports on global rank 0 only: one report, not one per rank.
            from minispeed.profiler import StepProfiler

            self._step_profiler = StepProfiler(module, config.flops_profiler)

    # -- the loop ---------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, with every tensor argument moved to the engine's device (and,
        in training mode, `forward_arguments`' keyword arguments added)."""
        if self._step_profiler is not None and not self._profiling:
            self._start_profile()
        if self._parked is not None:
            self._refuse_parked("forward")
        args = _to_device(args, self.device)
        if kwargs:
            kwargs = _to_device(kwargs, self.device)
        if self.forward_arguments is not None and self.module.training:
            kwargs = {**kwargs, **self.forward_arguments(self.global_steps)}
        if self._half_inputs:  # fp16.auto_cast: the positional inputs only, as DeepSpeed's
            args = to_half(args)
        autocast = self.config.precision.autocast
        if autocast is not None or torch.is_autocast_enabled(self.device.type):
            # torch_autocast's region, or the caller's autocast switched off, as DeepSpeed's.
            with zero.autocast_region(autocast, self.device.type):
                return self._run_module(args, kwargs)
        return self._run_module(args, kwargs)

    def _run_module(self, args: tuple, kwargs: dict) -> Any:
        # `self._modules["module"]`, not `self.module`: the registry read directly, where the
        # attribute goes through two __getattr__ calls (the engine's declining one, nn.Module's).
        module = self._modules["module"]
        if not self.config.wall_clock_breakdown:  # untimed: no context manager on the hot path
            return module(*args, **kwargs)
        with self._timed("forward"):
            return module(*args, **kwargs)

    def get_pld_theta(self) -> float | None:
        """Progressive layer drop's `pld_theta` for the next training forward (DeepSpeed
        0.17.6's; minispeed.engine.legacy); None when the section is off."""
        arguments = self.forward_arguments
        if arguments is None or not arguments.layer_drop.enabled:
            return None
        return arguments.layer_drop.theta_at(self.global_steps)

    @property
    def curriculum_scheduler_legacy(self) -> ForwardArguments:
        """The legacy seqlen curriculum's scheduler (DeepSpeed 0.17.6's attribute, present only
        with `curriculum_learning` enabled): `set_custom_get_difficulty(fn)`,
        `get_current_difficulty()` (minispeed.engine.legacy)."""
        arguments = self.forward_arguments
        if arguments is None or arguments.schedule is None:
            raise AttributeError(
                "curriculum_scheduler_legacy exists with the curriculum_learning section enabled"
            )
        return arguments

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of `loss`, scaled for fp16 and (unless `scale_wrt_gas=False`: the caller
        divided it, as the Trainer does) by `1 / gradient_accumulation_steps`; returns the loss
        so divided, as DeepSpeed's. `retain_graph=True` is refused (the optimizer's hooks
        consume each gradient once)."""
        opt = self.optimizer
        if opt is None:
            opt = self._require_optimizer("backward")  # raises
        if self._parked is not None:
            self._refuse_parked("backward")
        if retain_graph:
            raise NotImplementedError(
                "engine.backward(retain_graph=True) is not supported by minispeed: its gradient "
                "hooks take each parameter's gradient once per backward; call "
                "engine.backward(loss)"
            )
        # Note [DeepSpeed's sequence-parallel reduction] in sequence_groups.py
        summed = loss * self._sequence_factor if self._sequence_factor != 1 else loss
        # The engine's count decides the window's end, as DeepSpeed's (set_train_batch_size may
        # change the accumulation steps at any micro-step: surface.py).
        ends = self.is_gradient_accumulation_boundary()
        if not self.config.wall_clock_breakdown:  # no dict of arguments built per call
            opt.backward(summed, ends=ends, divided=not scale_wrt_gas)
        else:
            with self._timed("backward"):
                opt.backward(summed, ends=ends, divided=not scale_wrt_gas)
        # DeepSpeed's return value: the loss as its backward ran on it (after the graph is freed).
        return loss / self.config.gradient_accumulation_steps if scale_wrt_gas else loss

    @property
    def sequence_parallel_size(self) -> int:
        """S, the ranks splitting each sequence (DeepSpeed's attribute; 1: none)."""
        return self.config.sequence_parallel_size or 1

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step (the next `step()`) ends an accumulation window: the
        value `set_gradient_accumulation_boundary` set, else every
        `gradient_accumulation_steps`-th micro-step."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the coming micro-steps end their accumulation window (DeepSpeed's
        override, which accelerate sets before every backward: it ends an epoch's last, short
        window early). Holds until set again; the loss is still divided by
        `gradient_accumulation_steps`, as DeepSpeed divides it."""
        if not isinstance(is_boundary, bool):
            raise TypeError(
                f"set_gradient_accumulation_boundary takes a bool, got {type(is_boundary).__name__}"
            )
        self._boundary = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """DeepSpeed's context for micro-steps whose gradients are not reduced yet: stages 0 and
        1 reduce only at a window's end already, so it checks and changes nothing; stages 2 and 3
        reduce every micro-step's gradients into partitions, which DeepSpeed refuses too, and so
        does `step()` inside it."""
        stage = self.config.zero.stage
        if stage >= 2:
            raise RuntimeError(
                f"engine.no_sync() cannot be used at ZeRO stage {stage}: its gradients are "
                "partitioned as they are reduced, every micro-step (DeepSpeed refuses it too); "
                "use gradient_accumulation_steps instead"
            )
        if self._no_sync:
            raise RuntimeError("engine.no_sync() is already active: it cannot be nested")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """Call after every `backward`; acts at accumulation boundaries only."""
        opt = self.optimizer
        if opt is None:
            opt = self._require_optimizer("step")  # raises
        if self._parked is not None:
            self._refuse_parked("step")
        if self._no_sync:
            raise RuntimeError(
                "engine.step() inside engine.no_sync(): leave the context first (DeepSpeed "
                "refuses it too)"
            )
        boundary = opt.at_boundary
        if not self.config.wall_clock_breakdown:
            stepped = opt.step()
        else:
            with self._timed("step"):
                stepped = opt.step()
        # The counters are plain ints: bumped in the instance dict, past nn.Module.__setattr__
        # (its parameter/buffer/module checks are ~17 builtin calls per assignment).
        counters = self.__dict__
        counters["micro_steps"] += 1
        if boundary:
            self._end_of_step(bool(stepped), lr_kwargs)

    def _start_profile(self) -> None:
        """Open the step profiler's context for this step (it profiles only the configured one):
        at the step's first forward, or when a pipeline's `train_batch` starts."""
        assert self._step_profiler is not None
        self._stack.enter_context(self._step_profiler.step(self.global_steps))
        self._profiling = True

    def _end_of_step(
        self,
        stepped: bool,
        lr_kwargs: Mapping[str, Any] | None = None,
        loss: float | None = None,
    ) -> None:
        """An accumulation boundary, after the optimizer's step (`stepped`: it was applied; False
        after an fp16 overflow): the scheduler, the counters, the profiled step's report, the
        comms logger's step mark, `steps_per_print`'s line (with the step's `loss`, when the
        engine knows it: a pipeline's) and the step observers."""
        counters = self.__dict__  # plain values, past nn.Module.__setattr__ (see step)
        counters["_step_applied"] = stepped
        if stepped:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            counters["skipped_steps"] += (
                1  # fp16 overflow: DeepSpeed counts the step, skips the scheduler
            )
        counters["global_steps"] += 1
        counters["global_samples"] += self.config.train_batch_size
        if self._profiling:  # this was the profiled step: closing the stack reports it
            self._stack.close()
            self._profiling = False
        if self.comms_logger is not None:
            self.comms_logger.mark_step()
        if self._monitoring:
            self._write_monitor()
        self._report(loss)
        if self._monitoring:
            self._timers_at_boundary = self._timer_totals()
        for observer in self._observers:
            observer.on_boundary(self)

    def _write_monitor(self) -> None:
        """The boundary's monitor events, as DeepSpeed 0.19.8's engine writes them: the
        learning rate and (fp16) the loss scale, then, under `wall_clock_breakdown` or the
        flops profiler, the window's timers in ms (a pipeline's `train_batch` writes no
        timers, as DeepSpeed's)."""
        samples = self.global_samples
        lr = self.get_lr()[0]
        self.monitor.write_events(monitors.step_events(lr, self._loss_scale(), samples))
        config = self.config
        if self._writes_timers and (config.wall_clock_breakdown or config.flops_profiler.enabled):
            last = self._timers_at_boundary
            window = {k: (v - last.get(k, 0.0)) * 1e3 for k, v in self._timer_totals().items()}
            # The backward timer holds the reduction at its end; DeepSpeed's "inner" is without.
            window["backward_inner"] = window["backward"] - window["backward_allreduce"]
            self.monitor.write_events(monitors.timer_events(window, samples))

    def _timer_totals(self) -> dict[str, float]:
        """The timers' seconds, with the optimizer's end-of-backward reduction as
        `backward_allreduce` (timed under `wall_clock_breakdown`)."""
        reduced = self._reduce_timer.seconds if self._reduce_timer is not None else 0.0
        return {**self.timers, "backward_allreduce": reduced}

    _writes_timers = True  # the pipeline engine's train_batch writes none (DeepSpeed's)

    def _loss_scale(self) -> float | None:
        """The fp16 loss scale (None unless training in fp16)."""
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if self.config.precision.param_dtype != torch.float16 or scaler is None:
            return None
        return scaler.scale

    def _require_optimizer(self, what: str) -> zero.ZeroOptimizer:
        if self.optimizer is None:
            raise RuntimeError(
                f"engine.{what}() needs an optimizer: pass optimizer= to initialize() or give an "
                f'"optimizer" section in the config'
            )
        return self.optimizer

    @contextlib.contextmanager
    def _timed(self, name: str) -> Any:
        if not self.config.wall_clock_breakdown:
            yield
            return
        acc = get_accelerator()
        acc.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            acc.synchronize()
            self.timers[name] += time.perf_counter() - start

    def _report(self, loss: float | None) -> None:
        """`steps_per_print`: every that many optimizer steps, one line on rank 0 with what
        DeepSpeed 0.19.8 prints then (its `_report_progress` and `ThroughputTimer` lines, and a
        pipeline's loss line): the step, skipped steps, learning rates, momenta, the loss (a
        pipeline's), the fp16 loss scale, samples per second over the last steps and on
        average since step 2 (DeepSpeed's timer skips the first two as warm-up), time per step
        and the accelerator's memory (CPU: the process's resident set), then the timers under
        `wall_clock_breakdown`."""
        now = time.perf_counter()
        if self.global_steps == _WARM_UP_STEPS:
            self._warm_since = now
        every = self.config.steps_per_print
        if not every or self.global_steps % every or comm.get_rank() != 0:
            return
        lr = ", ".join(f"{x:.6g}" for x in self.get_lr())
        line = f"step={self.global_steps}, skipped={self.skipped_steps}, lr=[{lr}]"
        line += f", mom={self.get_mom()}"
        if loss is not None:
            line += f", loss={loss:.4f}"
        scale = self._loss_scale()
        if scale is not None:
            line += f", loss_scale={scale:g}"
        elapsed = now - self._step_started
        batch = self.config.train_batch_size
        line += f", {batch * every / elapsed:.1f} samples/s"
        if self._warm_since is not None and self.global_steps > _WARM_UP_STEPS:
            warm = (self.global_steps - _WARM_UP_STEPS) * batch / (now - self._warm_since)
            line += f" (running avg {warm:.1f})"
        line += f", {elapsed / every * 1e3:.1f} ms/step"
        acc = get_accelerator()
        line += (
            f", memory {acc.memory_allocated() / 2**30:.2f} GiB "
            f"(peak {acc.max_memory_allocated() / 2**30:.2f} GiB)"
        )
        if self.config.wall_clock_breakdown:
            parts = ", ".join(f"{k}={v / every * 1e3:.1f} ms" for k, v in self.timers.items())
            line += f" ({parts})"
            self.timers = dict.fromkeys(self.timers, 0.0)
        self._step_started = time.perf_counter()
        _log.info(line)

    # -- what DeepSpeed's engine answers ----------------------------------------------------------
    def train(self, mode: bool = True) -> Engine:
        """Set the module's training mode (returns the engine)."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """Set the module to evaluation mode (returns the engine)."""
        return self.train(False)

    def was_step_applied(self) -> bool:
        """Whether the last accumulation boundary stepped the optimizer (`False` after an fp16
        overflow skipped it, and before the first boundary), as DeepSpeed's."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        opt = self.optimizer
        groups = opt.param_groups if opt is not None and hasattr(opt, "param_groups") else []
        if not groups and opt is not None:
            groups = opt.optimizer.param_groups
        return [float(g["lr"]) for g in groups]

    def get_mom(self) -> list[Any]:
        """The momentum of each param group: Adam's `betas`, else SGD's `momentum` (DeepSpeed's
        `get_mom`; None for a group with neither)."""
        opt = self.optimizer
        groups = opt.param_groups if opt is not None and hasattr(opt, "param_groups") else []
        if not groups and opt is not None:
            groups = opt.optimizer.param_groups
        return [g.get("betas", g.get("momentum")) for g in groups]

    def get_global_grad_norm(self) -> float | None:
        """The L2 norm of all gradients before clipping at the last step, over every rank.

        As DeepSpeed's: computed at every step whether or not `gradient_clipping` is on, except
        for fp32 at ZeRO stage 0 without clipping (DeepSpeed steps the torch optimizer itself
        there, `None`); `None` before the first step. Note [the norm without clipping].
        """
        return None if self.optimizer is None else self.optimizer.global_grad_norm

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3)."""
        return self.config.zero.stage

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward."""
        return self.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.gradient_accumulation_steps

    def zero_grad(self) -> None:
        """Drop accumulated gradients (`step` already does at each boundary)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def describe(self) -> str:
        """What `initialize` did to the model, step by step as it ran: the grid and its groups,
        the modules split or replaced, the hooks each step installed and on which modules, the
        parameters partitioned (bytes per rank), the optimizer and scheduler and the keys that
        chose them, what is offloaded where (composition.py). This rank's view."""
        return self.composition.text()

    # -- checkpoints (the calls: checkpoint/calls.py) ---------------------------------------------
    def _save_part(
        self,
        save_dir: str | os.PathLike,
        tag: str,
        client: dict[str, Any],
        save_latest: bool,
        exclude_frozen: bool = False,
    ) -> None:
        """The files are `zero.save_checkpoint`'s, one per data-parallel rank, in one directory
        per pipeline stage and expert rank (`minispeed.engine.checkpoint`); the counters and the
        scheduler travel in zero's client state."""
        self._require_optimizer("save_checkpoint")
        state = {
            _ENGINE_STATE: {
                "global_steps": self.global_steps,
                "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps,
                "micro_steps": self.micro_steps,
                "lr_scheduler": _state_of(self.lr_scheduler),
                "train_batch_size": self.config.train_batch_size,
            },
            "client": client,
        }
        ckpt_async.checkpointer_of(self).save(
            self._part(state, exclude_frozen), save_dir, tag, save_latest=save_latest
        )

    def _part(self, payload: dict[str, Any], exclude_frozen: bool = False) -> ckpt.Part:
        """This rank's part of the grid's checkpoint (`checkpoint/grid.py`)."""
        opt = self._require_optimizer("save_checkpoint")
        place = ckpt_async.place_of(self)
        return ckpt.Part(place, self.module, opt, payload, self._partition(), exclude_frozen)

    def _partition(self) -> list[int] | None:
        """The layer boundaries a checkpoint must be loaded with (a pipeline's; None here)."""
        return None

    def _load_part(
        self, load_dir: str | os.PathLike, tag: str | None, restore: Restore
    ) -> tuple[Path, dict[str, Any] | None]:
        """Zero's files, then the counters and the scheduler as `restore` says."""
        self._require_optimizer("load_checkpoint")
        saver = ckpt_async.checkpointer_of(self)
        tag_dir, saved = saver.load(
            self._part({}), load_dir, tag, load_optimizer_states=restore.optimizer,
            strict=restore.strict,
        )  # fmt: skip
        saved = dict(saved or {})
        ours = saved.get(_ENGINE_STATE)
        client = saved.get("client", saved) if ours is not None else saved
        if ours is not None and restore.counters:
            self.global_steps = ours["global_steps"]
            self.global_samples = ours["global_samples"]
            self.skipped_steps = ours["skipped_steps"]
            self.micro_steps = ours["micro_steps"]
            if restore.scheduler and self.lr_scheduler is not None:
                if ours["lr_scheduler"] is None:
                    raise ValueError(
                        "this checkpoint holds no scheduler state but the engine has a scheduler; "
                        "pass load_lr_scheduler_states=False to keep the scheduler as built"
                    )
                self.lr_scheduler.load_state_dict(ours["lr_scheduler"])
        return Path(tag_dir), client

    def save_16bit_model(
        self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin"
    ) -> bool:
        """Write the model's weights in their training dtype as one `state_dict` file (rank 0).
        At stage 3 without `stage3_gather_16bit_weights_on_model_save` nothing is written and it
        returns False, as DeepSpeed's (with a warning naming the key)."""
        opt = self._require_optimizer("save_16bit_model")
        if self.config.zero.stage == 3 and not self.zero_gather_16bit_weights_on_model_save():
            warn_once(
                f"save_16bit_model did not save the model in {os.fspath(save_dir)!r}: at stage 3 it "
                "gathers the whole model, which needs "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save = true (as in "
                "DeepSpeed, it returns False); or save_checkpoint and `minispeed consolidate`"
            )
            return False
        axes = () if self.grid is None else self.grid.topology.axes
        if "tensor" in axes or "pipe" in axes:
            raise NotImplementedError(
                "save_16bit_model under tensor or pipeline parallelism is not implemented: rank "
                "0 holds its slices (its stage) only. Use save_checkpoint (it loads at any "
                "tensor-parallel size, 1 included, then save_16bit_model from the unsplit engine)"
            )
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        zero.save_16bit_model(opt, self.module, save_dir, save_filename)
        return True

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The model's `state_dict` with whole parameters in their training dtype, on global rank
        0 (None elsewhere), as DeepSpeed's (accelerate and the Trainer call it for `save_model`
        under ZeRO-3); `exclude_frozen_parameters` leaves out those without `requires_grad`.
        Collective: `zero.full_state_dict` (one all-gather per module). As DeepSpeed's, it
        needs stage 3 and not `stage3_gather_16bit_weights_on_model_save`: that key gates the
        callers (accelerate's `get_state_dict`, `save_16bit_model`), while the Trainer calls
        this directly to save a PEFT adapter."""
        if self.config.zero.stage != 3:
            raise ValueError(
                "_zero3_consolidated_16bit_state_dict needs ZeRO stage 3 (as DeepSpeed's); at "
                f"stage {self.config.zero.stage} every rank holds whole parameters: use "
                "engine.module.state_dict()"
            )
        state = zero.full_state_dict(self.module, rank0_only=True)
        if comm.get_rank() != 0:
            return None
        return self._trainable_only(state) if exclude_frozen_parameters else state

    def _trainable_only(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` without the model's frozen parameters (`exclude_frozen_parameters`)."""
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        return {k: v for k, v in state.items() if k not in frozen}

    def _consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor]:
        """DeepSpeed's gather of a tensor-parallel model (accelerate's `get_state_dict`, so the
        Trainer's `save_model`, under `tensor_parallel.autotp_size` > 1): the unsplit model's
        `state_dict`, in its training dtype, on every rank. Collective over the tensor group:
        one all-gather of each split parameter's whole bytes
        (`minispeed.tensor_parallel.unshard_state_dict`). Refused with a pipeline, or with ZeRO-3
        partitioning the slices (save_checkpoint loads at any tensor-parallel size there)."""
        axes = () if self.grid is None else self.grid.topology.axes
        if "tensor" not in axes or "pipe" in axes or self.config.zero.stage == 3:
            raise NotImplementedError(
                "_consolidated_16bit_state_dict gathers a tensor-parallel model at ZeRO stage 0-2 "
                f"without a pipeline (this engine: grid axes {axes}, ZeRO stage "
                f"{self.config.zero.stage}): use save_checkpoint (it loads at any tensor-parallel "
                "size, 1 included) and `minispeed consolidate`"
            )
        import minispeed.tensor_parallel as tensor_parallel

        group = tensor_parallel.TensorGroup.of(self.grid)
        state = tensor_parallel.unshard_state_dict(self.module, group)
        return self._trainable_only(state) if exclude_frozen_parameters else state

    # -- parking the states between phases (RLHF: generation needs the device) ------------------
    def offload_states(
        self,
        include: Any = None,
        device: Any = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """DeepSpeed's `offload_states`: move the kinds of training state named by `include`
        (DeepSpeed's `OffloadStateTypeEnum` members or their names; all when `None`) to host
        memory and free their device memory, until `reload_states()`. Call between steps.

        What moves, and what it costs (`B` bytes of those states: copied to the host, freed on
        the device; the host buffers are kept for the next call): `minispeed.zero.parking`.
        States already in host memory (an offloaded optimizer's, or everything on a CPU-only
        machine) stay where they are. Until `reload_states()`, `forward`, `backward` and `step`
        raise, naming the fix."""
        from minispeed.zero import parking

        opt = self._require_optimizer("offload_states")
        where = str(getattr(device, "value", device))
        if where == "none":
            warn_once(_log, "offload_states(device='none'): nothing is moved")
            return
        if where != "cpu":
            raise ValueError(
                f"offload_states(device={where!r}): states can be moved to the 'cpu' only "
                "(DeepSpeed refuses NVMe here too)"
            )
        if self.config.zero.offload_param is not None:
            raise RuntimeError(
                "offload_states() with zero_optimization.offload_param set: the parameters "
                "already live on the host; DeepSpeed refuses this combination too"
            )
        kinds = parking.KINDS if include is None else [str(getattr(k, "value", k)) for k in include]
        # First what a pass left gathered, released as stage 3 releases it: parked, its full
        # buffer would come back on reload while the parameter reads as released.
        parking.release_gathered(opt)
        parked = self._parked
        taken = set(parked.slots) if parked is not None else set()
        more = parking.park(
            opt,
            self.module,
            [k for k in kinds if k not in taken],
            pin_memory=pin_memory,
            non_blocking=non_blocking,
            reuse=self._park_buffers,
        )
        if parked is not None:
            more.slots.update(parked.slots)
        self._parked, self._park_buffers = more, None

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's `reload_states`: give back every state `offload_states` moved, byte for
        byte (`B` bytes allocated on the device and copied back); a no-op when none is."""
        from minispeed.zero import parking

        parked, self._parked = self._parked, None
        if parked is not None:
            parking.unpark(parked, non_blocking=non_blocking)
            self._park_buffers = parked

    def empty_partition_cache(self) -> None:
        """DeepSpeed's `empty_partition_cache`: at stage 3, release every gathered parameter that
        no module holds and that is not persistent (between passes there is normally none);
        then collect garbage and empty the device allocator's cache."""
        from minispeed.zero import parking

        for opt in (self.optimizer, self.forward_only_zero):
            if opt is not None and not opt.closed and hasattr(opt, "strategy"):
                parking.release_gathered(opt)

    def _refuse_parked(self, what: str) -> None:
        raise RuntimeError(
            f"engine.{what}() while the training states are offloaded by "
            "engine.offload_states(): call engine.reload_states() first"
        )

    def compile(
        self,
        backend: Any = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """DeepSpeed's `engine.compile` (accelerate calls it when a dynamo backend is set, as
        with the Trainer's `torch_compile=True`): `nn.Module.compile` of the model, as DeepSpeed
        does without deepcompile, at every ZeRO stage. Stages 0-2 hook the gradients (the hooks
        run as autograd accumulates each one, outside the compiled graphs); stage 3's module
        hooks, which gather and release each module's parameters, run eagerly between the
        graphs (`minispeed.core.compiling.eager`), so each module's forward is a graph of its
        own and stage 3 releases what it gathered as in eager mode. A second call does
        nothing. Refused with a deepcompile `schedule` and with compiled autograd (and on a
        pipeline: `PipelineEngine.compile`).
        """
        if self.is_compiled:
            return
        refusal = (
            "engine.compile(schedule=...) asks for deepcompile's schedules (ds_config "
            "`compile.deepcompile`), which minispeed does not provide"
            if schedule is not None
            else "engine.compile(compiled_autograd_enabled=True) would have compiled autograd "
            "trace ZeRO's gradient hooks"
            if compiled_autograd_enabled
            else None
        )
        if refusal is not None:
            raise NotImplementedError(
                f"engine.compile() is not supported here by minispeed: {refusal}; call "
                "engine.compile() without it, or turn torch.compile off "
                "(TrainingArguments(torch_compile=False), or no dynamo backend in accelerate's "
                "config)"
            )
        kwargs = {k: v for k, v in (compile_kwargs or {}).items() if k != "backend"}
        self.module.compile(backend=backend or "inductor", **kwargs)
        self._compiled = True

    def destroy(self) -> None:
        """Stop the comms logger and release the model's hooks (the model stays usable)."""
        self._stack.close()
        if self.comms_logger is not None:
            self.comms_logger.__exit__(None, None, None)
        if self._reduce_timer is not None:
            self._reduce_timer.close()
        self.monitor.close()
        for opt in (self.optimizer, self.forward_only_zero):
            if opt is not None and not opt.closed:
                opt.close()


# Note [the norm without clipping]
# DeepSpeed 0.19.8's engine answers `get_global_grad_norm()` with its optimizer's
# `_global_grad_norm` (runtime/engine.py:3518). Its ZeRO 1-2 optimizer computes it at every
# step unless `zero_optimization.compute_grad_norm` is false (stage_1_and_2.py:3033-3071), as
# do stage 3 (stage3.py:2897) and the 16-bit wrappers of stage 0 (bf16_optimizer.py:400,
# fp16/fused_optimizer.py:340); fp32 at stage 0 steps the torch optimizer itself, which has
# none, so the answer is `None` there even with clipping (recorded in
# tests/engine/fixtures/ds_engine_answers.json); there minispeed gives the norm it clipped by,
# and `None` without clipping. `ZeroOptimizer` computes the norm only to clip, so with
# `gradient_clipping` 0 elsewhere the engine hands it an infinite threshold, which
# `ZeroOptimizer` reads as "the norm only": the norm is computed (a read of the gradients and,
# under partitioned gradients, one 4-byte all-reduce per step) and the gradients are left as
# they are, overflowed ones included, as DeepSpeed leaves them. 1-bit Adam (no DeepSpeed
# reference since 0.19) keeps its configuration.


def zero_config_for(config: EngineConfig, optimizer: Any) -> zero.ZeroConfig:
    """The `ZeroConfig` `initialize` shards with: `config.zero`, with an infinite clipping
    threshold where clipping is off and DeepSpeed computes the norm anyway (Note [the norm
    without clipping])."""
    if (
        config.zero.max_grad_norm > 0
        or (config.zero.stage == 0 and config.precision.param_dtype == torch.float32)
        or isinstance(optimizer, comm.optim.CompressedMomentumOptimizer)
    ):
        return config.zero
    return dataclasses.replace(config.zero, max_grad_norm=math.inf)


def _state_of(scheduler: Any) -> Any:
    return (
        scheduler.state_dict()
        if scheduler is not None and hasattr(scheduler, "state_dict")
        else None
    )


def to_half(value: Any) -> Any:
    """`value` with every floating-point tensor in it (tuples, lists, dicts) cast to fp16:
    `fp16.auto_cast`'s input cast."""
    return map_tensors(value, lambda t: t.half() if t.is_floating_point() else t)


def _to_device(value: Any, device: torch.device) -> Any:
    """Move every tensor inside `value` (tuples, lists, dicts) to `device`; `value` itself when
    nothing in it moves (the usual call: tensors already there, checked without copying)."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple | list):
        for v in value:
            if not (isinstance(v, torch.Tensor) and v.device == device):
                break
        else:
            return value
        moved = [_to_device(v, device) for v in value]
        return type(value)(moved) if not hasattr(value, "_fields") else type(value)(*moved)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device)) for k, v in value.items())
    return value
