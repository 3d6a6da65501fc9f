"""One point of `minispeed tune`'s search: the knobs a trial sets on top of the script's config.

Shared by the search (`search.py`), which walks from candidate to candidate, and the memory check
(`memory.py`), which predicts a candidate's peak bytes before it runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["Candidate"]


@dataclass(frozen=True)
class Candidate:
    """The knobs one trial sets on top of the base config."""

    stage: int
    micro_batch: int
    grad_accum: int
    reduce_bucket: int
    allgather_bucket: int
    offload_optimizer: bool = False

    @property
    def label(self) -> str:
        """A short name: `z2 mb16 ga1 rb100000 ab100000 [offload]`."""
        buckets = f"rb{self.reduce_bucket}" + (
            f" ab{self.allgather_bucket}" if self.stage in (1, 2) else ""
        )
        off = " offload" if self.offload_optimizer else ""
        return f"z{self.stage} mb{self.micro_batch} ga{self.grad_accum} {buckets}{off}"

    def config(self, base: dict[str, Any], world: int) -> dict[str, Any]:
        """`base` with these knobs set (a new dict)."""
        cfg = copy.deepcopy(base)
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.grad_accum
        if "train_batch_size" in cfg:
            cfg["train_batch_size"] = self.micro_batch * self.grad_accum * world
        zero = cfg.setdefault("zero_optimization", {})
        zero["stage"] = self.stage
        zero["reduce_bucket_size"] = self.reduce_bucket
        if self.stage in (1, 2):
            zero["allgather_bucket_size"] = self.allgather_bucket
        else:
            zero.pop("allgather_bucket_size", None)  # a stage 1-2 key
        if self.stage == 0:
            zero.pop("reduce_scatter", None)
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
            # the script's own optimizer (a torch Adam/AdamW) is then stepped by offload's CPU
            # kernel, unless the user's config says otherwise
            cfg.setdefault("zero_force_ds_cpu_optimizer", False)
        else:
            zero.pop("offload_optimizer", None)
        return cfg
