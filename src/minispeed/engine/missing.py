"""A DeepSpeed name minispeed does not provide, raised so that both ways of asking answer.

```python
def __getattr__(name):                      # a module's, for the names it declines
    if name in _DECLINED:
        decline(f"deepspeed.utils.{name} is not provided by minispeed; use ...", name)
    raise AttributeError(...)
```

`from deepspeed.utils import name` should get an `ImportError` carrying the message: if the
module's `__getattr__` raises `AttributeError`, Python discards the message and raises its own
"cannot import name", which says nothing of minispeed. But `hasattr(module, name)` and
`getattr(module, name, default)`, which libraries use to probe DeepSpeed's features, expect an
`AttributeError`: an `ImportError` escapes them. So `decline` looks at the instruction its
caller is running: `IMPORT_FROM` (a `from ... import` statement) gets the `ImportError`,
anything else `NotProvided`, an `AttributeError` with the same message. Reading the caller's
instruction is CPython's frame API; where it says nothing, `NotProvided` is raised (the same
text on attribute access; Python's plain message on a from-import).

A module reached through the `deepspeed` distribution's adapters is asked by the adapter, not
by the statement: the adapter (`deepspeed_paths.adapted_attribute`) catches `NotProvided` and
declines again, with the same message, for its own caller.
"""

from __future__ import annotations

import dis
import sys
from types import FrameType
from typing import NoReturn

_IMPORT_FROM = dis.opmap.get("IMPORT_FROM")


class NotProvided(AttributeError):
    """A name minispeed declines: an `AttributeError` whose message says why and what to use
    (`hasattr` answers False, `getattr(..., default)` gives the default)."""


def importing_from(frame: FrameType | None) -> bool:
    """Whether `frame` is running a `from ... import` statement."""
    if frame is None or _IMPORT_FROM is None:
        return False
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == _IMPORT_FROM


def decline(message: str, name: str, depth: int = 1) -> NoReturn:
    """Raise `message` for the missing `name`, as an `ImportError` when the frame `depth` levels
    above the caller runs a `from ... import` and as `NotProvided` otherwise. `depth` 1: the
    caller is a module's `__getattr__`, asked by the frame above it."""
    if importing_from(sys._getframe(depth + 1)):
        raise ImportError(message, name=name)
    raise NotProvided(message, name=name)
