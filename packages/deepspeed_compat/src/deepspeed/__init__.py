"""`deepspeed`: minispeed's `minispeed.engine` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine import *  # noqa: F403
from minispeed.engine import __all__  # noqa: F401
from minispeed.engine.git_version_info import version as __version__

for _child in ('accelerator', 'checkpoint', 'checkpointing', 'comm', 'compression', 'elasticity', 'git_version_info', 'inference', 'launcher', 'moe', 'monitor', 'ops', 'pipe', 'profiling', 'runtime', 'sequence', 'utils', 'zero'):
    _importlib.import_module(f"{__name__}.{_child}")


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
