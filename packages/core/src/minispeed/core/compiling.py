"""Code that must run eagerly inside `torch.compile`d code, in one place for torch 2.11-2.13.

    from minispeed.core.compiling import eager, is_compiling

    hook = eager(hook)       # dynamo never traces it: the graph breaks around each call
    if is_compiling(): ...   # True only while dynamo traces (a constant in the traced code)

Stage 3 gathers and releases parameters in module hooks (collectives, Python state, autograd
hooks on the outputs): traced by dynamo, they would either break the graph at some arbitrary
line inside or be baked into a graph that never gathers again. `eager` marks such a function
as a graph break of its own: the compiled code stops before the call, the function runs as
plain Python (nothing it calls is compiled either), and the next graph starts after it. Outside
compiled code each call costs about 1.8 us more than the bare function (dynamo's wrapper turns
its frame callback off and on: 2.1 us against 0.37 us for a 3-argument no-op, 10^5 calls, load
5 on 2 cores): for stage 3, two hook calls per parameter-owning module per forward.

Both are torch's own API, present unchanged in torch 2.11, 2.12 and 2.13: `eager` is
`torch._disable_dynamo` (`torch.compiler.disable` imports `torch._dynamo` when it wraps, a few
seconds at import; this wrapper imports it at its first call, which torch's optimizers do at
their first step anyway), `is_compiling` is `torch.compiler.is_compiling`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["eager", "is_compiling"]

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """``fn``, run eagerly (never traced, a graph break of its own) when compiled code calls it."""
    return torch._disable_dynamo(fn)  # type: ignore[return-value]


#: Whether dynamo is tracing the calling code now (False when it runs, compiled or not). torch's
#: own function, not a wrapper: guards call it on every op on a stage-3 parameter.
is_compiling = torch.compiler.is_compiling
