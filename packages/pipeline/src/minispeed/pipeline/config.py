"""`PipelineConfig`: the options of `partition` and `PipelineExecutor`, and DeepSpeed's keys for them.

```python
cfg = PipelineConfig.from_ds_config(json.load(open("ds_config.json")))
module = pipeline.partition(layers, loss_fn=loss, **cfg.partition_kwargs())
executor = pipeline.PipelineExecutor(module, opt, **cfg.executor_kwargs())
```

DeepSpeed keys read (top level and the `"pipeline"` section), and what they become:

| DeepSpeed | here |
|---|---|
| `train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps` | `micro_batches` = the accumulation steps (DeepSpeed's pipeline engine runs one micro-batch per accumulation step), `micro_batch_size`; DeepSpeed's rule (`batch_triple`): any two give the third through train = micro × accumulation × data-parallel size, one alone sets accumulation to 1, contradictions are errors |
| `pipeline.stages` (an int; `"auto"` is refused) | `stages` |
| `pipeline.partition` / `pipeline.partition_method` (`"best"` = `"parameters"`) | `partition_method` |
| `pipeline.seed_layers` | `seed = 0` when true, `None` (torch's current RNG) when false |
| `pipeline.activation_checkpoint_interval` (0 or 1 only) | `activation_checkpointing` |
| `pipeline.pipe_partitioned`, `pipeline.grad_partitioned` | refused when true: there is no tensor parallelism to split over |

minispeed's own keys in the same section: `schedule`, `virtual_stages`. Unknown keys are errors.

The data-parallel size in the batch rule is `data_parallel_size` when given, else the world size
of `minispeed.comm` divided by `pipeline.stages` (as DeepSpeed's engine takes it from its process
grid), or 1 before `init_distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import minispeed.comm as comm
from minispeed.core.config import BATCH_KEYS as _TRIPLE
from minispeed.core.config import batch_triple, check_keys
from minispeed.pipeline.schedules import SCHEDULES

__all__ = ["PipelineConfig", "batch_triple"]


def _data_parallel_size(stages: Any) -> int:
    """World size / stages once `minispeed.comm` is initialized; 1 before (nothing to divide)."""
    if not comm.is_initialized() or not isinstance(stages, int) or stages < 1:
        return 1
    world = comm.get_world_size()
    if world % stages:
        raise ValueError(
            f"pipeline.stages={stages} does not divide the world size {world}; use a stage count "
            "that divides it (the rest is data parallelism)"
        )
    return world // stages


_KNOWN = {
    "stages",
    "partition",
    "partition_method",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
    "schedule",
    "virtual_stages",
}


@dataclass(frozen=True)
class PipelineConfig:
    """How to cut and run a pipeline (validated on construction)."""

    stages: int = 1
    """Pipeline stages P (the rest of the world is data parallelism)."""
    micro_batches: int = 1
    """Micro-batches M per step; the bubble is (P−1)/(M+P−1), so M ≥ 4P keeps it under 20%."""
    schedule: str = "1f1b"
    """One of `schedules.SCHEDULES`."""
    partition_method: str = "parameters"
    """`"uniform"`, `"parameters"` or `"type:<regex>"`."""
    virtual_stages: int = 1
    """Model chunks per stage (V ≥ 2 only with `"interleaved_1f1b"`)."""
    activation_checkpointing: bool = False
    """Recompute each chunk's forward during its backward (keeps only chunk inputs)."""
    seed: int | None = 0
    """Layer i is built under `torch.manual_seed(seed + i)`; None: no reseeding."""
    micro_batch_size: int | None = None
    """Samples per micro-batch on one replica (DeepSpeed's `train_micro_batch_size_per_gpu`):
    each replica's `train_batch` takes `micro_batch_size · micro_batches` samples. None: not
    fixed by this config (the executor splits whatever batch it is given)."""
    data_parallel_size: int = 1
    """Replicas N of each stage that the batch sizes above assume."""

    @property
    def train_batch_size(self) -> int | None:
        """Samples per step over all replicas: micro_batch_size · micro_batches · N."""
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * self.micro_batches * self.data_parallel_size

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches", "virtual_stages", "data_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PipelineConfig.{name} must be an int >= 1, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"PipelineConfig.schedule={self.schedule!r} is unknown; use one of {sorted(SCHEDULES)}"
            )
        m = self.partition_method
        if m not in ("uniform", "parameters") and not m.startswith("type:"):
            raise ValueError(
                f"PipelineConfig.partition_method={m!r}; use 'uniform', 'parameters' or 'type:<regex>'"
            )

    def partition_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `pipeline.partition`."""
        return {
            "stages": self.stages,
            "method": self.partition_method,
            "virtual_stages": self.virtual_stages,
            "activation_checkpointing": self.activation_checkpointing,
            "seed": self.seed,
        }

    def executor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `PipelineExecutor`."""
        return {"micro_batches": self.micro_batches, "schedule": self.schedule}

    @classmethod
    def from_ds_config(
        cls, ds_config: dict[str, Any], data_parallel_size: int | None = None
    ) -> PipelineConfig:
        """Translate a whole DeepSpeed config dict (see the module docstring for the keys):
        picks the `pipeline` section and the batch keys and hands them to `from_section`;
        `data_parallel_size`: N in the batch rule (default: world size / `pipeline.stages`)."""
        if not isinstance(ds_config, dict):
            raise TypeError(f"ds_config must be a dict, got {type(ds_config).__name__}")
        train, micro, acc = (ds_config.get(k) for k in _TRIPLE)
        return cls.from_section(
            ds_config.get("pipeline"),
            train_batch_size=train,
            micro_batch_size=micro,
            gradient_accumulation_steps=acc,
            data_parallel_size=data_parallel_size,
        )

    @classmethod
    def from_section(
        cls,
        section: dict[str, Any] | None,
        *,
        train_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        gradient_accumulation_steps: int | None = None,
        data_parallel_size: int | None = None,
    ) -> PipelineConfig:
        """The pipeline's own section, `pipeline` (None: one stage), with the batch triple from
        the top level (any two of the three, DeepSpeed's rule) and the data-parallel size N
        (default: world size / `pipeline.stages`). An unknown key is a `ConfigError` with its
        path and the nearest known key."""
        section = {} if section is None else section
        check_keys(section, _KNOWN, "pipeline")
        if "partition" in section and "partition_method" in section:
            raise ValueError("pipeline sets both partition and partition_method; keep one")
        stages = section.get("stages", 1)
        if stages == "auto":
            raise ValueError(
                "pipeline.stages='auto' is not supported: give the number of stages as an int"
            )
        method = section.get("partition_method", section.get("partition", "parameters"))
        if method == "best":
            method = "parameters"
        interval = section.get("activation_checkpoint_interval", 0)
        if interval not in (0, 1):
            raise ValueError(
                f"pipeline.activation_checkpoint_interval={interval!r}: minispeed checkpoints a "
                "whole stage chunk or nothing; use 0 (off) or 1 (on)"
            )
        for key in ("pipe_partitioned", "grad_partitioned"):
            if section.get(key):
                raise ValueError(
                    f"pipeline.{key}=true splits activations over tensor-parallel ranks, which "
                    "minispeed.pipeline does not have; set it to false or remove it"
                )
        if data_parallel_size is None:
            data_parallel_size = _data_parallel_size(stages)
        _, micro, acc = batch_triple(
            train_batch_size,
            micro_batch_size,
            gradient_accumulation_steps,
            data_parallel_size=data_parallel_size,
        )
        return cls(
            stages=stages,
            micro_batches=acc,
            micro_batch_size=micro,
            data_parallel_size=data_parallel_size,
            schedule=section.get("schedule", "1f1b"),
            partition_method=method,
            virtual_stages=section.get("virtual_stages", 1),
            activation_checkpointing=bool(interval),
            seed=0 if section.get("seed_layers", True) else None,
        )
