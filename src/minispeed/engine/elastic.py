"""Elastic batch sizes, DeepSpeed 0.17.6's `elasticity` section (0.19.8 removed it): one global
batch that stays the same for every world size in a range, so a job can be rescaled without
changing its convergence.

```python
config = ElasticConfig.from_ds_config({"enabled": True, "max_train_batch_size": 2000,
                                       "micro_batch_sizes": [2, 4, 6], "version": 0.1})
batch, world_sizes, micro = config.compute(world_size=8)
```

How the batch is chosen (version 0.1), with `B` = `max_train_batch_size` and `m_i` the
`micro_batch_sizes`: each base `b` of `m_1, ..., m_k, lcm(m_i)` gives the candidate `b * h`, `h`
the largest highly composite number (`HCN`) with `h <= B // b` (a base `>= B` is its own
candidate). For each candidate the valid world sizes are the `n` in `[min_gpus, max_gpus]` with
`batch % (m_i n) == 0` for some `i` (`batch // m_i` and its divisors up to half of it); the
candidate with the most valid sizes wins, ties going to the larger batch (`prefer_larger_batch`,
else the smaller). Version 0.2 (the default) works per node: the same search over nodes with
`B / (num_gpus_per_node / model_parallel_size)`, scaled back; a world size outside the result
gets the largest multiple of `m_i * dp` at most `B` instead (`dp` its data-parallel size). The
micro-batch is the largest `m_i` dividing `batch // world_size`; the engine runs
`gradient_accumulation_steps = batch // (micro * world_size)`.

Errors are `ElasticityError`s (a `ConfigError` naming the key): DeepSpeed 0.17.6's conditions,
recorded by scripts/record_ds_legacy.py. Cost: O(k * B / m) integer steps at set-up; nothing
per step.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minispeed.core.config import ConfigError

__all__ = [
    "ElasticConfig",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "adopt_batch",
]

LATEST_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
# Highly composite numbers (more divisors than any smaller number) up to 720720: scaling a base
# by one gives a batch that many world sizes divide.
HCN = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
       10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760,
       277200, 332640, 498960, 554400, 665280, 720720)  # fmt: skip


class ElasticityError(ConfigError):
    """An elastic config that cannot run (DeepSpeed's name; a `ConfigError` naming the key)."""


class ElasticityConfigError(ElasticityError):
    """A wrong or missing key of the `elasticity` section."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the config's valid sizes."""


_KEYS = ("enabled", "max_train_batch_size", "micro_batch_sizes", "min_gpus", "max_gpus",
         "num_gpus_per_node", "model_parallel_size", "min_time", "version",
         "prefer_larger_batch", "ignore_non_elastic_batch_info")  # fmt: skip


@dataclass(frozen=True)
class ElasticConfig:
    """DeepSpeed 0.17.6's `elasticity` section (the module docstring)."""

    enabled: bool = False
    """Choose the batch triple from the world size (`compute`)."""
    max_train_batch_size: int = 2000
    """`B`, the largest global batch accepted (required when enabled)."""
    micro_batch_sizes: tuple[int, ...] = (2, 4, 6)
    """The micro-batch sizes a rank may run (required when enabled)."""
    min_gpus: int = 1
    """The smallest world size to plan for."""
    max_gpus: int = 10000
    """The largest world size to plan for."""
    num_gpus_per_node: int = 1
    """Version 0.2: ranks per node (the search is over nodes)."""
    model_parallel_size: int = 1
    """Version 0.2: ranks per model replica."""
    min_time: int = 0
    """For the resource scheduler; not used here."""
    version: float = LATEST_VERSION
    """0.1 or 0.2."""
    prefer_larger_batch: bool = True
    """Break ties towards the larger batch (false: the smaller)."""
    ignore_non_elastic_batch_info: bool = False
    """Let the config's batch keys stand beside the section (they are overridden); false refuses
    them."""
    keys: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The keys written (for the batch-key check)."""

    @classmethod
    def from_ds_config(cls, config: Any, path: str = "elasticity") -> ElasticConfig:
        """The section as DeepSpeed 0.17.6 reads it, refusing what it refuses, naming the key."""
        if not isinstance(config, Mapping):
            raise ElasticityConfigError(path, f"is {config!r}; give an object")
        for name in config:
            if name not in _KEYS:
                raise ElasticityConfigError(
                    f"{path}.{name}", f"is not a key; use {', '.join(_KEYS)}"
                )
        enabled = bool(config.get("enabled", False))
        if enabled:
            for name in ("max_train_batch_size", "micro_batch_sizes"):
                if name not in config:
                    raise ElasticityConfigError(f"{path}.{name}", "elasticity requires it: add it")
        micro = config.get("micro_batch_sizes", list(cls.micro_batch_sizes))
        if not isinstance(micro, list) or not all(
            isinstance(m, int) and not isinstance(m, bool) and m > 0 for m in micro
        ):
            raise ElasticityConfigError(
                f"{path}.micro_batch_sizes", f"is {micro!r}; give a list of positive integers"
            )
        out = cls(**{**config, "micro_batch_sizes": tuple(micro)}, keys=tuple(config))
        if out.min_gpus < 1 or out.max_gpus < 1 or out.max_gpus < out.min_gpus:
            raise ElasticityConfigError(
                f"{path}.min_gpus",
                f"is {out.min_gpus} with max_gpus {out.max_gpus}; give 1 <= min_gpus <= max_gpus",
            )
        for name in ("model_parallel_size", "num_gpus_per_node"):
            if getattr(out, name) < 1:
                raise ElasticityConfigError(f"{path}.{name}", f"is {getattr(out, name)}; give >= 1")
        if out.min_time < 0:
            raise ElasticityConfigError(f"{path}.min_time", f"is {out.min_time}; give >= 0")
        return out

    def compute(
        self, world_size: int = 0, target_version: str = MINIMUM_DEEPSPEED_VERSION,
        path: str = "elasticity",
    ) -> tuple[int, list[int], int | None]:  # fmt: skip
        """`(batch, valid world sizes, micro-batch)` (the module docstring); `world_size` 0:
        version 0.1 gives no micro-batch, version 0.2 reads `WORLD_SIZE`. A world size not
        valid for the config is an `ElasticityIncompatibleWorldSize`."""
        if not self.enabled:
            raise ElasticityConfigError(f"{path}.enabled", "is false; set it to true")
        version = float(self.version)
        if self.model_parallel_size > 1 and version != 0.2:
            raise ElasticityConfigError(
                f"{path}.model_parallel_size",
                f"is {self.model_parallel_size}; version {self.version} plans data parallelism "
                "only: use version 0.2",
            )
        if version > LATEST_VERSION:
            raise ElasticityConfigError(
                f"{path}.version", f"is {self.version}; the latest is {LATEST_VERSION}"
            )
        if _release(target_version) < _release(MINIMUM_DEEPSPEED_VERSION):
            raise ElasticityError(
                "target_deepspeed_version",
                f"is {target_version}; elasticity needs {MINIMUM_DEEPSPEED_VERSION} or later",
            )
        micro = None
        if version == 0.1:
            batch, valid = self._search(
                self.max_train_batch_size, self.min_gpus, self.max_gpus, path
            )
        elif version == 0.2:
            if world_size == 0:
                env = os.environ.get("WORLD_SIZE", "")
                if not env.isnumeric():
                    raise ElasticityConfigError(
                        f"{path}.version",
                        f"is 0.2, which needs the world size: pass world_size or set WORLD_SIZE "
                        f"(it is {env or 'unset'})",
                    )
                world_size = int(env)
            batch, valid, micro = self._per_node(world_size, path)
        else:
            raise ElasticityConfigError(f"{path}.version", f"is {self.version}; use 0.1 or 0.2")
        batch = int(batch)
        if world_size > 0:
            if world_size not in valid:
                raise ElasticityIncompatibleWorldSize(
                    path,
                    f"the world size {world_size} is not one of the valid sizes {valid} for "
                    "max_train_batch_size, micro_batch_sizes, min_gpus and max_gpus: launch one "
                    "of them or change those keys",
                )
            micro = self._micro(batch // world_size)
        return batch, valid, micro

    def _micro(self, per_rank: int) -> int | None:
        """The largest micro-batch size dividing `per_rank`."""
        fits = [m for m in set(self.micro_batch_sizes) if per_rank % m == 0]
        if not fits:
            raise ElasticityError(
                "elasticity.micro_batch_sizes",
                f"has no size dividing the {per_rank} samples per rank: add one",
            )
        return max(fits)

    def _search(self, limit: int, min_gpus: int, max_gpus: int, path: str) -> tuple[int, list[int]]:
        """Version 0.1's batch and valid world sizes under the batch limit `limit`."""
        micro = self.micro_batch_sizes
        min_gpus = min_gpus or 1
        max_gpus = max_gpus or limit // min(micro)
        if any(m > limit for m in micro):
            raise ElasticityConfigError(
                f"{path}.micro_batch_sizes",
                f"has a size above max_train_batch_size ({limit} per node): lower it",
            )
        bases = [*micro, math.lcm(*micro)]
        candidates = []
        for base in bases:
            if base >= limit:
                candidates.append(base)
            else:
                candidates.append(max(h for h in HCN if h <= limit // base) * base)
        best, best_valid = min(micro), None
        most = 0
        # DeepSpeed 0.17.6 scans the distinct candidates in set order: ties keep the first seen.
        for batch in list(set(candidates)):
            valid = _valid_world_sizes(batch, micro, min_gpus, max_gpus)
            larger = batch > best if self.prefer_larger_batch else batch < best
            if len(valid) > most or (len(valid) == most and larger):
                best, best_valid, most = batch, valid, len(valid)
        return int(best), best_valid or []

    def _per_node(self, world_size: int, path: str) -> tuple[int, list[int], int | None]:
        """Version 0.2's batch, valid data-parallel sizes and micro-batch for `world_size`."""
        if self.num_gpus_per_node % self.model_parallel_size:
            raise ElasticityError(
                f"{path}.num_gpus_per_node",
                f"is {self.num_gpus_per_node}, not a multiple of model_parallel_size "
                f"{self.model_parallel_size}: make it one",
            )
        per_node = self.num_gpus_per_node // self.model_parallel_size
        batch, nodes = self._search(
            int(self.max_train_batch_size / per_node),
            int(self.min_gpus / self.num_gpus_per_node),
            int(self.max_gpus / self.num_gpus_per_node),
            path,
        )
        batch *= per_node
        valid = [n * per_node for n in nodes]

        def micro_for(total: int) -> int | None:
            fits = [m for m in self.micro_batch_sizes if total // world_size % m == 0]
            if not fits:
                return None
            return max(fits) if self.prefer_larger_batch else fits[0]

        if world_size // self.model_parallel_size in valid:
            return batch, valid, micro_for(batch)
        dp = (world_size / self.num_gpus_per_node) * per_node
        sizes = [math.floor(self.max_train_batch_size / float(m * dp)) * m * dp
                 for m in self.micro_batch_sizes]  # fmt: skip
        total = max(sizes) if self.prefer_larger_batch else min(sizes)
        return total, [int(dp)], micro_for(total)


def _valid_world_sizes(batch: int, micro: tuple[int, ...], low: int, high: int) -> list[int]:
    """The world sizes in [low, high] at which `batch` splits into whole micro-batches of one of
    the sizes `micro` (`batch // m` and its divisors up to half of it)."""
    out = set()
    for m in micro:
        if batch % m:
            continue
        most = batch // m
        if low <= most <= high:
            out.add(most)
        out.update(n for n in range(max(low, 1), min(most // 2, high) + 1) if most % n == 0)
    return sorted(out)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def adopt_batch(ds: Mapping[str, Any], config: ElasticConfig, world_size: int) -> dict[str, Any]:
    """`ds` with its batch triple chosen by the enabled section `config` for `world_size` data
    ranks, as DeepSpeed 0.17.6's config does: batch keys written beside the section are refused
    unless `ignore_non_elastic_batch_info` (then overridden)."""
    written = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                           "gradient_accumulation_steps") if k in ds]  # fmt: skip
    if written and not config.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(
            "elasticity",
            f"is enabled and chooses the batch, but the config also sets {', '.join(written)}: "
            "remove them, or set elasticity.ignore_non_elastic_batch_info to true (they are "
            "then overridden)",
        )
    batch, _, micro = config.compute(world_size)
    assert micro is not None  # compute() finds one for a valid world size
    return {**ds, "train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": batch // (micro * world_size)}  # fmt: skip
