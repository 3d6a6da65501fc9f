"""`deepspeed.runtime.data_pipeline`: minispeed's `minispeed.engine.runtime.data_pipeline` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.runtime.data_pipeline as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.runtime.data_pipeline import *  # noqa: F403
from minispeed.engine.runtime.data_pipeline import __all__  # noqa: F401

for _child in ('curriculum_scheduler',):
    _importlib.import_module(f"{__name__}.{_child}")


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
