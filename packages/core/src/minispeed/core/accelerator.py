"""One object that answers every device question: which device, which streams, which backend.

No other module in minispeed branches on `torch.cuda.is_available()`: it asks
`get_accelerator`. That keeps CPU-only machines (gloo, no streams) and GPU machines (NCCL,
CUDA streams and events) on one code path, and lets a test force the CPU with
`MINISPEED_ACCELERATOR=cpu` on a machine that has a GPU.

On the CPU, streams and events are no-ops that keep the same interface: an event still measures
wall time (so the comms logger can time collectives on either device), a stream context does
nothing, and `synchronize()` returns at once, since CPU kernels run eagerly on the calling thread.

Costs: nothing is allocated here except what a caller asks for (`pin_memory` copies a tensor into
page-locked host memory of the same size: `numel * element_size` bytes).
"""

from __future__ import annotations

import contextlib
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "get_accelerator",
    "set_accelerator",
]

ACCELERATOR_ENV = "MINISPEED_ACCELERATOR"


class _HostEvent:
    """A CPU stand-in for `torch.cuda.Event`: records wall time when `record()` is called."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: object | None = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: object | None = None) -> None:
        """Nothing to wait for: CPU work is already done when `record` returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """CPU work is synchronous; nothing to do."""

    def elapsed_time(self, end: _HostEvent) -> float:
        """Milliseconds between this event and `end`, like `torch.cuda.Event.elapsed_time`."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded: call record() on each")
        return (end._t - self._t) * 1e3


class _HostStream:
    """A CPU stand-in for `torch.cuda.Stream`: every method is a no-op."""

    def wait_stream(self, other: object) -> None:
        """Work on the CPU is ordered by program order already."""

    def wait_event(self, event: object) -> None:
        """Work on the CPU is ordered by program order already."""

    def record_event(self, event: _HostEvent | None = None) -> _HostEvent:
        event = event or _HostEvent()
        event.record()
        return event

    def synchronize(self) -> None:
        """Nothing is queued on a host stream."""

    def query(self) -> bool:
        return True


class Accelerator(ABC):
    """The interface every device implements. Use `get_accelerator` to get the active one."""

    #: Short name: `"cpu"` or `"cuda"`.
    name: str

    @abstractmethod
    def is_available(self) -> bool:
        """Whether this device can be used on this machine."""

    @abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind the process can see."""

    @abstractmethod
    def current_device_index(self) -> int:
        """Index of the device new tensors go to."""

    @abstractmethod
    def set_device(self, index: int) -> None:
        """Make `index` the current device of this process (a no-op on the CPU)."""

    def device(self, index: int | None = None) -> torch.device:
        """The `torch.device` for `index` (the current device when `None`)."""
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, self.current_device_index() if index is None else index)

    @abstractmethod
    def communication_backend(self) -> str:
        """The torch.distributed backend for tensors on this device: `gloo` or `nccl`."""

    # -- streams and events ------------------------------------------------------------------
    @abstractmethod
    def Stream(self, priority: int = 0) -> object:
        """A new stream (a no-op object on the CPU)."""

    @abstractmethod
    def Event(self, enable_timing: bool = False) -> object:
        """A new event; on the CPU it records wall time."""

    @abstractmethod
    def current_stream(self) -> object:
        """The stream kernels are queued on now."""

    @abstractmethod
    def stream(self, stream: object | None) -> contextlib.AbstractContextManager:
        """A context that queues work on `stream` (does nothing on the CPU)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every queued kernel of the current device has finished."""

    # -- memory -------------------------------------------------------------------------------
    @abstractmethod
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked host copy of `tensor` (the tensor itself where pinning means nothing)."""

    @abstractmethod
    def memory_allocated(self) -> int:
        """Bytes held by live tensors on the device (CPU: resident set size of the process)."""

    @abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak of `memory_allocated` since the last reset (CPU: peak resident set size)."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Restart the peak counter (on the CPU the kernel's peak RSS cannot be reset)."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused blocks to the driver (a no-op on the CPU)."""

    def is_bf16_supported(self) -> bool:
        """Whether bf16 arithmetic runs natively (true on CPUs, Ampere and later GPUs)."""
        return True

    def is_fp16_supported(self) -> bool:
        """Whether fp16 arithmetic is supported."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _read_proc_status_kib(field: str) -> int:
    """A `kB` field of `/proc/self/status` in bytes; 0 where procfs is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CpuAccelerator(Accelerator):
    """Host execution: gloo for communication, no streams, RSS for memory statistics."""

    name = "cpu"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device_index(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        """There is one host device; nothing to select."""

    def communication_backend(self) -> str:
        return "gloo"

    def Stream(self, priority: int = 0) -> _HostStream:
        return _HostStream()

    def Event(self, enable_timing: bool = False) -> _HostEvent:
        return _HostEvent(enable_timing)

    def current_stream(self) -> _HostStream:
        return _HostStream()

    @contextlib.contextmanager
    def stream(self, stream: object | None) -> Iterator[None]:
        yield

    def synchronize(self) -> None:
        """CPU kernels run eagerly; nothing is pending."""

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        # Page-locked memory only matters for DMA to a GPU; on a CPU-only machine it is a copy
        # for nothing (and torch refuses to pin without a CUDA runtime).
        return tensor

    def memory_allocated(self) -> int:
        return _read_proc_status_kib("VmRSS")

    def max_memory_allocated(self) -> int:
        return _read_proc_status_kib("VmHWM")

    def reset_peak_memory_stats(self) -> None:
        """Linux keeps the peak RSS (VmHWM) for the process's lifetime; it cannot be reset here."""

    def empty_cache(self) -> None:
        """The CPU allocator returns memory to the OS by itself."""


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through `torch.cuda`: NCCL, real streams and events, the caching allocator."""

    name = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device_index(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def communication_backend(self) -> str:
        return "nccl"

    def Stream(self, priority: int = 0) -> torch.cuda.Stream:
        return torch.cuda.Stream(priority=priority)

    def Event(self, enable_timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=enable_timing)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def stream(self, stream: object | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()


_ACCELERATORS: dict[str, type[Accelerator]] = {"cpu": CpuAccelerator, "cuda": CudaAccelerator}
_active: Accelerator | None = None


def _choose() -> Accelerator:
    """The one place minispeed decides which device it runs on."""
    forced = os.environ.get(ACCELERATOR_ENV, "").strip().lower()
    if forced:
        if forced not in _ACCELERATORS:
            raise ValueError(
                f"{ACCELERATOR_ENV}={forced!r} is not a known accelerator; "
                f"set it to one of {sorted(_ACCELERATORS)} or unset it to auto-detect"
            )
        acc = _ACCELERATORS[forced]()
        if not acc.is_available():
            raise RuntimeError(
                f"{ACCELERATOR_ENV}={forced!r} but no {forced} device is available here; "
                f"unset {ACCELERATOR_ENV} or set it to 'cpu'"
            )
        return acc
    cuda = CudaAccelerator()
    return cuda if cuda.is_available() else CpuAccelerator()


def get_accelerator() -> Accelerator:
    """The active accelerator, chosen once per process (`MINISPEED_ACCELERATOR` overrides)."""
    global _active
    if _active is None:
        _active = _choose()
    return _active


def set_accelerator(accelerator: Accelerator | str | None) -> Accelerator | None:
    """Replace the active accelerator (`None` re-runs detection on next use). Returns the old one."""
    global _active
    old = _active
    if isinstance(accelerator, str):
        if accelerator not in _ACCELERATORS:
            raise ValueError(
                f"unknown accelerator {accelerator!r}; use one of {sorted(_ACCELERATORS)}"
            )
        accelerator = _ACCELERATORS[accelerator]()
    _active = accelerator
    return old
