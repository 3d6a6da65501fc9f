"""DeepSpeed engine's query methods that only read the config, the process group or the
optimizer's param groups, kept apart from the training loop (`engine.py`).

Scripts call them to log or to branch (`if engine.global_rank == 0`, `engine.fp16_enabled()`,
`engine.get_mom()`); each answers as DeepSpeed 0.19.8's engine does for the same config
(`scripts/record_ds_classic.py` records them). Costs: attribute reads, no collective.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import minispeed.comm as comm

__all__ = ["DeepSpeedQueries"]


class DeepSpeedQueries:
    """Mixed into `Engine`: expects `config` (an `EngineConfig`) and `optimizer`."""

    config: Any
    optimizer: Any

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's `LOCAL_RANK`; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return comm.get_rank()

    @property
    def world_size(self) -> int:
        """The number of processes in the world."""
        return comm.get_world_size()

    @property
    def dp_world_size(self) -> int:
        """The data-parallel size (ranks that split each batch)."""
        return self.config.data_parallel_size

    def fp16_enabled(self) -> bool:
        return self.config.precision.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.param_dtype == torch.bfloat16

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage > 0), DeepSpeed's `zero_enabled`."""
        return self.config.zero.stage > 0

    def gradient_clipping(self) -> float:
        """The global-norm clipping threshold (0.0: off; DeepSpeed's default 1.0 when absent)."""
        return self.config.zero.max_grad_norm

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether the config lets a ZeRO-3 model be gathered whole on saving
        (`stage3_gather_16bit_weights_on_model_save`)."""
        return bool(self.config.zero.stage3_gather_16bit_weights_on_model_save)

    def get_mom(self) -> list[Any]:
        """Each param group's `betas` (Adam-like) or `momentum` (SGD-like), as DeepSpeed's."""
        groups = [] if self.optimizer is None else self.optimizer.param_groups
        return [g["betas"] if "betas" in g else g.get("momentum") for g in groups]

    def save_fp16_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)  # type: ignore[attr-defined]
