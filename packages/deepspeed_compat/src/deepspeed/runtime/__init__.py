"""`deepspeed.runtime`: minispeed's `minispeed.engine.runtime` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.runtime as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.runtime import *  # noqa: F403
from minispeed.engine.runtime import __all__  # noqa: F401

for _child in ('activation_checkpointing', 'base_optimizer', 'config', 'data_pipeline', 'dataloader', 'engine', 'lr_schedules', 'pipe', 'sequence_parallel', 'tensor_parallel', 'torch_autocast', 'utils', 'zero'):
    _importlib.import_module(f"{__name__}.{_child}")


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
