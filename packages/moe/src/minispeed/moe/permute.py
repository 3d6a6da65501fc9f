"""Permute tokens into expert order and back: the compiled op, its reference, and autograd.

Reading order: `permute_reference.py` (what the two kernels compute), this file (which one runs,
and how they pair up as each other's backward), `dispatch.py` (the plan that produces the
indices).

`gather_rows` / `combine_rows` have the reference's signatures and dispatch on the device:

- CPU, fp32: the C++ op (`csrc/permute/permute.cpp`; scalar, AVX2+FMA and AVX-512 row loops on
  OpenMP threads, see Note [SIMD paths, one build] there);
- CUDA, fp32: the CUDA op (`csrc/permute/permute_cuda.cu`);
- any other dtype, an op that cannot be built, or `MINISPEED_DISABLE_OPS=moe_permute`: the
  reference (after one warning when the op could not be built).

`permute(x, plan)` and `unpermute(y, plan, weight)` are the differentiable forms the layer uses:

| forward                                   | backward of the input                         |
|-------------------------------------------|-----------------------------------------------|
| permute: `gather_rows(x, slot_token)`     | `combine_rows(grad, token_slot)` (weight 1)   |
| unpermute: `combine_rows(y, token_slot, w)` | `gather_rows(grad, slot_token, slot_weight)` |

plus, for unpermute, the gate weights' gradient `dw[t, j] = <grad[t], y[token_slot[t, j]]>`.
Costs per call: N·d reads and writes for a gather of N rows, T·k·d reads and T·d writes for a
combine (fp32: 4 B each) - against the einsum reference's S·E·C·d multiply-adds
(see `dispatch_einsum.py`).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from minispeed.core.accelerator import get_accelerator
from minispeed.core.op_builder import OpBuilder, OpLoader
from minispeed.moe import permute_reference as reference

__all__ = [
    "PermuteBuilder",
    "PermuteCudaBuilder",
    "combine_rows",
    "gather_rows",
    "load_op",
    "permute",
    "reference",
    "unpermute",
]

_CSRC = Path(__file__).resolve().parent / "csrc"


class PermuteBuilder(OpBuilder):
    """The CPU op: one pybind11-only .cpp (no torch headers: builds in seconds), SIMD + OpenMP."""

    name = "moe_permute"
    csrc_root = _CSRC
    sources = ("permute/permute.cpp",)


class PermuteCudaBuilder(OpBuilder):
    """The CUDA op: plain-CUDA kernels plus a host-only pybind11 binding (needs a GPU)."""

    name = "moe_permute_cuda"
    csrc_root = _CSRC
    sources = ("permute/permute_cuda.cu", "permute/permute_cuda_binding.cpp")
    uses_simd = False
    uses_openmp = False


_OPS = OpLoader({"cpu": PermuteBuilder(), "cuda": PermuteCudaBuilder()})


def load_op(device_type: str = "cpu") -> ModuleType | None:
    """The compiled op for `device_type`, or `None` to run the reference.

    Loaded once per process (the SIMD level in force at the first call wins);
    `MINISPEED_DISABLE_OPS` is read on every call.
    """
    return _OPS.load(device_type)


def _check_rows(name: str, src: torch.Tensor, index: torch.Tensor, extra: torch.Tensor | None):
    if src.dim() != 2:
        raise ValueError(f"{name}: src must be 2-D (rows, d), got shape {tuple(src.shape)}")
    if index.device != src.device or (extra is not None and extra.device != src.device):
        raise ValueError(f"{name}: src, index and weights must be on one device ({src.device})")


def _compiled(src: torch.Tensor) -> ModuleType | None:
    if src.dtype != torch.float32:
        return None  # the kernels are fp32; other dtypes take the reference
    return load_op(src.device.type)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _run_cuda(kernel: Any, *args: Any) -> None:
    """Launch a CUDA kernel with a device error flag, then raise if an index was out of range."""
    acc = get_accelerator()
    device = args[0].device
    if device.index is not None and device.index != acc.current_device_index():
        raise ValueError(
            f"permute op: tensors on {device} but the current device is "
            f"{acc.current_device_index()}: call get_accelerator().set_device({device.index}) first"
        )
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    raw = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    kernel(*raw, flag.data_ptr(), acc.current_stream().cuda_stream)
    if int(flag.item()):  # one sync; a bad index must raise, not read wild memory silently
        raise IndexError("permute op: an index is outside [-1, rows); see the reference's check")


def gather_rows(
    src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None = None, level: int = -1
) -> torch.Tensor:
    """`out[i] = scale[i] * src[index[i]]`, zero row for index -1; `src` (R, d), `index` (N,).

    `level` picks the CPU SIMD path (-1: the widest runnable; tests pass each of
    `load_op().simd_levels()`).
    """
    _check_rows("gather_rows", src, index, scale)
    op = _compiled(src)
    if op is None:
        return reference.gather_rows(src, index, scale)
    return _launch(op, "gather_rows", src, index, scale, (), level)


def combine_rows(
    src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None = None, level: int = -1
) -> torch.Tensor:
    """`out[t] = Σ_j weight[t, j] * src[index[t, j]]`, index -1 skipped; `index` (T, k)."""
    _check_rows("combine_rows", src, index, weight)
    if index.dim() != 2:
        raise ValueError(f"combine_rows: index must be (T, k), got shape {tuple(index.shape)}")
    op = _compiled(src)
    if op is None:
        return reference.combine_rows(src, index, weight)
    return _launch(op, "combine_rows", src, index, weight, (index.shape[1],), level)


def _launch(
    op: ModuleType,
    name: str,
    src: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor | None,
    per_row: tuple[int, ...],
    level: int,
) -> torch.Tensor:
    """Run kernel `name` of `op` (CPU or CUDA): both kernels take `(src, src_rows, out, out_rows,
    index, weights, *per_row, d)`, one output row per row of `index` (gather: `(N,)`, no
    `per_row`; combine: `(T, k)`, `per_row = (k,)`)."""
    if index.dtype != torch.int64:
        raise TypeError(f"{name}: index must be int64, got {index.dtype}; call .long()")
    src_c = src.detach().contiguous()
    idx = index.contiguous()
    w = None if weights is None else weights.detach().to(torch.float32).contiguous()
    n, d = src.shape
    rows = idx.shape[0]
    out = torch.empty(rows, d, dtype=src.dtype, device=src.device)
    kernel = getattr(op, name)
    if src.device.type == "cuda":
        _run_cuda(kernel, src_c, n, out, rows, idx, _ptr(w), *per_row, d)
    else:
        level = op.simd_levels()[-1] if level < 0 else level
        kernel(src_c.data_ptr(), n, out.data_ptr(), rows, idx.data_ptr(), _ptr(w), *per_row, d,
               level)  # fmt: skip
    return out


# -- differentiable forms ---------------------------------------------------------------------
class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot_token: torch.Tensor, token_slot: torch.Tensor):
        ctx.save_for_backward(token_slot)
        return gather_rows(x, slot_token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (token_slot,) = ctx.saved_tensors
        return combine_rows(grad.contiguous(), token_slot), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        y: torch.Tensor,
        weight: torch.Tensor,
        token_slot: torch.Tensor,
        slot_token: torch.Tensor,
    ):
        ctx.save_for_backward(y, weight, token_slot, slot_token)
        return combine_rows(y, token_slot, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        y, weight, token_slot, slot_token = ctx.saved_tensors
        grad = grad.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            # Each slot is read by exactly one (token, choice): its weight scales the gradient.
            valid = token_slot >= 0
            slot_weight = torch.zeros(y.shape[0], dtype=grad.dtype, device=grad.device)
            slot_weight[token_slot[valid]] = weight.detach()[valid].to(grad.dtype)
            grad_y = gather_rows(grad, slot_token, slot_weight)
        if ctx.needs_input_grad[1]:
            t, k = token_slot.shape
            picked = gather_rows(y.detach(), token_slot.reshape(-1))
            picked = picked.view(t, k, y.shape[1])  # (T, k, d); explicit d: T may be 0
            grad_w = (picked * grad[:, None, :]).sum(-1).to(weight.dtype)
        return grad_y, grad_w, None, None


def permute(x: torch.Tensor, slot_token: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (T, d) into slot order: `out[i] = x[slot_token[i]]` (zero for -1), (N, d).

    `token_slot` (T, k) is the inverse map (the slots each token went to, -1 if none), used by
    the backward: the gradient of a token is the sum over its slots.
    """
    return _Permute.apply(x, slot_token, token_slot)


def unpermute(
    y: torch.Tensor, weight: torch.Tensor, token_slot: torch.Tensor, slot_token: torch.Tensor
) -> torch.Tensor:
    """Weighted sum back to tokens: `out[t] = Σ_j weight[t, j] * y[token_slot[t, j]]`, (T, d).

    Differentiable in `y` and in the gate `weight` (T, k).
    """
    return _Unpermute.apply(y, weight, token_slot, slot_token)
