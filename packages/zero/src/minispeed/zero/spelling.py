"""Did-you-mean for ds_config keys: a misspelled section must fail, never fall back silently.

A DeepSpeed config is one dict whose top-level sections belong to different packages, so
`ZeroConfig.from_ds_config` and `MixedPrecision.from_ds_config` cannot refuse every key they do
not read (`"optimizer"` belongs to someone else). What they can refuse is a key that is *almost*
one of theirs: `"zero_optimisation"` would otherwise train at stage 0, and
`"gradient_acumulation_steps"` would leave accumulation at 1, silently. A top-level key that is not
a known DeepSpeed key and lies within a small edit distance of a section we read is an error
naming the key we meant. (The engine will validate the whole file later; until then, this.)

Cost: one edit-distance computation per (top-level key, known section): O(len²) each, negligible.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from minispeed.core.config import did_you_mean, edit_distance
from minispeed.core.config import is_close as _close

__all__ = ["check_top_level_spelling", "did_you_mean", "edit_distance"]

# Top-level keys DeepSpeed itself defines (any package's): never reported as misspellings, even
# where one is close to another (`fp16` / `bf16`).
DEEPSPEED_TOP_LEVEL = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "bfloat16",
        "amp",
        "torch_autocast",
        "data_types",
        "zero_optimization",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "sparse_gradients",
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "flops_profiler",
        "activation_checkpointing",
        "aio",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "monitor_config",
        "comms_logger",
        "elasticity",
        "pipeline",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "sparse_attention",
        "curriculum_learning",
        "data_efficiency",
        "compression_training",
        "checkpoint",
        "autotuning",
        "moe",
        "nebula",
        "quantize_training",
        "eigenvalue",
        "progressive_layer_drop",
        "hybrid_engine",
        "weight_quantization",
        "disable_allgather",
        "timers",
        "compile",
        "tensor_parallel",
        "use_data_before_expert_parallelism",
        "graph_harvesting",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "load_universal_checkpoint",
        "use_node_local_storage",
    }
)


def check_top_level_spelling(ds_config: dict[str, Any], sections: Iterable[str], who: str) -> None:
    """Raise `ValueError` for a top-level key of `ds_config` that is a near miss of one of
    `sections` (the keys `who` reads) and not itself a DeepSpeed key."""
    sections = set(sections)
    for key in ds_config:
        if not isinstance(key, str) or key in sections or key in DEEPSPEED_TOP_LEVEL:
            continue
        for known in sorted(sections):
            if _close(key, known):
                raise ValueError(
                    f"ds_config key {key!r} is not a DeepSpeed key; did you mean {known!r}? "
                    f"{who} reads {known!r} and would otherwise ignore {key!r} silently: "
                    f"rename it"
                )
