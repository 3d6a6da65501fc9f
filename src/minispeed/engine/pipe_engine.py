"""DeepSpeed's `PipelineEngine`: the `Engine` of a `minispeed.pipeline.PipelineModule`, driving
its stage's `minispeed.pipeline.PipelineExecutor` with `train_batch(data_iter)` /
`eval_batch(data_iter)`.

```python
model = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, seed_layers=True)
engine, optimizer, _, _ = minispeed.engine.initialize(model=model, config=ds_config,
                                                      model_parameters=model.parameters())
loss = engine.train_batch(iter(loader))   # pulls gradient_accumulation_steps micro-batches
```

It is the same engine as any model's (`Engine`): one `EngineConfig`, the same counters and
queries, ZeRO's optimizer (stage 0 when the config asks for none), the same checkpoints, and
at the end of each `train_batch` the same boundary (`Engine._end_of_step`): the scheduler, the
counters, the FLOPs profile of the configured step, the comms logger's step, `steps_per_print`'s
line and the timers (`wall_clock_breakdown`: forward and backward are the sums of the
executor's compute passes, step the optimizer's). What it adds, each as DeepSpeed's pipeline
engine does it:

- **The batch triple**: `train_batch_size = train_micro_batch_size_per_gpu ×
  gradient_accumulation_steps × D` (D = data-parallel size = world / (stages · tensor)); one
  step runs `gradient_accumulation_steps` micro-batches.
- **Pulling the data** (`minispeed.pipeline.pull_batch`): `data_iter` yields `(inputs,
  labels)` per micro-batch; the first stage reads the inputs, the last the labels, the others
  nothing (each stage iterates its own `data_iter`, as under DeepSpeed); all ranks agree that
  every stage got its data before the schedule starts. `initialize(training_data=dataset)`
  instead gives the engine its own loader (in order over the data-parallel replicas,
  repeating), which `train_batch()` reads when given no iterator; `set_batch_fn(fn)` maps each
  micro-batch a stage reads.
- **Equal replicas**: the module's build broadcasts each stage's parameters and buffers from
  its first data-parallel replica (DeepSpeed's `_broadcast_model`).
- **Gradient clipping** (`gradient_clipping`) is ZeRO's, over `zero.ModelParallel`: by the
  2-norm of the whole model's gradient, summed over every stage (a tied parameter counted
  once, on the lowest stage holding it), the norm the unsplit model would have;
  `g ← g · min(1, max_norm / (norm + 1e-6))` as in DeepSpeed's `clip_grad_norm_`. Different
  from DeepSpeed 0.19.8 on purpose: its pipeline counts a parameter only where
  `mpu.get_model_parallel_rank() == 0`, and the pipeline grid's model-parallel rank is the
  stage id, so it clips every stage by the norm of stage 0's gradients alone.
- **The schedule**: 1F1B, or GPipe when there are fewer micro-batches than stages (DeepSpeed
  runs its 1F1B there; the package's needs M ≥ P; same work, same numbers); minispeed's
  `pipeline.schedule` key picks another.
- **ZeRO stages 0-2** shard over each stage's data-parallel group through `minispeed.zero.shard`;
  the executor lets the optimizer reduce the gradients. The grid's pipe axis (and tensor axis,
  on a 3D grid: see `grid.model_parallel`) is handed to ZeRO as its model-parallel axes, so
  the gradient norm is the whole model's, the fp16 overflow verdict is the grid's (an overflow
  on one stage skips the step on all), and the gradients of tied layers are summed over their
  stages inside ZeRO's step, after its data reduction (Note [summing a shared gradient after
  the reduction] in `minispeed.zero.model_parallel`). Cost over the data reduction: two 4-byte
  all-reduces over the pipe group per step, and per tied parameter of W elements two
  all-reduces of W·4 bytes (data group, then its holders). DeepSpeed 0.19.8 refuses ZeRO-2
  with pipelines. Stage 3 is refused: it gathers parameters around each layer's forward and
  backward, which a pipeline stage would have to do per micro-batch.
- **fp16 / bf16** (`fp16.enabled`, `bf16.enabled`, `data_types`): the stages' parameters,
  activations and the gradients sent between stages are 16-bit; ZeRO keeps the fp32 masters
  and fp16's dynamic loss scale, the same on every rank because the overflow verdict is the
  grid's. Inputs are passed as given (token ids need no cast; DeepSpeed's pipeline does not
  cast them either).

The loss returned by `train_batch` is the mean over the micro-batches and the data-parallel
replicas, on every rank, as a 0-dim float32 tensor (DeepSpeed's `agg_train_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

import minispeed.comm as comm
import minispeed.pipeline as pipeline
from minispeed.engine import steps
from minispeed.engine.composition import Composition
from minispeed.engine.config import EngineConfig
from minispeed.engine.engine import Engine, StepObserver, to_half
from minispeed.engine.surface import PIPE_DECLINED
from minispeed.profiler import monitor as monitors

__all__ = ["PipelineEngine", "PipelineError"]


class PipelineError(Exception):
    """A call a pipeline engine does not take (DeepSpeed's `PipelineError`)."""


class PipelineEngine(Engine):
    """The `Engine` of a pipeline stage (see the module docstring).

    Built by `initialize` for a `minispeed.pipeline.PipelineModule` (or DeepSpeed's adapter,
    `minispeed.engine.pipe.PipelineModule`, which is one). Also built directly as
    `PipelineEngine(module, optimizer, ds_config, lr_scheduler=None)`, with a torch optimizer
    (or None: `eval_batch` only) and the ds_config dict: it then runs the steps `initialize`
    runs from the optimizer on (`steps.py`). Collective: every rank of the grid builds it.
    """

    _declined = PIPE_DECLINED  # DeepSpeed's pipeline names minispeed declines (surface.py)
    _writes_timers = False  # DeepSpeed's train_batch writes no timer events to the monitors

    def __init__(
        self,
        module: pipeline.PipelineModule,
        optimizer: Any,
        config: EngineConfig | Mapping[str, Any],
        lr_scheduler: Any = None,
        *,
        executor: pipeline.PipelineExecutor | None = None,
        observers: Sequence[StepObserver] = (),
        composition: Composition | None = None,
    ) -> None:
        if not isinstance(module, pipeline.PipelineModule) or module.grid is None:
            raise TypeError(
                "PipelineEngine needs a minispeed.pipeline.PipelineModule (or DeepSpeed's "
                f"minispeed.engine.pipe.PipelineModule), got {type(module).__name__}"
            )
        if isinstance(config, Mapping):  # built directly: initialize's steps from the optimizer
            optimizer, config, executor, composition = _compose(module, optimizer, config)
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"config must be the ds_config dict, got {type(config).__name__}")
        if executor is None:
            raise TypeError("PipelineEngine(config=EngineConfig) needs the executor= it drives")
        super().__init__(
            module, optimizer, config, lr_scheduler, observers=observers, grid=module.grid,
            composition=composition,
        )  # fmt: skip
        self.executor = executor
        self.data_iterator: Iterator | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None

    # -- DeepSpeed's pipeline API -----------------------------------------------------------------
    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.module.stage

    @property
    def num_stages(self) -> int:
        """Pipeline stages P."""
        return self.module.stages

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step (`gradient_accumulation_steps`)."""
        return self.config.gradient_accumulation_steps

    def is_first_stage(self) -> bool:
        """Whether this rank runs the first stage (reads the inputs)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (reads the labels, computes the loss)."""
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage (`stage_id`)."""
        return self.stage_id

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the stages run from the pipeline's own schedule, not through one forward."""
        raise NotImplementedError(
            "engine.compile() is not supported by minispeed's pipeline engine: its stages run "
            "from the pipeline schedule; call torch.compile on the layers before building the "
            "PipelineModule, or turn torch.compile off"
        )

    def reset_activation_shape(self) -> None:
        """The activations' shapes change from the next batch on (e.g. a longer sequence): each
        link between stages negotiates its shapes again at its next message (one more message
        of the layout's size). Every rank calls it at the same point, as under DeepSpeed."""
        self.executor.messenger.forget_layouts()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Refused: a pipeline's schedule and its optimizer's window are built for the
        configured number of micro-batches."""
        raise NotImplementedError(
            "set_train_batch_size on a pipeline engine is not supported by minispeed: its "
            "schedule is built for gradient_accumulation_steps micro-batches; build a new engine "
            "with the new train_batch_size (or gradient_accumulation_steps)"
        )

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Refused, as `set_train_batch_size`."""
        raise NotImplementedError(
            "set_train_micro_batch_size on a pipeline engine is not supported by minispeed: "
            "build a new engine with the new train_micro_batch_size_per_gpu"
        )

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator `train_batch()` reads when given none."""
        self.data_iterator = iterator

    def set_dataloader(self, loader: Iterable) -> None:
        """The loader `train_batch()` reads when given no iterator (`initialize(training_data=)`
        sets its own): an iterator over it, on the first and last stages, which read data."""
        self.training_dataloader = loader
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """`fn(micro_batch)` replaces each micro-batch the first and last stages read, in
        `train_batch` and `eval_batch` (DeepSpeed's post-processing hook, e.g. to broadcast a
        batch or build the masks)."""
        self.batch_fn = fn

    def _pull(self, data_iter: Iterator | None, micro_batches: int) -> tuple[Any, Any]:
        """The step's inputs and labels from `data_iter`, each micro-batch through `batch_fn`."""
        if data_iter is not None and self.batch_fn is not None:
            data_iter = map(self.batch_fn, data_iter)
        inputs, labels = pipeline.pull_batch(data_iter, micro_batches, self.module)
        if self._half_inputs and inputs is not None:
            # fp16.auto_cast: DeepSpeed's pipeline runs each micro-batch's inputs through the
            # engine's forward, which casts them; the labels reach the loss as given.
            inputs = to_half(inputs)
        return inputs, labels

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches pulled from
        `data_iter` (or the iterator set before); returns the mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_batch() requires gradients enabled. Use eval_batch() instead."
            )
        if self.optimizer is None:
            raise ValueError("train_batch needs an optimizer; build the engine with one")
        if self._parked is not None:
            self._refuse_parked("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self._step_profiler is not None:
            self._start_profile()
        self.module.train()
        inputs, labels = self._pull(self.data_iterator, self.micro_batches)
        loss = self.executor.train_batch(inputs, labels)
        if self.config.wall_clock_breakdown:
            timeline = self.executor.timeline
            self.timers["forward"] += timeline.forward_s()
            self.timers["backward"] += timeline.busy_s() - timeline.forward_s()
            self.timers["step"] += self.executor.step_seconds
        self.micro_steps += self.micro_batches
        self.agg_train_loss = torch.tensor(loss, dtype=torch.float32)
        self._end_of_step(self.executor.step_result is not False, loss=loss)
        if self._monitoring:
            self.monitor.write_events(monitors.loss_event("train_loss", loss, self.global_samples))
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Iterator,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward `num_micro_batches` (default `gradient_accumulation_steps`) micro-batches
        from `data_iter` without gradients, as DeepSpeed's:

        - default: the mean loss, on every rank (`bcast_loss=False`: on the last stage, None
          elsewhere);
        - `compute_loss=False`: the model's outputs instead of losses (the loss function is not
          called), on the last stage only;
        - `reduce_output="avg"` averages over the micro-batches and the data-parallel replicas
          (one all-reduce of the output's size among the last stage's replicas); `None` returns
          the list of per-micro-batch values on the last stage;
        - `return_logits`: `(value, outputs)`, the last micro-batch's model output on the last
          stage (None elsewhere).
        """
        if reduce_output not in ("avg", None):
            raise ValueError(
                f"eval_batch(reduce_output={reduce_output!r}): DeepSpeed's reductions are 'avg' "
                "and None (the per-micro-batch values)"
            )
        if self._parked is not None:
            self._refuse_parked("eval_batch")
        n = self.micro_batches if num_micro_batches is None else num_micro_batches
        self.module.eval()
        inputs, labels = self._pull(data_iter, n)
        ex = self.executor
        last = self.module.stage == self.module.stages - 1
        if compute_loss and reduce_output == "avg":
            loss, outputs = ex.eval_batch(inputs, labels, return_outputs=True, micro_batches=n)
            value = torch.tensor(loss, dtype=torch.float32) if bcast_loss or last else None
            if self._monitoring:  # every rank knows the loss: DeepSpeed broadcasts it for this
                self.monitor.write_events(
                    monitors.loss_event("eval_loss", loss, self.global_samples)
                )
        else:
            each = ex.eval_outputs(inputs, labels, compute_loss=compute_loss, micro_batches=n)
            outputs = each[-1] if return_logits and each is not None else None
            value = each if reduce_output is None or each is None else self._average(each)
        return (value, outputs if last else None) if return_logits else value

    def _average(self, each: list[Any]) -> Any:
        """The mean over micro-batches, then over the last stage's data-parallel replicas."""
        first = each[0]
        if isinstance(first, torch.Tensor):
            group = self.module.grid.group("data")
            mean = sum(each) / (len(each) * comm.get_world_size(group))
            comm.all_reduce(mean, group=group)
            return mean
        return type(first)(self._average([e[k] for e in each]) for k in range(len(first)))

    def _partition(self) -> list[int] | None:
        """The layer cut a checkpoint of this pipeline must be loaded with."""
        return list(self.module.boundaries)


def _compose(
    module: pipeline.PipelineModule, optimizer: Any, ds: Mapping[str, Any]
) -> tuple[Any, EngineConfig, pipeline.PipelineExecutor, Composition]:
    """`initialize`'s steps for a pipeline built directly from a torch optimizer and a
    ds_config dict: the config, `zero.shard` over the stage's data group, the executor."""
    import minispeed.moe

    composition = Composition()
    grid = module.grid
    # Built directly, the engine clips only when `gradient_clipping` is given (initialize
    # applies DeepSpeed's default of 1.0: Note [DeepSpeed clips at 1.0 by default]).
    ds = {"gradient_clipping": 0.0, **ds}
    cfg = EngineConfig.from_ds_config(
        ds, data_parallel_size=grid.size("data"), pipeline_stages=module.stages
    )
    steps.record_config(composition, cfg, "PipelineEngine(config=...)")
    axes = grid.topology.axes
    shape = {a: grid.size(a) if a in axes else 1 for a in ("pipe", "data", "tensor")}
    steps.record_grid(composition, shape, grid)
    steps.check_pipeline(module, cfg, bool(minispeed.moe.moe_layers(module)))
    if optimizer is not None:
        with composition.step("optimizer", keys=("PipelineEngine(optimizer=...)",)) as step:
            step.did(f"{type(optimizer).__module__}.{type(optimizer).__name__}")
        optimizer = steps.shard(
            composition, module, optimizer, cfg, grid=grid, ties=module.tied_grad_groups()
        )
    return optimizer, cfg, steps.pipeline_executor(composition, module, optimizer, cfg), composition
