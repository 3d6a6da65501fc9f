"""Cross-entropy over logits split along the vocabulary: the full `(M, V)` never exists.

Each rank holds `(M, V/n)` logits (the output of a column-parallel head). The loss of token i
with target t is `log Σ_v exp(z_iv) − z_it`, and each piece reduces over ranks:

1. the row maximum `m_i` (for a stable exp): local max, one all-reduce MAX of `M` floats;
2. `Σ_v exp(z_iv − m_i)` and `z_it − m_i` (non-zero only on the rank holding t): local, then one
   all-reduce SUM of `2·M` floats, both in one message.

Backward needs no communication: `∂loss_i/∂z_iv = softmax_iv − [v = t]`, and each rank computes
its own `V/n` columns of the softmax from its logits and the reduced sum. Saved for backward:
the local softmax, `(M, V/n)`. Bytes per call: `costs.cross_entropy_collectives`.
"""

from __future__ import annotations

from typing import Any

import torch

import minispeed.comm as comm
from minispeed.tensor_parallel.group import TensorGroup

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tg: TensorGroup) -> torch.Tensor:  # fmt: skip
        v_local = logits.shape[-1]
        start = tg.rank * v_local
        z = logits.float()
        row_max = z.max(dim=-1).values
        if tg.size > 1:
            comm.all_reduce(row_max, op=comm.ReduceOp.MAX, group=tg.group)
        z = z - row_max.unsqueeze(-1)  # (..., V/n)
        local_t = target - start
        here = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.masked_fill(~here, 0)
        target_logit = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        exp = z.exp_()
        stats = torch.stack([target_logit, exp.sum(dim=-1)])  # (2, ...): one message
        if tg.size > 1:
            comm.all_reduce(stats, group=tg.group)
        target_logit, sum_exp = stats
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, here)
        ctx.dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_t, here = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -here.unsqueeze(-1).to(g.dtype))
        return (g * grad.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Any, *, ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:  # fmt: skip
    """`F.cross_entropy(whole_logits, target)` from this rank's vocabulary slice of the logits.

    `logits`: `(..., V/n)`, rank r's columns `[r·V/n, (r+1)·V/n)` (a column-parallel head's
    output); `target`: `(...)` ids in `[0, V)`, or `ignore_index` (no loss, no gradient).
    `reduction`: `"mean"` (over the targets not ignored), `"sum"` or `"none"` (per token).
    Collective: two all-reduces, `4·M` and `8·M` bytes for `M` tokens (fp32); none in backward.
    """
    tg = TensorGroup.of(group)
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
            f"{tuple(target.shape)} must agree on every dimension but the last (vocabulary)"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    keep = target != ignore_index
    losses = _VocabParallelCrossEntropy.apply(logits, target.masked_fill(~keep, -1), tg)
    losses = losses * keep  # ignored targets: no loss, zero gradient
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / keep.sum()
