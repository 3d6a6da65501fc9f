"""Bytes per GPU and per node for each ZeRO stage *and offload mode*, in DeepSpeed's figures.

`formulas.py` holds the ZeRO paper's model-state bytes (what minispeed keeps, checked against
live runs). DeepSpeed ships a second, coarser set of figures, the ones its users size jobs with:
`estimate_zero2_model_states_mem_needs_all_cold` / `_all_live` and
`estimate_zero3_model_states_mem_needs_all_cold` / `_all_live`. `estimate_modes` reproduces them
byte for byte (`tests/engine/test_cli_estimate.py` compares against their recorded output), so a
`minispeed estimate` table reads the same as DeepSpeed's printout, and extends them to the modes
DeepSpeed does not cover. Notation: Ψ parameters, L the largest layer's parameters (stage 3
gathers one layer at a time), n GPUs per node, N = n × nodes GPUs, f the buffer factor (1.5).

| stage | offload | per GPU | per node (CPU) | source |
|---|---|---|---|---|
| 0 | none | 20Ψ | 4Ψ·n·f | DeepSpeed's accounting, extended |
| 1 | none | 4Ψ + 16Ψ/N | 4Ψ·n·f | DeepSpeed's accounting, extended |
| 1, 2 | optimizer → CPU | 2Ψ | Ψ·max(4N, 16)·f | `estimate_zero2` |
| 2 | none | 2Ψ + 18Ψ/N | 4Ψ·n·f | `estimate_zero2` |
| 3 | none | 4L + 18Ψ/N | zero_init: 4L·n·f, else 4Ψ·n·f | `estimate_zero3` |
| 3 | optimizer → CPU | 4L + 2Ψ/N | Ψ·16/nodes·f (no zero_init: max with 4Ψ·n·f) | `estimate_zero3` |
| 3 | + parameters → CPU | 4L | Ψ·18/nodes·f (no zero_init: max with 4Ψ·n·f) | `estimate_zero3` |
| any | … → NVMe | as → CPU | the no-offload row's CPU bytes; the CPU row's on NVMe | minispeed |

DeepSpeed's 18 bytes per partitioned parameter are 16-bit gradients (2), fp32 gradients (4), the
fp32 master (4) and Adam's two moments (8); stage 0 keeps all of it whole (2 + 18 = 20), stage 1
keeps the 16-bit gradients whole. The CPU column is per node: every process loads the fp32 model
on its host (4Ψ·n) unless `zero.Init` (zero_init) builds it partitioned. These are model states
only (activations come on top), and an upper bound for minispeed, which keeps no fp32 gradient
copy (`formulas.model_state_bytes`: 16Ψ/N at stage 3). Cost: arithmetic only, or one walk over a
live model's parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from torch import nn

__all__ = ["ModeEstimate", "Offload", "count_params", "estimate_modes", "largest_params"]


class Offload(Enum):
    """Where the model states live besides the GPU (DeepSpeed's `offload_optimizer` /
    `offload_param` devices)."""

    NONE = "none"
    OPTIMIZER_CPU = "optimizer->cpu"
    OPTIMIZER_NVME = "optimizer->nvme"
    PARAMS_CPU = "optimizer+params->cpu"
    PARAMS_NVME = "optimizer+params->nvme"

    @property
    def optimizer_device(self) -> str:
        """DeepSpeed's `offload_optimizer.device` for this mode."""
        return {"none": "none"}.get(self.value, self.value.rsplit(">", 1)[1])

    @property
    def param_device(self) -> str:
        """DeepSpeed's `offload_param.device` for this mode."""
        return self.value.rsplit(">", 1)[1] if "params" in self.value else "none"


@dataclass(frozen=True)
class ModeEstimate:
    """One row of the table: a stage, an offload mode and (stage 3) whether `zero.Init` builds
    the model partitioned; bytes per GPU, per node's CPU memory and per node's NVMe."""

    stage: int
    offload: Offload
    zero_init: bool | None
    gpu_bytes: int
    cpu_bytes_per_node: int
    nvme_bytes_per_node: int
    #: Which estimator the figures come from (DeepSpeed's function, or how they extend it).
    source: str
    #: MiCS (stage 3 inside shard groups of this many GPUs, replicated across them), or None.
    mics_shard_size: int | None = None

    def fits(
        self,
        gpu_bytes: int | None,
        cpu_bytes_per_node: int | None,
        nvme_bytes_per_node: int | None = None,
    ) -> bool | None:
        """Whether the figures fit the given memories (None: no size given); a size left out
        is not checked."""
        limits = (
            (gpu_bytes, self.gpu_bytes),
            (cpu_bytes_per_node, self.cpu_bytes_per_node),
            (nvme_bytes_per_node, self.nvme_bytes_per_node),
        )
        if all(cap is None for cap, _ in limits):
            return None
        return all(cap is None or need <= cap for cap, need in limits)


def count_params(model: nn.Module) -> tuple[int, int]:
    """(Ψ, L) of a live model, as DeepSpeed's `model_to_params` counts them: tied parameters
    once, and L the most parameters one module holds directly (not through children).

    Counted by identity rather than DeepSpeed's `data_ptr()`, so a model on the meta device
    (every pointer 0) counts right too.
    """
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def _zero2(psi: int, n: int, nodes: int, offload: bool, f: float) -> tuple[int, int]:
    """DeepSpeed's `estimate_zero2_model_states_mem_needs`: (cpu, gpu), same arithmetic."""
    total_gpus = nodes * n
    if offload:
        return int(psi * max(4 * total_gpus, 16) * f), int(2 * psi)
    return int(psi * 4 * n * f), int(2 * psi + int(18 * psi / total_gpus))


def _zero3(
    psi: int, largest: int, n: int, nodes: int, opt: bool, params: bool, zero_init: bool, f: float
) -> tuple[int, int]:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs`: (cpu, gpu), same arithmetic."""
    total_gpus, per_node = nodes * n, 1 / nodes
    layer = 4 * largest
    if opt and params:
        gpu = layer
        cpu = psi * (18 * per_node if zero_init else max(4 * n, 18 * per_node)) * f
    elif opt:
        gpu = layer + int(2 * psi / total_gpus)
        cpu = psi * (16 * per_node if zero_init else max(4 * n, 16 * per_node)) * f
    else:
        gpu = layer + int(18 * psi / total_gpus)
        cpu = (largest if zero_init else psi) * 4 * n * f
    return int(cpu), int(gpu)


def _whole(what: str, value: int | float) -> int:
    """`value` as an int, or a ValueError naming `what` when it is not a finite whole number >= 0
    (`inf`, `nan`, `-5`, `1.5` from a command line)."""
    if not math.isfinite(value) or value != int(value) or value < 0:
        raise ValueError(f"{what} must be a finite whole number >= 0, got {value}")
    return int(value)


def estimate_modes(
    model_or_num_params: nn.Module | int | float,
    gpus_per_node: int = 1,
    num_nodes: int = 1,
    *,
    largest_layer_params: int | None = None,
    additional_buffer_factor: float = 1.5,
    mics_shard_size: int | None = None,
) -> list[ModeEstimate]:
    """Every (stage, offload mode) row of the module docstring's table, in DeepSpeed's figures.

    `model_or_num_params`: a live `nn.Module` (Ψ and L counted as `count_params` does, which is
    DeepSpeed's `_all_live`) or Ψ (DeepSpeed's `_all_cold`; L defaults to 0, as a count alone
    cannot tell it). Example: `estimate_modes(7e9, gpus_per_node=8, largest_layer_params=131e6)`.
    `mics_shard_size` (S, whole nodes: a multiple of `gpus_per_node` dividing every GPU): also
    the stage-3 rows under MiCS, DeepSpeed's stage-3 arithmetic over S GPUs (S/n nodes) instead
    of all of them: each shard group holds a whole replica, so per GPU it is Ψ/S, not Ψ/N.
    """
    if isinstance(model_or_num_params, nn.Module):
        psi, largest = count_params(model_or_num_params)
        largest = largest if largest_layer_params is None else int(largest_layer_params)
    else:
        psi = _whole("a parameter count", model_or_num_params)
        largest = _whole("largest_layer_params", largest_layer_params or 0)
    if gpus_per_node < 1 or num_nodes < 1:
        raise ValueError(
            f"need gpus_per_node >= 1 and num_nodes >= 1, got {gpus_per_node} and {num_nodes}"
        )
    if not 0 <= largest <= psi:
        raise ValueError(f"need 0 <= largest_layer_params ({largest}) <= the parameters ({psi})")
    if not (math.isfinite(additional_buffer_factor) and additional_buffer_factor >= 1):
        raise ValueError(
            "additional_buffer_factor scales the CPU bytes up (DeepSpeed's default 1.5): it must "
            f"be a finite number >= 1, got {additional_buffer_factor}"
        )
    n, nodes, f = gpus_per_node, num_nodes, additional_buffer_factor
    total_gpus = n * nodes
    load = int(psi * 4 * n * f)  # every process loads the fp32 model on its host
    ours = "DeepSpeed's accounting, extended (DeepSpeed has no estimator for stages 0 and 1)"
    z2, z3 = "estimate_zero2_model_states_mem_needs", "estimate_zero3_model_states_mem_needs"
    nvme = "minispeed: the CPU mode's GPU bytes, its offloaded CPU bytes on NVMe"
    rows = [
        ModeEstimate(0, Offload.NONE, None, 20 * psi, load, 0, ours),
        ModeEstimate(1, Offload.NONE, None, 4 * psi + int(16 * psi / total_gpus), load, 0, ours),
    ]
    for stage in (1, 2):
        none_cpu, none_gpu = _zero2(psi, n, nodes, False, f)
        off_cpu, off_gpu = _zero2(psi, n, nodes, True, f)
        if stage == 2:
            rows.append(ModeEstimate(2, Offload.NONE, None, none_gpu, none_cpu, 0, z2))
        src = z2 if stage == 2 else f"{z2} (stages 1 and 2 share one optimizer)"
        rows.append(ModeEstimate(stage, Offload.OPTIMIZER_CPU, None, off_gpu, off_cpu, 0, src))
        rows.append(ModeEstimate(stage, Offload.OPTIMIZER_NVME, None, off_gpu, load, off_cpu, nvme))
    for offload, opt, params in (
        (Offload.NONE, False, False),
        (Offload.OPTIMIZER_CPU, True, False),
        (Offload.PARAMS_CPU, True, True),
    ):
        for zero_init in (True, False):
            cpu, gpu = _zero3(psi, largest, n, nodes, opt, params, zero_init, f)
            rows.append(ModeEstimate(3, offload, zero_init, gpu, cpu, 0, z3))
    for offload, params in ((Offload.OPTIMIZER_NVME, False), (Offload.PARAMS_NVME, True)):
        cpu, gpu = _zero3(psi, largest, n, nodes, True, params, True, f)
        base, _ = _zero3(psi, largest, n, nodes, False, False, True, f)
        rows.append(ModeEstimate(3, offload, True, gpu, base, cpu, nvme))
    if mics_shard_size is not None:
        if mics_shard_size % n or (total_gpus % mics_shard_size):
            raise ValueError(
                f"mics_shard_size {mics_shard_size} must be whole nodes of {n} GPUs and divide "
                f"the {total_gpus} GPUs; use a multiple of {n} that divides {total_gpus}"
            )
        mics = "minispeed: MiCS, estimate_zero3_model_states_mem_needs over the S GPUs of a group"
        for offload, opt, params in (
            (Offload.NONE, False, False),
            (Offload.OPTIMIZER_CPU, True, False),
            (Offload.PARAMS_CPU, True, True),
        ):
            cpu, gpu = _zero3(psi, largest, n, mics_shard_size // n, opt, params, True, f)
            rows.append(ModeEstimate(3, offload, True, gpu, cpu, 0, mics, mics_shard_size))
    return rows


def largest_params(
    gpus_per_node: int,
    num_nodes: int,
    *,
    gpu_bytes: int | None,
    cpu_bytes_per_node: int | None = None,
    nvme_bytes_per_node: int | None = None,
    largest_layer_params: int = 0,
    additional_buffer_factor: float = 1.5,
) -> list[tuple[ModeEstimate, int | None]]:
    """The inverse of `estimate_modes`: for each of its rows, the largest Ψ whose row fits the
    memories given (0 when even Ψ = L does not; None when no size given limits it, e.g. the
    GPU's 4L of stage 3 with everything offloaded and no CPU size), with the row at that Ψ.

    Every figure of a row grows with Ψ (L fixed), so a bisection over whole Ψ finds the boundary
    exactly: `estimate_modes(Ψ)` fits and `estimate_modes(Ψ + 1)` does not. Cost: about 60 calls
    of `estimate_modes` per row (arithmetic only).
    """
    if gpu_bytes is None and cpu_bytes_per_node is None and nvme_bytes_per_node is None:
        raise ValueError("largest_params needs at least one memory size (GPU, CPU or NVMe)")
    floor = int(largest_layer_params)

    def rows(psi: int) -> list[ModeEstimate]:
        return estimate_modes(
            psi,
            gpus_per_node,
            num_nodes,
            largest_layer_params=floor,
            additional_buffer_factor=additional_buffer_factor,
        )

    def fits(psi: int, i: int) -> bool:
        return bool(rows(psi)[i].fits(gpu_bytes, cpu_bytes_per_node, nvme_bytes_per_node))

    out = []
    for i, row in enumerate(rows(floor)):
        if not fits(floor, i):
            out.append((row, 0))
            continue
        lo, hi = floor, max(2 * floor, 1 << 20)
        while hi <= 1 << 60 and fits(hi, i):
            lo, hi = hi, 2 * hi
        if hi > 1 << 60:
            out.append((row, None))
            continue
        while hi - lo > 1:  # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, i) else (lo, mid)
        out.append((rows(lo)[i], lo))
    return out
