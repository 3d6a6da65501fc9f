"""`deepspeed.utils`: minispeed's `minispeed.engine.utils` under DeepSpeed's name.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

import importlib as _importlib

import minispeed.engine.utils as _adapter
from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute
from minispeed.engine.utils import *  # noqa: F403
from minispeed.engine.utils import __all__  # noqa: F401

for _child in ('groups', 'init_on_device', 'logging', 'tensor_fragment', 'z3_leaf_module', 'zero_to_fp32', 'zero_to_torch'):
    _importlib.import_module(f"{__name__}.{_child}")
from minispeed.engine.utils import z3_leaf_module  # noqa: E402


def __getattr__(name):
    return _adapted_attribute(__name__, _adapter, name)
