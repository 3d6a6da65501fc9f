"""Named time ranges: the one primitive every minispeed package marks its phases with.

```python
from minispeed.core import ranges

with ranges.range("zero3.gather"):  # or @ranges.range("pipeline.forward") on a function
    ...
```

A range is pushed to three listeners, each only while it listens:

- **NVTX**, so Nsight Systems draws the phase by name on its timeline. NVTX listens when a tool
  has injected itself (`NVTX_INJECTION64_PATH` is set, as `nsys` does) or when
  `MINISPEED_NVTX=1`; the push goes through the `nvtx` package (domain `minispeed`), else
  `torch.cuda.nvtx`.
- **`torch.profiler`**, through `torch.profiler.record_function`, so a CPU run's Chrome/Perfetto
  trace shows the same names. It listens while a profiler is recording.
- **`Timer(name)`**, the seconds spent inside every range of that name (the device synchronized
  at both ends), summed while the timer is open: how an engine's `wall_clock_breakdown` times a
  phase deep inside a package (`zero.backward_done`: DeepSpeed's `backward_allreduce`) without
  that package knowing of timers.

When none listens a range costs one call, two boolean reads and one dict read: no allocation, no
C call into a profiler. comm and zero call this primitive, never `minispeed.profiler`, so the packages
do not depend on the profiler; the profiler builds its views on the names they emit.

Names are dotted, package first: `comm.all_gather`, `zero3.gather`, `pipeline.forward`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NVTX_DOMAIN", "Timer", "enable_nvtx", "nvtx_enabled", "range"]

_NVTX_ENV = "MINISPEED_NVTX"
_nvtx_on: bool | None = None  # decided once, on first use; enable_nvtx() overrides
_push: Callable[[str], Any] | None = None
_pop: Callable[[], Any] | None = None


NVTX_DOMAIN = "minispeed"
"""The NVTX domain minispeed's ranges are pushed in (with the `nvtx` package; Nsight Systems
shows it as its own row). torch's fallback binding pushes in the default domain."""


def _find_nvtx() -> tuple[Callable[[str], Any], Callable[[], Any]] | None:
    """The NVTX push/pop pair: the `nvtx` package, else torch's CUDA binding, else None."""
    try:
        import nvtx  # the NVTX C API through a small extension; loads the injected tool

        domain = nvtx.get_domain(NVTX_DOMAIN)
        attributes: dict[str, Any] = {}  # name -> event attributes (a registered string)

        def push(name: str) -> None:
            attr = attributes.get(name)
            if attr is None:
                attr = attributes[name] = domain.get_event_attributes(message=name)
            domain.push_range(attr)

        return push, domain.pop_range
    except (ImportError, AttributeError):
        pass
    try:
        from torch.cuda import nvtx as torch_nvtx

        torch_nvtx.range_push("minispeed.probe")  # raises on builds without NVTX
        torch_nvtx.range_pop()
        return torch_nvtx.range_push, torch_nvtx.range_pop
    except (ImportError, RuntimeError, AttributeError):
        return None


def enable_nvtx(on: bool = True) -> bool:
    """Switch NVTX emission on or off for this process; returns whether it is now on.

    On needs an NVTX binding (`pip install nvtx`, or a CUDA build of torch); without one it
    stays off and returns False.
    """
    global _nvtx_on, _push, _pop
    pair = _find_nvtx() if on else None
    _push, _pop = pair if pair else (None, None)
    _nvtx_on = pair is not None
    return _nvtx_on


def nvtx_enabled() -> bool:
    """Whether ranges are pushed to NVTX (decided on first use from the environment)."""
    if _nvtx_on is None:
        wanted = bool(os.environ.get("NVTX_INJECTION64_PATH")) or os.environ.get(_NVTX_ENV) == "1"
        enable_nvtx(wanted)
    return bool(_nvtx_on)


def _profiler_recording() -> bool:
    return torch._C._autograd._profiler_enabled()


_timers: dict[str, list[Timer]] = {}  # range name -> the open timers of that name


class Timer:
    """Seconds spent inside `range(name)`, summed from now until `close()` (or the context's
    exit): `with ranges.Timer("zero.backward_done") as t: ...; t.seconds`.

    Each timed range costs two device synchronizations (`Accelerator.synchronize`, nothing on
    CPU) and two `perf_counter` reads; ranges of other names, one dict read.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.seconds = 0.0
        _timers.setdefault(name, []).append(self)

    def close(self) -> None:
        """Stop listening (idempotent); `seconds` keeps its sum."""
        listening = _timers.get(self.name, [])
        if self in listening:
            listening.remove(self)
            if not listening:
                del _timers[self.name]

    def __enter__(self) -> Timer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _synchronize() -> None:
    from minispeed.core.accelerator import get_accelerator  # accelerator imports nothing of ours

    get_accelerator().synchronize()


# `range` shadows the builtin on purpose, in this module only: NVTX pushes and pops ranges.
class range(contextlib.ContextDecorator):
    """A named range: `with range("zero3.gather"):` or `@range("pipeline.step")`.

    Costs nothing measurable when no tool listens (see the module docstring); otherwise one
    NVTX push/pop and one `record_function` enter/exit.
    """

    __slots__ = ("_name", "_record", "_start")

    def __init__(self, name: str) -> None:
        self._name = name
        self._record: contextlib.AbstractContextManager[Any] | None = None
        self._start: float | None = None

    def __enter__(self) -> range:
        if _timers and self._name in _timers:
            _synchronize()
            self._start = time.perf_counter()
        if nvtx_enabled():
            _push(self._name)  # type: ignore[misc]
        if _profiler_recording():
            self._record = torch.profiler.record_function(self._name)
            self._record.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._record is not None:
            record, self._record = self._record, None
            record.__exit__(*exc)
        if _nvtx_on:
            _pop()  # type: ignore[misc]
        if self._start is not None:
            _synchronize()
            elapsed, self._start = time.perf_counter() - self._start, None
            for timer in _timers.get(self._name, ()):
                timer.seconds += elapsed

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = self._name

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with range(name):  # a fresh range per call: the decorator may be re-entered
                return fn(*args, **kwargs)

        return wrapped
