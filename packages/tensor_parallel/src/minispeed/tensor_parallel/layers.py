"""The split layers: `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`.

A linear `y = x Wᵀ + b` with `W` of shape `(N, K)` splits two ways over n ranks:

- **column-parallel**: rank r keeps rows `[r·N/n, (r+1)·N/n)` of W (and of b): its output is a
  slice of y's features, no communication in forward; its input is read whole by every rank, so
  backward sums the input gradients (`copy_to_parallel`);
- **row-parallel**: rank r keeps columns `[r·K/n, (r+1)·K/n)` of W, reads the matching slice of
  x, and produces a partial sum of y: forward all-reduces (`reduce_from_parallel`); b is whole
  and added once, after the sum.

Column then row (attention's qkv then proj, the MLP's fc then proj) needs one all-reduce in
forward and one in backward per pair: the column layer's output slice is exactly the row
layer's input slice. Bytes per call: `minispeed.tensor_parallel.costs`.

With `sequence_parallel=True` (Megatron-SP) the activations between pairs are sequence shards:
the column layer all-gathers its input (and keeps only the shard for backward, gathering it
again there), the row layer reduce-scatters its output.

Weights keep the layout of the module they were cut from: `nn.Linear`'s `(N, K)`, or Hugging
Face `Conv1D`'s `(K, N)` (`transposed=True`), so a split model's parameter names and layouts are
the unsplit model's, sliced; `shard_specs` says which dimension each parameter is cut along.
"""

from __future__ import annotations

from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from minispeed.tensor_parallel.group import TensorGroup
from minispeed.tensor_parallel.mappings import (
    SEQ_DIM,
    all_gather_along,
    copy_to_parallel,
    gather_from_parallel,
    reduce_from_parallel,
    reduce_scatter_along,
    reduce_scatter_to_sequence,
    scatter_to_parallel,
)
from minispeed.tensor_parallel.sharding import ShardSpec, part_major, shard

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "source_layout"]


def source_layout(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """`(weight, bias, transposed)` of an `nn.Linear` (`transposed=False`, weight `(N, K)`) or a
    Hugging Face `Conv1D` (`transposed=True`, weight `(K, N)`); anything else is refused."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight, module.bias, True
    raise TypeError(
        f"{type(module).__name__} cannot be split as a linear: column and row parallelism take an "
        "nn.Linear or a Hugging Face Conv1D"
    )


def _parameter(t: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


class _GatheredLinear(torch.autograd.Function):
    """`y = all_gather_seq(x) Wᵀ + b`, keeping only the shard `x` for backward (Megatron-SP).

    Forward: one all-gather of the input (`e·M·K`). Backward: the same all-gather again (the whole
    input is needed for the weight gradient), then a reduce-scatter of the input gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tg: TensorGroup) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, w)
        ctx.tg, ctx.has_bias = tg, b is not None
        return F.linear(all_gather_along(x, SEQ_DIM, tg), w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        whole = all_gather_along(x, SEQ_DIM, ctx.tg)  # (..., T, K)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_along(grad.matmul(w), SEQ_DIM, ctx.tg)
        g2, x2 = grad.reshape(-1, grad.shape[-1]), whole.reshape(-1, whole.shape[-1])
        grad_w = g2.t().matmul(x2) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class _ParallelLinear(nn.Module):
    """What both parallel linears share: the group, this rank's slice of the weight (with its
    `ShardSpec`), `from_module` and the repr."""

    def _take_weight_slice(
        self, weight: torch.Tensor, group: Any, transposed: bool, spec: ShardSpec, what: str
    ) -> None:
        self.tg = TensorGroup.of(group)
        self.transposed = transposed
        spec.check(weight.shape[spec.dim], self.tg.size, what)
        self.weight = _parameter(shard(weight, spec, self.tg.rank, self.tg.size), weight)
        self.shard_specs = {"weight": spec}

    @classmethod
    def from_module(cls, module: nn.Module, group: Any, **options: Any) -> Self:
        """This rank's slice of an `nn.Linear` or `Conv1D` (copied; the original is untouched)."""
        weight, bias, transposed = source_layout(module)
        return cls(weight, bias, group, transposed=transposed, **options)  # type: ignore[call-arg]

    def _repr(self, **flags: Any) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in flags.items())
        return f"local weight {tuple(self.weight.shape)}, rank {self.tg.rank} of {self.tg.size}, {shown}"


class ColumnParallelLinear(_ParallelLinear):
    """`y_r = x W_rᵀ + b_r`: this rank's slice of the output features (see the module docstring).

    Weight `(N/n, K)` per rank (`(K, N/n)` when `transposed`), bias `(N/n,)`. `parts`: a fused
    weight cut per part (3 equal parts for q/k/v stacked; proportions `(H, KV, KV)` for q/k/v of
    unequal widths), so each rank holds whole heads of each.
    `gather_output=True` all-gathers the output slices into the whole `y`. Bytes per call:
    `costs.column_collectives` (plain: one all-reduce of the input gradient, `e·M·K`, in backward).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any, *,
        transposed: bool = False, parts: int | tuple[int, ...] = 1, gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        out_dim = 1 if transposed else 0
        spec = ShardSpec(out_dim, parts)
        self._take_weight_slice(
            weight, group, transposed, spec, "ColumnParallelLinear output features"
        )
        self.parts = parts
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _parameter(
                shard(bias, ShardSpec(0, parts), self.tg.rank, self.tg.size), bias
            )
            self.shard_specs["bias"] = ShardSpec(0, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.transposed else self.weight  # (N/n, K)
        if self.sequence_parallel:
            y = _GatheredLinear.apply(x, w, self.bias, self.tg)
        else:
            y = F.linear(copy_to_parallel(x, self.tg), w, self.bias)
        if not self.gather_output:
            return y
        # rank-major (rank, part, piece) -> the unsplit layer's part-major order
        return part_major(gather_from_parallel(y, self.tg), ShardSpec(-1, self.parts), self.tg.size)

    def extra_repr(self) -> str:
        return self._repr(
            parts=self.parts,
            gather_output=self.gather_output,
            sequence_parallel=self.sequence_parallel,
        )


class RowParallelLinear(_ParallelLinear):
    """`y = Σ_r x_r W_rᵀ + b`: this rank's slice of the input features, partial sums all-reduced.

    Weight `(N, K/n)` per rank (`(K/n, N)` when `transposed`), bias `(N,)` whole. The input is
    already split (`input_is_parallel=True`, the output of a `ColumnParallelLinear`) or whole
    (`False`: this rank's slice is taken, the gradient all-gathered). Bytes per call:
    `costs.row_collectives` (plain: one all-reduce of the output, `e·M·N`, in forward).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any, *,
        transposed: bool = False, input_is_parallel: bool = True, sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        in_dim = 0 if transposed else 1
        self._take_weight_slice(
            weight, group, transposed, ShardSpec(in_dim), "RowParallelLinear input features"
        )
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _parameter(bias.detach().clone(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.tg)
        w = self.weight.t() if self.transposed else self.weight  # (N, K/n)
        y = F.linear(x, w)  # a partial sum over this rank's inputs
        if not self.sequence_parallel:
            y = reduce_from_parallel(y, self.tg)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence(y, self.tg)
        # The bias meets only this rank's sequence shard: its gradient is partial, summed in
        # backward by the copy (one all-reduce of e·N bytes).
        return y if self.bias is None else y + copy_to_parallel(self.bias, self.tg)

    def extra_repr(self) -> str:
        return self._repr(
            input_is_parallel=self.input_is_parallel, sequence_parallel=self.sequence_parallel
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split: rank r keeps ids `[r·V/n, (r+1)·V/n)`.

    Each rank looks up the ids it holds and writes zeros for the others; forward all-reduces the
    `(..., C)` output (`e·M·C` bytes), backward is free: a row's gradient lands on the rank that
    holds it. With `sequence_parallel`: a reduce-scatter to sequence shards, and an all-gather of
    the gradient in backward (`costs.embedding_collectives`).
    Weight `(V/n, C)` per rank; cut like a column-parallel output head, so a tied head shares it.
    """

    def __init__(
        self, weight: torch.Tensor, group: Any, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.tg = TensorGroup.of(group)
        self.sequence_parallel = sequence_parallel
        spec = ShardSpec(0)
        spec.check(weight.shape[0], self.tg.size, "VocabParallelEmbedding vocabulary")
        self.weight = _parameter(shard(weight, spec, self.tg.rank, self.tg.size), weight)
        self.shard_specs = {"weight": spec}
        self.num_embeddings = weight.shape[0]  # the whole vocabulary, V
        self.vocab_start = self.tg.rank * (weight.shape[0] // self.tg.size)

    @classmethod
    def from_module(cls, module: nn.Module, group: Any, **options: Any) -> VocabParallelEmbedding:
        """This rank's rows of an `nn.Embedding` (copied; the original is untouched)."""
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"vocab parallelism takes an nn.Embedding, not {type(module).__name__}")
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError("VocabParallelEmbedding: padding_idx and max_norm are not supported")
        return cls(module.weight, group, **options)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tg)
        return reduce_from_parallel(out, self.tg)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} ids, rows [{self.vocab_start}, "
            f"{self.vocab_start + self.weight.shape[0]}) here, rank {self.tg.rank} of {self.tg.size}"
        )
