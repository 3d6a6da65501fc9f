"""`deepspeed.moe.utils`: minispeed's `minispeed.engine.moe.utils` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.moe.utils as _adapter
from minispeed.engine.moe.utils import *  # noqa: F403
from minispeed.engine.moe.utils import __all__  # noqa: F401


def __getattr__(name):
    return getattr(_adapter, name)
