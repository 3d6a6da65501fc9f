"""ZeRO stage 3: parameters partitioned across ranks and fetched module by module.

Reading order, outside-in:

1. :mod:`.hooks` — the four moments (module pre/post forward, pre/post backward) and what each does;
2. :mod:`.coordinator` — the fetch trace, prefetch within a budget, the live-parameter limit, and
   how ranks that run modules in different orders are caught instead of hanging (the check
   itself: :mod:`.trace`);
3. :mod:`.params` — one partitioned parameter (:class:`ShardedParam`, its state enum) and the
   all-gather / release of one parameter or a group; :mod:`.grads` — the gradient reduce-scatter;
4. :mod:`.init` — ``Init`` (build a model already partitioned), ``GatheredParameters`` (full
   values for user code), ``set_leaf_module`` (fetch a subtree at once);
5. :mod:`.strategy` — :class:`Stage3Strategy`, what the optimizer sees; :mod:`.access` — why reading
   a released parameter raises; :mod:`.ledger` — bytes per step, as a formula.

The life of one parameter, with a measured trace, is in docs/packages/zero-stage3.md.
"""

from minispeed.zero.stage3.access import ParameterNotGatheredError
from minispeed.zero.stage3.init import (
    GatheredParameters,
    Init,
    full_state_dict,
    is_leaf_module,
    set_leaf_module,
)
from minispeed.zero.stage3.ledger import Stage3StepBytes, stage3_step_bytes
from minispeed.zero.stage3.params import REGISTRY, ParamState, ShardedParam
from minispeed.zero.stage3.strategy import Stage3Strategy
from minispeed.zero.stage3.trace import FetchOrderError, TraceCheck

__all__ = [
    "REGISTRY",
    "FetchOrderError",
    "GatheredParameters",
    "Init",
    "ParamState",
    "ParameterNotGatheredError",
    "ShardedParam",
    "Stage3StepBytes",
    "Stage3Strategy",
    "TraceCheck",
    "full_state_dict",
    "is_leaf_module",
    "set_leaf_module",
    "stage3_step_bytes",
]
