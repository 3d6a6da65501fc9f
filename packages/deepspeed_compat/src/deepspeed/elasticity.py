"""`deepspeed.elasticity`: minispeed's `minispeed.engine.elasticity` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.elasticity as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.elasticity import *  # noqa: F403
from minispeed.engine.elasticity import __all__  # noqa: F401


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
