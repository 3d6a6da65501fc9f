"""CPU optimizer steps, compiled or reference: Adam/AdamW, Adagrad and Lion over many tensors.

The functions here have the signatures of `minispeed.offload.cpu_optim_reference` (re-exported
as ``cpu_optim.reference``) and agree with it, and so with ``torch.optim``, to a few ulps per step.
Each call runs every tensor in ONE OpenMP loop over chunks of ``grain`` elements
(``csrc/cpu_optim/cpu_optim.cpp``); the SIMD path is the build's widest unless ``simd`` picks a
narrower one (0 scalar, 1 AVX2, 2 AVX-512; `simd_levels` lists what this build has).

Masters are fp32. ``write_back`` (optional, one bf16 or fp16 tensor per parameter) receives the
updated parameter rounded to nearest even in the same pass: 2 B more written per element instead
of a separate cast that reads the 4 B master again.

Bytes per element, the floor of a step on a memory-bound CPU: Adam 28 (read p, g, m, v; write p,
m, v), Adagrad and Lion 20. See `step_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from minispeed.offload import cpu_optim_reference as reference
from minispeed.offload.ops import load_op

__all__ = [
    "DEFAULT_GRAIN",
    "adagrad_step",
    "adam_step",
    "lion_step",
    "reference",
    "simd_levels",
    "step_bytes",
]

#: Elements per OpenMP task: 32768 x 28 B = 896 KiB of Adam traffic, enough to amortize a task
#: and small enough that a 1M-element tensor still spreads over the cores.
DEFAULT_GRAIN = 1 << 15

_HALF_KIND = {torch.bfloat16: 1, torch.float16: 2}
_STATES_PER_OPTIMIZER = {"adam": 2, "adagrad": 1, "lion": 1}


def step_bytes(optimizer: str, numel: int, write_back: bool = False) -> int:
    """Bytes a step moves through memory: ``numel * (8 + 8 * states) (+ 2 with write-back)``.

    Adam: 28 B per element (read p, g, m, v: 16 B; write p, m, v: 12 B); Adagrad, Lion: 20 B.
    """
    states = _STATES_PER_OPTIMIZER[optimizer]
    per_element = 4 * (2 + states) + 4 * (1 + states)  # reads (p, g, states) + writes (p, states)
    return numel * (per_element + (2 if write_back else 0))


def simd_levels() -> list[int]:
    """SIMD levels the compiled op can run (0 scalar, 1 AVX2, 2 AVX-512); ``[]`` without the op."""
    op = load_op()
    return list(op.simd_levels()) if op is not None else []


def _check(
    name: str,
    groups: Sequence[Sequence[torch.Tensor]],
    labels: Sequence[str],
    write_back: Sequence[torch.Tensor] | None,
) -> int:
    """Validate the tensor lists; returns the write-back kind (0 none, 1 bf16, 2 fp16)."""
    count = len(groups[0])
    for label, tensors in zip(labels, groups):
        if len(tensors) != count:
            raise ValueError(
                f"{name}: {labels[0]} has {count} tensors but {label} has {len(tensors)}; "
                "pass one of each per parameter"
            )
    for k in range(count):
        numel = groups[0][k].numel()
        for label, tensors in zip(labels, groups):
            t = tensors[k]
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise TypeError(
                    f"{name}: {label}[{k}] is {t.dtype} on {t.device}; the CPU optimizer keeps "
                    "fp32 masters, gradients and states on the CPU: pass .float().cpu() tensors"
                )
            if not t.is_contiguous():
                raise ValueError(
                    f"{name}: {label}[{k}] is not contiguous; pass .contiguous() tensors "
                    "(the step writes them in place)"
                )
            if t.numel() != numel:
                raise ValueError(
                    f"{name}: {label}[{k}] has {t.numel()} elements, {labels[0]}[{k}] {numel}"
                )
    if write_back is None:
        return 0
    if len(write_back) != count:
        raise ValueError(f"{name}: write_back has {len(write_back)} tensors for {count} parameters")
    dtypes = {t.dtype for t in write_back}
    if len(dtypes) > 1 or not dtypes <= _HALF_KIND.keys():
        raise TypeError(
            f"{name}: write_back tensors must all be bf16 or all fp16, got {sorted(map(str, dtypes))}"
        )
    for k, t in enumerate(write_back):
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != groups[0][k].numel():
            raise ValueError(
                f"{name}: write_back[{k}] must be a contiguous CPU tensor of "
                f"{groups[0][k].numel()} elements, got {tuple(t.shape)} on {t.device}"
            )
    return _HALF_KIND[next(iter(dtypes))] if dtypes else 0


def _pointers(
    groups: Sequence[Sequence[torch.Tensor]], write_back: Sequence[torch.Tensor] | None
) -> tuple[list[list[int]], list[int]]:
    """Per tensor: (param, grad, state0, state1, half) data pointers (0 where absent), numel."""
    ptrs, counts = [], []
    for k in range(len(groups[0])):
        row = [g[k].data_ptr() for g in groups]
        row += [0] * (4 - len(row))
        row.append(write_back[k].data_ptr() if write_back is not None else 0)
        ptrs.append(row)
        counts.append(groups[0][k].numel())
    return ptrs, counts


def _op_and_level(simd: int | None) -> tuple[ModuleType | None, int]:
    op = load_op()
    if op is None:
        return None, 0
    levels = op.simd_levels()
    level = levels[-1] if simd is None else simd
    if level not in levels:
        raise ValueError(f"SIMD level {level} is not in this build's levels {levels}")
    return op, level


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    bias_correction: bool = True,
    write_back: Sequence[torch.Tensor] | None = None,
    simd: int | None = None,
    grain: int | None = None,
) -> None:
    """One Adam (``decoupled_weight_decay=False``: L2 added to the gradient) or AdamW step, in place.

    ``step`` is the step number after this update (1 on the first call): it sets the bias
    corrections ``1 - beta1**step`` and ``1 - beta2**step`` (both 1 with
    ``bias_correction=False``, DeepSpeed's switch). Moves 28 B per element.
    """
    groups = (params, grads, exp_avgs, exp_avg_sqs)
    half = _check("adam_step", groups, ("params", "grads", "exp_avgs", "exp_avg_sqs"), write_back)
    if step < 1:
        raise ValueError(
            f"adam_step: step must be >= 1 (the step count after this update), got {step}"
        )
    op, level = _op_and_level(simd)
    if op is None:
        return reference.adam_step(
            params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction, write_back=write_back,
        )  # fmt: skip
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    ptrs, counts = _pointers(groups, write_back)
    op.adam_step(
        ptrs,
        counts,
        0.0 if decoupled_weight_decay else weight_decay,  # L2: g += wd * p
        1 - lr * weight_decay if decoupled_weight_decay else 1.0,  # AdamW: p *= 1 - lr * wd
        1 - beta1,
        beta2,
        1 - beta2,
        bias_correction2**0.5,
        eps,
        -(lr / bias_correction1),
        half,
        level,
        grain or DEFAULT_GRAIN,
    )


def adagrad_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    state_sums: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    lr_decay: float,
    eps: float,
    weight_decay: float,
    write_back: Sequence[torch.Tensor] | None = None,
    simd: int | None = None,
    grain: int | None = None,
) -> None:
    """One Adagrad step in place (``step`` >= 1 sets ``clr = lr / (1 + (step - 1) lr_decay)``). 20 B/elt."""
    groups = (params, grads, state_sums)
    half = _check("adagrad_step", groups, ("params", "grads", "state_sums"), write_back)
    if step < 1:
        raise ValueError(f"adagrad_step: step must be >= 1, got {step}")
    op, level = _op_and_level(simd)
    if op is None:
        return reference.adagrad_step(
            params, grads, state_sums, step=step, lr=lr, lr_decay=lr_decay, eps=eps,
            weight_decay=weight_decay, write_back=write_back,
        )  # fmt: skip
    clr = lr / (1 + (step - 1) * lr_decay)
    ptrs, counts = _pointers(groups, write_back)
    op.adagrad_step(ptrs, counts, weight_decay, eps, -clr, half, level, grain or DEFAULT_GRAIN)


def lion_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    write_back: Sequence[torch.Tensor] | None = None,
    simd: int | None = None,
    grain: int | None = None,
) -> None:
    """One Lion step in place (see the reference for the formula). 20 B per element."""
    groups = (params, grads, exp_avgs)
    half = _check("lion_step", groups, ("params", "grads", "exp_avgs"), write_back)
    op, level = _op_and_level(simd)
    if op is None:
        return reference.lion_step(
            params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
            write_back=write_back,
        )  # fmt: skip
    ptrs, counts = _pointers(groups, write_back)
    op.lion_step(
        ptrs,
        counts,
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        1 - lr * weight_decay,
        -lr,
        half,
        level,
        grain or DEFAULT_GRAIN,
    )
