"""DeepSpeed's ZeRO-2 memory estimators (`deepspeed.runtime.zero.stage_1_and_2`), over
`minispeed.zero.memory.estimate_modes`; the package docstring says what differs."""

from __future__ import annotations

from torch import nn

from minispeed.zero.memory.modes import Offload, count_params, estimate_modes

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """`(cpu bytes per node, gpu bytes)` of ZeRO-2's model states, as DeepSpeed figures them."""
    rows = estimate_modes(
        int(total_params),
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor=additional_buffer_factor,
    )
    want = Offload.OPTIMIZER_CPU if cpu_offload else Offload.NONE
    (row,) = [r for r in rows if r.stage == 2 and r.offload is want]
    return row.cpu_bytes_per_node, row.gpu_bytes


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-2 table for a live model (its parameters counted as DeepSpeed does)."""
    total_params, _ = count_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(
        total_params, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-2 table for `total_params`: with and without the optimizer on the CPU."""
    print(
        _header(num_gpus_per_node, num_nodes)
        + f"SW: Model with {int(total_params / 1e6)}M total params."
    )
    print("  per CPU  |  per GPU |   Options")
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor
        )
        print(_line(cpu, gpu, f"offload_optimizer={'cpu' if cpu_offload else 'none'}"))


def _header(num_gpus_per_node: int, num_nodes: int) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return (
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
    )


def _line(cpu: int, gpu: int, options: str) -> str:
    return f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}"
