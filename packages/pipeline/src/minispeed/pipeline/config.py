"""`PipelineConfig`: the options of `partition` and `PipelineExecutor`, and DeepSpeed's keys for them.

```python
ds = json.load(open("ds_config.json"))
cfg = PipelineConfig.from_section(ds.get("pipeline"), micro_batch_size=4, gradient_accumulation_steps=8)
module = pipeline.partition(layers, loss_fn=loss, **cfg.partition_kwargs())
executor = pipeline.PipelineExecutor(module, opt, **cfg.executor_kwargs())
```

DeepSpeed keys read (top level and the `"pipeline"` section), and what they become:

| DeepSpeed | here |
|---|---|
| `train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps` | `micro_batches` = the accumulation steps (DeepSpeed's pipeline engine runs one micro-batch per accumulation step), `micro_batch_size`; DeepSpeed's rule (`batch_triple`): any two give the third through train = micro × accumulation × data-parallel size, one alone sets accumulation to 1, contradictions are errors |
| `pipeline.stages` (an int, or `"auto"`: the caller's `known_stages`, a `PipelineModule`'s) | `stages` |
| `pipeline.partition` / `pipeline.partition_method` (`"best"` = `"parameters"`) | `partition_method` |
| `pipeline.seed_layers` | `seed = 0` when true, `None` (torch's current RNG) when false |
| `pipeline.activation_checkpoint_interval` (0 or 1 only) | `activation_checkpointing` |
| `pipeline.pipe_partitioned`, `pipeline.grad_partitioned` | accepted either way (DeepSpeed's default, true, included); tensors go between stages whole |

minispeed's own keys in the same section: `schedule` (left out: 1F1B, or GPipe when M < P),
`virtual_stages`. Unknown keys are errors. Each field names the key it reads (the config
pattern, `minispeed.core.sections`).

The data-parallel size in the batch rule is `data_parallel_size` when given, else the world size
of `minispeed.comm` divided by `pipeline.stages` (as DeepSpeed's engine takes it from its process
grid), or 1 before `init_distributed`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import minispeed.comm as comm
from minispeed.core.config import BATCH_KEYS as _TRIPLE
from minispeed.core.config import ConfigError, batch_triple, field_error, join_path
from minispeed.core.sections import Section, Unsupported, build, ds_only, key, translate_section
from minispeed.pipeline.schedules import SCHEDULES

__all__ = ["PipelineConfig", "batch_triple"]


def _data_parallel_size(stages: Any) -> int:
    """World size / stages once `minispeed.comm` is initialized; 1 before (nothing to divide)."""
    if not comm.is_initialized() or not isinstance(stages, int) or stages < 1:
        return 1
    world = comm.get_world_size()
    if world % stages:
        raise ConfigError(
            "pipeline.stages",
            f"{stages} does not divide the world size {world}; use a stage count that divides "
            "it (the rest is data parallelism)",
        )
    return world // stages


def _method(value: Any) -> Any:
    """DeepSpeed's `"best"` is our `"parameters"`."""
    return "parameters" if value == "best" else value


def _checkpoint_interval(value: Any) -> bool:
    if isinstance(value, bool) or value not in (0, 1):
        raise ValueError(
            f"{value!r}: minispeed checkpoints a whole stage chunk or nothing; use 0 (off) or 1 (on)"
        )
    return bool(value)


def _seed(value: Any) -> int | None:
    if not isinstance(value, bool):
        raise TypeError(f"must be true or false, got {value!r}")
    return 0 if value else None


@dataclass(frozen=True)
class PipelineConfig(Section):
    """How to cut and run a pipeline (DeepSpeed section `pipeline`; validated on construction)."""

    ds_path: ClassVar[str] = "pipeline"
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "use_reentrant": ds_only(
            None, "the pipeline's activation checkpointing uses torch's non-reentrant form"
        ),
    }

    stages: int = key(
        "stages",
        1,
        schema={"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]},
        derived='Left out or "auto": the PipelineModule\'s stage count (1 without one).',
    )
    """Pipeline stages P (the rest of the world is data parallelism)."""
    micro_batches: int = 1
    """Micro-batches M per step; the bubble is (P−1)/(M+P−1), so M ≥ 4P keeps it under 20%."""
    schedule: str = key(
        "schedule",
        "1f1b",
        schema={"enum": sorted(SCHEDULES)},
        derived="Left out: 1f1b, or gpipe when there are fewer micro-batches than stages "
        "(the same work; 1F1B needs M >= P).",
    )
    """minispeed's key: one of `schedules.SCHEDULES`."""
    partition_method: str = key(
        "partition_method", "parameters", aliases=("partition",), read=_method
    )
    """How layers are cut into stages: `"uniform"`, `"parameters"` (DeepSpeed's `"best"`) or
    `"type:<regex>"`."""
    virtual_stages: int = key("virtual_stages", 1)
    """minispeed's key: model chunks per stage (V ≥ 2 only with `"interleaved_1f1b"`)."""
    activation_checkpointing: bool = key(
        "activation_checkpoint_interval",
        False,
        read=_checkpoint_interval,
        schema={"type": "integer", "enum": [0, 1], "default": 0},
    )
    """Recompute each chunk's forward during its backward, keeping only chunk inputs
    (DeepSpeed `activation_checkpoint_interval`: 0 off, 1 on)."""
    seed: int | None = key(
        "seed_layers", 0, read=_seed, schema={"type": "boolean", "default": True}
    )
    """Layer i is built under `torch.manual_seed(seed + i)`; None: no reseeding (DeepSpeed
    `seed_layers`: true gives seed 0, false None). DeepSpeed's default is false; here true, so a
    stage's layers get the weights the same model built whole on one process gets
    (`build_unsplit`, the reference tests compare with), whatever the RNG did before; write
    false for torch's RNG as is (data-parallel replicas still start equal: see the module)."""
    pipe_partitioned: bool = key("pipe_partitioned", True)
    """DeepSpeed's (default true): under tensor parallelism, send the activations between
    stages split over the tensor ranks and all-gather them on arrival. minispeed.pipeline sends
    them whole either way: the same values, T times the bytes of DeepSpeed's split send."""
    grad_partitioned: bool = key("grad_partitioned", True)
    """DeepSpeed's (default true): the same split for the gradients sent back between stages;
    sent whole here either way, as for `pipe_partitioned`."""
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
        super().__post_init__()
        for name in ("stages", "micro_batches", "virtual_stages", "data_parallel_size"):
            v = getattr(self, name)
            if v < 1:
                raise field_error(self, name, f"must be an int >= 1, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise field_error(
                self,
                "schedule",
                f"{self.schedule!r} is unknown; use one of {sorted(SCHEDULES)}",
            )
        m = self.partition_method
        if m not in ("uniform", "parameters") and not m.startswith("type:"):
            raise field_error(
                self,
                "partition_method",
                f"{m!r}; use 'uniform', 'parameters' or 'type:<regex>'",
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
        """Deprecated (use `from_section`): the `pipeline` section and the batch keys picked out
        of a whole ds_config; `data_parallel_size`: N in the batch rule (default: world size /
        `pipeline.stages`)."""
        warnings.warn(
            "PipelineConfig.from_ds_config is deprecated: use PipelineConfig.from_section("
            "ds_config['pipeline'], micro_batch_size=..., gradient_accumulation_steps=...)",
            DeprecationWarning,
            stacklevel=2,
        )
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
        section: Mapping[str, Any] | None = None,
        *,
        path: str | None = None,
        train_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        gradient_accumulation_steps: int | None = None,
        data_parallel_size: int | None = None,
        known_stages: int | None = None,
    ) -> PipelineConfig:
        """The pipeline's own section, `pipeline` (None: one stage), with the batch triple from
        the top level (any two of the three, DeepSpeed's rule), the data-parallel size N
        (default: world size / `pipeline.stages`) and `known_stages`, the stage count the caller
        already knows (a `PipelineModule`'s).

        The one rule for `stages`: left out or `"auto"`, it is `known_stages` (left out without
        one: 1; `"auto"` without one: an error, since nothing knows the count); an int given
        with `known_stages` must equal it. `schedule` left out is 1F1B, or GPipe when there are
        fewer micro-batches than stages (the same order of work; 1F1B needs M ≥ P). An unknown
        key is a `ConfigError` with its path and the nearest known key."""
        path = cls.ds_path if path is None else path
        stages: Any = "auto" if known_stages is not None else 1
        if isinstance(section, Mapping) and "stages" in section:  # read here: it may be "auto"
            section = dict(section)
            stages = section.pop("stages")
            if isinstance(stages, float) and stages.is_integer():
                stages = int(stages)
        kwargs = translate_section(cls, section, path)
        where = join_path(path, "stages")
        if stages == "auto":
            if known_stages is None:
                raise ConfigError(
                    where,
                    '"auto" needs the stage count from a PipelineModule; here, give the number '
                    "of stages as an int",
                )
            stages = known_stages
        elif isinstance(stages, bool) or not isinstance(stages, int):
            raise ConfigError(where, f'must be an int >= 1 or "auto", got {stages!r}')
        elif known_stages is not None and stages != known_stages:
            raise ConfigError(
                where,
                f"{stages} but the PipelineModule has {known_stages} stages; make them equal or "
                'write "auto"',
            )
        if data_parallel_size is None:
            data_parallel_size = _data_parallel_size(stages)
        _, micro, acc = batch_triple(
            train_batch_size,
            micro_batch_size,
            gradient_accumulation_steps,
            data_parallel_size=data_parallel_size,
        )
        kwargs.setdefault("schedule", "1f1b" if acc >= stages else "gpipe")
        kwargs.update(
            stages=stages,
            micro_batches=acc,
            micro_batch_size=micro,
            data_parallel_size=data_parallel_size,
        )
        return build(cls, path, kwargs, section)
