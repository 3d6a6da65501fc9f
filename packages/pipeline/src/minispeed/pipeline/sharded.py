"""Optimizers that reduce gradients themselves: ZeRO stage 1 inside each data-parallel group.

```python
module = pipeline.partition(layers, stages=2, loss_fn=loss)                 # 2 × 2 ranks
opt = zero.shard(module, torch.optim.AdamW(module.parameters()),
                 zero.ZeroConfig(stage=1, gradient_accumulation_steps=M),   # M·V when interleaved
                 group=module.grid.group("data"))                           # this stage's replicas
executor = pipeline.PipelineExecutor(module, opt, micro_batches=M)
```

A plain `torch.optim` optimizer leaves the data-parallel reduction to the executor's
`ReduceGrads` instruction (one all-reduce of the stage's gradients). An optimizer with a
`backward(loss)` method, like `minispeed.zero`'s, owns it instead: it scales each micro-batch's
backward by 1/G (G = its `gradient_accumulation_steps`), accumulates, and on the G-th backward
reduce-scatters the gradients over its group; its `step()` steps this rank's shard of the
optimizer state and all-gathers the parameters. The executor then routes every backward pass
through `optimizer.backward` and skips `ReduceGrads`. This package never imports zero: the
contract is the method.

Note [a scalar for a stage without a loss]
    `optimizer.backward` takes a scalar; a middle stage has no loss, only its outputs o and the
    gradients g that arrived for them. Σ (o · g.detach()).sum() is a scalar whose gradient is the
    same vector-Jacobian product as `torch.autograd.backward(o, g)`. The executor already divides
    each micro-batch's loss by M, and g carries that division from the stages after, so the
    scalar is multiplied by G before the optimizer scales it by 1/G (exact for G a power of two,
    one rounding otherwise). A loss scale S (fp16: the optimizer multiplies every backward's
    scalar by S, read from `optimizer.loss_scaler.scale`) also travels in g already, so the
    scalar of a stage without a loss is divided by S too, and computed in fp32: Σ o·g of fp16
    tensors scaled by S would overflow fp16, though only its gradient matters.

What does not fit, refused when the executor is built (each with the fix):

- ZB-H1: its backward is two passes (`b`, `W`); the optimizer's backward is one.
- tied layers, unless the optimizer sums them: their gradients are summed over stages by
  `ReduceTiedGrads` after the program, but the optimizer reduces (and partitions) them inside
  the last backward, before that sum. An optimizer whose `shared_params()` lists every tied
  parameter sums them itself in its step (minispeed.zero's, built with
  `model_parallel=zero.ModelParallel(shared=...)` from `module.tied_grad_groups()`: its Note
  [summing a shared gradient after the reduction]); `ReduceTiedGrads` then does nothing.
- G ≠ M·V: the optimizer must see one window per batch, one backward per micro-batch and chunk.

And one that is not refused: the optimizer's reduce-scatter runs inside a stage's last backward,
inside the program, so a failure on one replica before that point leaves the same stage of the
other replicas waiting in it (the end-of-batch agreement in `status.py` covers the executor's own
`ReduceGrads` only). After any failed batch the executor refuses further batches in this mode
(the optimizer's accumulation window is left half-way).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_reducing_optimizer", "reduces_gradients", "surrogate_loss"]


def reduces_gradients(optimizer: Any) -> bool:
    """Whether `optimizer` owns the data-parallel reduction (has a `backward(loss)` method)."""
    return callable(getattr(optimizer, "backward", None))


def check_reducing_optimizer(optimizer: Any, schedule: Any, tied: list[Any]) -> int:
    """Refuse what does not fit (module docstring); return G, the optimizer's window.
    `tied`: this stage's tied parameters shared with other stages."""
    if schedule.splits_backward:
        raise ValueError(
            f"{schedule.name} splits backward into two passes, which an optimizer with its own "
            "backward() (e.g. minispeed.zero's) cannot run; use 1f1b, gpipe or interleaved_1f1b"
        )
    summed = {id(p) for p in getattr(optimizer, "shared_params", list)()}
    if any(id(p) not in summed for p in tied):
        raise ValueError(
            "tied layers are summed across stages after the backward passes, but an optimizer "
            "with its own backward() reduces inside the last one, before that sum; let the "
            "optimizer sum them (zero.shard(..., model_parallel=zero.ModelParallel(shared="
            "[(p, g) for p, g, _ in module.tied_grad_groups()]))), untie the layers or use a "
            "torch.optim optimizer"
        )
    want = schedule.micro_batches * schedule.virtual_stages
    config = getattr(optimizer, "config", None)
    got = getattr(config, "gradient_accumulation_steps", want)
    if got != want:
        raise ValueError(
            f"the optimizer accumulates over gradient_accumulation_steps={got} backward passes "
            f"but one batch runs {want} per stage (micro_batches × virtual_stages); set "
            f"gradient_accumulation_steps={want}"
        )
    return want


def loss_scale(optimizer: Any) -> float:
    """The factor the optimizer's `backward` multiplies the scalar by besides 1/G (fp16's loss
    scale; 1 for an optimizer without one)."""
    return float(getattr(getattr(optimizer, "loss_scaler", None), "scale", 1.0))


def surrogate_loss(
    outs: list[torch.Tensor], grads: list[torch.Tensor | None], window: int, scale: float = 1.0
) -> torch.Tensor:
    """The scalar of Note [a scalar for a stage without a loss], times the window G; the terms
    of received gradients (which carry the loss scale `scale` already) divided by it."""
    total = None
    for o, g in zip(outs, grads):
        term = o if g is None else (o.float() * g.detach().float()).sum() / scale
        total = term if total is None else total + term
    if total is None:
        raise RuntimeError("no output of this stage requires grad: nothing to back-propagate")
    return total * window
