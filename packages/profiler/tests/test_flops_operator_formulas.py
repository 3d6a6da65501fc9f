"""Each operator's count equals its analytic formula, written out here by hand, and equals
torch's FlopCounterMode for the multiply-accumulate part where both count."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from minispeed.profiler import FlopsProfiler


def _count(model, *inputs, backward=False):
    with FlopsProfiler(model) as prof:
        out = model(*inputs)
        if backward:
            out.sum().backward()
    return prof.result()  # .root: the module alone (the test's .sum() runs outside it)


def _torch_count(model, *inputs, backward=False):
    with FlopCounterMode(display=False) as f:
        out = model(*inputs)
        if backward:
            out.sum().backward()
    return f.get_total_flops()


class Fn(nn.Module):
    def __init__(self, fn, *params):
        super().__init__()
        self.fn = fn
        self.ps = nn.ParameterList(params)

    def forward(self, *x):
        return self.fn(*x, *self.ps)


def test_linear_forward_and_backward_match_the_formula_and_flop_counter():
    B, K, N = 6, 5, 7
    lin = nn.Linear(K, N)
    x = torch.randn(B, K, requires_grad=True)
    r = _count(lin, x, backward=True)
    assert r.root.forward.macs == B * K * N
    assert r.root.forward.flops == 2 * B * K * N + B * N  # + the bias add
    # backward: grad_input (B,N)@(N,K), grad_weight (N,B)@(B,K), grad_bias sums B·N
    assert r.root.backward.macs == 2 * B * K * N
    assert r.root.backward.flops == 4 * B * K * N + B * N
    assert 2 * (r.root.forward.macs + r.root.backward.macs) == _torch_count(lin, x, backward=True)


def test_matmul_and_bmm_count_2mkn_per_batch():
    a, b = torch.randn(3, 4, 5), torch.randn(3, 5, 6)
    r = _count(Fn(torch.bmm), a, b)
    assert r.root.forward.flops == 2 * 3 * 4 * 5 * 6 == _torch_count(Fn(torch.bmm), a, b)
    r = _count(Fn(torch.matmul), torch.randn(4, 5), torch.randn(5, 6))
    assert r.root.forward.flops == 2 * 4 * 5 * 6


@pytest.mark.parametrize("groups,stride,transposed", [(1, 1, False), (2, 2, False), (1, 2, True)])
def test_conv2d_counts_batch_times_weight_times_output_positions(groups, stride, transposed):
    cls = nn.ConvTranspose2d if transposed else nn.Conv2d
    conv = cls(4, 6, kernel_size=3, stride=stride, groups=groups, bias=True)
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    y = conv(x)
    spatial = x.shape[2:] if transposed else y.shape[2:]
    macs = 2 * conv.weight.numel() * spatial[0] * spatial[1]  # batch 2
    r = _count(conv, x, backward=True)
    assert r.root.forward.macs == macs
    assert r.root.forward.flops == 2 * macs + y.numel()
    assert r.root.backward.macs == 2 * macs  # grad_input and grad_weight
    # FlopCounterMode prices the weight gradient of a grouped convolution as if ungrouped
    # (`groups` times too many MACs); otherwise the two agree.
    torch_overcount = 2 * (groups - 1) * macs
    ours = 2 * (r.root.forward.macs + r.root.backward.macs)
    assert ours + torch_overcount == _torch_count(conv, x, backward=True)


def test_layer_norm_and_softmax_count_per_element():
    x = torch.randn(3, 4, 8, requires_grad=True)
    r = _count(nn.LayerNorm(8), x, backward=True)
    assert r.root.forward.flops == x.numel() * (5 + 2)
    assert r.root.backward.flops == x.numel() * (9 + 3)
    x.grad = None  # else the module's backward also adds into x.grad (x.numel() FLOPs)
    r = _count(Fn(lambda t: torch.softmax(t, -1)), x, backward=True)
    assert r.root.forward.flops == 5 * x.numel()
    assert r.root.backward.flops == 4 * x.numel()


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_counts_visible_pairs_and_the_cpu_flash_kernel(causal):
    B, H, S, D = 2, 3, 10, 4
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    sdpa = Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    pairs = B * H * (S * (S + 1) // 2 if causal else S * S)
    r = _count(sdpa, q, k, v, backward=True)
    assert r.root.forward.macs == pairs * 2 * D
    assert r.root.forward.flops == 2 * pairs * 2 * D + 6 * pairs
    assert r.root.backward.macs == pairs * 5 * D
    assert r.root.backward.flops == 2 * pairs * 5 * D + 11 * pairs
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in r.op_totals
    # FlopCounterMode does not know the CPU flash kernel: it counts nothing here.
    assert _torch_count(sdpa, q, k, v, backward=True) == 0


def test_unknown_operators_are_listed_and_known_ones_still_counted():
    x = torch.randn(4, 4)
    r = _count(Fn(lambda t: torch.linalg.qr(t @ t).Q), x)
    assert r.root.forward.flops == 2 * 4 * 4 * 4
    assert any("linalg_qr" in name for name in r.unknown_ops)


def test_an_optimizer_step_is_counted_per_element_without_unknown_ops():
    lin = nn.Linear(8, 8)
    lin(torch.randn(2, 8)).sum().backward()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, foreach=True)
    opt.step()  # creates the momentum buffers
    with FlopsProfiler(lin) as prof:
        opt.step()
    r = prof.result()
    assert r.unknown_ops == {}
    assert r.forward.flops >= 72  # at least one pass over the 72 parameters
    assert any(name.startswith("aten._foreach_") for name in r.op_totals)
