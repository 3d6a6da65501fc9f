"""A decode step's blocks as raw op calls on buffers kept between steps.

Note [decode step as raw op calls]
A batch-1 int8 decode step of GPT-2 (124M) reads its weights in ~14 ms at this machine's
single-core bandwidth, and each of its 12 `FusedGPTBlock` forwards cost ~250 µs of Python
around the kernels besides: four `nn.Module` calls, a wrapper per kernel (checks, an output
`torch.empty`), `chunk`, three reshapes and two `index_copy_` for the cache, the residual add.
`GPTDecodePlan` runs the same kernels in the same order on the same inputs, so its output is the
block loop's bit for bit (`test_decode_plan_equals_the_block_loop` checks), on buffers allocated
once per batch size and reused every step (the weights' and buffers' addresses are read once).
For GPT blocks the whole layer loop is one op call per step, `op.gpt_layers` (Note [the GPT
blocks in one call] in csrc/kernels/decode_step.cpp), which runs per layer:

```text
a      = LayerNorm1(x)                 layer_norm                             -> a
qkv    = a @ Wqkvᵀ + b                 int8_linear / linear                   -> qkv (B, 3C)
cache  <- k, v (rows of qkv)           a copy per sequence into its slot
y      = attention(q, cache)           decode_attention (q: in qkv, or one copy at B > 1)
n2, h  = LayerNorm2(y @ Woᵀ + bo + x)  int8_linear, layer_norm(residual=x)
g      = gelu(n2 @ Wfcᵀ + bfc)         int8_linear, bias_gelu[_tanh]
x'     = g @ Wpᵀ + bp + h              int8_linear, the residual add
```

LLaMA blocks (`LlamaDecodePlan`) are one op call per kernel from Python, with `index_copy_` for
the cache writes and torch's `silu(gate) · up` with int8 weights.

It applies where every block is a `FusedGPTBlock` whose four linears are `Int8Linear`s or
`StreamingLinear`s the C++ op takes (no tensor parallelism), the op is loaded, the tensors are on
the CPU, and the batch has at most `op.linear_max_rows` rows when a linear is fp32; otherwise
`InferenceGPT.decode` runs the block loop. Buffers: `4 · B · (6C + F)` bytes per plan (C the
width, F the MLP width), one plan per batch size and thread, kept on the model.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from minispeed.inference import kernels
from minispeed.inference.fused_gpt import FusedGPTBlock, StreamingLinear, set_decode_planner
from minispeed.inference.fused_llama import FusedLlamaBlock
from minispeed.inference.quantize import Int8Linear

__all__ = ["GPTDecodePlan", "LlamaDecodePlan", "build"]

# linear(x_ptr, out_ptr, rows): y (rows, N) = x (rows, K) @ Wᵀ + b, all addresses but x/out fixed.
LinearCall = Callable[[int, int, int], None]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _linear_fields(op: ModuleType, m: torch.nn.Module, rows: int) -> tuple | None:
    """`(kind, weight, scales, bias, N, K)` of the op call `kernels.int8_linear` or
    `kernels.linear` makes for module `m` at `rows` rows (kind 0: int8 (N, K); 1: fp32 (N, K);
    2: fp32 stored (K, N)), then the tensors behind the addresses; None where that wrapper would
    not call the op (another module, layout, dtype, device)."""
    if isinstance(m, Int8Linear):
        wq, s, b = m.weight_q, m.scales, m.bias
        if not (wq.is_cpu and wq.is_contiguous() and s.dtype == torch.float32):
            return None
        if b is not None and not (b.dtype == torch.float32 and b.is_contiguous()):
            return None
        return (0, wq.data_ptr(), s.data_ptr(), _ptr(b), *wq.shape), (wq, s, b)
    if type(m) is StreamingLinear:
        w, b = m.weight, m.bias
        if rows > op.linear_max_rows or w.dtype != torch.float32 or not w.is_cpu:
            return None
        if b is not None and not (b.dtype == torch.float32 and b.is_contiguous()):
            return None
        kn = kernels.stored_transposed(w)  # a Conv1D weight's transposed view: True
        if kn is None:
            return None
        return (2 if kn else 1, w.data_ptr(), 0, _ptr(b), *w.shape), (w, b)
    return None


def _linear_call(op: ModuleType, m: torch.nn.Module, rows: int) -> LinearCall | None:
    """The op call of `_linear_fields` as a function of the input and output addresses."""
    found = _linear_fields(op, m, rows)
    if found is None:
        return None
    (kind, w, s, b, N, K), keep = found
    if kind == 0:
        return lambda x, out, M, keep=keep: op.int8_linear(x, w, s, b, out, M, N, K)
    return lambda x, out, M, keep=keep: op.linear(x, w, b, out, M, N, K, kind == 2)


class GPTDecodePlan:
    """The L blocks of an `InferenceGPT` decode step at `batch` rows (see Note [decode step as
    raw op calls]), run by one `op.gpt_layers` call per step (Note [the GPT blocks in one call] in
    csrc/kernels/decode_step.cpp); build with `GPTDecodePlan.build`, which answers None where it
    does not apply."""

    def __init__(self, op: ModuleType, blocks: list[FusedGPTBlock], batch: int, head_dim: int,
                 layers: list[list[int]], keep: list) -> None:  # fmt: skip
        self.op, self.blocks, self.batch, self._keep = op, blocks, batch, keep
        first = blocks[0]
        C, F, B = first.ln1.weight.numel(), first.fc.out_features, batch
        self.C, self.D, self.H, self.F = C, head_dim, first.n_head, F
        self.layers = torch.tensor(layers, dtype=torch.int64)  # (L, op.gpt_layer_fields)
        self.eps = torch.tensor([[b.ln1.eps, b.ln2.eps] for b in blocks], dtype=torch.float64)
        # x0, x1 (the residual stream, ping-pong), a, p, y, n2, h, qkv, f, g, q: see decode_step.cpp
        widths = (C, C, C, C, C, C, C, 3 * C, F, F, C)
        self.buffers = [torch.empty(B, w) for w in widths]
        self.x0 = self.buffers[0]
        self.buffer_ptrs = torch.tensor([t.data_ptr() for t in self.buffers], dtype=torch.int64)
        self.by_address = {t.data_ptr(): t for t in self.buffers[:2]}

    @staticmethod
    def build(model: torch.nn.Module, op: ModuleType, batch: int) -> GPTDecodePlan | None:
        """A plan for `model`'s blocks at `batch` rows, or None (see the module docstring)."""
        blocks = list(model.blocks)
        if model.n_kv_head != model.n_head:
            return None
        layers, keep = [], []
        for b in blocks:
            if type(b) is not FusedGPTBlock:
                return None
            if not _vectors_ok(b.ln1.weight, b.ln1.bias, b.ln2.weight, b.ln2.bias, b.fc_bias):
                return None
            found = [_linear_fields(op, m, batch) for m in (b.qkv, b.attn_proj, b.fc, b.mlp_proj)]
            if any(f is None for f in found):
                return None
            vectors = (b.ln1.weight, b.ln1.bias, b.ln2.weight, b.ln2.bias, b.fc_bias)
            row = [_ptr(v) for v in vectors] + [int(b.gelu_approximate == "tanh")]
            for fields, tensors in found:
                row.extend(fields)
                keep.append(tensors)
            layers.append(row)
        if len(layers[0]) != op.gpt_layer_fields:
            return None
        return GPTDecodePlan(op, blocks, batch, model.head_dim, layers, keep)

    def run(self, x: torch.Tensor, cache, slots: torch.Tensor, tables: torch.Tensor,
            seq_lens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The blocks over `x` `(B, 1, C)`, writing each layer's K, V at `slots` of `cache`;
        returns `(B, 1, C)` (a buffer of the plan: read it before the next step)."""
        B, C = self.batch, self.C
        self.x0.copy_(x.view(B, C))
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        caches = torch.tensor([t.data_ptr() for kv in zip(cache.k, cache.v) for t in kv],
                              dtype=torch.int64)  # fmt: skip
        out = self.op.gpt_layers(
            self.layers.data_ptr(), self.eps.data_ptr(), self.buffer_ptrs.data_ptr(),
            caches.data_ptr(), len(self.blocks), slots.data_ptr(), tables.data_ptr(),
            seq_lens.data_ptr(), B, C, self.F, self.H, self.D, cache.k[0].shape[1],
            tables.shape[1], 1.0 / self.D**0.5,
        )  # fmt: skip
        return self.by_address[out].view(B, 1, C)


def _vectors_ok(*vectors: torch.Tensor | None) -> bool:
    """Every given vector is a contiguous fp32 CPU tensor (what the wrappers would pass as is)."""
    return all(
        v is None or (v.is_cpu and v.dtype == torch.float32 and v.is_contiguous()) for v in vectors
    )


class LlamaDecodePlan:
    """`FusedLlamaBlock`s as raw op calls (see Note [decode step as raw op calls]): per layer
    `op.rms_norm`, q/k/v (`op.linear_many` with fp32 weights, three `op.int8_linear` with int8),
    `op.rotary` on q and k, the cache writes, `op.decode_attention` (grouped-query), o and
    `op.rms_norm(residual=x)`, then `op.swiglu` (fp32) or gate, up and `silu(gate) · up` (int8, in
    torch as the block does), down, and the residual add."""

    def __init__(self, op: ModuleType, blocks: list[FusedLlamaBlock], batch: int,
                 calls: list[tuple]) -> None:  # fmt: skip
        self.op, self.blocks, self.batch, self.calls = op, blocks, batch, calls
        first, B = blocks[0], batch
        self.C, self.D = first.ln1.weight.numel(), first.head_dim
        self.H, self.KV, self.F = first.n_head, first.n_kv_head, first.down.in_features
        C, HD, KD, F = self.C, self.H * self.D, self.KV * self.D, self.F
        self.x = [torch.empty(B, C), torch.empty(B, C)]  # the residual stream, ping-pong
        self.a, self.p, self.n2, self.h = (torch.empty(B, C) for _ in range(4))
        self.q, self.qr, self.y = torch.empty(B, HD), torch.empty(B, HD), torch.empty(B, HD)
        self.k, self.kr, self.v = torch.empty(B, KD), torch.empty(B, KD), torch.empty(B, KD)
        self.g, self.u, self.m = torch.empty(B, F), torch.empty(B, F), torch.empty(B, F)

    @staticmethod
    def build(model: torch.nn.Module, op: ModuleType, batch: int) -> LlamaDecodePlan | None:
        """A plan for `model`'s LLaMA blocks at `batch` rows, or None (see the module docstring)."""
        calls = []
        for b in model.blocks:
            if type(b) is not FusedLlamaBlock:
                return None
            if not _vectors_ok(b.ln1.weight, b.ln2.weight, b.cos, b.sin):
                return None
            if b.streaming:  # fp32: one linear_many for q/k/v, one swiglu (as the block calls)
                ws = (b.q, b.k, b.v, b.gate, b.up)
                if batch > op.linear_max_rows or not all(
                    m.weight.is_cpu and m.weight.is_contiguous() and _vectors_ok(m.bias) for m in ws
                ):
                    return None
                if b.gate.weight.shape != b.up.weight.shape:
                    return None
                inner = (b.q, b.k, b.v), (b.gate, b.up)
            else:
                inner = tuple(_linear_call(op, m, batch) for m in (b.q, b.k, b.v, b.gate, b.up))
                if any(c is None for c in inner):
                    return None
            outer = tuple(_linear_call(op, m, batch) for m in (b.o, b.down))
            if any(c is None for c in outer):
                return None
            calls.append((inner, outer))
        return LlamaDecodePlan(op, list(model.blocks), batch, calls)

    def _qkv(self, blk: FusedLlamaBlock, inner) -> None:
        """q, k, v of `self.a` into `self.q`, `self.k`, `self.v`, as the block computes them."""
        if blk.streaming:
            ms = inner[0]
            self.op.linear_many(self.a.data_ptr(), [m.weight.data_ptr() for m in ms],
                                [_ptr(m.bias) for m in ms],
                                [t.data_ptr() for t in (self.q, self.k, self.v)],
                                [m.weight.shape[0] for m in ms], self.batch, self.C)  # fmt: skip
            return
        for call, out in zip(inner[:3], (self.q, self.k, self.v)):
            call(self.a.data_ptr(), out.data_ptr(), self.batch)

    def _gated(self, blk: FusedLlamaBlock, inner) -> None:
        """`silu(gate(n2)) · up(n2)` into `self.m`, as the block computes it."""
        if blk.streaming:
            gate, up = inner[1]
            self.op.swiglu(self.n2.data_ptr(), gate.weight.data_ptr(), up.weight.data_ptr(),
                           _ptr(gate.bias), _ptr(up.bias), self.m.data_ptr(), self.batch, self.F,
                           self.C)  # fmt: skip
            return
        inner[3](self.n2.data_ptr(), self.g.data_ptr(), self.batch)
        inner[4](self.n2.data_ptr(), self.u.data_ptr(), self.batch)
        torch.mul(torch.nn.functional.silu(self.g), self.u, out=self.m)

    def run(self, x: torch.Tensor, cache, slots: torch.Tensor, tables: torch.Tensor,
            seq_lens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """As `GPTDecodePlan.run`; `positions` `(B, 1)` int64, each sequence's new position."""
        op, B, C, D, H, KV = self.op, self.batch, self.C, self.D, self.H, self.KV
        pos = positions.reshape(-1)
        if pos.dtype != torch.int64 or not pos.is_contiguous():
            pos = pos.to(torch.int64).contiguous()
        cur = self.x[0]
        cur.copy_(x.view(B, C))
        tp, lp, scale = tables.data_ptr(), seq_lens.data_ptr(), 1.0 / D**0.5
        for layer, (blk, (inner, (lin_o, lin_down))) in enumerate(zip(self.blocks, self.calls)):
            nxt = self.x[(layer + 1) % 2]
            eps1, eps2 = blk.ln1.variance_epsilon, blk.ln2.variance_epsilon
            op.rms_norm(cur.data_ptr(), 0, blk.ln1.weight.data_ptr(), self.a.data_ptr(),
                        self.p.data_ptr(), B, C, eps1)  # fmt: skip
            self._qkv(blk, inner)
            cos, sin = blk.cos.data_ptr(), blk.sin.data_ptr()
            op.rotary(self.q.data_ptr(), cos, sin, pos.data_ptr(), self.qr.data_ptr(), B, H, D)
            op.rotary(self.k.data_ptr(), cos, sin, pos.data_ptr(), self.kr.data_ptr(), B, KV, D)
            kc, vc = cache.k[layer], cache.v[layer]
            kc.view(-1, KV, D).index_copy_(0, slots, self.kr.view(B, KV, D))
            vc.view(-1, KV, D).index_copy_(0, slots, self.v.view(B, KV, D))
            op.decode_attention(self.qr.data_ptr(), kc.data_ptr(), vc.data_ptr(), tp, lp,
                                self.y.data_ptr(), B, H, KV, D, kc.shape[1], tables.shape[1],
                                scale)  # fmt: skip
            lin_o(self.y.data_ptr(), self.p.data_ptr(), B)
            op.rms_norm(self.p.data_ptr(), cur.data_ptr(), blk.ln2.weight.data_ptr(),
                        self.n2.data_ptr(), self.h.data_ptr(), B, C, eps2)  # fmt: skip
            self._gated(blk, inner)
            lin_down(self.m.data_ptr(), nxt.data_ptr(), B)
            nxt.add_(self.h)
            cur = nxt
        return cur.view(B, 1, C)


def build(model: torch.nn.Module, op: ModuleType | None, batch: int):
    """The plan of `model`'s decode step at `batch` rows (GPT or LLaMA blocks), or None where the
    block loop must run (see Note [decode step as raw op calls])."""
    if op is None or not len(model.blocks) or model.tp is not None:
        return None
    if type(model.blocks[0]) is FusedLlamaBlock:
        return LlamaDecodePlan.build(model, op, batch)
    return GPTDecodePlan.build(model, op, batch)


set_decode_planner(build)
