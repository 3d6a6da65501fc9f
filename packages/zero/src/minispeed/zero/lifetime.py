"""`Detachable`: the lifetime of what `zero.shard` returns, written once.

`ZeroOptimizer` (optimizer.py) and `ForwardOnly` (stage3/forward_only.py) both put hooks on the
user's model and hand it back with ``close()``: idempotent, their own hooks removed first, then
the strategy's ``close`` (stage 3: collective, the parameters gathered back), then ``zero.shard``'s
callback (the model may be sharded again), even when the strategy raised. As a context manager,
``close`` runs on a clean exit only: after an error other ranks may never reach a collective
close, and the hooks hold their owners weakly (Note [hooks hold their owner weakly] in
contract.py), so dropping the objects still frees everything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

__all__ = ["Detachable"]


class Detachable:
    """Close-once lifetime. A subclass sets ``_closed = False``, ``_hooks`` (its handles on the
    model) and ``_on_close`` in its constructor, and releases the rest in `_detach`."""

    _closed: bool
    _hooks: list[Any]
    _on_close: Callable[[], None] | None

    def close(self) -> None:
        """Hand the model back as a plain `nn.Module` (idempotent): this object's hooks removed,
        then `_detach`, then ``zero.shard``'s callback."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        try:
            self._detach()
        finally:
            if self._on_close is not None:
                self._on_close()

    def _detach(self) -> None:
        """Release what the subclass holds on the model (its strategy's ``close``)."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Whether `close` ran (the model is plain PyTorch again)."""
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:  # See the module docstring: a collective close after an error hangs
            self.close()
