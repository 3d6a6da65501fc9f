"""DeepSpeed's `deepspeed.utils` import path: the names scripts import from it.

```python
from minispeed.engine.utils import RepeatingLoader, log_dist, logger   # was: deepspeed.utils
log_dist(f"step {step} loss {loss:.4f}", ranks=[0])
data_iter = iter(RepeatingLoader(loader))       # endless, for pipeline train_batch
```

`log_dist(message, ranks=None, level=INFO)` logs `"[Rank r] message"` on the listed ranks
(`[-1]`: every rank), as DeepSpeed's: with `ranks=None` it logs only before the process group
exists. `logger` is minispeed's engine logger. `RepeatingLoader(loader)` restarts `loader` when it
runs out. `logging` (a module) holds the logger and DeepSpeed's other log calls. `zero_to_fp32` (a module) turns a sharded checkpoint into one fp32 state dict.
`safe_get_full_grad`, `safe_get_full_fp32_param`, `safe_get_full_optimizer_state` and the rest
of DeepSpeed's `safe_*` names (from `tensor_fragment`): one parameter's whole value from the
sharded optimizer. `groups` answers DeepSpeed's process-group queries, `set_z3_leaf_modules`
marks stage-3 leaves (`z3_leaf_module.py`), `OnDevice` builds modules on a device
(`init_on_device.py`).
"""

from __future__ import annotations

from minispeed.engine.missing import NotProvided, decline
from minispeed.engine.utils import groups, logging, tensor_fragment, zero_to_fp32
from minispeed.engine.utils.init_on_device import OnDevice
from minispeed.engine.utils.logging import log_dist, logger
from minispeed.engine.utils.tensor_fragment import *  # noqa: F403 (its __all__: the safe_* names)
from minispeed.engine.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    z3_leaf_module,
)
from minispeed.pipeline import RepeatingLoader

__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "logger",
    "logging",
    "set_z3_leaf_modules",
    "z3_leaf_module",
    "zero_to_fp32",
    *tensor_fragment.__all__,
]


def __getattr__(name: str) -> object:
    # The safe_* names minispeed does not provide are declined naming what to use.
    try:
        return getattr(tensor_fragment, name)
    except NotProvided as declined:
        decline(str(declined), name)
