"""A large gradient is reduce-scattered in the tensor autograd produced, not copied into a bucket.

Note [a large gradient travels alone] (stage3/strategy.py): a gradient of at least
``_ALONE_NUMEL`` elements forms a bucket of its own and its reduce-scatter runs in place in its
``(N, s)`` view, so the step writes no staging copy of it; smaller gradients still share buckets
(one ``torch.cat`` each). On 2 gloo ranks, with the default bucket (large enough for the whole
model), the large weight's message is its own and its input is the very storage autograd
accumulated; the step's result equals plain AdamW on the averaged gradient.
"""

from __future__ import annotations

import torch
from torch import nn

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3.strategy import _ALONE_NUMEL

LARGE = (640, 512)  # 327,680 elements: above _ALONE_NUMEL


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(LARGE[1], LARGE[0]), nn.Tanh(), nn.Linear(LARGE[0], 8))


def _body(rank: int, world_size: int) -> dict:
    model = _model()
    x = torch.randn(4, LARGE[1], generator=torch.Generator().manual_seed(rank))
    big = model[0].weight
    produced: list[int] = []  # storage of the gradient autograd accumulated (our hook runs later)
    big.register_post_accumulate_grad_hook(
        lambda p: produced.append(p.grad.untyped_storage().data_ptr())
    )
    opt = zero.shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=zero.ZeroConfig(stage=3)
    )
    reducer = opt.strategy.reducer
    sent: list[tuple[int, int]] = []  # (input numel, input storage) of each reduce-scatter
    plain = reducer.reduce_scatter

    def spy(output, input, **kwargs):
        sent.append((input.numel(), input.untyped_storage().data_ptr()))
        return plain(output, input, **kwargs)

    reducer.reduce_scatter = spy
    opt.backward(model(x).square().mean())
    opt.step()
    with zero.GatheredParameters(list(model.parameters())):
        after = [p.detach().clone() for p in model.parameters()]
    return dict(produced=produced, sent=sent, after=after)


def test_a_large_gradient_is_reduced_where_autograd_left_it() -> None:
    assert LARGE[0] * LARGE[1] >= _ALONE_NUMEL
    results = run_distributed(_body, world_size=2, timeout_s=120)
    for got in results:
        [storage] = got["produced"]
        numels = sorted(n for n, _ in got["sent"])
        small = sum(p.numel() for p in _model().parameters()) - LARGE[0] * LARGE[1]
        assert numels == sorted([small, LARGE[0] * LARGE[1]]), numels  # its own message
        assert (LARGE[0] * LARGE[1], storage) in got["sent"]  # in place: no staging copy
    # The same step in one process: AdamW on the gradient averaged over both ranks' inputs.
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xs = [torch.randn(4, LARGE[1], generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (sum(model(x).square().mean() for x in xs) / 2).backward()
    opt.step()
    for got in results:
        for ours, want in zip(got["after"], model.parameters()):
            torch.testing.assert_close(ours, want.detach(), rtol=1e-5, atol=1e-6)
