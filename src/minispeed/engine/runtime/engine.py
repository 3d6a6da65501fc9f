"""`deepspeed.runtime.engine`: `DeepSpeedEngine`, the name scripts and libraries test engines
against (`isinstance(model, DeepSpeedEngine)`: accelerate unwraps a prepared model by it), and
the type names of `initialize`'s optimizer and scheduler callables.

`DeepSpeedEngine` is an abstract class that every engine `initialize` returns is registered
with (`Engine`, `MoEEngine`, `PipelineEngine`, as DeepSpeed's pipeline engine is a
`DeepSpeedEngine`); build engines with `initialize`, not with it.
"""

import abc
from collections.abc import Callable
from typing import Any

import torch

from minispeed.engine.engine import Engine
from minispeed.engine.pipe_engine import PipelineEngine

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]


class DeepSpeedEngine(abc.ABC):  # noqa: B024 (a name to test against, nothing to implement)
    """DeepSpeed's engine class name, for `isinstance(model, deepspeed.DeepSpeedEngine)`."""


DeepSpeedEngine.register(Engine)
DeepSpeedEngine.register(PipelineEngine)

DeepSpeedOptimizerCallable = Callable[[Any], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], Any]
