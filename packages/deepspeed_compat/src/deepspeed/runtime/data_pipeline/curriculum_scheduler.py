"""`deepspeed.runtime.data_pipeline.curriculum_scheduler`: minispeed's `minispeed.engine.runtime.data_pipeline.curriculum_scheduler` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.runtime.data_pipeline.curriculum_scheduler as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.runtime.data_pipeline.curriculum_scheduler import *  # noqa: F403
from minispeed.engine.runtime.data_pipeline.curriculum_scheduler import __all__  # noqa: F401


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
