"""Offload configuration: ``offload_optimizer``, ``offload_param`` and ``aio``, with DeepSpeed's keys.

Three frozen dataclasses (the config pattern, `minispeed.core.sections`), each built directly or
from its ds_config section with ``from_section(section)`` (the section's dict, e.g.
``ds["zero_optimization"]["offload_optimizer"]`` or ``ds["aio"]``). Our field names carry their
units (``buffer_numel`` counts elements, as DeepSpeed's ``buffer_size`` does); each field names the
DeepSpeed key it reads. An unknown key is an error that names it and the closest known key; a
value we cannot honour is an error that names the key as written and the fix.

Who reads what: `AioConfig` drives `minispeed.offload.aio.AsyncIO`;
`OffloadOptimizerConfig` drives `minispeed.offload.swapped.SwappedOptimizer` (and, through
``minispeed.zero``'s offload bridge, stages 1-3); `OffloadParamConfig` sizes the
`minispeed.offload.swapper.TensorSwapper` that holds ZeRO-3's parameter shards
(``minispeed.zero.stage3.offloaded``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from minispeed.core.config import ConfigTypeError, did_you_mean, field_error
from minispeed.core.sections import Section, Unsupported, ds_only, key, read_section

__all__ = ["AioConfig", "OffloadOptimizerConfig", "OffloadParamConfig"]


@dataclass(frozen=True)
class AioConfig(Section):
    """How the async I/O engine reads and writes swap files (DeepSpeed section ``aio``).

    The portable back end runs blocking pread/pwrite calls on worker threads, so the I/Os in
    flight are ``thread_count * queue_depth`` workers (see Note [the portable back end] in
    ``csrc/aio/aio.h``): the depth a libaio back end reaches with ``thread_count`` threads each
    submitting ``queue_depth`` requests.
    """

    ds_path: ClassVar[str] = "aio"
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "use_gds": ds_only(False, "no GPUDirect Storage: NVMe reads and writes pass host memory")
    }

    block_bytes: int = key("block_size", 1 << 20)
    """Bytes per pread/pwrite call (DeepSpeed `block_size`), a multiple of 4096. Larger blocks:
    fewer calls; smaller: more parallelism per request. 1 MiB is DeepSpeed's default."""
    queue_depth: int = key("queue_depth", 8)
    """I/Os each thread keeps in flight (`queue_depth`)."""
    thread_count: int = key("thread_count", 1, aliases=("intra_op_parallelism",))
    """Submitting threads (`thread_count`; newer DeepSpeed calls it `intra_op_parallelism`)."""
    single_submit: bool = key("single_submit", False)
    """Run each request's blocks one after another on one worker (`single_submit`): one I/O in
    flight per request instead of up to the worker count."""
    overlap_events: bool = key("overlap_events", True)
    """Return from `submit` at once and complete in the background (`overlap_events`). False:
    every submit waits for its own completion (no overlap of I/O with compute)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_bytes < 4096 or self.block_bytes % 4096:
            raise field_error(
                self,
                "block_bytes",
                f"must be a positive multiple of 4096 (O_DIRECT needs blocks aligned to the "
                f"device's sector), got {self.block_bytes}; e.g. 1048576",
            )
        for name in ("queue_depth", "thread_count"):
            if getattr(self, name) < 1:
                raise field_error(self, name, f"must be >= 1, got {getattr(self, name)}")

    @property
    def workers(self) -> int:
        """Worker threads of the portable back end: ``thread_count * queue_depth``."""
        return self.thread_count * self.queue_depth


_DEVICES = ("none", "cpu", "nvme")


def _device(value: Any) -> Any:
    """`device: null` means the default, ``none``."""
    return "none" if value is None else value


def _check_device(obj: Any) -> None:
    if obj.device not in _DEVICES:
        hint = did_you_mean([str(obj.device)], _DEVICES)
        raise field_error(obj, "device", f"{obj.device!r}{hint}: use one of {list(_DEVICES)}")
    if obj.device == "nvme" and not obj.nvme_path:
        raise field_error(
            obj,
            "nvme_path",
            "must be given with device 'nvme': a directory on a fast local disk (swap files "
            "are created under it)",
        )


@dataclass(frozen=True)
class OffloadOptimizerConfig(Section):
    """Where optimizer states live (DeepSpeed ``zero_optimization.offload_optimizer``).

    ``cpu``: fp32 masters and states in host memory, stepped by the CPU optimizer.
    ``nvme``: the same, with the states swapped to files under ``nvme_path`` between steps.
    """

    ds_path: ClassVar[str] = "zero_optimization.offload_optimizer"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "fast_init": ds_only(
            False, "DeepSpeed's fast NVMe optimizer set-up; the states are swapped out one way"
        ),
        "ratio": ds_only(1.0, "the whole optimizer step is offloaded, not a share of it"),
        "super_offload": ds_only(False, "DeepSpeed's SuperOffload (GH200); use device: cpu"),
        "cpuadam_cores_perc": ds_only(
            0.8, "SuperOffload's core share; minispeed's CPU Adam uses torch's threads"
        ),
    }
    ds_extra: ClassVar[dict[str, Any]] = {
        "pipeline": {
            "type": "boolean",
            "description": "DeepSpeed's older switch for both pipeline_read and pipeline_write "
            "(each written out wins).",
        }
    }

    device: str = key("device", "none", read=_device, schema={"enum": list(_DEVICES)})
    """Where the states live: ``none``, ``cpu`` or ``nvme``."""
    nvme_path: str | None = key("nvme_path", None)
    """Directory for swap files when ``device='nvme'``."""
    buffer_count: int = key("buffer_count", 4)
    """Host buffers for swapped partitions; >= 2 to prefetch while stepping."""
    pin_memory: bool = key("pin_memory", False)
    """Page-lock the host buffers: needed for async copies to a GPU; on a CPU-only machine they
    are locked with mlock (never paged out), which fails without the privilege. DeepSpeed's
    default is true; here false, so that a config leaving it out runs on a host without that
    privilege (give true on a GPU host for overlapped copies)."""
    pipeline_read: bool = key("pipeline_read", False)
    """Read the next partition's states while this one is stepped."""
    pipeline_write: bool = key("pipeline_write", False)
    """Write a stepped partition's states back while the next one is stepped."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_device(self)
        if self.buffer_count < 1:
            raise field_error(self, "buffer_count", f"must be >= 1, got {self.buffer_count}")
        if (self.pipeline_read or self.pipeline_write) and self.buffer_count < 2:
            raise field_error(
                self,
                "buffer_count",
                f"{self.buffer_count} leaves no buffer to prefetch into: use buffer_count >= 2 "
                "with pipeline_read/pipeline_write (4 is the default)",
            )

    @classmethod
    def from_section(
        cls, section: Mapping[str, Any] | None = None, *, path: str | None = None, **context: Any
    ) -> OffloadOptimizerConfig:
        """From DeepSpeed's ``offload_optimizer`` section (None: device ``none``); its older
        ``pipeline`` key sets both directions unless they are written out."""
        path = cls.ds_path if path is None else path
        if isinstance(section, Mapping) and "pipeline" in section:
            section = dict(section)
            both = section.pop("pipeline")
            if not isinstance(both, bool):
                raise ConfigTypeError(
                    f"{path}.pipeline",
                    f"must be true or false, got {both!r} ({type(both).__name__})",
                )
            section.setdefault("pipeline_read", both)
            section.setdefault("pipeline_write", both)
        return read_section(cls, section, path, **context)


@dataclass(frozen=True)
class OffloadParamConfig(Section):
    """Where ZeRO-3 parameter partitions live (DeepSpeed ``zero_optimization.offload_param``)."""

    ds_path: ClassVar[str] = "zero_optimization.offload_param"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default

    device: str = key("device", "none", read=_device, schema={"enum": list(_DEVICES)})
    """Where the shards live: ``none``, ``cpu`` or ``nvme``."""
    nvme_path: str | None = key("nvme_path", None)
    """Directory for swap files when ``device='nvme'``."""
    buffer_count: int = key("buffer_count", 5)
    """Host buffers for swapped-in parameter partitions."""
    buffer_numel: int = key("buffer_size", 100_000_000)
    """Elements per buffer (DeepSpeed `buffer_size`, which counts elements): at least the
    largest partition swapped at once."""
    max_in_cpu_numel: int | None = key("max_in_cpu", None)
    """With ``device='nvme'``: parameter-shard elements per rank kept in host memory, the first
    shards in order, whole shards only; the rest go to NVMe (DeepSpeed `max_in_cpu`). Left out:
    every shard goes to NVMe. DeepSpeed's default is 1e9 (so a model under 1e9 elements per rank
    stays in CPU memory there, and `device: nvme` writes nothing); here only an explicit value
    keeps shards, so `device: nvme` means NVMe (write 1e9 for DeepSpeed's placement)."""
    pin_memory: bool = key("pin_memory", False)
    """Page-lock the buffers, as in `OffloadOptimizerConfig` (DeepSpeed's default is true; here
    false, for the same reason)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_device(self)
        for name in ("buffer_count", "buffer_numel"):
            if getattr(self, name) < 1:
                raise field_error(self, name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_in_cpu_numel is not None and self.max_in_cpu_numel < 0:
            raise field_error(
                self, "max_in_cpu_numel", f"must be >= 0, got {self.max_in_cpu_numel}"
            )
