"""minispeed's logger: one `logging.Logger` named `minispeed`, rank-aware, rich when on a terminal.

Every message carries the process's rank (`[rank 1]`) once torch.distributed is initialized, so
the interleaved output of several processes stays readable. `MINISPEED_LOG_LEVEL` sets the level
(default `INFO`). `warn_once` emits a warning a single time per process, used for op fallbacks.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger", "log_rank0", "warn_once"]

_LOGGER_NAME = "minispeed"
_warned: set[str] = set()


def _rank() -> int | None:
    """The distributed rank, or None before init (never imports a collective module eagerly)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank_tag = f"[rank {rank}] " if rank is not None else ""
        return True


def get_logger(name: str | None = None) -> logging.Logger:
    """The `minispeed` logger, or its child `minispeed.<name>`."""
    root = logging.getLogger(_LOGGER_NAME)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(rank_tag)s%(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("MINISPEED_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return root if name is None else root.getChild(name)


def warn_once(message: str, logger: logging.Logger | None = None) -> bool:
    """Log `message` as a warning the first time it is seen in this process. Returns whether it did."""
    if message in _warned:
        return False
    _warned.add(message)
    (logger or get_logger()).warning(message)
    return True


def log_rank0(message: str, level: int = logging.INFO) -> None:
    """Log on rank 0 only (or when not distributed)."""
    if _rank() in (None, 0):
        get_logger().log(level, message)
