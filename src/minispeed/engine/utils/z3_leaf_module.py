"""`deepspeed.utils.z3_leaf_module`: mark modules whose whole subtree stage 3 fetches at once
(a mixture-of-experts block whose experts run in a data-dependent order), over
`minispeed.zero.set_leaf_module`.

`set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found=True)` marks every module of
`model` whose class is listed (classes, or class names) and returns them; with none found it
raises a `ValueError` (DeepSpeed's) unless `raise_if_not_found=False`. Call it before
`initialize` (minispeed builds its fetch units once, in `zero.shard`; DeepSpeed reads the flag
at every forward): after, it raises, naming that. `get_z3_leaf_modules(model)` lists the marked
modules, `z3_leaf_module(module)` answers for one. `unset_z3_leaf_modules` is not provided
(minispeed's marks are fixed once the model is sharded). Cost: a walk over the modules.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

import minispeed.zero as zero
from minispeed.zero.stage3.init import is_leaf_module

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_modules", "z3_leaf_module"]


def set_z3_leaf_modules(
    model: nn.Module,
    leaf_module_classes: Sequence[type | str],
    raise_if_not_found: bool = True,
) -> list[nn.Module]:
    """Mark `model`'s modules of the given classes as stage-3 leaves (module docstring)."""
    wanted = [c if isinstance(c, str) else c.__name__ for c in leaf_module_classes]
    found = [m for m in model.modules() if type(m).__name__ in wanted]
    if not found and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules: no module of {wanted} in {type(model).__name__}; check the "
            "class names or pass raise_if_not_found=False"
        )
    zero.set_leaf_module(found)
    return found


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` marked as stage-3 leaves."""
    return [m for m in model.modules() if is_leaf_module(m)]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` itself is marked as a stage-3 leaf."""
    return is_leaf_module(model)
