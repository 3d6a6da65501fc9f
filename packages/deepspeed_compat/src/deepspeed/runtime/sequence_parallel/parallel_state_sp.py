"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: minispeed's `minispeed.engine.runtime.sequence_parallel.parallel_state_sp` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.runtime.sequence_parallel.parallel_state_sp as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.runtime.sequence_parallel.parallel_state_sp import *  # noqa: F403
from minispeed.engine.runtime.sequence_parallel.parallel_state_sp import __all__  # noqa: F401


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
