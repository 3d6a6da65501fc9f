"""The tuner's memory check: will a candidate fit one device, before it runs?

Predicted peak per device = model states of the candidate's stage and offload mode (DeepSpeed's
figures, `minispeed.zero.memory.modes.estimate_modes`, the ones `minispeed estimate` prints) +
activation bytes per sample × micro-batch. The per-sample figure is learnt from the trials that
ran: `(measured peak - their model states) / their micro-batch`, the largest seen (on the CPU
the peak is the process's resident set, so the runtime's own bytes land there too: an
overestimate, which errs towards rejecting). Until a trial has run and Ψ is known (or given
with `--params`), nothing is rejected.
"""

from __future__ import annotations

from minispeed.engine.tune.candidate import Candidate
from minispeed.zero.memory.modes import Offload, estimate_modes

__all__ = ["MemoryModel", "device_memory_bytes"]

GiB = 2**30


class MemoryModel:
    """Predicts a candidate's peak bytes per device and says why one cannot fit."""

    def __init__(
        self,
        world_size: int,
        capacity_bytes: int,
        num_params: int | None = None,
        largest_layer_params: int | None = None,
    ) -> None:
        self.world_size = world_size
        self.capacity_bytes = capacity_bytes
        self.num_params = num_params
        self.largest_layer = largest_layer_params or 0
        self.activation_bytes_per_sample = 0.0

    def learn(self, c: Candidate, peak_bytes: int, result: dict | None = None) -> None:
        """Take a measured trial's peak (and Ψ, L when the trial reported them)."""
        if result is not None:
            self.num_params = self.num_params or result.get("num_params")
            self.largest_layer = self.largest_layer or result.get("largest_layer_params", 0)
        if self.num_params is None:
            return
        per_sample = max(0.0, (peak_bytes - self.model_states(c)) / c.micro_batch)
        self.activation_bytes_per_sample = max(self.activation_bytes_per_sample, per_sample)

    def model_states(self, c: Candidate) -> int:
        """DeepSpeed's per-GPU model-state bytes for the candidate's stage and offload mode."""
        assert self.num_params is not None
        offload = Offload.OPTIMIZER_CPU if c.offload_optimizer else Offload.NONE
        for row in estimate_modes(
            self.num_params, self.world_size, 1, largest_layer_params=self.largest_layer
        ):
            if row.stage == c.stage and row.offload is offload and row.zero_init in (None, False):
                return row.gpu_bytes
        raise AssertionError(f"no estimate for stage {c.stage}, {offload}")

    def predicted_peak(self, c: Candidate) -> int | None:
        """Model states + activations for `c`, or None while Ψ is unknown."""
        if self.num_params is None:
            return None
        return self.model_states(c) + int(self.activation_bytes_per_sample * c.micro_batch)

    def rejects(self, c: Candidate) -> str | None:
        """Why `c` cannot fit (the figures), or None when it may."""
        peak = self.predicted_peak(c)
        if peak is None or peak <= self.capacity_bytes:
            return None
        states = self.model_states(c)
        return (
            f"estimator: {states / GiB:.2f} GiB model states + "
            f"{(peak - states) / GiB:.2f} GiB activations > {self.capacity_bytes / GiB:.2f} GiB "
            f"per device"
        )


def device_memory_bytes(nproc_per_node: int) -> int:
    """One device's memory: the GPU's total, or on the CPU this host's memory shared by the
    node's processes."""
    import torch

    from minispeed.core.accelerator import get_accelerator

    if get_accelerator().device().type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return kib * 1024 // nproc_per_node
