"""The operator table: what each aten operator costs, from its arguments and outputs.

`op_cost(func, args, kwargs, out)` answers a `Cost` for an operator it knows and `None` for
one it does not (the profiler lists those by name; it never guesses). An operator is known when

1. it has a formula below (matrix products, convolutions, attention, recurrent layers,
   normalization, softmax, losses, reductions), or
2. it carries PyTorch's `pointwise` tag (1 FLOP per output element, see `formulas`), or
3. it moves or creates data without arithmetic (views, copies, gathers, factories) or is a
   collective (`c10d`) or a profiler annotation: 0 FLOPs;
4. it is an optimizer's `_foreach_*` list operator: 1 FLOP per element of its first list.

Formulas read arguments by their schema names (`_bind`), so positional and keyword calls count
alike. See Note [what a FLOP is here] in `formulas.py` for the conventions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from minispeed.profiler import formulas as F
from minispeed.profiler.formulas import Cost

__all__ = ["matmul_shape", "op_cost"]

aten = torch.ops.aten
Formula = Callable[[dict[str, Any], Any], Cost]
_FORMULAS: dict[Any, Formula] = {}


def _register(*packets: Any) -> Callable[[Formula], Formula]:
    def deco(fn: Formula) -> Formula:
        for packet in packets:
            _FORMULAS[packet] = fn
        return fn

    return deco


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name: positional first, then keywords, then defaults."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _numel(x: Any) -> int:
    return x.numel() if isinstance(x, torch.Tensor) else 0


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


# ---- matrix products -------------------------------------------------------------------------


@_register(aten.mm)
def _mm(a: dict, out: Any) -> Cost:
    (m, k), n = a["self"].shape, a["mat2"].shape[1]
    return F.matmul(m, k, n)


@_register(aten.addmm)
def _addmm(a: dict, out: Any) -> Cost:
    (m, k), n = a["mat1"].shape, a["mat2"].shape[1]
    return F.matmul(m, k, n, bias=True)


@_register(aten.bmm)
def _bmm(a: dict, out: Any) -> Cost:
    b, m, k = a["self"].shape
    return F.matmul(m, k, a["mat2"].shape[2], batch=b)


@_register(aten.baddbmm)
def _baddbmm(a: dict, out: Any) -> Cost:
    b, m, k = a["batch1"].shape
    return F.matmul(m, k, a["batch2"].shape[2], batch=b, bias=True)


@_register(aten.addmv)
def _addmv(a: dict, out: Any) -> Cost:
    m, k = a["mat"].shape
    return F.matmul(m, k, 1, bias=True)


@_register(aten.mv)
def _mv(a: dict, out: Any) -> Cost:
    m, k = a["self"].shape
    return F.matmul(m, k, 1)


@_register(aten.dot, aten.vdot)
def _dot(a: dict, out: Any) -> Cost:
    return F.matmul(1, a["self"].numel(), 1)


# ---- convolution -----------------------------------------------------------------------------


@_register(aten.convolution, aten._convolution, aten.convolution_overrideable)
def _conv(a: dict, out: Any) -> Cost:
    x, w, transposed = a["input"], a["weight"], a["transposed"]
    y = _first_tensor(out)
    cost = F.conv(x.shape[0], w.shape, y.shape[2:], transposed=transposed, in_spatial=x.shape[2:])
    if a.get("bias") is not None:
        cost = cost + Cost(y.numel())
    return cost


@_register(aten.convolution_backward)
def _conv_backward(a: dict, out: Any) -> Cost:
    # grad_input is a (transposed) convolution of grad_output with the weight, grad_weight one of
    # the input with grad_output: each has the forward's MACs. grad_bias sums grad_output.
    g, x, w, transposed, mask = (
        a[k] for k in ("grad_output", "input", "weight", "transposed", "output_mask")
    )
    fwd = F.conv(x.shape[0], w.shape, g.shape[2:], transposed=transposed, in_spatial=x.shape[2:])
    cost = Cost()
    for wanted in mask[:2]:
        if wanted:
            cost = cost + fwd
    if mask[2]:
        cost = cost + Cost(g.numel())
    return cost


# ---- attention -------------------------------------------------------------------------------

_SDPA_FWD = (
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
)
_SDPA_BWD = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
)


def _sdpa_cost(a: dict, backward: bool) -> Cost:
    q, k, v = a["query"], a["key"], a["value"]  # (B, H, S, D); k, v may have fewer heads (GQA)
    batch_heads = math.prod(q.shape[:-2])
    # A given mask can hide anything: count the full rectangle (Note [what a FLOP is here]).
    causal = bool(a.get("is_causal", False))
    return F.sdpa(batch_heads, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], causal, backward)


@_register(*_SDPA_FWD)
def _sdpa_fwd(a: dict, out: Any) -> Cost:
    return _sdpa_cost(a, backward=False)


@_register(*_SDPA_BWD)
def _sdpa_bwd(a: dict, out: Any) -> Cost:
    return _sdpa_cost(a, backward=True)


# ---- recurrent layers (Note [what a FLOP is here], `formulas.rnn_layer`) ---------------------


@_register(aten.mkldnn_rnn_layer, aten.mkldnn_rnn_layer_backward)
def _mkldnn_rnn(a: dict, out: Any) -> Cost:
    # oneDNN's LSTM on CPU: one call per layer and direction; weight1 (backward) or weight0
    # (forward) is W_ih (G, I).
    backward = "grad_output" in a
    w_ih = a["weight1"] if backward else a["weight0"]
    x = a["input"]
    return F.rnn_layer(
        F.RNN_KINDS[a["mode"]], x.numel() // x.shape[-1], w_ih.shape[1], a["hidden_size"],
        bias=bool(a["has_biases"]), backward=backward,
    )  # fmt: skip


@_register(aten._cudnn_rnn, aten._cudnn_rnn_backward)
def _cudnn_rnn(a: dict, out: Any) -> Cost:
    # cuDNN's RNN, LSTM and GRU: every layer and direction in one call; `weight` holds
    # `weight_stride0` tensors per layer and direction: W_ih, W_hh[, b_ih, b_hh][, W_hr].
    weights, per, x = a["weight"], a["weight_stride0"], a["input"]
    backward = "output_mask" in a
    kind, tokens = F.RNN_KINDS[a["mode"]], x.numel() // x.shape[-1]
    cost = Cost()
    for i in range(0, len(weights), per):
        cost = cost + F.rnn_layer(
            kind, tokens, weights[i].shape[1], a["hidden_size"], bias=per >= 4,
            proj_size=a["proj_size"], backward=backward,
            weight_grads=not backward or bool(a["output_mask"][3]),
        )  # fmt: skip
    return cost


@_register(aten._thnn_fused_lstm_cell, aten._thnn_fused_gru_cell)
def _fused_cell(a: dict, out: Any) -> Cost:
    # The element-wise half of an LSTMCell/GRUCell on CUDA (its products are mm calls).
    kind = "lstm" if "cx" in a else "gru"
    gates = a["input_gates"]
    hidden = gates.shape[-1] // F.RNN_GATES[kind]
    tokens = gates.numel() // gates.shape[-1]
    bias = a.get("input_bias") is not None
    return Cost(tokens * (F.RNN_POINTWISE[kind] * hidden + (2 * gates.shape[-1] if bias else 0)))


@_register(aten._thnn_fused_lstm_cell_backward_impl, aten._thnn_fused_gru_cell_backward)
def _fused_cell_backward(a: dict, out: Any) -> Cost:
    kind = "lstm" if "grad_cy" in a else "gru"
    grad = a["grad_hy"] if a.get("grad_hy") is not None else a["grad_cy"]
    hidden, tokens = grad.shape[-1], grad.numel() // grad.shape[-1]
    gates = F.RNN_GATES[kind] * hidden
    bias = 2 * tokens * gates if a["has_bias"] else 0
    return Cost(2 * tokens * F.RNN_POINTWISE[kind] * hidden + bias)


# ---- normalization, softmax, losses, reductions ----------------------------------------------


@_register(aten.native_layer_norm)
def _layer_norm(a: dict, out: Any) -> Cost:
    return F.layer_norm(a["input"].numel(), affine=a.get("weight") is not None)


@_register(aten.native_layer_norm_backward)
def _layer_norm_backward(a: dict, out: Any) -> Cost:
    mask = a["output_mask"]
    n = a["grad_out"].numel()
    flops = (F.LN_BWD if mask[0] else 0) + (F.LN_AFFINE_BWD if mask[1] or mask[2] else 0)
    return Cost(n * flops)


@_register(aten._softmax, aten._log_softmax)
def _softmax(a: dict, out: Any) -> Cost:
    return F.softmax(a["self"].numel())


@_register(aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward(a: dict, out: Any) -> Cost:
    return F.softmax(a["grad_output"].numel(), backward=True)


@_register(aten.nll_loss_forward, aten.nll_loss_backward, aten.nll_loss2d_forward)
def _nll(a: dict, out: Any) -> Cost:
    return Cost(a["target"].numel())  # gather and sum (or scatter) one value per target


@_register(aten.embedding_dense_backward)
def _embedding_backward(a: dict, out: Any) -> Cost:
    return Cost(a["grad_output"].numel())  # each gradient row is added into its token's row


@_register(
    aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.prod, aten.var,
    aten.std, aten.norm, aten.linalg_vector_norm, aten.var_mean, aten.std_mean, aten.logsumexp,
    aten.any, aten.all, aten.argmax, aten.argmin, aten.cumsum,
)  # fmt: skip
def _reduction(a: dict, out: Any) -> Cost:
    return Cost(_numel(a.get("self", a.get("input"))))


# ---- no arithmetic ---------------------------------------------------------------------------

_DATA_MOVEMENT = {
    aten.clone, aten._unsafe_view, aten.copy_, aten._to_copy, aten.copy, aten.cat, aten.stack, aten.embedding,
    aten.index, aten.index_select, aten.gather, aten.scatter, aten.index_put, aten.index_put_,
    aten.masked_select, aten.constant_pad_nd, aten.repeat, aten.flip, aten.roll, aten.tril,
    aten.triu, aten.zeros, aten.zeros_like, aten.ones, aten.ones_like, aten.empty, aten.empty_like,
    aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.new_zeros, aten.new_ones,
    aten.full, aten.full_like, aten.new_full, aten.fill_, aten.fill, aten.zero_, aten.arange,
    aten.randn, aten.rand, aten.randint, aten.randperm, aten.normal_, aten.uniform_,
    aten.bernoulli_, aten.bernoulli, aten.native_dropout, aten.scalar_tensor, aten.lift_fresh,
    aten.lift_fresh_copy, aten._local_scalar_dense, aten.item, aten.topk, aten.sort,
    aten.multinomial, aten.split_with_sizes_copy, aten.slice_scatter, aten.select_scatter,
    aten.select_backward, aten.slice_backward, aten.set_, aten.resize_, aten.alias,
    aten.nonzero, aten.one_hot, aten.sym_size, aten.sym_numel, aten.sym_stride,
    aten.is_same_size, aten._has_compatible_shallow_copy_type, aten.detach, aten.detach_,
    aten.masked_fill, aten.masked_fill_, aten.where, aten.unfold, aten.pixel_shuffle,
    aten.native_dropout_backward,
}  # fmt: skip
"""Operators that move, create or select values: 0 FLOPs (a dropout's mask multiply is
counted only through the mask-free pointwise ops around it; a `where` selects)."""


_NO_ARITHMETIC_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor", "profiler"}
"""Collectives (bytes on the wire, which the comms logger counts) and profiler annotations."""


def _is_view(func: Any) -> bool:
    """Operators whose output aliases their input (view, transpose, expand, split, ...)."""
    schema = func._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


_MATMULS = {aten.mm: ("self", "mat2"), aten.addmm: ("mat1", "mat2"), aten.bmm: ("self", "mat2"),
            aten.baddbmm: ("batch1", "batch2")}  # fmt: skip


def matmul_shape(func: Any, args: tuple, kwargs: dict) -> tuple[int, int, int, int] | None:
    """`(batch, m, k, n)` of a matrix-product operator, None for any other operator: the
    performance model times each shape the step runs (`perf_model.matmul_seconds`)."""
    names = _MATMULS.get(func.overloadpacket)
    if names is None:
        return None
    a = _bind(func, args, kwargs)
    x, y = a[names[0]], a[names[1]]
    batch = x.shape[0] if x.dim() == 3 else 1
    return batch, x.shape[-2], x.shape[-1], y.shape[-1]


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> Cost | None:
    """The cost of one call of aten operator `func` (an OpOverload), or None if unknown."""
    packet = func.overloadpacket
    formula = _FORMULAS.get(packet)
    if formula is not None:
        return formula(_bind(func, args, kwargs), out)
    if func.namespace in _NO_ARITHMETIC_NAMESPACES:
        return F.ZERO
    if packet.__name__.startswith("_foreach_"):
        # An optimizer's fused list operators: 1 FLOP per element of the first list, like the
        # element-wise operator they batch.
        first = args[0] if args else ()
        return Cost(sum(_numel(t) for t in first) if isinstance(first, (list, tuple)) else 0)
    if packet in _DATA_MOVEMENT or _is_view(func):
        return F.ZERO
    if torch.Tag.pointwise in func.tags:
        y = _first_tensor(out)
        return Cost(y.numel() if y is not None else 0)
    return None
