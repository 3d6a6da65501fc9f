"""``torch.optim.Optimizer`` classes over the CPU kernels: CPUAdam, CPUAdamW, CPUAdagrad, CPULion.

Drop-in replacements for ``torch.optim.Adam`` / ``AdamW`` / ``Adagrad`` on fp32 CPU parameters,
each behaving like the torch class it is named after, defaults included: `CPUAdam` is
``torch.optim.Adam`` (L2 weight decay unless ``decoupled_weight_decay=True``), `CPUAdamW` is
``torch.optim.AdamW``. DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW unless ``adamw_mode=False``)
keeps DeepSpeed's default under DeepSpeed's name, in ``minispeed.engine.ops.adam``. They take
the same constructor arguments, the same ``param_groups`` keys and the same ``state`` entries
(``step`` as a 0-dim fp32 tensor, ``exp_avg``, ``exp_avg_sq``, ``sum``), so a ``state_dict`` saved
by one loads into the other and training continues identically (see Note [bit-equal to
torch.optim, but for sqrt] in ``csrc/cpu_optim/cpu_optim.h`` for how close "identically" is).
What they add: every parameter of a step runs in ONE multi-threaded SIMD loop, and
``step(write_back=...)`` writes the updated weights as bf16/fp16 in the same pass.

Memory: Adam/AdamW keep 8 B of state per parameter (``exp_avg``, ``exp_avg_sq``), Adagrad and
Lion 4 B. A step moves 28 B (Adam) or 20 B (Adagrad, Lion) per parameter through memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from minispeed.core import ranges
from minispeed.offload import cpu_optim

__all__ = ["CPUAdagrad", "CPUAdam", "CPUAdamW", "CPULion", "Lion"]


def _refuse(cls: str, **flags: Any) -> None:
    """Raise for torch.optim options the CPU kernels do not implement."""
    for name, value in flags.items():
        if value:
            raise ValueError(
                f"{cls}({name}={value!r}) is not supported by the CPU kernels; use "
                f"torch.optim for it, or leave {name} at its default"
            )


def write_back_by_param(
    optimizer: torch.optim.Optimizer, write_back: Sequence[torch.Tensor | None] | None
) -> dict[int, torch.Tensor | None]:
    """`id(param)` -> its write-back tensor, from one entry per parameter in `param_groups`
    order; `{}` when `write_back` is None. A list of the wrong length is an error naming both."""
    if write_back is None:
        return {}
    all_params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(write_back) != len(all_params):
        raise ValueError(
            f"{type(optimizer).__name__}.step: write_back has {len(write_back)} entries for "
            f"{len(all_params)} parameters; pass one tensor or None per parameter"
        )
    return dict(zip(map(id, all_params), write_back))


class _CPUOptimizer(torch.optim.Optimizer):
    """Shared step loop: collect (param, grad, states) per group, one kernel call per group."""

    _name = ""
    elementwise = True  # each element's update reads only its own state: ZeRO may step slices

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], simd: int | None) -> None:
        super().__init__(params, defaults)
        self._simd = simd  # None: the build's widest path (not saved: state_dict stays torch's)
        for group in self.param_groups:
            self._check_group(group)

    def _check_group(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise TypeError(
                    f"{self._name} steps fp32 CPU parameters, got {p.dtype} on {p.device}: keep "
                    "fp32 master copies on the CPU (that is what offloading does) and pass those"
                )
            if not p.is_contiguous():
                raise ValueError(f"{self._name}: a parameter is not contiguous; call .contiguous()")

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _step_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, torch.Tensor]],
        write_back: list[torch.Tensor] | None,
    ) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        write_back: Sequence[torch.Tensor | None] | None = None,
    ) -> float | None:
        """One step of every parameter with a gradient.

        ``write_back``: one bf16/fp16 tensor (or ``None``) per parameter, in ``param_groups``
        order; each receives its updated parameter, rounded to nearest even, in the same pass.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        out_of = write_back_by_param(self, write_back)
        with ranges.range("offload.cpu_step"):
            for group in self.param_groups:
                self._check_group(group)
                params, grads, states, outs = [], [], [], []
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise ValueError(f"{self._name} does not support sparse gradients")
                    state = self.state[p]
                    if not state:
                        state.update(self._init_state(p, group))
                    params.append(p)
                    grads.append(p.grad.detach().float().contiguous())
                    states.append(state)
                    outs.append(out_of.get(id(p)))
                if not params:
                    continue
                # Parameters with and without a write-back target go in two kernel calls.
                with_out = [i for i, o in enumerate(outs) if o is not None]
                without = [i for i, o in enumerate(outs) if o is None]
                for idx, wb in ((without, None), (with_out, [outs[i] for i in with_out])):
                    if idx:
                        self._step_group(
                            group,
                            [params[i] for i in idx],
                            [grads[i] for i in idx],
                            [states[i] for i in idx],
                            wb,
                        )
        return loss


class CPUAdam(_CPUOptimizer):
    """`torch.optim.Adam` on the CPU: the same arguments, defaults and ``state_dict``.

    **Default: Adam with L2 regularisation** (``g += wd * p``), as ``torch.optim.Adam``, so a
    script that swaps ``torch.optim.Adam`` for `CPUAdam` trains the same model;
    ``decoupled_weight_decay=True`` (torch's switch) is AdamW (``p *= 1 - lr * wd``), which
    `CPUAdamW` makes the default. (DeepSpeed's ``DeepSpeedCPUAdam`` defaults to AdamW; its
    adapter in ``minispeed.engine.ops.adam`` keeps that default under that name.)
    ``bias_correction`` (default True, as in torch and DeepSpeed) divides the moments by
    ``1 - beta**step``; False steps with the raw moments. Both are stored per param group
    (``decoupled_weight_decay``, ``bias_correction``), so a ``torch.optim.Adam`` checkpoint
    loads as Adam and an ``AdamW`` one as AdamW. ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable`` and ``fused`` must stay off. ``simd`` picks a SIMD path (0 scalar,
    1 AVX2, 2 AVX-512; default the build's widest). 8 B of state per parameter.
    """

    state_tensors_per_param = 2  # exp_avg, exp_avg_sq

    _name = "CPUAdam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        simd: int | None = None,
    ) -> None:
        _refuse(
            type(self).__name__,
            amsgrad=amsgrad,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
        )
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"{type(self).__name__}: need lr, eps, weight_decay >= 0 and 0 <= betas < 1, got "
                f"lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=bool(decoupled_weight_decay),
            bias_correction=bool(bias_correction),
        )
        super().__init__(params, defaults, simd)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        _refuse(
            self._name,
            amsgrad=group.get("amsgrad", False),
            maximize=group.get("maximize", False),
            capturable=group.get("capturable", False),
            differentiable=group.get("differentiable", False),
        )

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    def _step_group(self, group, params, grads, states, write_back) -> None:
        for s in states:
            s["step"] += 1
        adam_step_by_count(
            group,
            [float(s["step"]) for s in states],
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            write_back=write_back,
            simd=self._simd,
        )


def adam_step_by_count(
    group: dict,
    counts: Sequence[float],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    write_back: Sequence[torch.Tensor | None] | None = None,
    simd: Any = None,
) -> None:
    """`cpu_optim.adam_step` with a param group's hyper-parameters, once per distinct step count
    (`counts[i]`, already incremented: a parameter added to the model later has a smaller one)
    and, where `write_back[i]` is given for some tensors only, once with and once without it."""
    calls: dict[tuple[float, bool], list[int]] = {}
    for i, count in enumerate(counts):
        has_out = write_back is not None and write_back[i] is not None
        calls.setdefault((float(count), has_out), []).append(i)
    beta1, beta2 = group["betas"]
    for (step, has_out), idx in calls.items():
        cpu_optim.adam_step(
            [params[i] for i in idx],
            [grads[i] for i in idx],
            [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx],
            step=int(step),
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group.get("decoupled_weight_decay", False),
            bias_correction=group.get("bias_correction", True),
            write_back=[write_back[i] for i in idx] if has_out else None,
            simd=simd,
        )


class CPUAdamW(CPUAdam):
    """AdamW on the CPU: `CPUAdam` with decoupled weight decay (default 0.01), like torch."""

    _name = "CPUAdamW"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        simd: int | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            simd=simd,
        )


class CPUAdagrad(_CPUOptimizer):
    """Adagrad on the CPU: same arguments and ``state_dict`` as ``torch.optim.Adagrad``.

    State (``sum``, ``step``) is created at construction, as torch does. 4 B per parameter.
    """

    _name = "CPUAdagrad"
    state_tensors_per_param = 1  # sum

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        simd: int | None = None,
    ) -> None:
        _refuse("CPUAdagrad", maximize=maximize, differentiable=differentiable, fused=fused)
        if lr < 0 or lr_decay < 0 or weight_decay < 0 or eps < 0 or initial_accumulator_value < 0:
            raise ValueError(
                "CPUAdagrad: lr, lr_decay, weight_decay, eps and the initial value must be >= 0"
            )
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            foreach=foreach,
            maximize=False,
            differentiable=False,
            fused=None,
        )
        super().__init__(params, defaults, simd)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(self._init_state(p, group))

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        _refuse(self._name, maximize=group.get("maximize", False))

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        init = group["initial_accumulator_value"]
        return {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "sum": torch.full_like(p, init, memory_format=torch.preserve_format),
        }

    def _step_group(self, group, params, grads, states, write_back) -> None:
        by_step: dict[float, list[int]] = {}
        for i, s in enumerate(states):
            s["step"] += 1
            by_step.setdefault(float(s["step"]), []).append(i)
        for step, idx in by_step.items():
            cpu_optim.adagrad_step(
                [params[i] for i in idx],
                [grads[i] for i in idx],
                [states[i]["sum"] for i in idx],
                step=int(step),
                lr=float(group["lr"]),
                lr_decay=group["lr_decay"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                write_back=[write_back[i] for i in idx] if write_back is not None else None,
                simd=self._simd,
            )


class CPULion(_CPUOptimizer):
    """Lion (sign of an interpolated momentum; Chen et al. 2023) on the CPU. 4 B per parameter.

    ``p -= lr * (sign(b1 m + (1 - b1) g) + weight_decay * p)``, then ``m = b2 m + (1 - b2) g``.
    torch.optim has no Lion; the state is ``exp_avg`` as in the common PyTorch implementations.
    """

    state_tensors_per_param = 1  # exp_avg

    _name = "CPULion"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        simd: int | None = None,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not all(0 <= b <= 1 for b in betas):
            raise ValueError(
                f"CPULion: need lr, weight_decay >= 0 and 0 <= betas <= 1, got {lr}, {weight_decay}, {betas}"
            )
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), simd)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def _step_group(self, group, params, grads, states, write_back) -> None:
        beta1, beta2 = group["betas"]
        cpu_optim.lion_step(
            params,
            grads,
            [s["exp_avg"] for s in states],
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=group["weight_decay"],
            write_back=write_back,
            simd=self._simd,
        )


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on any device,
    elementwise: `CPULion`'s pure-PyTorch reference as a `torch.optim` class, so the update rule
    is written once (`cpu_optim_reference.lion_step`) and both step the same numbers.

    Per parameter, with gradient g and momentum m (`state["exp_avg"]`, as `CPULion`):

    ```text
    c <- b1 m + (1 - b1) g
    p <- p (1 - lr wd) - lr sign(c)
    m <- b2 m + (1 - b2) g
    ```

    DeepSpeed's FusedLion and CPU Lion (same defaults: lr 1e-3, betas (0.9, 0.999), wd 0).
    One difference, where `c` is exactly 0 (a parameter whose gradient and momentum are both 0):
    DeepSpeed moves it by `+lr` (CUDA) or `-lr` (CPU, `-copysign(lr, +0)`); here `sign(0) = 0`
    leaves it where it is, as the paper does. 4 B of state per parameter (fp32) or its dtype's
    size; the update runs in fp32 for low-precision parameters.
    """

    elementwise = True  # zero.shard may step a slice of each parameter (stages 1-3)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"Lion: need lr >= 0 and weight_decay >= 0, got {lr}, {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be two values in [0, 1], got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Lion update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients; use dense ones")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                master = p if p.dtype == torch.float32 else p.float()
                grad, m = p.grad.to(master.dtype), exp_avg.to(master.dtype)
                cpu_optim.reference.lion_step(
                    [master], [grad], [m], lr=lr, beta1=beta1, beta2=beta2, weight_decay=decay
                )
                if master is not p:
                    p.copy_(master)
                if m is not exp_avg:
                    exp_avg.copy_(m)
        return loss
