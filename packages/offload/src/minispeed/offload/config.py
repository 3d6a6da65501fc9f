"""Offload configuration: ``offload_optimizer``, ``offload_param`` and ``aio``, with DeepSpeed's keys.

Three frozen dataclasses, each built directly or from its ds_config section with
``from_ds_config(section)`` (the section's dict, e.g. ``ds["zero_optimization"]["offload_optimizer"]``
or ``ds["aio"]``). Our field names carry their units (``buffer_numel`` counts elements, as
DeepSpeed's ``buffer_size`` does); DeepSpeed's keys are translated once, here. An unknown key is an
error that names it and the closest known key; a value we cannot honour is an error that names
the key and the fix.

Who reads what: `AioConfig` drives `minispeed.offload.aio.AsyncIO`;
`OffloadOptimizerConfig` drives `minispeed.offload.swapped.SwappedOptimizer` (and, through
``minispeed.zero``'s offload bridge, stages 1-3); `OffloadParamConfig` sizes the
`minispeed.offload.swapper.TensorSwapper` that holds ZeRO-3's parameter shards
(``minispeed.zero.stage3.offloaded``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from minispeed.core.config import ConfigError, check_keys, did_you_mean, translate

__all__ = ["AioConfig", "OffloadOptimizerConfig", "OffloadParamConfig"]


def _translate(
    section: Any, name: str, keys: dict[str, str], fixed: dict[str, Any]
) -> dict[str, Any]:
    """DeepSpeed keys -> our field names (`minispeed.core.config`'s check and translation):
    an unknown key is a `ConfigError` naming the nearest known key; a key in `fixed` is
    accepted only at the one value minispeed.offload implements."""
    check_keys(
        section,
        keys.keys(),
        name,
        unsupported={k: f"minispeed.offload implements only {v!r}" for k, v in fixed.items()},
        defaults=fixed,
    )
    return translate(section, keys, counts=keys)


def _as_dict(section: Any, name: str) -> dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise TypeError(
            f"{name} must be a dict (a ds_config section), got {type(section).__name__}"
        )
    return dict(section)


# The keys both offload sections (optimizer states and parameters) share, under the same names.
_DEVICE_KEYS = {
    "device": "device",
    "nvme_path": "nvme_path",
    "buffer_count": "buffer_count",
    "pin_memory": "pin_memory",
}


def _device_section(section: Any, name: str) -> dict[str, Any]:
    """An offload section as a fresh dict; `device: null` means the default (``none``)."""
    section = _as_dict(section, name)
    if section.get("device") is None:
        section.pop("device", None)
    return section


def _check_types(obj: Any, prefix: str) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        expected = {
            "int": int,
            "bool": bool,
            "str": str,
            "str | None": (str, type(None)),
            "int | None": (int, type(None)),
        }[str(f.type)]
        if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
            raise TypeError(f"{prefix}.{f.name} must be {f.type}, got {value!r}")


@dataclass(frozen=True)
class AioConfig:
    """How the async I/O engine reads and writes swap files (DeepSpeed section ``aio``).

    The portable back end runs blocking pread/pwrite calls on worker threads, so the I/Os in
    flight are ``thread_count * queue_depth`` workers (see Note [the portable back end] in
    ``csrc/aio/aio.h``): the depth a libaio back end reaches with ``thread_count`` threads each
    submitting ``queue_depth`` requests.
    """

    #: Bytes per pread/pwrite call (``block_size``). Larger blocks: fewer calls; smaller: more
    #: parallelism per request. 1 MiB is DeepSpeed's default.
    block_bytes: int = 1 << 20
    #: I/Os each thread keeps in flight (``queue_depth``).
    queue_depth: int = 8
    #: Submitting threads (``thread_count``; newer DeepSpeed calls it ``intra_op_parallelism``).
    thread_count: int = 1
    #: Run each request's blocks one after another on one worker (``single_submit``): one I/O in
    #: flight per request instead of up to the worker count.
    single_submit: bool = False
    #: Return from ``submit`` at once and complete in the background (``overlap_events``). False:
    #: every submit waits for its own completion (no overlap of I/O with compute).
    overlap_events: bool = True

    def __post_init__(self) -> None:
        _check_types(self, "AioConfig")
        if self.block_bytes < 4096 or self.block_bytes % 4096:
            raise ValueError(
                f"aio.block_size={self.block_bytes} must be a positive multiple of 4096 "
                "(O_DIRECT needs blocks aligned to the device's sector); e.g. 1048576"
            )
        for name in ("queue_depth", "thread_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"aio.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def workers(self) -> int:
        """Worker threads of the portable back end: ``thread_count * queue_depth``."""
        return self.thread_count * self.queue_depth

    @classmethod
    def from_ds_config(cls, section: dict[str, Any] | None) -> AioConfig:
        """From DeepSpeed's ``aio`` section (``None`` or ``{}``: the defaults)."""
        section = _as_dict(section, "aio")
        if "intra_op_parallelism" in section:
            alias = section.pop("intra_op_parallelism")
            if "thread_count" in section and section["thread_count"] != alias:
                raise ValueError(
                    "aio sets both thread_count and intra_op_parallelism, differently; keep one"
                )
            section["thread_count"] = alias
        keys = {
            "block_size": "block_bytes",
            "queue_depth": "queue_depth",
            "thread_count": "thread_count",
            "single_submit": "single_submit",
            "overlap_events": "overlap_events",
        }
        return cls(**_translate(section, "aio", keys, {"use_gds": False}))


_DEVICES = ("none", "cpu", "nvme")


def _check_device(prefix: str, device: str, nvme_path: str | None) -> None:
    if device not in _DEVICES:
        hint = did_you_mean([str(device)], _DEVICES)
        raise ConfigError(f"{prefix}.device", f"{device!r}{hint}: use one of {list(_DEVICES)}")
    if device == "nvme" and not nvme_path:
        raise ValueError(
            f"{prefix}.device='nvme' needs {prefix}.nvme_path: set it to a directory on a fast "
            "local disk (swap files are created under it)"
        )


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where optimizer states live (DeepSpeed ``zero_optimization.offload_optimizer``).

    ``cpu``: fp32 masters and states in host memory, stepped by the CPU optimizer.
    ``nvme``: the same, with the states swapped to files under ``nvme_path`` between steps.
    """

    #: ``none``, ``cpu`` or ``nvme`` (``device``).
    device: str = "none"
    #: Directory for swap files when ``device='nvme'`` (``nvme_path``).
    nvme_path: str | None = None
    #: Host buffers for swapped partitions (``buffer_count``); >= 2 to prefetch while stepping.
    buffer_count: int = 4
    #: Page-lock the host buffers (``pin_memory``): needed for async copies to a GPU; on a CPU-only
    #: machine they are locked with mlock (never paged out), which fails without the privilege.
    pin_memory: bool = False
    #: Read the next partition's states while this one is stepped (``pipeline_read``).
    pipeline_read: bool = False
    #: Write a stepped partition's states back while the next one is stepped (``pipeline_write``).
    pipeline_write: bool = False

    def __post_init__(self) -> None:
        _check_types(self, "offload_optimizer")
        _check_device("offload_optimizer", self.device, self.nvme_path)
        if self.buffer_count < 1:
            raise ValueError(
                f"offload_optimizer.buffer_count must be >= 1, got {self.buffer_count}"
            )
        if (self.pipeline_read or self.pipeline_write) and self.buffer_count < 2:
            raise ValueError(
                f"offload_optimizer.buffer_count={self.buffer_count} leaves no buffer to prefetch "
                "into: use buffer_count >= 2 with pipeline_read/pipeline_write (4 is the default)"
            )

    @classmethod
    def from_ds_config(cls, section: dict[str, Any] | None) -> OffloadOptimizerConfig:
        """From DeepSpeed's ``offload_optimizer`` section (``None``: device ``none``)."""
        section = _device_section(section, "offload_optimizer")
        if "pipeline" in section:  # DeepSpeed's older switch for both directions
            both = section.pop("pipeline")
            section.setdefault("pipeline_read", both)
            section.setdefault("pipeline_write", both)
        keys = {
            **_DEVICE_KEYS,
            "pipeline_read": "pipeline_read",
            "pipeline_write": "pipeline_write",
        }
        fixed = {"fast_init": False, "ratio": 1.0}
        return cls(**_translate(section, "offload_optimizer", keys, fixed))


@dataclass(frozen=True)
class OffloadParamConfig:
    """Where ZeRO-3 parameter partitions live (DeepSpeed ``zero_optimization.offload_param``)."""

    #: ``none``, ``cpu`` or ``nvme`` (``device``).
    device: str = "none"
    #: Directory for swap files when ``device='nvme'`` (``nvme_path``).
    nvme_path: str | None = None
    #: Host buffers for swapped-in parameter partitions (``buffer_count``).
    buffer_count: int = 5
    #: Elements per buffer (``buffer_size``, which counts elements): at least the largest
    #: partition swapped at once.
    buffer_numel: int = 100_000_000
    #: With ``device='nvme'``: parameter-shard elements per rank kept in host memory, the first
    #: shards in order, whole shards only; the rest go to NVMe (``max_in_cpu``). ``None`` (the
    #: key absent): every shard goes to NVMe. DeepSpeed's default is 1e9 (so a model under 1e9
    #: elements per rank stays in CPU memory there); here only an explicit value keeps shards.
    max_in_cpu_numel: int | None = None
    #: Page-lock the buffers (``pin_memory``), as in `OffloadOptimizerConfig`.
    pin_memory: bool = False

    def __post_init__(self) -> None:
        _check_types(self, "offload_param")
        _check_device("offload_param", self.device, self.nvme_path)
        for name, ds in (("buffer_count", "buffer_count"), ("buffer_numel", "buffer_size")):
            if getattr(self, name) < 1:
                raise ValueError(f"offload_param.{ds} must be >= 1, got {getattr(self, name)}")
        if self.max_in_cpu_numel is not None and self.max_in_cpu_numel < 0:
            raise ValueError(f"offload_param.max_in_cpu must be >= 0, got {self.max_in_cpu_numel}")

    @classmethod
    def from_ds_config(cls, section: dict[str, Any] | None) -> OffloadParamConfig:
        """From DeepSpeed's ``offload_param`` section (``None``: device ``none``)."""
        section = _device_section(section, "offload_param")
        keys = {**_DEVICE_KEYS, "buffer_size": "buffer_numel", "max_in_cpu": "max_in_cpu_numel"}
        return cls(**_translate(section, "offload_param", keys, {}))
