"""Sequence tiling (`tiled.py`, ALST's TiledMLP and tiled loss), one process: the tiled result and
every gradient equal the untiled computation's, each weight's gradient arrives once per backward
(what ZeRO's hooks need), the bytes autograd keeps from forward to backward are the tiled ones of
the module docstring, and bad arguments are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minispeed.tensor_parallel.tiled import (
    SequenceTiledCompute,
    TiledLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
    tile_bounds,
)

B, T, D, F_, V = 2, 10, 8, 24, 16


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, F_, bias=False), nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _mlp(self: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return GatedMLP.forward(self, x)


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad] + [p.grad for p in module.parameters()]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shards", [1, 3, 4, 10])
def test_tiled_mlp_equals_the_mlp_values_and_gradients(shards: int) -> None:
    torch.manual_seed(0)
    mlp, x0, g = GatedMLP(), torch.randn(B, T, D), torch.randn(B, T, D)
    x = x0.clone().requires_grad_()
    want_out = mlp(x)
    want_out.backward(g)
    want = _grads(mlp, x)
    mlp.zero_grad()
    x = x0.clone().requires_grad_()
    out = TiledMLP.apply(_mlp, mlp, x, shards, None)
    out.backward(g)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    _close(_grads(mlp, x), want)


def test_each_weight_gradient_arrives_once_per_backward() -> None:
    """ZeRO's reducer takes a gradient when its hook fires and refuses a second one in the same
    backward: the tiles' gradients are summed inside and handed over once."""
    mlp, x = GatedMLP(), torch.randn(B, T, D, requires_grad=True)
    fired = []
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    TiledMLP.apply(_mlp, mlp, x, 5, None).sum().backward()
    assert len(fired) == 3 and {id(p) for p in fired} == {id(p) for p in mlp.parameters()}


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps from forward to backward while `fn()` runs (saved tensors, each
    storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_tiled_mlp_keeps_only_its_input_for_backward() -> None:
    """Untiled, a gated MLP keeps its input and ≈ 4·B·T·I·b bytes of intermediates; tiled, only
    the input (B·T·d·b): the (1 − 1/s)·4·B·T·I·b of the module docstring, and more, is not held."""
    mlp, x = GatedMLP(), torch.randn(B, T, D, requires_grad=True)
    untiled = _saved_bytes(lambda: mlp(x))
    tiled = _saved_bytes(lambda: TiledMLP.apply(_mlp, mlp, x, 5, None))
    intermediates = 4 * B * T * F_ * 4
    assert untiled >= intermediates  # gate, up, silu, product (and x, the weights)
    assert tiled == B * T * D * 4  # x alone


def _head_loss(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(x).float()
    return F.cross_entropy(logits.view(-1, V), y.reshape(-1), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("shards", [1, 3, 7])
def test_tiled_logits_loss_equals_the_loss_under_any_scaling(shards: int) -> None:
    """The summed loss, then divided by the counted tokens and scaled (as the sequence-parallel
    weighting does): values and the gradients of x and the head's weight equal the untiled ones.
    (DeepSpeed's version computes the weight gradient inside forward for an incoming gradient of
    1, so this scaling makes it wrong.)"""
    torch.manual_seed(1)
    head, x0 = nn.Linear(D, V, bias=False), torch.randn(B, T, D)
    y = torch.randint(0, V, (B, T))
    y[0, :3] = -100
    count = (y != -100).sum()
    x = x0.clone().requires_grad_()
    want_loss = _head_loss(head, x, y) / count * 0.37
    want_loss.backward()
    want = _grads(head, x)
    head.zero_grad()
    x = x0.clone().requires_grad_()
    summed = TiledLogitsLoss.apply(_head_loss, head, x, y, None, shards, [head.weight], "sum")
    loss = summed / count * 0.37
    loss.backward()
    torch.testing.assert_close(loss, want_loss)
    _close(_grads(head, x), want)


def test_tiled_logits_loss_mask_and_mean() -> None:
    """With a mask passed to `fn` and the mean over equal tiles."""
    torch.manual_seed(2)
    head, x0 = nn.Linear(D, V, bias=False), torch.randn(B, T, D)
    y, mask = torch.randint(0, V, (B, T)), torch.rand(B, T) > 0.3

    def masked(head, x, y, m):
        return (F.cross_entropy(head(x), y, reduction="none") * m).sum()

    x = x0.clone().requires_grad_()
    want_loss = masked(head, x.reshape(-1, D), y.reshape(-1), mask.reshape(-1).float()) / 4
    want_loss.backward()
    want = _grads(head, x)
    head.zero_grad()
    x = x0.clone().requires_grad_()
    loss = TiledLogitsLoss.apply(masked, head, x, y, mask.float(), 4, None, "mean")
    loss.backward()
    torch.testing.assert_close(loss, want_loss)
    _close(_grads(head, x), want)


def test_sequence_tiled_compute_both_forms() -> None:
    """The generic form: an MLP over tiles (output joined on the sequence dim, then averaged), and
    the positional `SequenceTiledCompute.apply`, against the untiled values and gradients."""
    torch.manual_seed(3)
    mlp, x0, scale = GatedMLP(), torch.randn(B, T, D), torch.randn(B, T, 1)

    def fn(hidden, scale, factor):
        return mlp(hidden) * scale * factor

    x = x0.clone().requires_grad_()
    want_loss = fn(x, scale, 2.0).mean()
    want_loss.backward()
    want = _grads(mlp, x)
    params = list(mlp.parameters())
    for form in ("kwargs", "positional"):
        mlp.zero_grad()
        x = x0.clone().requires_grad_()
        if form == "kwargs":
            loss = sequence_tiled_compute(
                fn, T, 4, {"hidden": x, "scale": scale}, {"factor": 2.0}, "hidden", params
            )
        else:
            loss = SequenceTiledCompute.apply(
                fn, T, 4, ["hidden", "scale"], ["factor"], "hidden", params, 1, "mean",
                x, scale, 2.0,
            )  # fmt: skip
        loss.backward()
        torch.testing.assert_close(loss, want_loss)
        _close(_grads(mlp, x), want)


def test_tile_bounds_cut_as_torch_chunk() -> None:
    for n, s in [(10, 3), (10, 4), (3, 5), (8, 8), (1, 1)]:
        sizes = [b - a for a, b in tile_bounds(n, s)]
        assert sizes == [c.shape[0] for c in torch.arange(n).chunk(s)]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: TiledMLP.apply(_mlp, GatedMLP(), torch.randn(B, T, D), 0, None), "shards"),
        (lambda: TiledMLP.apply(_mlp, GatedMLP(), torch.randn(D), 2, None), r"\(\.\.\., T, d\)"),
        (
            lambda: TiledLogitsLoss.apply(
                _head_loss, nn.Linear(D, V), torch.randn(B, T, D), torch.zeros(B, T - 1), None,
                2, None, "sum",
            ),
            "same B and T",
        ),
        (
            lambda: TiledLogitsLoss.apply(
                _head_loss, nn.Linear(D, V), torch.randn(B, T, D), torch.zeros(B, T), None, 2,
                None, "max",
            ),
            "output_reduction",
        ),
        (
            lambda: sequence_tiled_compute(
                lambda h: h, T, 2, {"h": torch.randn(B, T + 1, D)}, {}, "h"
            ),
            r"seqlen=10",
        ),
        (lambda: sequence_tiled_compute(lambda h: h, T, 2, {"h": torch.randn(B, T)}, {}, "x"), "'x'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_by_name(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
