"""DeepSpeed's `deepspeed.checkpointing` import path: activation checkpointing over
`minispeed.zero.checkpoint`.

```python
import minispeed.engine as deepspeed
deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
h = deepspeed.checkpointing.checkpoint(block, h)       # keep h, recompute block in backward
```

`checkpoint(function, *args, **kwargs)` keeps the inputs only and recomputes `function` in
backward, with the RNG replayed (dropout draws the same mask), as DeepSpeed's does. minispeed's is
the non-reentrant form (saved-tensor hooks): gradients also reach parameters when no input
requires grad (DeepSpeed's reentrant `checkpoint` then silently gives them none; its
`non_reentrant_checkpoint` does not) and `torch.autograd.grad` works through it. Bytes kept per
call until backward: the inputs' bytes (on the host with `checkpoint_in_cpu`); extra compute:
one forward of `function`.

`configure(mpu_, deepspeed_config=None, partition_activations=None,
contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None,
profile=None)` reads the same options, or the `activation_checkpointing` section of a ds_config
(dict or JSON path): `cpu_checkpointing` / `checkpoint_in_cpu` keep the saved inputs on the
host; `synchronize_checkpoint_boundary` / `synchronize` synchronizes the accelerator before and
after each checkpointed forward; `partition_activations` is accepted only without model
parallelism (there is nothing to partition over, as in DeepSpeed with one model-parallel rank);
`contiguous_memory_optimization` / `contiguous_checkpointing` (a buffer layout for partitioned
activations) and `number_checkpoints` (that buffer's size) are accepted and change nothing here;
`profile` is refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minispeed.core.accelerator import get_accelerator
from minispeed.zero import ActivationCheckpointingConfig
from minispeed.zero import checkpoint as _zero_checkpoint

__all__ = [
    "apply",
    "checkpoint",
    "configure",
    "is_configured",
    "non_reentrant_checkpoint",
    "reset",
]


@dataclass
class _Settings:
    configured: bool = False
    cpu_checkpointing: bool = False
    synchronize: bool = False


_SETTINGS = _Settings()


def _section(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    """The `activation_checkpointing` section of a ds_config (dict or JSON path), read by its
    class (`minispeed.zero.ActivationCheckpointingConfig`, the engine's too)."""
    if isinstance(deepspeed_config, (str, Path)):
        deepspeed_config = json.loads(Path(deepspeed_config).read_text())
    if not isinstance(deepspeed_config, dict):
        raise TypeError(
            f"deepspeed_config must be a ds_config dict or a JSON path, got "
            f"{type(deepspeed_config).__name__}"
        )
    return ActivationCheckpointingConfig.from_section(
        deepspeed_config.get("activation_checkpointing")
    )


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how `checkpoint` keeps its inputs (see the module docstring). Arguments given here
    override the config's section, as in DeepSpeed; unset ones return to the defaults."""
    # contiguous_checkpointing: a buffer layout for partitioned activations, which minispeed
    # keeps as ordinary tensors; either value runs the same (the section's key likewise).
    if profile:
        raise NotImplementedError(
            "checkpointing profile=True is not implemented; use minispeed.profiler instead"
        )
    section = (
        _section(deepspeed_config)
        if deepspeed_config is not None
        else ActivationCheckpointingConfig()
    )
    given = {
        "partition_activations": partition_activations,
        "num_checkpoints": num_checkpoints,
        "offload_to_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
    }
    section = dataclasses.replace(section, **{k: v for k, v in given.items() if v is not None})
    mp_size = 1 if mpu_ is None else int(mpu_.get_model_parallel_world_size())
    try:
        section.check_model_parallel(mp_size, path="partition_activations")
    except ValueError as e:
        raise NotImplementedError(str(e)) from None
    apply(section)


def apply(section: ActivationCheckpointingConfig) -> None:
    """Use `section`'s settings for every later `checkpoint` (what `configure` and the engine's
    `initialize` call)."""
    _SETTINGS.configured = True
    _SETTINGS.cpu_checkpointing = section.offload_to_cpu
    _SETTINGS.synchronize = section.synchronize


def is_configured() -> bool:
    """Whether `configure` was called (DeepSpeed's `is_configured`)."""
    return _SETTINGS.configured


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; minispeed keeps none (no-op)."""


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, keeping only the inputs for backward (module docstring)."""
    if kwargs:
        keys, count = tuple(kwargs), len(args)

        def call(*all_args: Any) -> Any:
            return function(*all_args[:count], **dict(zip(keys, all_args[count:])))

        return checkpoint(call, *args, *kwargs.values())
    if _SETTINGS.synchronize:
        get_accelerator().synchronize()
    out = _zero_checkpoint(function, *args, offload_to_cpu=_SETTINGS.cpu_checkpointing)
    if _SETTINGS.synchronize:
        get_accelerator().synchronize()
    return out


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's non-reentrant variant: minispeed's `checkpoint` already is one."""
