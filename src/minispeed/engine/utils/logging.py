"""DeepSpeed's `deepspeed.utils.logging`: the engine's logger and the rank-aware ways to log.

```python
from minispeed.engine.utils.logging import logger, log_dist   # was: deepspeed.utils.logging
logger.setLevel(logging.WARNING)          # what Lightning's DeepSpeedStrategy does
log_dist("loaded", ranks=[0])             # "[Rank 0] loaded", on rank 0 only
```

`logger` is minispeed's engine logger (`minispeed.core.logging.get_logger("engine")`), the same
object as `minispeed.engine.utils.logger`. The rank rule of `log_dist`, `print_dist` and
`log_dist_once` is DeepSpeed's: before the process group exists every process logs; after, the
ranks listed do (`[-1]`: every rank; `None` or `[]`: none). Each costs one `comm.get_rank()`.
"""

from __future__ import annotations

import functools
import logging as _logging
from collections.abc import Sequence

import minispeed.comm as comm
from minispeed.core.logging import get_logger

__all__ = [
    "get_current_level",
    "get_dist_msg",
    "get_log_level_from_string",
    "log_dist",
    "log_dist_once",
    "log_levels",
    "logger",
    "print_dist",
    "set_log_level_from_string",
    "should_log_le",
    "warning_once",
]

logger = get_logger("engine")

log_levels = {
    "debug": _logging.DEBUG,
    "info": _logging.INFO,
    "warning": _logging.WARNING,
    "error": _logging.ERROR,
    "critical": _logging.CRITICAL,
}
"""The level names `set_log_level_from_string` and `should_log_le` take."""


def get_dist_msg(message: str, ranks: Sequence[int] | None = None) -> str | None:
    """`"[Rank r] message"` when this process should log it (the rank rule above), else None."""
    if comm.is_initialized():
        rank = comm.get_rank()
        listed = list(ranks or [])
        if not listed or (listed[0] != -1 and rank not in listed):
            return None
    else:
        rank = -1
    return f"[Rank {rank}] {message}"


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = _logging.INFO) -> None:
    """Log `message` at `level` with its rank prefix, on the ranks the rule picks."""
    line = get_dist_msg(message, ranks)
    if line is not None:
        logger.log(level, line)


def print_dist(message: str, ranks: Sequence[int] | None = None) -> None:
    """As `log_dist`, printed whatever the log level."""
    line = get_dist_msg(message, ranks)
    if line is not None:
        print(line)


@functools.lru_cache(None)
def _once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, None if ranks is None else list(ranks), level)


def log_dist_once(
    message: str, ranks: Sequence[int] | None = None, level: int = _logging.INFO
) -> None:
    """`log_dist`, each distinct (message, ranks, level) once per process."""
    _once(message, None if ranks is None else tuple(ranks), level)


@functools.lru_cache(None)
def warning_once(*args: object) -> None:
    """`logger.warning(*args)`, each distinct call once per process."""
    logger.warning(*args)


def get_log_level_from_string(name: str) -> int:
    """The `logging` level of a name in `log_levels` (any case)."""
    try:
        return log_levels[name.lower()]
    except KeyError:
        raise ValueError(f"log level {name!r} is not one of {', '.join(log_levels)}") from None


def set_log_level_from_string(name: str, custom_logger: _logging.Logger | None = None) -> None:
    """Set the level of `custom_logger` (default `logger`) and of its handlers."""
    target = logger if custom_logger is None else custom_logger
    level = get_log_level_from_string(name)
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """`logger`'s effective level."""
    return logger.getEffectiveLevel()


def should_log_le(max_level: str) -> bool:
    """Whether `logger` logs at `max_level` or more verbosely (`"info"`: INFO or DEBUG)."""
    if not isinstance(max_level, str):
        raise ValueError(f"should_log_le takes a level name such as 'info', not {max_level!r}")
    return get_current_level() <= get_log_level_from_string(max_level)
