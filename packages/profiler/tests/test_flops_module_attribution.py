"""Each module is charged its own work, forward and backward, once per call: siblings that share
an input, modules that return their input, a block called several times (its calls, and the
adds that combine them charged to its caller: Note [who adds up a gradient] in tracker.py). Expectations
come from each module counted alone (`FlopCounterMode` for the matrix products, the formulas
written out here by hand for the rest), never from the profiler itself."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from minispeed.profiler import FlopsProfiler

B, C = 4, 8


def _alone_matmul_flops(module, *shapes):
    """Forward and backward matmul FLOPs of `module` run alone (inputs needing gradients)."""
    xs = [torch.randn(*s, requires_grad=True) for s in shapes]
    with FlopCounterMode(display=False) as fc:
        out = module(*xs)
    fwd = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        out.sum().backward()
    module.zero_grad(set_to_none=True)
    return fwd, fc.get_total_flops()


def _exclusive_rows_sum_to_the_total(r):
    """Each module's own share (itself minus its children) plus the work outside every
    module adds up to the step's total, in both phases."""

    def own(m, phase):
        return getattr(m, phase).flops - sum(getattr(c, phase).flops for c in m.children)

    def walk(m):
        yield m
        for c in m.children:
            yield from walk(c)

    for phase, outside in (("forward", r.outside_forward), ("backward", r.outside_backward)):
        rows = sum(own(m, phase) for m in walk(r.root))
        assert rows + outside.flops == getattr(r, phase).flops, phase
        assert all(own(m, phase) >= 0 for m in walk(r.root)), phase


class SharedInput(nn.Module):
    """Attention-style projections and a gated MLP: q, k, v (and gate, up) read the same x."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(C)
        self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.gate, self.up = nn.Linear(C, 2 * C, bias=False), nn.Linear(C, 2 * C, bias=False)
        self.down = nn.Linear(2 * C, C, bias=False)

    def forward(self, x):
        h = self.ln(x)
        a = self.q(h) * self.k(h) + self.v(h)  # (B, C)
        return self.down(torch.relu(self.gate(a)) * self.up(a))


def test_siblings_that_share_an_input_are_each_charged_their_own_backward():
    torch.manual_seed(0)
    model = SharedInput()
    x = torch.randn(B, C, requires_grad=True)
    with FlopsProfiler(model) as prof:
        model(x).sum().backward()
    r = prof.result()
    for name, fan_in, fan_out, bias in (
        ("q", C, C, True), ("k", C, C, True), ("v", C, C, True),
        ("gate", C, 2 * C, False), ("up", C, 2 * C, False), ("down", 2 * C, C, False),
    ):  # fmt: skip
        row = r.module(name)
        fwd, bwd = _alone_matmul_flops(getattr(model, name), (B, fan_in))
        assert (2 * row.forward.macs, 2 * row.backward.macs) == (fwd, bwd), name
        # By hand: forward 2·B·K·N (+ B·N bias); backward dX and dW, 4·B·K·N (+ B·N bias sum).
        mkn = B * fan_in * fan_out
        assert row.forward.flops == 2 * mkn + (B * fan_out if bias else 0), name
        assert row.backward.flops == 4 * mkn + (B * fan_out if bias else 0), name
    # The parent owns what it runs itself, the accumulation of h's three gradients included:
    # LayerNorm backward aside, adding dh from q, k, v is 2·B·C.
    ln = r.module("ln")
    assert ln.backward.flops == B * C * (9 + 3)  # formulas.LN_BWD + LN_AFFINE_BWD, nothing else
    _exclusive_rows_sum_to_the_total(r)


@pytest.mark.parametrize("passthrough", [nn.Identity(), nn.Dropout(p=0.0)], ids=type)
def test_a_module_returning_its_input_is_charged_nothing(passthrough):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(C, C), passthrough, nn.Linear(C, C), nn.Tanh())
    model.train()
    x = torch.randn(B, C, requires_grad=True)
    with FlopsProfiler(model) as prof:
        model(x).sum().backward()
    r = prof.result()
    assert r.module("1").forward.flops == r.module("1").backward.flops == 0
    for name in ("0", "2"):
        fwd, bwd = _alone_matmul_flops(model[int(name)], (B, C))
        row = r.module(name)
        assert (2 * row.forward.macs, 2 * row.backward.macs) == (fwd, bwd), name
        assert row.backward.flops == 4 * B * C * C + B * C, name
    assert r.module("3").backward.flops == B * C  # tanh_backward, one FLOP per element
    _exclusive_rows_sum_to_the_total(r)


class Repeated(nn.Module):
    """ALBERT-style: one block applied `times` times in one forward."""

    def __init__(self, times):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(C, C), nn.Tanh())
        self.head = nn.Linear(C, 1)
        self.times = times

    def forward(self, x):
        for _ in range(self.times):
            x = self.block(x)
        return self.head(x)


@pytest.mark.parametrize("times", [1, 3])
def test_a_block_called_several_times_is_charged_every_backward(times):
    torch.manual_seed(0)
    model = Repeated(times)
    x = torch.randn(B, C, requires_grad=True)
    with FlopsProfiler(model) as prof:
        model(x).sum().backward()
    r = prof.result()
    block = r.module("block")
    assert block.calls == times

    class Alone(nn.Module):  # the block's calls, counted alone by FlopCounterMode
        def forward(self, x):
            for _ in range(times):
                x = model.block(x)
            return x

    fwd, bwd = _alone_matmul_flops(Alone(), (B, C))
    assert (2 * block.forward.macs, 2 * block.backward.macs) == (fwd, bwd)
    # By hand, per call: dX and dW 4·B·C², the bias gradient B·C, tanh's B·C. The block is
    # charged its calls, each what one call costs; adding the weight's and bias's gradients of
    # the `times` calls together, (times-1)·(C²+C), is the caller's (Note [who adds up a
    # gradient] in tracker.py), here the model's own share.
    per_call = 4 * B * C * C + 2 * B * C
    assert block.backward.flops == times * per_call
    head = r.module("head")
    assert head.backward.flops == 4 * B * C + 1 * B
    assert r.root.backward.flops - block.backward.flops - head.backward.flops == (times - 1) * (
        C * C + C
    )
    assert r.module("block.0").calls == times
    _exclusive_rows_sum_to_the_total(r)


class Calls(nn.Module):
    """`lin` (no bias) called `times` times: in a chain, or each call on the same input `x`."""

    def __init__(self, times: int, form: str):
        super().__init__()
        self.lin, self.times, self.form = nn.Linear(C, C, bias=False), times, form

    def forward(self, x):
        if self.form == "chain":
            for _ in range(self.times):
                x = self.lin(x)
            return x
        return sum(self.lin(x) for _ in range(self.times))  # x handed to every call


@pytest.mark.parametrize("form", ["chain", "same_input"])
@pytest.mark.parametrize("times", [1, 2, 3])
def test_a_module_called_n_times_is_charged_n_calls_and_its_caller_the_sums(times, form):
    """The rule of Note [who adds up a gradient], on issue 32's `Linear` called 1, 2, 3 times:
    the module's backward is `times` × one call's (dX and dW: 2 · 2·B·C²), never the adds that
    combine its calls; those are its caller's: (times-1)·C² for its weight's gradients, and
    (times-1)·B·C more when every call reads the same input x (x's gradients)."""
    torch.manual_seed(0)
    model = Calls(times, form)
    x = torch.randn(B, C, requires_grad=True)
    with FlopsProfiler(model) as prof:
        model(x).sum().backward()
    r = prof.result()
    lin = r.module("lin")
    assert lin.calls == times
    assert lin.backward.flops == times * 2 * (2 * B * C * C)
    caller_adds = (times - 1) * C * C + (times - 1) * B * C * (form == "same_input")
    assert r.root.backward.flops - lin.backward.flops == caller_adds
    _exclusive_rows_sum_to_the_total(r)


class _Marker:
    """An object only the autograd graph holds (through a custom function's context)."""


class _Keep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, marker):
        ctx.marker = marker
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


@pytest.mark.parametrize("outside_model", [True, False])
def test_a_gradient_hook_is_no_modules_work_and_the_accumulation_stays_its(outside_model):
    """Note [work in a gradient hook]: ZeRO's kind of hook (the gradient scaled by 1/N into a
    bucket, after `AccumulateGrad`) is no module's backward: the "(outside modules)" row, or
    uncounted for a `StepProfiler`; the accumulation into an existing `.grad`, in the same
    node, stays the module's. The received gradient is still stolen into `.grad`, not copied.
    Before, the hook's C·C FLOPs were charged to the `Linear`."""
    lin = nn.Linear(C, C, bias=False)
    slot = torch.empty(C, C)

    def into_bucket(p: torch.Tensor) -> None:
        torch.mul(p.grad, 0.5, out=slot)

    lin.weight.register_post_accumulate_grad_hook(into_bucket)
    x = torch.randn(B, C, requires_grad=True)
    grad_path = 4 * B * C * C  # dX and dW, 2·B·C·C each
    for existing in (None, torch.zeros(C, C)):
        lin.weight.grad, x.grad = existing, None
        with FlopsProfiler(lin, outside_model=outside_model) as prof:
            lin(x).sum().backward()
        r = prof.result()
        added = 0 if existing is None else C * C  # .grad += the new gradient
        assert r.root.backward.flops == grad_path + added
        assert r.outside_backward.flops == (C * C if outside_model else 0)  # the hook's mul
        assert r.backward.flops == r.root.backward.flops + r.outside_backward.flops
        assert torch.equal(slot, 0.5 * lin.weight.grad)
        if existing is None:  # stolen, as unprofiled: no copy of the gradient
            assert not {"aten.clone", "aten.copy_"} & set(r.op_calls), r.op_calls


def test_a_profiled_forward_frees_its_graph_like_an_unprofiled_one():
    import gc
    import weakref

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(C, C)

        def forward(self, x, marker):
            return self.lin(_Keep.apply(x, marker))

    model = Model()
    prof = FlopsProfiler(model)
    marker = _Marker()
    alive = weakref.ref(marker)
    with prof:
        y = model(torch.randn(B, C, requires_grad=True), marker)
    del y, marker  # no backward: the graph, and what it saved, must go with its last tensor
    gc.collect()
    assert alive() is None  # the profiler keeps no node (its tags live in the nodes)
    assert prof.result().module("lin").forward.macs == B * C * C


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_blocks_own_their_recomputation_and_backward(use_reentrant):
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(C, C), nn.Linear(C, C)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = Block(), nn.Linear(C, 1)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=use_reentrant))

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(B, C, requires_grad=True)
    with set_checkpoint_early_stop(False), FlopsProfiler(model) as prof:
        model(x).sum().backward()
    r = prof.result()
    linear_fwd = 2 * B * C * C + B * C
    linear_bwd = 4 * B * C * C + B * C  # dX, dW, the bias gradient
    for name in ("block.a", "block.b"):  # each linear ran twice forward and once backward
        row = r.module(name)
        assert row.forward.flops == row.recompute.flops == linear_fwd, name
        assert row.backward.flops == linear_bwd + linear_fwd, name  # recompute inside backward
    block = r.module("block")
    tanh = B * C  # forward, and its backward (tanh_backward)
    assert block.recompute.flops == 2 * linear_fwd + tanh
    assert block.backward.flops == 2 * linear_bwd + tanh + block.recompute.flops
    _exclusive_rows_sum_to_the_total(r)
