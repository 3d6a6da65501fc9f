"""Run a schedule: each instruction class maps to one method of `PipelineExecutor`.

```python
module = pipeline.partition(layers, stages=2, loss_fn=F.cross_entropy)
executor = pipeline.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1),
                                     micro_batches=4, schedule="1f1b")
loss = executor.train_batch(inputs, labels)   # every rank calls it; middle stages may pass None
```

Per batch the executor splits the batch into M micro-batches along dim 0, runs this stage's
program (`schedule.program(stage)`, checked by `checker.check` once, when the executor is built),
and returns the batch's mean loss on every rank. Gradients accumulate in `.grad` over the M
micro-batches (each micro-batch's loss is divided by M), so one step on a batch equals one step of
the unsplit model on the same batch.

State kept between instructions, per (micro-batch, chunk) key:
`_inputs` (the chunk's input tuple, leaves that require grad when they came from another stage),
`_outputs` (its output tuple, or the loss on the last virtual stage), `_out_grads` (received
gradients of the outputs), `_in_grads` (gradients of the inputs, to send), `_segments` / `_weight_work` (what a
zero-bubble weight pass needs, `split_backward.py`). A key is "in flight" from its forward until the pass that frees it
(Backward, or BackwardWeight); `peak_in_flight` counts them: the activation memory of the schedule
in micro-batches (asserted against `costs.in_flight_bound`).

Errors (see Note [every rank reaches the agreement] in `status.py`): an exception while running
a program is passed to the neighbouring stages as an ABORT message (Note [a header before every
message] in `p2p.py`), then the failed rank skips the rest of its program but still joins the
batch's collectives with stand-ins, and the end-of-batch agreement makes every rank of the
pipe × data grid raise together: the failed rank its own error, the others `PipelineAbortedError`
naming it. Never a rank left blocked in a receive or in the data-parallel all-reduce. A NaN or
infinite loss raises `NonFiniteLossError` on every rank before the step. After a failure inside a
program (messages may be left unread between stages) the executor refuses further batches.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

from minispeed.core import ranges
from minispeed.pipeline import instructions as ins
from minispeed.pipeline import sharded, split_backward, status
from minispeed.pipeline.checker import check
from minispeed.pipeline.module import PipelineModule
from minispeed.pipeline.p2p import PipelineAbortedError, StageMessenger
from minispeed.pipeline.reduction import GradientAverager
from minispeed.pipeline.schedules import InferenceSchedule, PipeSchedule, get_schedule
from minispeed.pipeline.timeline import StageTimeline

__all__ = ["PipelineExecutor"]

Key = tuple[int, int]  # (micro_batch, chunk)


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _detached(x: Any) -> Any:
    """`x` with every tensor in it (nested tuples and lists) detached."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    return x


def _split(x: Any, m: int, what: str) -> list[Any]:
    """Split a tensor (or tuple of tensors) into m micro-batches along dim 0."""
    if isinstance(x, tuple):
        parts = [_split(t, m, what) for t in x]
        return [tuple(p[i] for p in parts) for i in range(m)]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {type(x).__name__}")
    if x.shape[0] % m:
        raise ValueError(
            f"{what} has batch size {x.shape[0]}, not divisible by micro_batches={m}; make the "
            "batch a multiple of the micro-batch count"
        )
    return list(x.chunk(m, dim=0))


class PipelineExecutor:
    """Runs `train_batch()` / `eval_batch()` of one pipeline stage (see module docstring).

    `optimizer`: a `torch.optim` optimizer over the stage's parameters (the executor averages
    gradients over data-parallel replicas), or one with its own `backward(loss)` that reduces
    them itself, e.g. `minispeed.zero.shard(module, opt, ZeroConfig(stage=1,
    gradient_accumulation_steps=M·V), group=module.grid.group("data"))` (see `sharded.py`).
    `check_finite_loss`: raise `NonFiniteLossError` on every rank, before the step, when the
    batch's loss is NaN or infinite.
    `forward_region`: called once per forward pass, a context manager each stage's module runs
    in (the loss outside it), e.g. `lambda: torch.autocast("cpu", dtype=torch.bfloat16)` for
    torch.autocast training (the engine's `torch_autocast` section); None: no region.

    Collective: every rank of the grid builds its executor, with the same arguments. Building
    ends with one agreement (`status.agree_at_build`: 2 all-reduces of 8 · P · D · 5 bytes), so a
    bad argument on one rank, or arguments that differ between ranks, raise on every rank.
    """

    def __init__(
        self,
        module: PipelineModule,
        optimizer: Any,
        *,
        micro_batches: int,
        schedule: str | type[PipeSchedule] = "1f1b",
        check_finite_loss: bool = True,
        forward_region: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.forward_region = forward_region or contextlib.nullcontext
        self.check_finite_loss = check_finite_loss
        self.micro_batches = micro_batches
        grid = module.grid
        if grid is None:
            raise ValueError(
                "the PipelineModule has no process grid; build it with pipeline.partition"
            )
        failure: Exception | None = None
        try:
            self._build_schedules(schedule)
        except Exception as exc:  # raised on every rank by the agreement below
            failure = exc
        # Note: a check that fails on one rank only, or arguments that differ between ranks,
        # would leave the other ranks waiting in their first receive: agree before any message.
        name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "?")
        status.agree_at_build(
            grid,
            failure,
            {
                "micro_batches": micro_batches if isinstance(micro_batches, int) else -1,
                "schedule": zlib.crc32(name.encode()),
                "check_finite_loss": bool(check_finite_loss),
                "whether the optimizer reduces gradients itself": sharded.reduces_gradients(
                    optimizer
                ),
            },
            "building the PipelineExecutor",
        )
        self.pipe_ranks = grid.group_ranks("pipe")
        self.dp = grid.size("data")
        # this rank's slot in the status vector of the pipe × data plane (see status.py)
        self._slot = module.stage * self.dp + grid.rank_in("data")
        self._broken: str | None = None
        self.device = next((q.device for q in module.parameters()), torch.device("cpu"))
        self.reducer = GradientAverager(module.parameters, grid.group("data"), self.dp, self.device)
        self.messenger = StageMessenger(
            module.stage, self.pipe_ranks, self.device, group=grid.group("pipe")
        )
        self.timeline = StageTimeline(module.stage)
        self.peak_in_flight = 0
        self._keep_outputs, self._kept_output = False, None  # see eval_batch(return_outputs)
        self._kept_output_of_last_eval: Any = None
        self._each: list[Any] | None = None  # see eval_outputs
        self._compute_loss = True
        # What the last batch's optimizer step returned (minispeed.zero's: False when an fp16
        # overflow skipped it) and how long it took, for the engine's counters and timers.
        self.step_result: Any = None
        self.step_seconds = 0.0
        self._dispatch: dict[type, Callable[[Any], None]] = {
            ins.LoadMicroBatch: self._load,
            ins.Forward: self._forward,
            ins.Backward: self._backward,
            ins.BackwardInput: self._backward_input,
            ins.BackwardWeight: self._backward_weight,
            ins.SendActivation: self._send_activation,
            ins.RecvActivation: self._recv_activation,
            ins.SendGrad: self._send_grad,
            ins.RecvGrad: self._recv_grad,
        }

    def _build_schedules(self, schedule: str | type[PipeSchedule]) -> None:
        """The schedules and their checks: local, so they may fail on one rank (see __init__)."""
        module, optimizer, p, v = (
            self.module,
            self.optimizer,
            self.module.stages,
            self.module.virtual_stages,
        )
        self.schedule = get_schedule(schedule)(self.micro_batches, p, v)
        if module.activation_checkpointing and self.schedule.splits_backward:
            raise ValueError(
                f"{self.schedule.name} splits backward per layer and cannot run on a checkpointed "
                "stage; turn activation_checkpointing off or use 1f1b"
            )
        self.eval_schedule = InferenceSchedule(self.micro_batches, p, v)
        # an optimizer with its own backward() reduces over data-parallel ranks: see sharded.py
        self._window = (
            sharded.check_reducing_optimizer(
                optimizer, self.schedule, [p for p, _, _ in module.tied_grad_groups()]
            )
            if sharded.reduces_gradients(optimizer)
            else 0
        )
        check(self.schedule)
        check(self.eval_schedule)

    # -- public API -------------------------------------------------------------------------------
    def train_batch(self, inputs: Any = None, labels: Any = None) -> float:
        """One optimizer step on (inputs, labels), split into M micro-batches; returns the batch's
        mean loss (averaged over data-parallel replicas) on every rank."""
        start: Exception | None = None
        if self.optimizer is None:
            start = ValueError("train_batch needs an optimizer; pass one to PipelineExecutor")
        elif self.module.loss_fn is None:
            start = ValueError("train_batch needs a loss: pass loss_fn= to pipeline.partition")
        self.module.train()
        return self._run(self.schedule, inputs, labels, start)

    def eval_batch(
        self,
        inputs: Any = None,
        labels: Any = None,
        *,
        return_outputs: bool = False,
        micro_batches: int | None = None,
    ) -> float | tuple[float, Any]:
        """Forwards only (no grad, no step); returns the mean loss on every rank. With
        `return_outputs`, `(loss, outputs)`: the last micro-batch's model output (before the
        loss) on the last stage, None elsewhere (DeepSpeed's `eval_batch(return_logits=True)`);
        it costs keeping that one output until the batch ends. `micro_batches` splits this batch
        into that many instead of the executor's M (every rank must pass the same)."""
        loss, _ = self._eval(inputs, labels, micro_batches, keep_last=return_outputs)
        return (loss, self._kept_output_of_last_eval) if return_outputs else loss

    def eval_outputs(
        self,
        inputs: Any = None,
        labels: Any = None,
        *,
        compute_loss: bool = True,
        micro_batches: int | None = None,
    ) -> list[Any] | None:
        """Forwards only; on the last stage each micro-batch's loss (`compute_loss`, not divided
        by M) or the model's output (`compute_loss=False`: the loss function is not called), in
        micro-batch order, detached; None on the other stages. Costs keeping all M outputs until
        the batch ends (DeepSpeed's `eval_batch(reduce_output=None)` / `compute_loss=False`)."""
        _, each = self._eval(inputs, labels, micro_batches, each=True, compute_loss=compute_loss)
        return each if self._is_last(self.module.virtual_stages - 1) else None

    def _eval(
        self,
        inputs: Any,
        labels: Any,
        micro_batches: int | None,
        *,
        keep_last: bool = False,
        each: bool = False,
        compute_loss: bool = True,
    ) -> tuple[float, list[Any] | None]:
        self.module.eval()
        m = self.micro_batches if micro_batches is None else micro_batches
        schedule = self.eval_schedule
        if m != self.micro_batches:
            if not isinstance(m, int) or m < 1:
                raise ValueError(f"eval micro_batches must be a positive int, got {m!r}")
            schedule = InferenceSchedule(m, self.module.stages, self.module.virtual_stages)
            check(schedule)
        saved, self.micro_batches = self.micro_batches, m
        self._keep_outputs, self._kept_output = keep_last, None
        self._each, self._compute_loss = ([] if each else None), compute_loss
        try:
            with torch.no_grad():
                loss = self._run(schedule, inputs, labels)
            self._kept_output_of_last_eval = self._kept_output
            return loss, self._each
        finally:
            self.micro_batches = saved
            self._keep_outputs, self._kept_output = False, None
            self._each, self._compute_loss = None, True

    # -- the loop ---------------------------------------------------------------------------------
    def _run(
        self, schedule: PipeSchedule, inputs: Any, labels: Any, start: Exception | None = None
    ) -> float:
        """Run this stage's program. `start`: a check that failed before it (e.g. no optimizer),
        on this rank perhaps alone: it takes the failure path from the first instruction (tell
        the neighbours, join the collectives with stand-ins, raise at the agreement), so every
        rank raises instead of the peers waiting in a receive (phase `start`)."""
        if self._broken is not None:
            raise PipelineAbortedError(
                f"this executor stopped at an earlier failed batch ({self._broken}); messages of "
                "that batch may still be queued in this pipeline's process group, so it cannot "
                "run another: build a new module with pipeline.partition (new groups) and a new "
                "executor, or restart from a checkpoint"
            )
        self._batch_inputs, self._batch_labels = inputs, labels
        self._micro_inputs: list[Any] | None = None
        self._micro_labels: list[Any] | None = None
        self._inputs: dict[Key, tuple] = {}
        self._outputs: dict[Key, tuple] = {}
        self._segments: dict[Key, list[split_backward.Segment]] = {}
        self._out_grads: dict[Key, tuple] = {}
        self._in_grads: dict[Key, tuple] = {}
        self._weight_work: dict[Key, list] = {}
        self._labels: dict[int, Any] = {}
        self._loss_sum = torch.zeros((), device=self.device)
        self._live, self.peak_in_flight = 0, 0
        self._trains = schedule.trains
        # eval sends tensors that do not require grad: a layout of its own, see p2p.Link
        self._act_kind = "act" if self._trains else "act_eval"
        self.timeline = StageTimeline(self.module.stage)
        failure: tuple[str, Exception] | None = None
        if start is not None:
            failure = ("start", start)
            self._abort_neighbours(start, deliver_s=0.0)
        for instr in schedule.program(self.module.stage):
            kind = type(instr)
            if kind is ins.OptimizerStep:
                loss = self._settle(failure)  # raises on every rank if any rank failed
                self._settle_step(self._guard("step", self._step))
                return loss
            if kind is ins.ReduceTiedGrads or kind is ins.ReduceGrads:
                # joined by every rank, failed or not: Note [every rank reaches the agreement]
                run = self._reduce_tied if kind is ins.ReduceTiedGrads else self._reduce_grads
                err = run(stand_in=failure is not None)
                if err is not None and failure is None:
                    failure = (status.PHASE_OF[kind], err)
                continue
            if failure is not None:
                continue  # skip the rest of the program after a failure
            try:
                self._dispatch[kind](instr)
            except Exception as exc:
                failure = (status.PHASE_OF[kind], exc)
                self._abort_neighbours(exc, deliver_s=0.0)
            except BaseException as exc:  # KeyboardInterrupt, SystemExit: no agreement, stop now
                self._abort_neighbours(exc, deliver_s=5.0)
                raise
        return self._settle(failure)

    def _abort_neighbours(self, exc: BaseException, deliver_s: float) -> None:
        neighbours = {
            (self.module.stage - 1) % self.module.stages,
            (self.module.stage + 1) % self.module.stages,
        }
        neighbours.discard(self.module.stage)
        # a stage that told us of the failure (or that we told) needs no abort message
        neighbours.discard(getattr(exc, "origin", None))
        self.messenger.abort(neighbours, deliver_s=deliver_s)

    def _guard(self, phase: str, fn: Callable[[], None]) -> tuple[str, Exception] | None:
        try:
            fn()
        except Exception as exc:
            return phase, exc
        return None

    def _settle(self, failure: tuple[str, Exception] | None) -> float:
        """The end-of-batch agreement (status.py): the loss averaged over replicas on every rank,
        and every rank raising together if any rank of the grid failed."""
        grid = self.module.grid
        assert grid is not None
        code = 0 if failure is None else status.status_code(*failure)
        value = self._loss_sum if failure is None else torch.zeros((), device=self.device)
        with ranges.range("pipeline.agree"):
            total, codes = status.agree(grid, self._slot, value, code, self.device)
        if any(codes):
            failed_program = any(c and status.decode(c)[0] in status.PROGRAM_PHASES for c in codes)
            if failed_program:  # unread messages may remain between stages: drop them, stop here
                self._broken = status.describe(grid, codes)
                self.messenger.drop_sends()
            else:  # every program ran to its end: every send met its receive
                self.messenger.wait_sends()
            self._clear_grads()
            status.raise_failure(grid, failure, codes, "the batch was not applied on any rank")
        self.messenger.wait_sends()
        loss = total / self.dp
        if self._trains and self.check_finite_loss and not bool(torch.isfinite(loss)):
            self._clear_grads()
            raise status.NonFiniteLossError(
                f"the batch's loss is {float(loss)} (mean over {self.dp} data-parallel replicas); "
                "no rank stepped its optimizer and gradients were cleared: skip this batch, lower "
                "the learning rate or look for bad data (check_finite_loss=False turns this off)"
            )
        return float(loss.item())

    def _settle_step(self, failure: tuple[str, Exception] | None) -> None:
        """After the step: a rank whose optimizer raised stops every rank (2 small all-reduces)."""
        grid = self.module.grid
        assert grid is not None
        code = 0 if failure is None else status.status_code(*failure)
        with ranges.range("pipeline.agree"):
            _, codes = status.agree(grid, self._slot, self._loss_sum, code, self.device)
        if any(codes):
            self._broken = status.describe(grid, codes)
            status.raise_failure(
                grid, failure, codes, "the other ranks did step: parameters may now differ"
            )

    def _clear_grads(self) -> None:
        if not self._trains or self.optimizer is None:
            return
        if self._window:  # its window is left half-way: see sharded.py
            self._broken = self._broken or "a failed batch with an optimizer that reduces itself"
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _is_first(self, chunk: int) -> bool:
        return chunk == 0 and self.module.stage == 0

    def _is_last(self, chunk: int) -> bool:
        return (
            chunk == self.module.virtual_stages - 1 and self.module.stage == self.module.stages - 1
        )

    # -- instructions -----------------------------------------------------------------------------
    def _load(self, i: ins.LoadMicroBatch) -> None:
        m = self.micro_batches
        if self._is_first(i.chunk):
            if self._micro_inputs is None:
                if self._batch_inputs is None:
                    raise ValueError(
                        "the first pipeline stage needs the batch inputs; pass inputs="
                    )
                self._micro_inputs = _split(self._batch_inputs, m, "inputs")
            self._inputs[(i.micro_batch, i.chunk)] = _as_tuple(self._micro_inputs[i.micro_batch])
        if self._is_last(i.chunk) and self.module.loss_fn is not None:
            if self._micro_labels is None:
                if self._batch_labels is None:
                    raise ValueError("the last pipeline stage needs the labels; pass labels=")
                self._micro_labels = _split(self._batch_labels, m, "labels")
            self._labels[i.micro_batch] = self._micro_labels[i.micro_batch]

    def _forward(self, i: ins.Forward) -> None:
        key = (i.micro_batch, i.chunk)
        x = self._inputs[key]
        arg = x[0] if len(x) == 1 else x
        start = time.perf_counter()
        with ranges.range("pipeline.forward"):
            keep: list | None = [] if self.schedule.splits_backward and self._trains else None
            # Note [a stage's forward is a call of its module] in module.py
            with self.forward_region():
                out = self.module(arg, chunk=i.chunk, segments=keep)
            if self._keep_outputs and self._is_last(i.chunk):  # the last micro-batch's stays
                self._kept_output = out
            if self._is_last(i.chunk) and self.module.loss_fn is not None and self._compute_loss:
                raw = self.module.loss_fn(out, self._labels.pop(i.micro_batch))
                loss = raw / self.micro_batches
                self._loss_sum += loss.detach()
                out = loss
                if self._each is not None:
                    self._each.append(raw.detach())
            elif self._each is not None and self._is_last(i.chunk):
                self._each.append(_detached(out))
        self.timeline.add("compute", i.label, start, time.perf_counter())
        if not self._is_last(i.chunk):
            self._check_message(out, i.chunk)
        if self._trains:
            self._outputs[key] = _as_tuple(out)
            if keep is not None:
                self._segments[key] = keep
            self._live += 1
            self.peak_in_flight = max(self.peak_in_flight, self._live)
        else:
            self._outputs[key] = _as_tuple(out)
            self._inputs.pop(key)

    def _check_message(self, out: Any, chunk: int) -> None:
        """A chunk's output travels to the next stage: a tensor or a flat tuple of tensors."""
        if isinstance(out, torch.Tensor) or (
            isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out)
        ):
            return
        parts = out if isinstance(out, tuple) else (out,)
        got = ", ".join(type(t).__name__ for t in parts) or "an empty tuple"
        lo = self.module.chunks[chunk].start
        hi = lo + len(self.module.chunks[chunk].entries) - 1
        raise TypeError(
            f"pipeline stage {self.module.stage} (layers {lo}..{hi}) returned {got}; a stage "
            "whose output goes to the next stage must return a tensor or a tuple of tensors "
            "(no dicts, lists, None or nested tuples): make its last layer return e.g. "
            "`tuple(d.values())` or `(hidden, mask)`"
        )

    def _output_pairs(self, key: Key) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        outs = [t for t in self._outputs.pop(key) if t.requires_grad]
        if self._is_last(key[1]):
            return outs, [None] * len(outs)
        grads = self._out_grads.pop(key)
        if len(grads) != len(outs):
            raise RuntimeError(
                f"stage {self.module.stage}: {len(outs)} outputs require grad but {len(grads)} "
                "gradients arrived; every output that requires grad must be used downstream"
            )
        return outs, list(grads)

    def _backward(self, i: ins.Backward) -> None:
        key = (i.micro_batch, i.chunk)
        outs, grads = self._output_pairs(key)
        start = time.perf_counter()
        with ranges.range("pipeline.backward"):
            if self._window:
                scale = sharded.loss_scale(self.optimizer)
                self.optimizer.backward(sharded.surrogate_loss(outs, grads, self._window, scale))  # type: ignore[union-attr]
            elif outs:
                torch.autograd.backward(outs, grads)  # type: ignore[arg-type]
        self.timeline.add("compute", i.label, start, time.perf_counter())
        inputs = [t for t in self._inputs.pop(key) if t.requires_grad]
        self._in_grads[key] = tuple(
            t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs
        )
        self._live -= 1

    def _backward_input(self, i: ins.BackwardInput) -> None:
        """Gradients of the chunk input, keeping what W needs: see `split_backward.py`."""
        key = (i.micro_batch, i.chunk)
        outs, grads = self._output_pairs(key)
        self._inputs.pop(key)
        start = time.perf_counter()
        with ranges.range("pipeline.backward_input"):
            in_grads, work = split_backward.backward_input(outs, grads, self._segments.pop(key))
        self.timeline.add("compute", i.label, start, time.perf_counter())
        # the first segment's leaves are the chunk's inputs that require grad, in order
        self._in_grads[key] = tuple(in_grads)
        self._weight_work[key] = work

    def _backward_weight(self, i: ins.BackwardWeight) -> None:
        key = (i.micro_batch, i.chunk)
        start = time.perf_counter()
        with ranges.range("pipeline.backward_weight"):
            params = [q for q in self.module.parameters() if q.requires_grad]
            split_backward.backward_weight(self._weight_work.pop(key), params)
        self.timeline.add("compute", i.label, start, time.perf_counter())
        self._live -= 1

    def _send_activation(self, i: ins.SendActivation) -> None:
        with ranges.range("pipeline.send"):
            receiver_chunk = i.chunk + 1 if self.module.stage == self.module.stages - 1 else i.chunk
            out = self._outputs[(i.micro_batch, i.chunk)]
            self.messenger.send(out, i.peer, self._act_kind, receiver_chunk)
            if not self._trains:
                self._outputs.pop((i.micro_batch, i.chunk))

    def _recv_activation(self, i: ins.RecvActivation) -> None:
        start = time.perf_counter()
        with ranges.range("pipeline.recv"):
            msg = self.messenger.recv(i.peer, self._act_kind, i.chunk)
        self.timeline.add("wait", i.label, start, time.perf_counter())
        self._inputs[(i.micro_batch, i.chunk)] = msg

    def _send_grad(self, i: ins.SendGrad) -> None:
        with ranges.range("pipeline.send"):
            receiver_chunk = i.chunk - 1 if self.module.stage == 0 else i.chunk
            self.messenger.send(
                self._in_grads.pop((i.micro_batch, i.chunk)), i.peer, "grad", receiver_chunk
            )

    def _recv_grad(self, i: ins.RecvGrad) -> None:
        start = time.perf_counter()
        with ranges.range("pipeline.recv"):
            msg = self.messenger.recv(i.peer, "grad", i.chunk)
        self.timeline.add("wait", i.label, start, time.perf_counter())
        self._out_grads[(i.micro_batch, i.chunk)] = msg

    def _reduce_tied(self, stand_in: bool) -> Exception | None:
        if self._window:  # the optimizer sums them in its step (checked: sharded.py)
            return None
        with ranges.range("pipeline.reduce_tied"):
            return self.module.reduce_tied_grads(stand_in=stand_in)

    def _reduce_grads(self, stand_in: bool) -> Exception | None:
        if self._window:  # an optimizer with its own backward() did it (sharded.py)
            return None
        return self.reducer.reduce(stand_in)

    def _step(self) -> None:
        assert self.optimizer is not None
        start = time.perf_counter()
        with ranges.range("pipeline.step"):
            self.step_result = self.optimizer.step()
            if not self._window:  # one with its own backward() clears them in its step
                self.optimizer.zero_grad(set_to_none=True)
        self.step_seconds = time.perf_counter() - start
