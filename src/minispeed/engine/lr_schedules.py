"""Learning-rate schedules by DeepSpeed name, with DeepSpeed's values step by step.

`WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle` and `LRRangeTest` take the arguments of
DeepSpeed 0.19.8's classes of the same names (`deepspeed.runtime.lr_schedules`), in the same order,
and set the same learning rates: the value written into the optimizer at construction, after each
`step()`, and what `get_last_lr()` returns (tests compare against values recorded with DeepSpeed,
`tests/engine/fixtures/ds_schedules.json`, to 1e-12 relative). `build_scheduler` builds one from a
ds_config `"scheduler"` section.

Conventions shared by every schedule (DeepSpeed's):

- `it` is `last_batch_iteration`: -1 at construction, +1 per `step()`. `step()` is called after
  each optimizer step, so the learning rate of the *n*-th optimizer step (n = 1, 2, ...) is the
  value at `it = n - 2`: the construction value serves step 1.
- A value given as a list has one entry per parameter group; a scalar applies to every group.
- `state_dict()` is `{"last_batch_iteration": it}`; `load_state_dict()` restores `it` **and
  re-applies** that step's learning rate (and OneCycle's betas) to the optimizer, so a schedule
  rebuilt and loaded continues exactly as the uninterrupted one (DeepSpeed leaves the learning
  rate to the optimizer's own checkpoint; the values agree).

Cost: O(parameter groups) floating-point operations per `step()`.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch

from minispeed.core.config import ConfigError
from minispeed.engine.by_name import SchedulerSection, check_params, construct, did_you_mean

__all__ = [
    "SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "WarmupType",
    "build_scheduler",
]


class WarmupType(enum.StrEnum):
    """How the warm-up fraction `f(it)` rises from 0 to 1 over `n = max(2, warmup_num_steps)`
    steps: `LOG`: `f = log(it + 1) / log(n)`; `LINEAR`: `f = it / n`."""

    LOG = "log"
    LINEAR = "linear"

    def fraction(self, it: int, num_steps: int) -> float:
        """The warm-up fraction at iteration `it` (`0 <= it < num_steps`)."""
        if self is WarmupType.LOG:
            return (1.0 / math.log(num_steps)) * math.log(it + 1)
        return it / num_steps


# -- validation helpers (shared by the classes; each raises a ValueError naming the key) ---------
def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"scheduler param {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_number(name: str, value: Any, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"scheduler param {name!r} must be a number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"scheduler param {name!r} must be >= {minimum}, got {value!r}")
    return value


def _check_steps(name: str, value: Any) -> int | float:
    """A step count given as an int or an integral float (JSON `1e5`), >= 0."""
    whole = isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not (isinstance(value, int) or whole) or value < 0:
        raise ValueError(
            f"scheduler param {name!r} must be a whole number of steps >= 0, got {value!r}"
        )
    return value


def _check_warmup_type(value: Any) -> WarmupType:
    try:
        return WarmupType(value)
    except ValueError:
        # DeepSpeed warns and falls back to 'log'; a typo would change the schedule silently.
        raise ValueError(
            f"scheduler param 'warmup_type' must be 'log' or 'linear', got {value!r}"
        ) from None


def _warmup(num_steps: Any, kind: Any) -> tuple[int, WarmupType]:
    """`warmup_num_steps` and `warmup_type`, checked: the warm-up length DeepSpeed uses,
    `max(2, warmup_num_steps)` (a 1-step log warm-up would divide by log 1), and its type."""
    return max(2, _check_int("warmup_num_steps", num_steps, minimum=1)), _check_warmup_type(kind)


def _torch_optimizer(optimizer: Any) -> Any:
    """The object whose `param_groups` the schedule writes: the optimizer, or the optimizer a
    wrapper holds as `.optimizer` (as DeepSpeed accepts)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer (no param_groups)")


def _per_group(optimizer: Any, value: Any, name: str, *, minimum: float | None = None) -> list:
    """`value` broadcast to one entry per param group, or checked to have one per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(
                f"scheduler param {name!r} has {len(value)} values but the optimizer has "
                f"{groups} param groups: give one value per group, or a single number"
            )
        values = list(value)
    else:
        values = [value] * groups
    for v in values:
        _check_number(name, v, minimum=minimum)
    return values


def _write_lrs(optimizer: Any, lrs: Sequence[float]) -> list:
    """Set each group's learning rate (in place where it is a tensor); return the groups' lrs."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Schedule:
    """What every schedule shares: the iteration counter, `step()`, `get_last_lr()`, and the
    checkpoint round trip. A subclass defines `get_lr()` (the lrs at the current iteration) and
    `_start()` (what construction writes at `it = -1`)."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", last_batch_iteration, minimum=-1
        )
        self._last_lr: list | None = None

    def get_lr(self) -> list[float]:
        """The learning rate of each param group at `last_batch_iteration`."""
        raise NotImplementedError

    def _start(self) -> None:
        """Write the construction values (called at construction when `it == -1`)."""
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def _apply(self) -> None:
        """Write the values of the current iteration into the optimizer."""
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next one) and write its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list:
        """The lrs last written by this schedule (DeepSpeed raises before any was written)."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr(): no learning rate set yet; call step() first"
            )
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        """`{"last_batch_iteration": it}`, DeepSpeed's format."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the iteration and write its values into the optimizer (module docstring)."""
        if "last_batch_iteration" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: no 'last_batch_iteration' in "
                f"{sorted(state_dict)}; was this saved by an lr schedule?"
            )
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", state_dict["last_batch_iteration"], minimum=-1
        )
        if self.last_batch_iteration == -1:
            self._start()
        else:
            self._apply()


class WarmupLR(_Schedule):
    """Warm up from `warmup_min_lr` to `warmup_max_lr`, then hold.

    With `n = max(2, warmup_num_steps)` and the warm-up fraction `f` of `warmup_type`
    (`WarmupType`):

    ```text
    lr(it) = min_lr                                  it < 0 (construction)
    lr(it) = min_lr + (max_lr - min_lr) · f(it)      0 <= it < n
    lr(it) = max_lr                                  it >= n
    ```

    `warmup_max_lr=None` takes each group's lr at construction (DeepSpeed 0.19.8's default).
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps, self.warmup_type = _warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr", minimum=0.0)
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr", minimum=0.0)
        if self.last_batch_iteration == -1:
            self._start()

    def _gamma(self) -> float:
        """The share of `max_lr - min_lr` added at the current iteration."""
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return self.warmup_type.fraction(it, self.warmup_num_steps)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`'s warm-up, then a linear decay to 0 at `total_num_steps`.

    ```text
    lr(it) = min_lr + (max_lr - min_lr) · g(it)
    g(it)  = f(it)                                          0 <= it < n (warm-up, as WarmupLR)
    g(it)  = max(0, (total - it) / max(1, total - n))       it >= n
    ```

    The decay starts from `min_lr + (max_lr - min_lr) · (total - n) / (total - n)`, i.e. max_lr,
    and reaches `min_lr` at `it = total`. `warmup_max_lr` defaults to 0.001 here (DeepSpeed's).
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return self.warmup_type.fraction(it, self.warmup_num_steps)
        remaining = float(self.total_num_steps - it)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scale each group's construction lr by a ratio: warm up, then a cosine to `cos_min_ratio`.

    With `n = max(2, warmup_num_steps)`, `T = total_num_steps`, `lr0` the group's lr at
    construction and `f` the warm-up fraction (`WarmupType`):

    ```text
    ratio(it) = 0                                              it < 0 (construction)
    ratio(it) = warmup_min_ratio + (1 - warmup_min_ratio) · f(it)       0 <= it < n
    ratio(it) = max(0, c + (1 - c) · (1 + cos(π · p)) / 2)     it >= n, c = cos_min_ratio,
                p = min(1, (it - n + 1) / max(1, T - n))
    lr(it)    = lr0 · ratio(it)
    ```

    Note: the construction value is 0 whatever `warmup_min_ratio` is (DeepSpeed's), so the
    first optimizer step does not move the parameters.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps, self.warmup_type = _warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps)
        self.warmup_min_ratio = _check_number("warmup_min_ratio", warmup_min_ratio, minimum=0.0)
        self.cos_min_ratio = _check_number("cos_min_ratio", cos_min_ratio, minimum=0.0)
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._start()

    def get_lr_ratio(self) -> float:
        """`ratio(it)` of the class docstring."""
        it, n = self.last_batch_iteration, self.warmup_num_steps
        if it < 0:
            return 0.0
        if it < n:
            rise = self.warmup_type.fraction(it, n)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - n + 1) / max(1, self.total_num_steps - n))
        half_cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr0 * ratio for lr0 in self.org_lrs]


class LRRangeTest(_Schedule):
    """Grow the lr from `lr_range_test_min_lr` without bound, to find where training diverges.

    ```text
    k(it)  = (it + 1) / step_size               continuous
    k(it)  = floor((it + 1) / step_size)        lr_range_test_staircase = True
    lr(it) = min_lr · (1 + step_rate · k(it)); at construction lr = min_lr
    ```
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(
            self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr", minimum=0.0
        )
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_rate = _check_number("lr_range_test_step_rate", lr_range_test_step_rate)
        if not isinstance(lr_range_test_staircase, bool):
            raise ValueError(
                f"scheduler param 'lr_range_test_staircase' must be true or false, got "
                f"{lr_range_test_staircase!r}"
            )
        self.staircase = lr_range_test_staircase
        if self.last_batch_iteration == -1:
            self._start()

    def _start(self) -> None:
        self._last_lr = _write_lrs(self.optimizer, self.min_lrs)

    def get_lr(self) -> list[float]:
        intervals = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        return [lr * (1 + self.step_rate * intervals) for lr in self.min_lrs]


class OneCycle(_Schedule):
    """One triangular cycle of the lr (and, inversely, of Adam's beta1), then an optional decay.

    With `T1 = cycle_first_step_size`, `T2 = cycle_second_step_size` (default T1), `T = T1 + T2`,
    `r = T1 / T` and `b = it + 1`, the position in the cycle and the scale `s` in [0, 1] are

    ```text
    x = b/T - floor(b/T)                      (DeepSpeed computes 1 + b/T - floor(1 + b/T))
    s = x / r                    x <= r       (rising half)
    s = (x - 1) / (r - 1)        x >  r       (falling half)
    stairs (count c > 0 for the half): s = floor(c · q / T_half) / c, q = b mod T in the rising
    half, T - (b mod T) in the falling one
    ```

    During the cycle (`it < T`): `lr = min_lr + (max_lr - min_lr) · s` and
    `beta1 = max_mom - (max_mom - min_mom) · s`. After it, with `d = (it - T + 1) / decay_step_size`:
    `lr = min_lr / (1 + decay_lr_rate · d)` and `beta1 = max_mom · (1 + decay_mom_rate · d)`,
    each held at `min_lr` / `max_mom` when its rate or `decay_step_size` is 0.

    At construction: `lr = min_lr`, `betas = (min_mom, 0.99)`, and `get_last_lr()` raises until the
    first `step()` (DeepSpeed's). Momentum is cycled only when `cycle_momentum` is true and the
    optimizer's defaults have `betas` (Adam-like); it **replaces beta2 with 0.99**, as DeepSpeed
    does.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(_check_number("cycle_first_step_size", cycle_first_step_size))
        if first <= 0:
            raise ValueError(f"scheduler param 'cycle_first_step_size' must be > 0, got {first}")
        if cycle_second_step_size is None:
            cycle_second_step_size = first
        second = float(_check_number("cycle_second_step_size", cycle_second_step_size, minimum=0))
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _check_int(
            "cycle_first_stair_count", cycle_first_stair_count, minimum=0
        )
        if cycle_second_stair_count is None:
            cycle_second_stair_count = cycle_first_stair_count
        self.second_stair_count = _check_int(
            "cycle_second_stair_count", cycle_second_stair_count, minimum=0
        )
        self.decay_step_size = _check_number("decay_step_size", decay_step_size, minimum=0)

        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr", minimum=0.0)
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr", minimum=0.0)
        self.decay_lr_rate = _check_number("decay_lr_rate", decay_lr_rate)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)

        if not isinstance(cycle_momentum, bool):
            raise ValueError(
                f"scheduler param 'cycle_momentum' must be true or false, got {cycle_momentum!r}"
            )
        defaults = getattr(self.optimizer, "defaults", self.optimizer.param_groups[0])
        # Momentum lives in `betas` only (Adam-like); SGD's `momentum` is left alone (DeepSpeed's).
        self.cycle_momentum = cycle_momentum and "betas" in defaults
        self.min_moms = _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = _check_number("decay_mom_rate", decay_mom_rate)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        if self.last_batch_iteration == -1:
            self._start()

    def _start(self) -> None:
        _write_lrs(self.optimizer, self.min_lrs)
        if self.cycle_momentum:
            self._write_beta1(self.min_moms)

    def _apply(self) -> None:
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())
        if self.cycle_momentum:
            self._write_beta1(self.get_mom_beta1())

    def _write_beta1(self, beta1s: Sequence[float]) -> None:
        for group, beta1 in zip(self.optimizer.param_groups, beta1s):
            group["betas"] = (beta1, 0.99)

    def _scale(self) -> float:
        """`s` of the class docstring at the current iteration."""
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        rising = x <= self.step_ratio
        scale = x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:
            # From the integer offset, not from `scale`: at a half-cycle boundary the float scale
            # can land 1e-16 under a stair, and floor() would drop a whole stair.
            in_cycle = b % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_intervals(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_intervals()
        return [lo / factor for lo in self.min_lrs]

    def get_mom_beta1(self) -> list[float]:
        """beta1 of each group at the current iteration (beta2 is 0.99)."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_intervals()
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """`betas` of each group at the current iteration, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        return [(beta1, 0.99) for beta1 in self.get_mom_beta1()]


SCHEDULES: dict[str, type[_Schedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


def build_scheduler(section: SchedulerSection | dict[str, Any], optimizer: Any) -> Any:
    """The schedule of a ds_config `"scheduler"` section, built over `optimizer`.

    `type` is one of `SCHEDULES` (case-sensitive, as DeepSpeed's) or, as DeepSpeed allows, the
    name of a `torch.optim.lr_scheduler` class; `params` are its keyword arguments. A misspelled
    type or param, a missing required param or a bad value is a `ConfigError` at the key as
    written (`scheduler.params.warmup_num_steps`).
    """
    if not isinstance(section, SchedulerSection):
        section = SchedulerSection.from_section(section)
    kind, params = section.type, dict(section.params)
    cls = SCHEDULES.get(kind)
    if cls is None:
        cls = getattr(torch.optim.lr_scheduler, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
            known = sorted(SCHEDULES)
            raise ConfigError(
                "scheduler.type",
                f"{kind!r} is unknown{did_you_mean(kind, known)}; supported: "
                f"{', '.join(known)}, or a torch.optim.lr_scheduler class name",
            )
    signature = inspect.signature(cls.__init__)
    names = [p for p in signature.parameters if p not in ("self", "optimizer")]
    check_params(params, names, "scheduler", repr(kind))
    missing = [
        p.name
        for p in signature.parameters.values()
        if p.name in names and p.default is inspect.Parameter.empty and p.name not in params
    ]
    if missing:
        raise ConfigError(
            f"scheduler.params.{missing[0]}", f"{kind} needs param {missing[0]!r} in 'params'"
        )
    return construct(cls, optimizer, params, "scheduler")
