"""Sequence tiling (ALST's TiledMLP and tiled loss): a per-token computation run over tiles of
the sequence, so its intermediates exist for one tile at a time.

A per-token function `f` (an MLP, the output head plus its loss) over B·T tokens keeps every
intermediate it makes until backward. Tiled, the forward runs `f` on each of `s` tiles of about
T/s tokens under `no_grad`, keeping only the input; the backward recomputes `f` tile by tile with
gradients on, takes that tile's gradients (of the input and of the weights) and drops the tile's
graph before the next. The result and the gradients are those of `f` on the whole sequence (up to
the order of float sums); the price is one more forward of `f`.

**Memory.** With b bytes per element:

| `f` | untiled, held from forward to backward | tiled, at any time |
|---|---|---|
| gated MLP (d → I → d) | ≈ 4·B·T·I·b (gate, up, activation, product) | ≈ 4·B·⌈T/s⌉·I·b |
| output head + cross-entropy (vocabulary V) | B·T·V·4 logits (fp32) + as much for their gradient | B·⌈T/s⌉·V·4·2 |

so tiling saves (1 − 1/s) of it: at T = 128k tokens, V = 128k, one sequence, the fp32 logits
alone are 64 GiB untiled, 4 GiB in 16 tiles. The input (B·T·d·b) is kept either way.

**Compute.** One more forward of `f` per step (`f`'s forward is about a third of its forward
plus backward, so ≈ +33% of `f`'s FLOPs), and no communication.

**Gradients** reach each weight once per backward, summed over the tiles inside the function and
returned as the function's gradient for that weight, so ZeRO's per-parameter gradient hooks fire
once (as for an untiled layer). This is where minispeed differs from DeepSpeed 0.19.8, whose
tiles accumulate into `.grad` one by one (it flags `ds_grad_is_ready` so its own ZeRO waits) and
whose `TiledFusedLogitsLoss` runs the backward inside the forward assuming the loss's incoming
gradient is 1: its weight gradients are wrong when the loss is then scaled (by a token count, or
by the sequence-parallel weighting); minispeed recomputes in backward and is exact for any
incoming gradient.

Pure PyTorch, no process group: `TiledMLP`, `SequenceTiledCompute` / `sequence_tiled_compute` and
`TiledLogitsLoss` keep DeepSpeed's call signatures (`deepspeed.runtime.sequence_parallel.
ulysses_sp` re-exports them). See `docs/architecture.md` (tensor_parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SequenceTiledCompute",
    "TiledLogitsLoss",
    "TiledMLP",
    "sequence_tiled_compute",
    "tile_bounds",
]


def tile_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """`[start, stop)` of each tile when `n` positions are cut into `shards` tiles of
    ⌈n/shards⌉ (the last shorter; fewer tiles when they run out), as `torch.chunk` cuts."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    size = max(1, -(-n // shards))
    return [(a, min(a + size, n)) for a in range(0, n, size)]


@dataclass(frozen=True)
class _Plan:
    """How one tiled call runs: `call(i, x_tile)` is tile i's output, `tiles` the bounds along
    `dim` of the grad-requiring input `x`, and `combine` how the outputs join:
    `"cat"` along `cat_dim`, `"stack"` (scalars into a vector), or `"sum"` / `"mean"` of scalars."""

    call: Callable[[int, torch.Tensor], torch.Tensor]
    tiles: list[tuple[int, int]]
    dim: int
    combine: str
    cat_dim: int = 1

    def join(self, outs: list[torch.Tensor]) -> torch.Tensor:
        if self.combine == "cat":
            return torch.cat(outs, dim=self.cat_dim)
        stacked = torch.stack([o.reshape(()) for o in outs])
        if self.combine == "stack":
            return stacked
        return stacked.sum() if self.combine == "sum" else stacked.mean()

    def grad_of(self, grad: torch.Tensor, i: int, out: torch.Tensor) -> torch.Tensor:
        """The incoming gradient of tile i's output."""
        if self.combine == "cat":
            a, b = self.tiles[i]
            return grad.narrow(self.cat_dim, a, b - a)
        if self.combine == "stack":
            return grad[i].reshape(out.shape)
        scale = 1.0 if self.combine == "sum" else 1.0 / len(self.tiles)
        return (grad * scale).reshape(out.shape)


class _Tiled(torch.autograd.Function):
    """`plan.join` of `plan.call` over the tiles of `x`; the weights `params` are inputs so their
    gradients (summed over the tiles) are returned once each."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.plan, ctx.params = plan, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            outs = [
                plan.call(i, x.narrow(plan.dim, a, b - a)) for i, (a, b) in enumerate(plan.tiles)
            ]
        return plan.join(outs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, (x,) = ctx.plan, ctx.saved_tensors
        want_x = ctx.needs_input_grad[1]
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[2:], strict=True) if need]
        x_grad = torch.zeros_like(x) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for i, (a, b) in enumerate(plan.tiles):
            tile = x.narrow(plan.dim, a, b - a).detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = plan.call(i, tile)
            inputs = ([tile] if want_x else []) + params
            if not inputs or not out.requires_grad:
                continue
            grads = torch.autograd.grad(out, inputs, plan.grad_of(grad, i, out), allow_unused=True)
            if want_x and grads[0] is not None:
                x_grad.narrow(plan.dim, a, b - a).copy_(grads[0])
            for k, g in enumerate(grads[int(want_x) :]):
                if g is not None:
                    sums[k] = g if sums[k] is None else sums[k].add_(g)
        it = iter(sums)
        param_grads = [next(it) if need else None for need in ctx.needs_input_grad[2:]]
        return (None, x_grad, *param_grads)


class TiledMLP:
    """DeepSpeed's `TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x)` (an MLP's
    forward, per token) over `shards` tiles of the sequence dim (-2) of `x`, `(B, T, d)` or
    `(T, d)`; returns `fn(self, x)` with the tiled memory and the extra forward of the module
    docstring. `compute_params`: the weights `fn` uses (default: `self`'s parameters)."""

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        self: nn.Module,
        x: torch.Tensor,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be (..., T, d), got shape {tuple(x.shape)}")
        dim = x.dim() - 2
        plan = _Plan(lambda i, t: fn(self, t), tile_bounds(x.shape[dim], shards), dim, "cat", dim)
        return tiled(plan, x, self, compute_params)


def tiled(
    plan: _Plan, x: torch.Tensor, module: nn.Module | None, params: Sequence | None
) -> torch.Tensor:
    """Run `plan` over `x` with gradients for `params` (default: `module`'s parameters)."""
    if params is None:
        params = [] if module is None else list(module.parameters())
    weights = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
    return _Tiled.apply(plan, x, *weights)


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, torch.Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[torch.Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """DeepSpeed's generic tiled call: `fn(**tile, **kwargs_to_pass)` where `tile` holds each of
    `kwargs_to_shard` (all `(B, seqlen, ...)`) cut along dim 1 into `shards` tiles; the outputs
    joined along `output_unshard_dimension` (0: per-tile scalars stacked, as for a loss), then
    reduced by `output_reduction` (`None`, `"mean"`, `"sum"`). Gradients flow to
    `kwargs_to_shard[grad_requiring_tensor_key]` and to `compute_params` (default: none; name the
    weights `fn` uses)."""
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(
            f"output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}"
        )
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not among "
            f"kwargs_to_shard ({sorted(kwargs_to_shard)})"
        )
    for key, t in kwargs_to_shard.items():
        if t.dim() < 2 or t.shape[1] != seqlen:
            raise ValueError(
                f"kwargs_to_shard[{key!r}] has shape {tuple(t.shape)}: every tensor to shard must "
                f"be (B, seqlen={seqlen}, ...)"
            )
    tiles = tile_bounds(seqlen, shards)
    others = {k: v for k, v in kwargs_to_shard.items() if k != grad_requiring_tensor_key}

    def call(i: int, x: torch.Tensor) -> torch.Tensor:
        a, b = tiles[i]
        cut = {k: v[:, a:b] for k, v in others.items()}
        return fn(**{grad_requiring_tensor_key: x}, **cut, **kwargs_to_pass)

    stacked = output_unshard_dimension == 0
    combine = ("stack" if output_reduction is None else output_reduction) if stacked else "cat"
    plan = _Plan(call, tiles, 1, combine, output_unshard_dimension)
    out = tiled(plan, kwargs_to_shard[grad_requiring_tensor_key], None, compute_params or [])
    if stacked or output_reduction is None:
        return out
    return out.sum() if output_reduction == "sum" else out.mean()


class SequenceTiledCompute:
    """DeepSpeed's `SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction,
    *values)`: the positional form of `sequence_tiled_compute` (the values of `keys_to_shard`,
    then of `keys_to_pass`)."""

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: Sequence[str],
        keys_to_pass: Sequence[str],
        grad_requiring_tensor_key: str,
        compute_params: Sequence[torch.Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *values: Any,
    ) -> torch.Tensor:
        if len(values) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(
                f"SequenceTiledCompute: {len(values)} values for {len(keys_to_shard)} keys to "
                f"shard and {len(keys_to_pass)} to pass"
            )
        n = len(keys_to_shard)
        return sequence_tiled_compute(
            fn, seqlen, shards, dict(zip(keys_to_shard, values[:n], strict=True)),
            dict(zip(keys_to_pass, values[n:], strict=True)), grad_requiring_tensor_key,
            compute_params, output_unshard_dimension, output_reduction,
        )  # fmt: skip


class TiledLogitsLoss:
    """DeepSpeed's `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)`: `fn(self, x_tile, y_tile[, mask_tile])` (typically the output head and a
    loss: one scalar per tile) over `shards` tiles of the B·T tokens of `x` `(B, T, d)` and `y`
    `(B, T, ...)` (and `mask` `(B, T)` when not `None`), joined by `output_reduction` (`"sum"`,
    or `"mean"` over the tiles: the token mean only when every tile counts as many tokens, so sum
    and divide by the count yourself otherwise). The whole logits tensor never exists (module
    docstring: saves (1 − 1/s)·B·T·V·4·2 bytes). `compute_params`: the weights `fn` uses
    (default: `self`'s parameters). Exact for any incoming gradient (DeepSpeed's is exact only
    when this is the final loss, unscaled)."""

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        self: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Sequence[torch.Tensor] | None = None,
        output_reduction: str = "mean",
    ) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction must be 'mean' or 'sum', got {output_reduction!r}")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be (B, T, ...) with the same "
                "B and T"
            )
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be (B, T) = {tuple(x.shape[:2])}")
        flat_x = x.reshape(-1, *x.shape[2:])
        flat_y = y.reshape(-1, *y.shape[2:])
        flat_mask = None if mask is None else mask.reshape(-1)
        tiles = tile_bounds(flat_x.shape[0], shards)

        def call(i: int, xt: torch.Tensor) -> torch.Tensor:
            a, b = tiles[i]
            extra = () if flat_mask is None else (flat_mask[a:b],)
            return fn(self, xt, flat_y[a:b], *extra)

        return tiled(_Plan(call, tiles, 0, output_reduction), flat_x, self, compute_params)
