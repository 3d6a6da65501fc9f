"""DeepSpeed's `deepspeed.checkpointing` import path: activation checkpointing over
`minispeed.zero.checkpoint`, Megatron's random-state tracker over `minispeed.core.rng` and its
per-tensor-parallel-rank seeds over `minispeed.tensor_parallel.seeds`.

```python
import minispeed.engine as deepspeed
deepspeed.checkpointing.configure(mpu, partition_activations=True)   # Megatron's mpu, or a grid
deepspeed.checkpointing.model_parallel_cuda_manual_seed(1234)
with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
    h = dropout(h_local)                               # a mask per tensor-parallel rank
h = deepspeed.checkpointing.checkpoint(block, h)       # keep h, recompute block in backward
```

What is provided, with DeepSpeed 0.19.8's names:

- `checkpoint(function, *args, **kwargs)` keeps the inputs only and recomputes `function` in
  backward with every random stream replayed: the CPU generator, the accelerator's, and each of
  the tracker's states (dropout inside `fork()`), so gradients equal the un-checkpointed run's
  bit for bit. minispeed's is the non-reentrant form (saved-tensor hooks): gradients also reach
  parameters when no input requires grad (DeepSpeed's reentrant `checkpoint` then silently gives
  them none; its `non_reentrant_checkpoint` does not) and `torch.autograd.grad` works through
  it. `non_reentrant_checkpoint` is the same function. Bytes kept per call until backward: the
  inputs' bytes (on the host with `checkpoint_in_cpu`; 1/n of each floating input with
  `partition_activations` over n tensor-parallel ranks, plus one all-gather of it in backward);
  extra compute: one forward of `function`.
- `CheckpointFunction`: DeepSpeed's reentrant autograd function,
  `CheckpointFunction.apply(function, all_outputs, *args)` (`all_outputs` receives every output,
  non-tensors too), `minispeed.zero.ReentrantCheckpoint` under the same settings.
- `get_cuda_rng_tracker()` / `CudaRNGStatesTracker` (`add`, `fork`, `get_states`, `set_states`,
  `reset`; an unknown name or a name or seed added twice raise `RngStateError`, an `Exception`
  as DeepSpeed's): `minispeed.core.rng.RngTracker`. "cuda" is DeepSpeed's word: the tracked
  states are the accelerator's generator's, the CPU generator's on a CPU-only machine.
- `model_parallel_cuda_manual_seed(seed)`: the accelerator's generator gets `seed`, the tracker
  exactly `"model-parallel-rng"` seeded `seed + 2718 + t` on tensor-parallel rank `t`
  (`minispeed.tensor_parallel.seed_tensor_parallel`); `model_parallel_reconfigure_tp_seed(seed)`
  re-seeds that state only. `t` comes from the configured `mpu` (Megatron's
  `get_tensor_model_parallel_rank`, else `get_model_parallel_rank`), or a minispeed grid given
  as `mpu` (or by `initialize`), else 0. DeepSpeed itself fails here without an `mpu`.
- `configure(mpu_, deepspeed_config=None, partition_activations=None,
  contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None,
  profile=None)` reads the same options, or the `activation_checkpointing` section of a
  ds_config (dict or JSON path): `cpu_checkpointing` / `checkpoint_in_cpu` keep the saved inputs
  on the host; `synchronize_checkpoint_boundary` / `synchronize` synchronizes the accelerator
  before and after each checkpointed forward; `partition_activations` keeps each
  tensor-parallel rank's slice (the ranks' inputs must be equal, as Megatron's replicated
  activations are); `contiguous_memory_optimization` / `contiguous_checkpointing` (a buffer
  layout) and `number_checkpoints` (that buffer's size) are accepted and change nothing here;
  `profile` logs each checkpointed forward's and recomputation's time on rank 0 (the
  accelerator synchronized around each, which serializes its work). The module-level flags Megatron-era code reads (`PARTITION_ACTIVATIONS`,
  `CPU_CHECKPOINT`, `mpu`, `mp_rank`, `mp_size`, ...) answer the current settings (read-only:
  change them through `configure`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import minispeed.comm as comm
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.core.logging import log_rank0
from minispeed.core.rng import (
    MODEL_PARALLEL_RNG,
    RngStateError,
    RngTracker,
    rng_tracker,
    set_device_rng_state,
)
from minispeed.tensor_parallel import TensorGroup, reseed_tensor_parallel, seed_tensor_parallel
from minispeed.zero import ActivationCheckpointingConfig, ReentrantCheckpoint
from minispeed.zero import checkpoint as _zero_checkpoint

__all__ = [
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "RngStateError",
    "apply",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = MODEL_PARALLEL_RNG
CudaRNGStatesTracker = RngTracker
"""DeepSpeed's name for the tracker class (`minispeed.core.rng.RngTracker`)."""
_CUDA_RNG_STATE_TRACKER = rng_tracker()


@dataclass
class _Settings:
    configured: bool = False
    cpu_checkpointing: bool = False
    synchronize: bool = False
    partition: bool = False
    contiguous: bool = False
    num_checkpoints: int | None = None
    profile: bool = False
    mpu: Any = None  # as given: Megatron's mpu or a minispeed grid
    tensor: TensorGroup | None = None  # this rank's tensor-parallel group, read from `mpu`

    @property
    def partition_group(self) -> Any:
        """The group checkpointed inputs are split over: the tensor-parallel one when
        partitioning over more than one rank."""
        if self.partition and self.tensor is not None and self.tensor.size > 1:
            return self.tensor.group
        return None


_SETTINGS = _Settings()

_FLAGS = {  # DeepSpeed's module globals, answered from the settings (module `__getattr__`)
    "PARTITION_ACTIVATIONS": lambda s: s.partition,
    "CPU_CHECKPOINT": lambda s: s.cpu_checkpointing,
    "CONTIGUOUS_CHECKPOINTING": lambda s: s.contiguous,
    "SYNCHRONIZE": lambda s: s.synchronize,
    "PROFILE_TIME": lambda s: s.profile,
    "deepspeed_checkpointing_enabled": lambda s: s.configured,
    "num_layers": lambda s: s.num_checkpoints,
    "mpu": lambda s: s.mpu,
    "mp_rank": lambda s: 0 if s.tensor is None else s.tensor.rank,
    "mp_size": lambda s: 1 if s.tensor is None else s.tensor.size,
    "mp_group": lambda s: None if s.tensor is None else s.tensor.group,
}


def __getattr__(name: str) -> Any:
    if name in _FLAGS:
        return _FLAGS[name](_SETTINGS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tensor_group(mpu: Any) -> TensorGroup | None:
    """This rank's tensor-parallel group from Megatron's mpu (DeepSpeed's rule: the
    `get_tensor_model_parallel_*` methods, else `get_model_parallel_*`) or a minispeed grid."""
    if mpu is None:
        return None
    if isinstance(mpu, TensorGroup | comm.ProcessGrid):
        return TensorGroup.of(mpu)
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return TensorGroup(
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_group(),
        )
    return TensorGroup(
        mpu.get_model_parallel_rank(),
        mpu.get_model_parallel_world_size(),
        mpu.get_model_parallel_group(),
    )


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
    override the config's section, as in DeepSpeed; unset ones return to the defaults. `mpu_`
    None keeps the mpu of an earlier call (DeepSpeed's rule)."""
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
        "profile": profile,
    }
    section = dataclasses.replace(section, **{k: v for k, v in given.items() if v is not None})
    apply(section, mpu_ if mpu_ is not None else _SETTINGS.mpu)
    # A buffer layout for partitioned activations, which minispeed keeps as ordinary tensors;
    # remembered only to answer CONTIGUOUS_CHECKPOINTING.
    _SETTINGS.contiguous = bool(contiguous_checkpointing)


def apply(section: ActivationCheckpointingConfig, mpu: Any = None) -> None:
    """Use `section`'s settings for every later `checkpoint`, partitioning over `mpu`'s
    tensor-parallel group (Megatron's mpu or a minispeed grid); what `configure` and the
    engine's `initialize` (with its grid) call."""
    _SETTINGS.configured = True
    _SETTINGS.cpu_checkpointing = section.offload_to_cpu
    _SETTINGS.synchronize = section.synchronize
    _SETTINGS.partition = section.partition_activations
    _SETTINGS.num_checkpoints = section.num_checkpoints
    _SETTINGS.profile = section.profile
    _SETTINGS.contiguous = False
    _SETTINGS.mpu = mpu
    _SETTINGS.tensor = _tensor_group(mpu)


def is_configured() -> bool:
    """Whether `configure` was called (DeepSpeed's `is_configured`)."""
    return _SETTINGS.configured


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; minispeed keeps none (no-op)."""


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn `partition_activations` on or off, keeping the other settings (DeepSpeed's)."""
    _SETTINGS.partition = bool(partition_activation)


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's contiguous-buffer size; recorded only (`num_layers`)."""
    _SETTINGS.num_checkpoints = nlayers


def _synchronize() -> None:
    if _SETTINGS.synchronize:
        get_accelerator().synchronize()


def _timed(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, logging on rank 0 how long each call took: the first is the forward, later
    ones the recomputation in backward (the `profile` setting)."""
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        phase = "forward" if calls == 0 else "recomputation"
        calls += 1
        get_accelerator().synchronize()
        start = time.perf_counter()
        with ranges.range(f"checkpointing.{phase}"):
            out = function(*args)
        get_accelerator().synchronize()
        log_rank0(f"activation checkpointing {phase}: {1e3 * (time.perf_counter() - start):.3f} ms")
        return out

    return run


def _configured(run: Callable[[Callable[..., Any]], Any], function: Callable[..., Any]) -> Any:
    """`run(function)` under the settings both entry points share: the accelerator synchronized
    before and after (`synchronize`), `function` timed (`profile`)."""
    _synchronize()
    out = run(_timed(function) if _SETTINGS.profile else function)
    _synchronize()
    return out


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, keeping only the inputs for backward (module docstring)."""
    if kwargs:
        keys, count = tuple(kwargs), len(args)

        def call(*all_args: Any) -> Any:
            return function(*all_args[:count], **dict(zip(keys, all_args[count:])))

        return checkpoint(call, *args, *kwargs.values())
    return _configured(
        lambda run: _zero_checkpoint(
            run,
            *args,
            offload_to_cpu=_SETTINGS.cpu_checkpointing,
            partition_group=_SETTINGS.partition_group,
        ),
        function,
    )


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's non-reentrant variant: minispeed's `checkpoint` already is one."""


class CheckpointFunction(ReentrantCheckpoint):
    """DeepSpeed's reentrant autograd function under the configured settings:
    `CheckpointFunction.apply(function, all_outputs, *args)` returns `function`'s tensor outputs
    and appends every output to `all_outputs` (`minispeed.zero.ReentrantCheckpoint`, whose
    docstring gives its costs and limits)."""

    @classmethod
    def apply(cls, run_function: Callable[..., Any], all_outputs: list, *args: Any) -> Any:
        keep = (_SETTINGS.cpu_checkpointing, _SETTINGS.partition_group)
        return _configured(
            lambda run: super(CheckpointFunction, cls).apply(run, all_outputs, keep, *args),
            run_function,
        )


def get_cuda_rng_tracker() -> RngTracker:
    """The process's tracker (`minispeed.core.rng.rng_tracker`), the one `checkpoint` replays."""
    return rng_tracker()


def _tensor_rank() -> int:
    return 0 if _SETTINGS.tensor is None else _SETTINGS.tensor.rank


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the accelerator's generator with `seed` and the tracker's `"model-parallel-rng"`
    with `seed + 2718 + t` (t: this rank's tensor-parallel rank; module docstring)."""
    seed_tensor_parallel(seed, _tensor_rank())


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the tracker's `"model-parallel-rng"` with `seed + 2718 + t` only."""
    reseed_tensor_parallel(seed, _tensor_rank())


def _set_cuda_rng_state(new_state: Any, device: int = -1) -> None:
    """Put `new_state` into the accelerator's generator (DeepSpeed's helper; `device` is the
    current one)."""
    set_device_rng_state(new_state)
