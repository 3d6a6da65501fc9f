"""`deepspeed.runtime.activation_checkpointing.checkpointing`: DeepSpeed's long path for
`deepspeed.checkpointing` (`minispeed.engine.checkpointing`): the same objects, and its
module-level flags read live from it."""

from typing import Any

import minispeed.engine.checkpointing as _short
from minispeed.engine.checkpointing import *  # noqa: F403
from minispeed.engine.checkpointing import (  # noqa: F401 - private names clients reach for
    _CUDA_RNG_STATE_TRACKER,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    __all__,
    _set_cuda_rng_state,
)


def __getattr__(name: str) -> Any:
    return getattr(_short, name)
