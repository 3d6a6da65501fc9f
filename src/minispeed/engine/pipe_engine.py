"""DeepSpeed's `PipelineEngine`: `train_batch(data_iter)` / `eval_batch(data_iter)` over
`minispeed.pipeline.PipelineExecutor`.

```python
model = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, seed_layers=True)
engine = PipelineEngine(model, torch.optim.AdamW(model.parameters()), ds_config)  # or an EngineConfig
loss = engine.train_batch(iter(loader))   # pulls gradient_accumulation_steps micro-batches
```

What the engine adds to the executor, each as DeepSpeed's pipeline engine does it:

- **The batch triple**: `train_batch_size = train_micro_batch_size_per_gpu ×
  gradient_accumulation_steps × D` (D = data-parallel size = world / stages), any two given,
  the third derived (DeepSpeed's `_set_batch_related_parameters`); one step runs
  `gradient_accumulation_steps` micro-batches.
- **Pulling the data**: `data_iter` yields `(inputs, labels)` per micro-batch; the first stage
  reads the inputs, the last the labels, the others nothing (each stage iterates its own
  `data_iter`, as under DeepSpeed). The micro-batches are concatenated and handed to the
  executor, which splits them back: one copy of the step's inputs (and labels), and every
  micro-batch must have the same size. Before the schedule starts, all ranks agree (one
  scalar all-reduce over the world) that every stage got its data, so an exhausted or bad
  iterator raises on every rank instead of leaving the others blocked in a receive.
- **Equal replicas**: the parameters and buffers are broadcast from the first rank of each
  data-parallel group when the engine is built (DeepSpeed's `_broadcast_model`).
- **Gradient clipping** (`gradient_clipping`): by the 2-norm of the whole model's gradient,
  summed over every stage (a tied parameter counted once, on the lowest stage holding it), the
  norm the unsplit model would have; `g ← g · min(1, max_norm / (norm + 1e-6))` as in
  DeepSpeed's `clip_grad_norm_`. Cost: one scalar all-reduce over the pipe group per step.
  Different from DeepSpeed 0.19.8 on purpose: its pipeline counts a parameter only where
  `mpu.get_model_parallel_rank() == 0`, and the pipeline grid's model-parallel rank is the
  stage id, so it clips every stage by the norm of stage 0's gradients alone.
- **The schedule**: 1F1B, or GPipe when there are fewer micro-batches than stages (DeepSpeed
  runs its 1F1B there; the package's needs M ≥ P; same work, same numbers); minispeed's
  `pipeline.schedule` key picks another.
- **The scheduler** steps after each optimizer step.
- **ZeRO stages 1 and 2** (`zero_optimization.stage`, the section's other keys as for any
  model) shard the optimizer state (stage 2: and the gradients) over each stage's
  data-parallel group through `minispeed.zero.shard`; the executor then lets the optimizer
  reduce the gradients. The grid's pipe axis (and tensor axis, on a 3D grid: see
  `tensor_plan.model_parallel`) is handed to ZeRO as its model-parallel axes
  (`zero.ModelParallel`), so the gradient norm for `gradient_clipping` is the whole model's
  (summed over every stage, a tied parameter counted once, on its lowest stage), the fp16
  overflow verdict is the grid's (an overflow on one stage skips the step on all), and the
  gradients of tied layers are summed over their stages inside ZeRO's step, after its data
  reduction (Note [summing a shared gradient after the reduction] in
  `minispeed.zero.model_parallel`). Cost over ZeRO alone: two 4-byte all-reduces over the
  pipe group per step, and per tied parameter of W elements two all-reduces of W·4 bytes
  (data group, then its holders). DeepSpeed 0.19.8 refuses ZeRO-2 with pipelines. Stage 3 is
  refused: it gathers parameters around each layer's forward and backward, which a pipeline
  stage would have to do per micro-batch.
- **fp16 / bf16** (`fp16.enabled`, `bf16.enabled`, `data_types`): the stages' parameters,
  activations and the gradients sent between stages are 16-bit; ZeRO (stage 0 when the config
  asks for none) keeps the fp32 masters and fp16's dynamic loss scale, the same on every rank
  because the overflow verdict is the grid's. Inputs are passed as given (token ids need no
  cast; DeepSpeed's pipeline does not cast them either).

The loss returned by `train_batch` is the mean over the micro-batches and the data-parallel
replicas, on every rank, as a 0-dim float32 tensor (DeepSpeed's `agg_train_loss`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import minispeed.comm as comm
import minispeed.engine.checkpoint as ckpt
import minispeed.engine.checkpoint_async as ckpt_async
import minispeed.pipeline as pipeline
import minispeed.zero as zero
from minispeed.engine import tensor_plan
from minispeed.engine.checkpoint_calls import CheckpointCalls, Restore
from minispeed.engine.config import EngineConfig

__all__ = ["PipelineEngine", "PipelineError"]

# What a zero checkpoint holds already of `state_dict()` (the rest travels as the engine's state).
_ZERO_OWNED = ("module", "optimizer")


class PipelineError(Exception):
    """A call a pipeline engine does not take (DeepSpeed's `PipelineError`)."""


class _StepHook:
    """The optimizer the executor steps: clips (plain optimizers), steps, then steps the
    scheduler. Every other attribute is the wrapped optimizer's, so the executor sees a ZeRO
    optimizer's `backward`/`config` (see `minispeed.pipeline.sharded`)."""

    def __init__(self, engine: PipelineEngine, optimizer: Any) -> None:
        self._engine, self._optimizer = engine, optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def step(self) -> None:
        self._engine._before_step()
        self._optimizer.step()
        if self._engine.lr_scheduler is not None:
            self._engine.lr_scheduler.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)


class PipelineEngine(CheckpointCalls):
    """DeepSpeed's pipeline engine over `minispeed.pipeline` (see the module docstring).

    `module`: a `minispeed.engine.pipe.PipelineModule`. `optimizer`: a torch optimizer over
    `module.parameters()` (or None: `eval_batch` only). `config`: the `EngineConfig`
    `initialize` resolved, or a whole ds_config dict (resolved here with the module's grid;
    `gradient_clipping` left out is then 0, off, as before DeepSpeed's default reached the
    engine: `initialize` applies that default). Collective: every rank of the grid builds it
    with the same config.
    """

    def __init__(
        self,
        module: Any,
        optimizer: Any,
        config: EngineConfig | dict[str, Any],
        lr_scheduler: Any = None,
    ) -> None:
        if not isinstance(module, pipeline.PipelineModule) or module.grid is None:
            raise TypeError(
                "PipelineEngine needs a minispeed.engine.pipe.PipelineModule, got "
                f"{type(module).__name__}"
            )
        if isinstance(config, dict):
            config = EngineConfig.from_ds_config(
                {"gradient_clipping": 0.0, **config},
                data_parallel_size=module.grid.size("data"),
                pipeline_stages=module.stages,
            )
        if not isinstance(config, EngineConfig):
            raise TypeError(
                f"config must be an EngineConfig or the ds_config dict, got {type(config).__name__}"
            )
        if module.virtual_stages != 1:
            raise ValueError("PipelineEngine runs one chunk per stage (virtual_stages=1)")
        self.module, self.lr_scheduler, self.config = module, lr_scheduler, config
        self.grid = module.grid
        self.num_stages, self.stage_id = module.stages, module.stage
        self.dp_world_size = self.grid.size("data")
        tbs, mbs, gas = (
            config.train_batch_size,
            config.micro_batch_size,
            config.gradient_accumulation_steps,
        )
        self._train_batch_size, self._micro_batch_size, self.micro_batches = tbs, mbs, gas
        self._clip = config.zero.max_grad_norm
        # The `pipeline` section as EngineConfig read it, with the module's stage count.
        assert config.pipeline is not None and config.pipeline.stages == self.num_stages
        schedule = config.pipeline.schedule
        self._refuse_unsupported(config)
        self.zero_stage = config.zero.stage
        self.precision = config.precision
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._broadcast_model()
        self.client_optimizer = optimizer
        # 16-bit training needs ZeRO's masters and loss scale: its stage 0 when none is asked
        wrap = self.zero_stage or self.precision.param_dtype != torch.float32
        self.optimizer = self._wrap_zero(optimizer, config) if wrap else optimizer
        self.executor = pipeline.PipelineExecutor(
            module,
            None if optimizer is None else _StepHook(self, self.optimizer),
            micro_batches=gas,
            schedule=schedule,
        )
        self.global_steps, self.global_samples = 0, 0
        self.data_iterator: Iterator | None = None
        self._global_grad_norm: float | None = None
        self._counted: list[torch.nn.Parameter] | None = None  # see _before_step
        self.agg_train_loss: torch.Tensor | None = None

    # -- construction -----------------------------------------------------------------------------
    def _refuse_unsupported(self, config: EngineConfig) -> None:
        stage = config.zero.stage
        if stage >= 3:
            raise NotImplementedError(
                f"zero_optimization.stage={stage} with a pipeline: use stage 0, 1 or 2 (stage 3 "
                "gathers each layer's parameters around its forward and backward, per "
                "micro-batch in a pipeline; DeepSpeed refuses it with pipelines too)"
            )

    def _broadcast_model(self) -> None:
        """DeepSpeed's `_broadcast_model`: replicas start equal whatever each rank's seed."""
        if self.dp_world_size == 1:
            return
        src = self.grid.group_ranks("data")[0]
        group = self.grid.group("data")
        for t in [*self.module.parameters(), *self.module.buffers()]:
            comm.broadcast(t.data, src=src, group=group)

    def _wrap_zero(self, optimizer: Any, config: EngineConfig) -> Any:
        """`zero.shard` over the data group, with the pipe axis as ZeRO's model-parallel axis
        (module docstring)."""
        if optimizer is None:
            raise ValueError(
                f"zero_optimization.stage={self.zero_stage} or 16-bit training needs an optimizer"
            )
        zero_config = dataclasses.replace(
            config.zero,
            gradient_accumulation_steps=self.micro_batches,
            # Wrapped or not is where DeepSpeed computes the norm without clipping: an infinite
            # threshold computes it (Note [the norm without clipping] in engine.py).
            max_grad_norm=self._clip or math.inf,
        )
        model_parallel = tensor_plan.model_parallel(
            self.module, self.grid, self.module.tied_grad_groups()
        )
        return zero.shard(
            self.module,
            optimizer,
            zero_config,
            self.precision,
            group=self.grid.group("data"),
            model_parallel=model_parallel,
            allow_untested_optimizer=config.zero_allow_untested_optimizer,
        )

    # -- DeepSpeed's API --------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        """Whether this rank runs the first stage (reads the inputs)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (reads the labels, computes the loss)."""
        return self.stage_id == self.num_stages - 1

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel replicas."""
        return self._train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one replica."""
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per step."""
        return self.micro_batches

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the whole model (every stage) at the last step: under ZeRO or
        16-bit at every step, as DeepSpeed's; else when gradient clipping computed one."""
        if self.optimizer is not self.client_optimizer:  # ZeRO's
            return self.optimizer.global_grad_norm
        return self._global_grad_norm

    def train(self, mode: bool = True) -> PipelineEngine:
        """Set the module's training mode."""
        self.module.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        """Set the module to evaluation mode."""
        self.module.eval()
        return self

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0, 1 or 2)."""
        return self.zero_stage

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state, for the engine's checkpoint files (one per stage and
        data rank): the stage's parameters, the optimizer (its shard under ZeRO-1/2), the
        scheduler, the step counters, and the grid and cut it belongs to. The tensors are
        references (as torch's `state_dict`s are): save or copy them before training on."""
        return {
            "module": self.module.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "grid": self._grid_signature(),
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
    ) -> None:
        """Restore `state_dict()`'s output; raises, naming both, when it was saved by another
        stage, another data rank, another stage count or another layer cut."""
        if state.get("grid") != self._grid_signature():
            raise ValueError(
                f"this pipeline checkpoint was saved by {state.get('grid')} but this rank is "
                f"{self._grid_signature()}; load the file of this stage and data rank, saved "
                "with the same stages and partition"
            )
        self.module.load_state_dict(state["module"])
        if load_optimizer_states and self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"]:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]

    def _grid_signature(self) -> dict[str, Any]:
        return {
            "stage": self.stage_id,
            "stages": self.num_stages,
            "data_rank": self.grid.rank_in("data"),
            "data_size": self.dp_world_size,
            "tensor_rank": self.grid.rank_in("tensor")
            if "tensor" in self.grid.topology.axes
            else 0,
            "tensor_size": self.grid.size("tensor") if "tensor" in self.grid.topology.axes else 1,
            "parts": list(self.module.boundaries),
        }

    # -- checkpoints (the calls: checkpoint_calls.py) ---------------------------------------------
    def _save_part(
        self, save_dir: ckpt.PathLike, tag: str, client: dict[str, Any], save_latest: bool
    ) -> None:
        """Every stage into one directory (collective over the grid), as DeepSpeed's.

        Each stage is a part of the tag (`minispeed.engine.checkpoint`): under ZeRO-1 its data
        group's zero files, one per data rank; without ZeRO its data rank 0 writes
        `state_dict()` (the replicas are equal). `latest` moves when every stage is sealed.
        """
        if ckpt.is_sharded(self.optimizer):
            counters = {k: v for k, v in self.state_dict().items() if k not in _ZERO_OWNED}
            payload = {"engine": counters, "client": client}
        else:
            payload = {"engine": self.state_dict(), "client": client}
        saver = ckpt_async.checkpointer_of(self)
        saver.save(self._checkpoint_part(payload), save_dir, tag, save_latest=save_latest)

    def _load_part(
        self, load_dir: ckpt.PathLike, tag: str | None, restore: Restore
    ) -> tuple[Path, dict[str, Any] | None]:
        """Every stage's part; another data-parallel size loads, another stage count or layer
        partition is refused naming both grids."""
        saver = ckpt_async.checkpointer_of(self)
        tag_dir, saved = saver.load(
            self._checkpoint_part({}), load_dir, tag, load_optimizer_states=restore.optimizer
        )
        state = dict(saved["engine"], grid=self._grid_signature())
        if ckpt.is_sharded(self.optimizer):  # zero restored both: reload what it put there
            state["module"], state["optimizer"] = self.module.state_dict(), None
        if restore.counters:
            self.load_state_dict(state, restore.optimizer, restore.scheduler)
        elif state["module"] is not None:
            self.module.load_state_dict(state["module"])
        return Path(tag_dir), saved["client"]

    def _checkpoint_part(self, payload: dict[str, Any]) -> Any:
        return ckpt.Part(
            ckpt_async.place_of(self),
            self.module,
            self.optimizer,
            self.grid.group("data"),
            payload,
            partition=list(self.module.boundaries),
        )

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator `train_batch()` reads when given none."""
        self.data_iterator = iterator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    __call__ = forward

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
        if self.executor.optimizer is None:
            raise ValueError("train_batch needs an optimizer; build the engine with one")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        inputs, labels = self._pull(self.data_iterator, self.micro_batches)
        loss = self.executor.train_batch(inputs, labels)
        self.global_steps += 1
        self.global_samples += self._train_batch_size
        self.agg_train_loss = torch.tensor(loss, dtype=torch.float32)
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
        """Forward `gradient_accumulation_steps` micro-batches without gradients; returns the
        mean loss on every rank, and with `return_logits` also the last micro-batch's model
        output on the last stage (None elsewhere), as DeepSpeed does."""
        if not compute_loss or reduce_output != "avg" or not bcast_loss:
            raise NotImplementedError(
                "eval_batch supports compute_loss=True, reduce_output='avg', bcast_loss=True "
                "(DeepSpeed's defaults) only"
            )
        if num_micro_batches not in (None, self.micro_batches):
            raise NotImplementedError(
                f"eval_batch(num_micro_batches={num_micro_batches}): minispeed evaluates "
                f"gradient_accumulation_steps={self.micro_batches} micro-batches; leave it unset"
            )
        self.module.eval()
        inputs, labels = self._pull(data_iter, self.micro_batches)
        captured: list[Any] = []
        loss_fn = self.module.loss_fn
        if return_logits and self.is_last_stage() and loss_fn is not None:

            def keep_outputs(outputs: Any, lab: Any) -> Any:
                captured[:] = [outputs]
                return loss_fn(outputs, lab)

            self.module.loss_fn = keep_outputs
        try:
            loss = torch.tensor(self.executor.eval_batch(inputs, labels), dtype=torch.float32)
        finally:
            self.module.loss_fn = loss_fn
        if return_logits:
            return loss, (captured[0] if captured else None)
        return loss

    # -- internals --------------------------------------------------------------------------------
    def _pull(self, data_iter: Iterator | None, m: int) -> tuple[Any, Any]:
        """The step's inputs (first stage) and labels (last stage), each the concatenation of
        `m` micro-batches; every rank raises if any stage failed to read (see module docstring)."""
        inputs = labels = None
        error: Exception | None = None
        if self.is_first_stage() or self.is_last_stage():
            try:
                if data_iter is None:
                    raise ValueError(
                        "train_batch/eval_batch need a data iterator yielding (inputs, labels)"
                    )
                batches = [next(data_iter) for _ in range(m)]
                for b in batches:
                    if not isinstance(b, (tuple, list)) or len(b) != 2:
                        raise TypeError(
                            "each micro-batch from data_iter must be a pair (inputs, labels), "
                            f"got {type(b).__name__}"
                        )
                if self.is_first_stage():
                    inputs = _concat([b[0] for b in batches], "inputs", self.device)
                if self.is_last_stage():
                    labels = _concat([b[1] for b in batches], "labels", self.device)
            except Exception as exc:  # agreed below, then raised on every rank
                error = exc
        failed = torch.tensor([0.0 if error is None else float(comm.get_rank() + 1)])
        comm.all_reduce(failed, op=comm.ReduceOp.MAX)
        if error is not None:
            raise error
        if failed.item():
            raise pipeline.PipelineAbortedError(
                f"rank {int(failed.item()) - 1} could not read its micro-batches from data_iter; "
                "no rank ran the batch"
            )
        return inputs, labels

    def _before_step(self) -> None:
        if self._clip <= 0 or self.optimizer is not self.client_optimizer:  # ZeRO clips
            return
        # a tied copy above the lowest holding stage carries the same summed gradient, a
        # parameter replicated over the tensor group the same values: count each once
        if self._counted is None:  # fixed once the engine is built
            ties = self.module.tied_grad_groups()
            self._counted = tensor_plan.counted_params(self.module, self.grid, ties)
        axes = self.grid.topology.axes
        groups = [self.grid.group(a) for a in ("pipe", "tensor") if a in axes]
        self._global_grad_norm = _clip_pipeline_grads(
            self._counted, list(self.module.parameters()), self._clip, groups
        )


def _concat(parts: list[Any], what: str, device: torch.device) -> Any:
    first = parts[0]
    if isinstance(first, (tuple, list)):
        return tuple(
            _concat([p[i] for p in parts], f"{what}[{i}]", device) for i in range(len(first))
        )
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"{what} must be tensors or tuples of tensors, got {type(first).__name__}")
    sizes = {int(p.shape[0]) for p in parts}
    if len(sizes) != 1:
        raise ValueError(
            f"the micro-batches' {what} have batch sizes {sorted(sizes)}; a pipeline needs "
            "every micro-batch of a step to have the same size (train_micro_batch_size_per_gpu)"
        )
    return torch.cat([p.to(device) for p in parts], dim=0)


def _clip_pipeline_grads(
    counted: list[torch.nn.Parameter],
    params: list[torch.nn.Parameter],
    max_norm: float,
    groups: list[Any],
) -> float:
    """Clip `params`' gradients by the 2-norm of `counted`'s summed over `groups` (pipe, then
    tensor); returns the norm."""
    total = torch.zeros((), dtype=torch.float32)
    for p in counted:
        if p.grad is not None:
            total += p.grad.detach().float().norm(2).to(total.device) ** 2
    for group in groups:
        comm.all_reduce(total, group=group)
    norm = total.sqrt()
    clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(clip_coef.to(p.grad.device))
    return float(norm)
