"""FLOP and MAC formulas: one function per kind of computation, on shapes only.

The operator table (`ops.py`) calls these for each aten operator it sees; the tests and the
docs call the same functions, so prose, tool and test cannot drift.

Conventions (Note [what a FLOP is here]):

- A **MAC** is one multiply-accumulate of a matrix product or a convolution; it costs **2 FLOPs**.
  `macs` counts only those; `flops` counts everything, so `flops = 2·macs + other`.
- Matrix product (M, K) @ (K, N): `M·K·N` MACs. A bias added to it (`addmm`): `M·N` more FLOPs.
- Convolution: `batch · prod(weight.shape) · prod(output spatial)` MACs (input spatial for a
  transposed convolution), `+ batch·C_out·prod(output spatial)` FLOPs for the bias.
- Element-wise operators (add, mul, gelu, tanh, ...): **1 FLOP per output element**, whatever
  the function (a GELU is one FLOP, as in DeepSpeed's profiler; transcendental cost is not
  modelled). Reductions (sum, mean, max): 1 FLOP per input element.
- LayerNorm forward: `LN_FWD` = 5 FLOPs per element (mean 1, subtract 1, square-accumulate 2,
  scale by 1/σ 1) + `AFFINE` = 2 with a weight and bias; backward: `LN_BWD` = 9 per element
  for the input gradient + 3 for the weight and bias gradients.
- Softmax (and log-softmax) forward: `SOFTMAX_FWD` = 5 FLOPs per element (max, subtract, exp,
  sum, divide); backward: `SOFTMAX_BWD` = 4 (multiply, sum, subtract, multiply).
- Scaled-dot-product attention over P visible (query, key) pairs per (batch, head):
  forward `P·(D_qk + D_v)` MACs (scores and the weighted sum of values) and `6·P` other FLOPs
  (scale 1 + softmax 5); backward `P·(3·D_qk + 2·D_v)` MACs (the scores recomputed, then the
  gradients of V, of the probabilities, of Q and of K) and `11·P` other FLOPs (scale and softmax
  recomputed 6, softmax backward 4, scale backward 1). Causal attention (`is_causal=True`,
  top-left aligned as in PyTorch: query i sees keys j <= i) has `P = Σ_i min(i+1, S_k)`, which
  is `S(S+1)/2` for a square S × S, not `S²`.
- Recurrent layers (RNN, LSTM, GRU; `rnn_layer`): the gate products of each step as matrix
  products, and per hidden element and step the element-wise work of the cell as PyTorch's
  own cell writes it (`RNN_POINTWISE`); the fused kernels (oneDNN, cuDNN) count the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AFFINE",
    "LN_BWD",
    "LN_FWD",
    "SOFTMAX_BWD",
    "SOFTMAX_FWD",
    "Cost",
    "attention_pairs",
    "conv",
    "gpt_forward",
    "layer_norm",
    "matmul",
    "rnn_layer",
    "sdpa",
    "softmax",
]

LN_FWD = 5
AFFINE = 2
LN_BWD = 9
LN_AFFINE_BWD = 3
SOFTMAX_FWD = 5
SOFTMAX_BWD = 4
RNN_GATES = {"rnn_relu": 1, "rnn_tanh": 1, "lstm": 4, "gru": 3}
"""Gate pre-activations per hidden element: `G = RNN_GATES[kind]·H` rows of the weights."""
RNN_POINTWISE = {"rnn_relu": 2, "rnn_tanh": 2, "lstm": 13, "gru": 10}
"""Element-wise FLOPs per hidden element and step, biases aside (PyTorch's cells):
RNN: add the two products, activation (2). LSTM: add the products (4), three sigmoids and a
tanh on the gates (4), `c' = f·c + i·g` (3), `h' = o·tanh(c')` (2): 13. GRU: `r` and `z`, add
and sigmoid (2 + 2), `n = tanh(x_n + r·h_n)` (3), `h' = n + z·(h − n)` (3): 10."""
RNN_KINDS = {0: "rnn_relu", 1: "rnn_tanh", 2: "lstm", 3: "gru"}
"""The `mode` argument of cuDNN's and oneDNN's RNN operators."""
SDPA_FWD_OTHER = 1 + SOFTMAX_FWD  # scale, softmax
SDPA_BWD_OTHER = SDPA_FWD_OTHER + SOFTMAX_BWD + 1  # recomputed scale and softmax, their backward


@dataclass(frozen=True)
class Cost:
    """What one operator call costs: `flops` in all, of which `2·macs` are multiply-accumulates."""

    flops: int = 0
    macs: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.macs + other.macs)


ZERO = Cost()


def matmul(m: int, k: int, n: int, batch: int = 1, bias: bool = False) -> Cost:
    """`batch` products (m, k) @ (k, n): `batch·m·k·n` MACs, `+ batch·m·n` FLOPs with a bias."""
    macs = batch * m * k * n
    return Cost(2 * macs + (batch * m * n if bias else 0), macs)


def conv(
    batch: int,
    weight_shape: Sequence[int],
    out_spatial: Sequence[int],
    bias: bool = False,
    *,
    transposed: bool = False,
    in_spatial: Sequence[int] = (),
) -> Cost:
    """A convolution's MACs: `batch · prod(weight) · prod(spatial)`.

    `spatial` is the output's spatial size for an ordinary convolution, the input's for a
    transposed one (each input position is scattered through the whole kernel). The bias adds
    `batch · C_out · prod(out_spatial)` FLOPs, C_out = weight_shape[0] (weight_shape[1]·groups
    for a transposed convolution: pass `bias=False` and add it yourself there).
    """
    spatial = in_spatial if transposed else out_spatial
    macs = batch * math.prod(weight_shape) * math.prod(spatial)
    bias_flops = batch * weight_shape[0] * math.prod(out_spatial) if bias else 0
    return Cost(2 * macs + bias_flops, macs)


def layer_norm(numel: int, affine: bool, backward: bool = False) -> Cost:
    """LayerNorm over `numel` elements (see the module docstring for the per-element counts)."""
    if backward:
        return Cost(numel * (LN_BWD + (LN_AFFINE_BWD if affine else 0)))
    return Cost(numel * (LN_FWD + (AFFINE if affine else 0)))


def softmax(numel: int, backward: bool = False) -> Cost:
    """Softmax or log-softmax over `numel` elements."""
    return Cost(numel * (SOFTMAX_BWD if backward else SOFTMAX_FWD))


def rnn_layer(
    kind: str,
    tokens: int,
    input_size: int,
    hidden_size: int,
    bias: bool,
    proj_size: int = 0,
    backward: bool = False,
    weight_grads: bool = True,
) -> Cost:
    """One layer and direction of an RNN (`kind`: "rnn_tanh", "rnn_relu", "lstm", "gru") over
    `tokens` = steps × batch, input I, hidden H, G = `RNN_GATES[kind]`·H gate rows, recurrent
    width R = `proj_size` or H:

    - forward: `tokens·G·(I + R)` MACs (the input and the recurrent products) plus
      `tokens·H·proj_size` for an LSTM's projection; `tokens·RNN_POINTWISE[kind]·H` element-wise
      FLOPs, `+ 2·tokens·G` for the two biases.
    - backward: the data gradients (of the input and the recurrent state) have the forward's
      MACs, the weight gradients as many again (`weight_grads=False`: cuDNN asked for data only);
      the element-wise work counts 2 FLOPs per forward element-wise FLOP (a local derivative
      and its product; the fused kernels' inner work is not observable, this is the convention).
    """
    gates = RNN_GATES[kind] * hidden_size
    recurrent = proj_size or hidden_size
    macs = tokens * gates * (input_size + recurrent) + tokens * hidden_size * proj_size
    other = tokens * (RNN_POINTWISE[kind] * hidden_size + (2 * gates if bias else 0))
    if not backward:
        return Cost(2 * macs + other, macs)
    macs = macs * (2 if weight_grads else 1)
    return Cost(2 * macs + 2 * other, macs)


def attention_pairs(s_q: int, s_k: int, causal: bool) -> int:
    """Visible (query, key) pairs of one head: `s_q·s_k`, or `Σ_i min(i+1, s_k)` when causal."""
    if not causal:
        return s_q * s_k
    full = min(s_q, s_k)  # rows 0..full-1 see i+1 keys, the rest see all s_k
    return full * (full + 1) // 2 + (s_q - full) * s_k


def sdpa(
    batch_heads: int, s_q: int, s_k: int, d_qk: int, d_v: int, causal: bool, backward: bool = False
) -> Cost:
    """Scaled-dot-product attention for `batch_heads` = B·H heads (module docstring for the terms)."""
    pairs = batch_heads * attention_pairs(s_q, s_k, causal)
    if backward:
        macs = pairs * (3 * d_qk + 2 * d_v)
        return Cost(2 * macs + SDPA_BWD_OTHER * pairs, macs)
    macs = pairs * (d_qk + d_v)
    return Cost(2 * macs + SDPA_FWD_OTHER * pairs, macs)


def gpt_forward(
    *,
    batch: int,
    seq: int,
    n_layer: int,
    n_embd: int,
    n_head: int,
    vocab: int,
    loss: bool = True,
    gelu_flops: int = 1,
) -> Cost:
    """Forward FLOPs of the GPT-2 recipe (examples/gpt.py; Hugging Face `GPT2LMHeadModel` with
    `gelu_flops=8`, its tanh-approximated `gelu_new` being 8 element-wise operators), module by
    module, from the formulas above. B = batch, T = seq,
    C = n_embd, L = n_layer, V = vocab, N = B·T tokens:

    - embeddings: the position add, `N·C`;
    - per block: two LayerNorms `2·N·C·(5+2)`; attention projections `matmul(N, C, 3C) +
      matmul(N, C, C)` with biases; causal attention `sdpa(B·H, T, T, C/H, C/H, causal)`; MLP
      `matmul(N, C, 4C) + matmul(N, 4C, C)` with biases and a GELU `gelu_flops·4·N·C`; two residual adds
      `2·N·C`;
    - final LayerNorm `N·C·7`, tied head `matmul(N, C, V)` (no bias);
    - loss: log-softmax `5·N·V` and the negative log-likelihood gather-sum `N`.

    The conventional "model FLOPs" are the MAC part: `2·N·(12·L·C² + V·C) + 2·L·B·C·T(T+1)`.
    """
    n, c = batch * seq, n_embd
    block = (
        layer_norm(2 * n * c, affine=True)
        + matmul(n, c, 3 * c, bias=True)
        + sdpa(batch * n_head, seq, seq, c // n_head, c // n_head, causal=True)
        + matmul(n, c, c, bias=True)
        + matmul(n, c, 4 * c, bias=True)
        + Cost(gelu_flops * 4 * n * c)  # GELU
        + matmul(n, 4 * c, c, bias=True)
        + Cost(2 * n * c)  # residual adds
    )
    total = Cost(n * c)  # token + position embedding add
    for _ in range(n_layer):
        total = total + block
    total = total + layer_norm(n * c, affine=True) + matmul(n, c, vocab)
    if loss:
        total = total + softmax(n * vocab) + Cost(n)
    return total
