"""A step's batch from a data iterator: what each stage reads, agreed by every rank.

```python
inputs, labels = pipeline.pull_batch(data_iter, micro_batches=4, module=module)
loss = executor.train_batch(inputs, labels)
```

DeepSpeed's pipeline engine pulls `(inputs, labels)` pairs from a data iterator, one per
micro-batch: the first stage reads the inputs, the last the labels, the others nothing (each
stage iterates its own iterator). `pull_batch` does the same and concatenates the M pairs along
dim 0 on the stage's device, the form `PipelineExecutor.train_batch` splits back: one copy of the
step's inputs (and labels), and every micro-batch must have the same size. Tuples of tensors are
concatenated element by element.

Before the schedule starts, every rank agrees (one 4-byte all-reduce over the world, MAX) that
every stage got its data, so an exhausted or bad iterator raises on every rank, the reading rank
its own error and the others `PipelineAbortedError` naming it, instead of leaving the others
blocked in a receive. Cost: M `next()` calls on the first and last stages, one concatenation of
the step's inputs and labels, and the all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

import minispeed.comm as comm
from minispeed.pipeline.module import PipelineModule
from minispeed.pipeline.p2p import PipelineAbortedError

__all__ = ["RepeatingLoader", "pull_batch"]


def pull_batch(
    data_iter: Iterator | None, micro_batches: int, module: PipelineModule
) -> tuple[Any, Any]:
    """The step's inputs (first stage, else None) and labels (last stage, else None), each the
    concatenation of `micro_batches` micro-batches from `data_iter`. Collective over the world:
    every rank raises if any stage failed to read (see the module docstring)."""
    first, last = module.stage == 0, module.stage == module.stages - 1
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    inputs = labels = None
    error: Exception | None = None
    if first or last:
        try:
            if data_iter is None:
                raise ValueError(
                    "train_batch/eval_batch need a data iterator yielding (inputs, labels)"
                )
            batches = [next(data_iter) for _ in range(micro_batches)]
            for b in batches:
                if not isinstance(b, (tuple, list)) or len(b) != 2:
                    raise TypeError(
                        "each micro-batch from data_iter must be a pair (inputs, labels), "
                        f"got {type(b).__name__}"
                    )
            if first:
                inputs = _concat([b[0] for b in batches], "inputs", device)
            if last:
                labels = _concat([b[1] for b in batches], "labels", device)
        except Exception as exc:  # agreed below, then raised on every rank
            error = exc
    failed = torch.tensor([0.0 if error is None else float(comm.get_rank() + 1)])
    comm.all_reduce(failed, op=comm.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        raise PipelineAbortedError(
            f"rank {int(failed.item()) - 1} could not read its micro-batches from data_iter; "
            "no rank ran the batch"
        )
    return inputs, labels


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


class RepeatingLoader:
    """An endless iterator over `loader`, restarting it (a new epoch) when it runs out: what a
    pipeline's `data_iter` usually is, since each step pulls M micro-batches whatever the epoch."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
