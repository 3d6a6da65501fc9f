"""`deepspeed.compression`: minispeed's `minispeed.engine.compression` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.compression as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.compression import *  # noqa: F403
from minispeed.engine.compression import __all__  # noqa: F401

for _child in ('compress', 'helper', 'scheduler'):
    _importlib.import_module(f"{__name__}.{_child}")


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
