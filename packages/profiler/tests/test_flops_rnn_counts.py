"""Recurrent layers are counted, not listed as unknown: the fused kernels (oneDNN's LSTM on CPU,
cuDNN's RNN/LSTM/GRU, the CUDA cells) count what PyTorch's own cell-by-cell version of the
same layer counts, and both equal a count written out here by hand."""

import pytest
import torch
from torch import nn

from minispeed.profiler import FlopsProfiler, formulas
from minispeed.profiler.ops import op_cost

aten = torch.ops.aten
T, B, I, H = 5, 3, 4, 6  # noqa: E741 (steps, batch, input, hidden: the papers' letters)


def _count(model, x):
    with FlopsProfiler(model) as prof:
        out, _ = model(x)
        out.sum().backward()
    model.zero_grad(set_to_none=True)
    return prof.result()


def _hand_forward_macs(gates, layers, dirs):
    """Per layer and direction, per token: G·(I_l + H) MACs; I_l = I, then dirs·H."""
    return sum(
        dirs * T * B * gates * H * ((I if layer == 0 else dirs * H) + H) for layer in range(layers)
    )


@pytest.mark.parametrize("bidirectional", [False, True])
def test_onednn_lstm_counts_what_the_cell_by_cell_lstm_counts(bidirectional):
    torch.manual_seed(0)
    lstm = nn.LSTM(I, H, num_layers=2, bidirectional=bidirectional)
    x = torch.randn(T, B, I, requires_grad=True)
    fused = _count(lstm, x)
    assert any("mkldnn_rnn_layer" in op for op in fused.op_calls)  # the oneDNN kernel ran
    assert fused.unknown_ops == {}
    with torch.backends.mkldnn.flags(enabled=False):
        cells = _count(lstm, x)
    assert not any("mkldnn" in op for op in cells.op_calls)  # addmm, sigmoid, tanh, mul, add
    assert fused.forward == cells.forward
    dirs = 2 if bidirectional else 1
    macs = _hand_forward_macs(4, 2, dirs)
    assert fused.forward.macs == macs
    # Backward: the data and the weight gradients, each the forward's MACs. The cell-by-cell
    # version skips the product for the zero initial state's gradient, B·H·4H per layer and
    # direction; the fused kernel computes it.
    assert fused.backward.macs == 2 * macs
    assert cells.backward.macs == 2 * macs - 2 * dirs * B * H * 4 * H


@pytest.mark.parametrize("cls,kind", [(nn.GRU, "gru"), (nn.RNN, "rnn_tanh")])
def test_the_gru_and_rnn_cell_constants_are_pytorchs_own_cells(cls, kind):
    torch.manual_seed(0)
    layer = cls(I, H, num_layers=1)
    r = _count(layer, torch.randn(T, B, I))  # on CPU these run cell by cell: counted op by op
    assert r.root.forward == formulas.rnn_layer(kind, T * B, I, H, bias=True)
    gates = formulas.RNN_GATES[kind] * H
    by_hand = 2 * T * B * gates * (I + H) + T * B * (formulas.RNN_POINTWISE[kind] * H + 2 * gates)
    assert r.root.forward.flops == by_hand


def test_cudnn_rnn_formula_covers_every_layer_direction_and_the_projection():
    # cuDNN's operator, priced from its arguments (meta tensors: no GPU needed).
    def meta(*shape):
        return torch.empty(*shape, device="meta")

    P, dirs = 2, 2  # an LSTM with projections, two layers, bidirectional
    weights = []
    for layer in range(2):
        for _ in range(dirs):
            fan_in = I if layer == 0 else dirs * P
            weights += [meta(4 * H, fan_in), meta(4 * H, P), meta(4 * H), meta(4 * H), meta(P, H)]
    args = (meta(T, B, I), weights, 5, None, meta(2 * dirs, B, P), meta(2 * dirs, B, H), 2, H, P,
            2, False, 0.0, True, True, [], None)  # fmt: skip
    cost = op_cost(aten._cudnn_rnn.default, args, {}, None)
    tokens = T * B
    macs = sum(
        dirs * tokens * (4 * H * ((I if layer == 0 else dirs * P) + P) + H * P)
        for layer in range(2)
    )
    other = 2 * dirs * tokens * (13 * H + 2 * 4 * H)
    assert cost == formulas.Cost(2 * macs + other, macs)


def test_cuda_fused_cells_count_their_element_wise_work():
    def meta(*shape):
        return torch.empty(*shape, device="meta")

    lstm = op_cost(
        aten._thnn_fused_lstm_cell.default,
        (meta(B, 4 * H), meta(B, 4 * H), meta(B, H), meta(4 * H), meta(4 * H)), {}, None,
    )  # fmt: skip
    assert lstm == formulas.Cost(B * (13 * H + 2 * 4 * H))
    gru = op_cost(aten._thnn_fused_gru_cell.default, (meta(B, 3 * H), meta(B, 3 * H), meta(B, H)),
                  {}, None)  # fmt: skip
    assert gru == formulas.Cost(B * 10 * H)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's RNN kernels need a GPU")
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_cudnn_rnns_count_what_the_cell_by_cell_version_counts(cls):
    torch.manual_seed(0)
    layer = cls(I, H, num_layers=2, bidirectional=True).cuda()
    x = torch.randn(T, B, I, device="cuda", requires_grad=True)
    fused = _count(layer, x)
    assert any("cudnn_rnn" in op for op in fused.op_calls)
    assert fused.unknown_ops == {}
    with torch.backends.cudnn.flags(enabled=False):
        cells = _count(layer, x)
    assert fused.forward == cells.forward
