"""`deepspeed.runtime.zero.stage3`: DeepSpeed's ZeRO-3 memory estimators, over
`minispeed.zero.memory.estimate_modes` (the package docstring says what differs), and
`unwrap_model_for_generation(model)`, a context holding every parameter of a ZeRO-3 model (an
engine or its module) gathered, so `generate()` fetches nothing per token
(`minispeed.zero.GatheredParameters` over them all: one all-gather on entry, Σ N·s·p bytes held
inside, nothing kept on exit)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from minispeed.engine.runtime.zero.stage_1_and_2 import _header, _line
from minispeed.engine.zero import GatheredParameters
from minispeed.zero.memory.modes import Offload, count_params, estimate_modes

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "unwrap_model_for_generation",
]


@contextmanager
def unwrap_model_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with all its parameters gathered inside the context (module docstring);
    collective."""
    with GatheredParameters(list(model.parameters())):
        yield model


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """`(cpu bytes per node, gpu bytes, largest layer's bytes)` of ZeRO-3's model states, as
    DeepSpeed figures them (`cpu_offload_params` counts only with `cpu_offload`, as there)."""
    rows = estimate_modes(
        int(total_params),
        num_gpus_per_node,
        num_nodes,
        largest_layer_params=int(largest_layer_params),
        additional_buffer_factor=additional_buffer_factor,
    )
    if not cpu_offload:
        want = Offload.NONE
    else:
        want = Offload.PARAMS_CPU if cpu_offload_params else Offload.OPTIMIZER_CPU
    (row,) = [r for r in rows if r.stage == 3 and r.offload is want and r.zero_init == zero_init]
    return row.cpu_bytes_per_node, row.gpu_bytes, 4 * int(largest_layer_params)


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-3 table for a live model (Ψ and its largest layer, counted as DeepSpeed
    counts them)."""
    total_params, largest = count_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params, largest, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-3 table: parameters and optimizer on the CPU, the optimizer only, neither;
    each with and without `zero.Init`."""
    print(
        _header(num_gpus_per_node, num_nodes)
        + f"SW: Model with {int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params."
    )
    print("  per CPU  |  per GPU |   Options")
    for cpu_offload, cpu_offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                cpu_offload, cpu_offload_params, zero_init, additional_buffer_factor,
            )  # fmt: skip
            options = (
                f"offload_param={'cpu' if cpu_offload_params else 'none'}, "
                f"offload_optimizer={'cpu' if cpu_offload else 'none'}, zero_init={int(zero_init)}"
            )
            print(_line(cpu, gpu, options))
