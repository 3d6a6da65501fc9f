"""Fused inference kernels, compiled or reference: the builder, and wrappers that pick one per call.

The functions here have the signatures of `minispeed.inference.kernels_reference` (re-exported
as `kernels.reference`) and agree with it to fp32 rounding (summation order differs). Each call:

- fp32 CPU tensors: the C++ op (`csrc/kernels/kernels.cpp`: AVX-512 / AVX2 / scalar helpers
  chosen by `MINISPEED_SIMD` at build time, OpenMP over rows, GIL released);
- fp32 CUDA tensors on the current device: the CUDA op (`inference_kernels_cuda`:
  `csrc/kernels/kernels_cuda.cu` with the pybind11 binding `kernels_cuda_binding.cpp`, launched
  on the current stream; built only where a GPU is present, never run on this project's CPU
  machines: compile-checked by nvcc only);
- tensors on mixed devices, an op that cannot be built, or `MINISPEED_DISABLE_OPS=inference_kernels`
  (`inference_kernels_cuda` for the CUDA op): the reference, after one warning.

Every kernel takes fp32 only (bf16/fp16 inference is not in this cut): another dtype raises a
`TypeError` that names the fix. Non-contiguous inputs are copied to contiguous first.

Costs (fp32, per call): `layer_norm`/`rms_norm` on (R, C): read 2RC (RC without residual) + 2C,
write 2RC floats; `bias_gelu`: read RC + C, write RC; `masked_softmax`: read RC (+ RC mask
bytes), write RC; `linear` (M, K) x (N, K), M <= 8: 2MNK FLOPs, 4NK weight bytes read once (`linear_many`:
the same per weight, one call; `swiglu`: two (N, K) weights, 4MNK FLOPs, 8NK bytes, writes MN);
`rotary_embedding` (T, H, D): read THD + TD, write THD; `decode_attention`:
4·L·D FLOPs and 2·L·D floats of cache read per (sequence, head); `int8_linear` (M, K) x (N, K):
2MNK FLOPs, N·K weight bytes (a quarter of fp32's) read from memory once per call, for every M
(Note [int8 linear: each weight byte read once for every row]); `argmax` (R, V): read RV floats.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from minispeed.core.op_builder import (
    OpBuilder,
    OpLoader,
)
from minispeed.inference import kernels_reference as reference

__all__ = [
    "InferenceCudaKernelsBuilder",
    "InferenceKernelsBuilder",
    "argmax",
    "bias_gelu",
    "check_decode_inputs",
    "decode_attention",
    "int8_linear",
    "layer_norm",
    "linear",
    "linear_many",
    "load_cuda_op",
    "load_op",
    "masked_softmax",
    "pinned_op",
    "reference",
    "rms_norm",
    "rotary_embedding",
    "rotary_tables",
    "stored_transposed",
    "swiglu",
]

_CSRC = Path(__file__).resolve().parent / "csrc"
rotary_tables = reference.rotary_tables


class InferenceKernelsBuilder(OpBuilder):
    """The CPU op: all seven kernels in one pybind11-only source (no torch headers: seconds to build)."""

    name = "inference_kernels"
    csrc_root = _CSRC
    sources = (
        "kernels/kernels.cpp",
        "kernels/sparse_attention.cpp",
        "kernels/linear.cpp",
        "kernels/decode_step.cpp",
    )


class InferenceCudaKernelsBuilder(OpBuilder):
    """The CUDA op: plain-CUDA kernels (`kernels_cuda.cu`) and a host-only pybind11 binding
    (`kernels_cuda_binding.cpp`), no torch headers; built only where a GPU is present."""

    name = "inference_kernels_cuda"
    csrc_root = _CSRC
    sources = ("kernels/kernels_cuda.cu", "kernels/kernels_cuda_binding.cpp")
    uses_simd = False
    uses_openmp = False


# The CPU op is loaded once per SIMD level: tests switch levels with MINISPEED_SIMD.
_OPS = OpLoader(
    {"cpu": InferenceKernelsBuilder(), "cuda": InferenceCudaKernelsBuilder()}, per_simd_level=True
)

_UNSET = object()
_PINNED: object = _UNSET  # set inside `pinned_op()`: the op every call uses, env unread

# Note [op lookup per call]
# A decode step calls ~10 kernels per block, so the op lookup sits on the per-token path.
# Outside a model forward `OpLoader` answers it from its cache under the raw values of
# MINISPEED_DISABLE_OPS and MINISPEED_SIMD (two os.environ reads), so tests that switch
# levels with monkeypatch.setenv still get the right op. Inside `pinned_op()` (InferenceGPT wraps
# each forward, prefill and decode step in it) the op is resolved once on entry and every kernel
# call reads one module global.


@contextlib.contextmanager
def pinned_op() -> Iterator[None]:
    """Within the block, every kernel call uses the op in force on entry (see Note [op lookup per call])."""
    global _PINNED
    previous = _PINNED
    _PINNED = load_op()
    try:
        yield
    finally:
        _PINNED = previous


def load_op() -> ModuleType | None:
    """The compiled CPU op for the SIMD level in force (`MINISPEED_SIMD`), or `None`: the reference."""
    if _PINNED is not _UNSET:
        return _PINNED  # type: ignore[return-value]
    return _OPS.load("cpu")


def _fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    """`t` checked to be fp32, out of autograd and contiguous (see Note [wrapper cost per call])."""
    if t.dtype != torch.float32:
        raise TypeError(
            f"{name} must be float32 for the inference kernels, got {t.dtype}: call .float() "
            "(bf16/fp16 kernels are not implemented)"
        )
    if t.requires_grad:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def load_cuda_op() -> ModuleType | None:
    """The compiled CUDA op (`inference_kernels_cuda`), or `None` (no GPU, no nvcc, or disabled:
    the reference runs, after one warning)."""
    return _OPS.load("cuda")


# Note [wrapper cost per call]
# A batch-1 int8 decode step of GPT-2 makes ~130 wrapper calls, whose C++ work at small sizes is
# a few microseconds; the wrapper around it was 20-25 µs (load 4-6 on 2 cores): `t.device`
# objects compared per tensor, a `detach()` and a `contiguous()` call per tensor, `torch.empty`
# with a device argument. The common case is checked first and cheaply: every tensor on the CPU
# (`is_cpu`), detached only when it requires grad, copied only when not contiguous.


def _op(*tensors: torch.Tensor | None) -> tuple[ModuleType | None, tuple[int, ...]]:
    """`(op, extra)` for a kernel call on `tensors`: the CPU op and `()` when all are on the CPU;
    the CUDA op and `(stream,)` (the current stream) when all are on the current CUDA device;
    `(None, ())` otherwise, or when the op is unavailable: the reference runs."""
    for t in tensors:  # the common case first: see Note [wrapper cost per call]
        if t is not None and not t.is_cpu:
            break
    else:
        return load_op(), ()
    device = None
    for t in tensors:  # a plain loop: this runs ~10 times per block per decode step
        if t is None:
            continue
        if device is None:
            device = t.device
        elif t.device != device:
            return None, ()
    if device is None or device.type == "cpu":
        return load_op(), ()
    if device.type != "cuda":
        return None, ()
    from minispeed.core.accelerator import get_accelerator

    acc = get_accelerator()
    if device.index not in (None, acc.current_device_index()):
        return None, ()  # another GPU than the current one: the reference handles it
    op = load_cuda_op()
    return (op, (acc.current_stream().cuda_stream,)) if op is not None else (None, ())


def _p(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check_vec(v: torch.Tensor | None, n: int, name: str) -> None:
    if v is not None and v.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(v.shape)}")


def _norm(kind, x, weight, bias, eps, residual):
    x = _fp32(x, "x")
    weight = _fp32(weight, "weight")
    bias = None if bias is None else _fp32(bias, "bias")
    C = x.shape[-1]
    _check_vec(weight, C, "weight")
    _check_vec(bias, C, "bias")
    if residual is not None:
        residual = _fp32(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(
                f"residual has shape {tuple(residual.shape)} but x {tuple(x.shape)}: they must match"
            )
    op, stream = _op(x, weight, bias, residual)
    if op is None:
        if kind == "rms":
            return reference.rms_norm(x, weight, eps, residual)
        return reference.layer_norm(x, weight, bias, eps, residual)
    out, h = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // C if C else 0
    if kind == "rms":
        op.rms_norm(x.data_ptr(), _p(residual), weight.data_ptr(), out.data_ptr(), h.data_ptr(),
                    rows, C, eps, *stream)  # fmt: skip
    else:
        op.layer_norm(x.data_ptr(), _p(residual), weight.data_ptr(), _p(bias), out.data_ptr(),
                      h.data_ptr(), rows, C, eps, *stream)  # fmt: skip
    return out, h


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(LayerNorm(h), h)` with `h = x + residual`, in one pass per row (see the reference)."""
    return _norm("ln", x, weight, bias, eps, residual)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(RMSNorm(h), h)` with `h = x + residual`, in one pass per row (see the reference)."""
    return _norm("rms", x, weight, None, eps, residual)


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """`gelu(x + bias)` in one pass: the erf GeLU, or with `approximate="tanh"` the tanh one
    (`F.gelu`'s argument; GPT-2's `gelu_new`; the CUDA op has only the erf form, so a CUDA tensor
    with "tanh" runs the reference)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f'approximate must be "none" or "tanh" (as F.gelu), got {approximate!r}')
    x = _fp32(x, "x")
    bias = None if bias is None else _fp32(bias, "bias")
    C = x.shape[-1]
    _check_vec(bias, C, "bias")
    op, stream = _op(x, bias)
    tanh = approximate == "tanh"
    if op is None or (tanh and stream):
        return reference.bias_gelu(x, bias, approximate)
    out = torch.empty_like(x)
    kernel = op.bias_gelu_tanh if tanh else op.bias_gelu
    kernel(x.data_ptr(), _p(bias), out.data_ptr(), x.numel() // C if C else 0, C, *stream)
    return out


def masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """Softmax of `scale * scores` over the last dim, `mask` (bool, broadcastable) True = keep.

    A broadcast mask is expanded to the scores' shape for the kernel (one byte per score).
    """
    scores = _fp32(scores, "scores")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be bool (True = keep), got {mask.dtype}: use mask.bool()")
        try:
            mask = mask.expand(scores.shape)
        except RuntimeError:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to scores "
                f"{tuple(scores.shape)}"
            ) from None
    op, stream = _op(scores, mask)
    if op is None:
        return reference.masked_softmax(scores, mask, scale)
    m = None if mask is None else mask.contiguous().view(torch.uint8)
    out = torch.empty_like(scores)
    C = scores.shape[-1]
    op.masked_softmax(scores.data_ptr(), _p(m), out.data_ptr(), scores.numel() // C if C else 0,
                      C, float(scale), *stream)  # fmt: skip
    return out


def rotary_embedding(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    validate: bool = True,
) -> torch.Tensor:
    """Rotate-half rotary embedding of `x` `(T, H, D)` at `positions` `(T,)` (int64).

    `validate=False` skips the range check of `positions` (two reductions, each read back to the
    host) for a caller that checked them once per forward, as `InferenceGPT` does for its L
    layers; they must then lie in `[0, cos.shape[0])`.
    """
    x, cos, sin = _fp32(x, "x"), _fp32(cos, "cos"), _fp32(sin, "sin")
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be (T, H, D) with even D, got {tuple(x.shape)}")
    T, H, D = x.shape
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D // 2:
        raise ValueError(
            f"cos and sin must both be (max_positions, {D // 2}), got {tuple(cos.shape)} and "
            f"{tuple(sin.shape)}: build them with rotary_tables(max_positions, {D})"
        )
    positions = positions.detach().to(torch.int64).contiguous()
    if positions.shape != (T,):
        raise ValueError(f"positions must be ({T},), got {tuple(positions.shape)}")
    if validate and T and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise ValueError(
            f"positions must lie in [0, {cos.shape[0]}), got [{int(positions.min())}, "
            f"{int(positions.max())}]: build longer tables"
        )
    op, stream = _op(x, cos, sin, positions)
    if op is None:
        return reference.rotary_embedding(x, positions, cos, sin)
    out = torch.empty_like(x)
    op.rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), out.data_ptr(),
              T, H, D, *stream)  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """One query token per sequence over its paged KV cache (see Note [paged decode attention]).

    `q` `(B, H, D)`; caches `(num_blocks, block_size, KV, D)` with `H` a multiple of `KV`
    (grouped-query attention: query head h reads cached head `h // (H // KV)`; `KV = H` is
    multi-head attention); `block_tables` `(B, max_blocks)` int32 block ids; `seq_lens` `(B,)`
    valid positions per sequence.

    `validate=False` skips the checks (dtypes, shapes, id ranges: three reductions that each read
    the tables) for a caller that made the inputs itself and checked them once per decode step,
    as `InferenceGPT.decode` does for its L layers; `block_tables` and `seq_lens` must then already
    be contiguous int32 tensors on the caches' device and `q` a contiguous fp32 one.
    """
    if validate:
        q = _fp32(q, "q")
        block_tables, seq_lens = check_decode_inputs(
            tuple(q.shape), k_cache, v_cache, block_tables, seq_lens
        )
    B, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    op, stream = _op(q, k_cache, v_cache, block_tables, seq_lens)
    if op is None:
        return reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    op.decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
                        B, H, k_cache.shape[2], D, k_cache.shape[1], block_tables.shape[1], scale,
                        *stream)  # fmt: skip
    return out


def check_decode_inputs(
    q_shape: tuple[int, ...],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check `decode_attention`'s inputs for queries of shape `q_shape` `(B, H, D)`; return the
    tables and lengths as contiguous int32. Raises `TypeError` / `ValueError` naming the problem."""
    if k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise TypeError(f"the KV cache must be float32, got {k_cache.dtype}/{v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            "k_cache and v_cache must be contiguous (the cache pool allocates them so)"
        )
    B, H, D = q_shape
    NB, BS = k_cache.shape[:2]
    KV = k_cache.shape[2] if k_cache.dim() == 4 else -1
    if k_cache.shape != (NB, BS, KV, D) or v_cache.shape != k_cache.shape or KV < 1 or H % KV:
        raise ValueError(
            f"caches must be (num_blocks, block_size, KV, {D}) with {H} query heads a multiple "
            f"of KV for q {tuple(q_shape)}, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    block_tables = block_tables.detach().to(torch.int32).contiguous()
    seq_lens = seq_lens.detach().to(torch.int32).contiguous()
    if block_tables.dim() != 2 or block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(
            f"block_tables must be ({B}, max_blocks) and seq_lens ({B},), got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    MB = block_tables.shape[1]
    if B and int(seq_lens.max()) > MB * BS:
        raise ValueError(f"a seq_len exceeds max_blocks * block_size = {MB * BS}")
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= NB):
        raise ValueError(f"block ids must lie in [0, {NB})")
    return block_tables, seq_lens


def int8_linear(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x (..., K) @ (weight_q (N, K) int8 · scales (N,))ᵀ + bias`, dequantized inside the kernel.

    The weight is read once per call whatever the row count (see Note [int8 linear: each weight
    byte read once for every row] in csrc/kernels/kernels.cpp). A non-contiguous `weight_q` is
    copied on every call: hold it contiguous, as `quantize_per_channel` returns it.
    """
    x = _fp32(x, "x")
    if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise TypeError(
            f"weight_q must be a 2-D int8 tensor, got {weight_q.dtype} {tuple(weight_q.shape)}: "
            "quantize it with minispeed.inference.quantize.quantize_per_channel"
        )
    N, K = weight_q.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects {K}")
    scales = _fp32(scales, "scales")
    bias = None if bias is None else _fp32(bias, "bias")
    _check_vec(scales, N, "scales")
    _check_vec(bias, N, "bias")
    op, stream = _op(x, weight_q, scales, bias)
    if op is None:
        return reference.int8_linear(x, weight_q, scales, bias)
    if not weight_q.is_contiguous():
        weight_q = weight_q.contiguous()
    M = x.numel() // K if K else 0
    out = x.new_empty((*x.shape[:-1], N))
    op.int8_linear(x.data_ptr(), weight_q.data_ptr(), scales.data_ptr(), _p(bias), out.data_ptr(),
                   M, N, K, *stream)  # fmt: skip
    return out


def _streaming_op(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
) -> ModuleType | None:
    """The CPU op when `kernels.linear`'s C++ path takes `x` with every weight and bias (fp32 CPU
    tensors, at most `linear_max_rows` rows of `x`, 2-D weights of `x`'s width), else `None`."""
    K = x.shape[-1] if x.dim() else 0
    rows = x.numel() // K if K else 0
    op = load_op() if x.is_cpu else None
    if op is None or not 0 < rows <= op.linear_max_rows or x.dtype != torch.float32:
        return None
    for w in weights:
        if w.dtype != torch.float32 or w.dim() != 2 or w.shape[-1] != K or not w.is_cpu:
            return None
    for b in biases:
        if b is not None and (b.dtype != torch.float32 or not b.is_cpu):
            return None
    return op


def _bias_of(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    _check_vec(bias, n, "bias")
    return bias.detach().contiguous()


def stored_transposed(weight: torch.Tensor) -> bool | None:
    """How the `(N, K)` `weight` is laid out for the streaming op: False contiguous
    (`nn.Linear`), True a transposed view of a contiguous `(K, N)` tensor (Hugging Face's
    `Conv1D`, the op's `kn` layout), None any other layout (the op does not take it)."""
    if weight.is_contiguous():
        return False
    return True if weight.stride() == (1, weight.shape[0]) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, reading the weight once when `x` has few rows (decode).

    `x` `(..., K)` with at most `op.linear_max_rows` (8) rows `M = x.numel() / K`, `weight`
    `(N, K)` fp32 on the CPU either contiguous (`nn.Linear`) or a transposed view of a contiguous
    `(K, N)` tensor (Hugging Face's `Conv1D` weight as injection shares it): the C++ op (see
    Note [reading the weights once at full bandwidth] in csrc/kernels/linear.cpp). Anything else
    (more rows: a prefill, compute-bound, where torch's GEMM wins; another layout, dtype or
    device): `F.linear` itself, the reference. Costs: 2MNK FLOPs, 4NK + 4MK + 4MN bytes moved.
    """
    op = _streaming_op(x, (weight,), (bias,))
    kn = None if op is None else stored_transposed(weight)
    if kn is None:
        return reference.linear(x, weight, bias)
    N, K = weight.shape
    bias = _bias_of(bias, N)
    x = x.detach().contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    op.linear(x.data_ptr(), weight.data_ptr(), _p(bias), out.data_ptr(), x.numel() // K, N, K, kn)
    return out


def linear_many(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w_i, b_i)` for each of several `(N_i, K)` weights over one `x`, in one C++
    call when `kernels.linear` would stream each (decode rows, contiguous `nn.Linear` weights):
    LLaMA's q, k and v (see Note [several weights, one pass over x] in csrc/kernels/linear.cpp).
    Otherwise one `reference.linear_many`. Costs: those of the separate `linear` calls,
    `2 M K Σ N_i` FLOPs and `4 K Σ N_i` weight bytes read once, in one call's overhead."""
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases")
    op = _streaming_op(x, tuple(weights), tuple(biases))
    if op is None or not all(w.is_contiguous() for w in weights):
        return reference.linear_many(x, weights, biases)
    biases = [_bias_of(b, w.shape[0]) for w, b in zip(weights, biases)]
    x = x.detach().contiguous()
    outs = tuple(torch.empty(*x.shape[:-1], w.shape[0], dtype=torch.float32) for w in weights)
    op.linear_many(x.data_ptr(), [w.data_ptr() for w in weights], [_p(b) for b in biases],
                   [o.data_ptr() for o in outs], [w.shape[0] for w in weights],
                   x.numel() // x.shape[-1], x.shape[-1])  # fmt: skip
    return outs


def swiglu(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`silu(F.linear(x, gate, gate_bias)) · F.linear(x, up, up_bias)`, LLaMA's MLP before its
    down projection, in one pass over both `(N, K)` weights at decode's few rows: row n of the
    gate and of the up are read side by side and the product written at once (see Note [several
    weights, one pass over x] in csrc/kernels/linear.cpp); otherwise `reference.swiglu`. Costs:
    `4 M N K` FLOPs, `8 N K` weight bytes read once, `4 M N` bytes written (the gate and up
    activations, `8 M N` bytes, are never stored)."""
    op = _streaming_op(x, (gate, up), (gate_bias, up_bias))
    if op is None or gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        return reference.swiglu(x, gate, up, gate_bias, up_bias)
    N, K = gate.shape
    gate_bias, up_bias = _bias_of(gate_bias, N), _bias_of(up_bias, N)
    x = x.detach().contiguous()
    out = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    op.swiglu(x.data_ptr(), gate.data_ptr(), up.data_ptr(), _p(gate_bias), _p(up_bias),
              out.data_ptr(), x.numel() // K, N, K)  # fmt: skip
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` for fp32 `x` `(..., V)` on the CPU, one pass per row (see Note [greedy argmax]
    in csrc/kernels/kernels.cpp): greedy decoding's pick over the vocabulary. Same answer as
    torch's (first index on ties, first NaN if any); other dtypes and devices, or an empty last
    dimension (which torch rejects), run the reference. CPU only: on a GPU torch's argmax is one
    kernel already, so the CUDA op has no counterpart."""
    op = load_op() if x.is_cpu else None
    V = x.shape[-1] if x.dim() else 0
    if op is None or x.dtype != torch.float32 or V == 0:
        return reference.argmax(x)
    x = x.detach().contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    op.argmax_rows(x.data_ptr(), out.data_ptr(), x.numel() // V, V)
    return out
