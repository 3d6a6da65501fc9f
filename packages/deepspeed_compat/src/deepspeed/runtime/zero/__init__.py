"""`deepspeed.runtime.zero`: minispeed's `minispeed.engine.runtime.zero` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.runtime.zero as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.runtime.zero import *  # noqa: F403
from minispeed.engine.runtime.zero import __all__  # noqa: F401

for _child in ('config', 'offload_config', 'parameter_offload', 'partition_parameters', 'stage3', 'stage_1_and_2'):
    _importlib.import_module(f"{__name__}.{_child}")


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
