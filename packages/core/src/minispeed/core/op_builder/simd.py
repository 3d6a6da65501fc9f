"""Which CPU vector instructions an op may be compiled for: AVX-512, AVX2, or plain scalar C++.

The level is read once from the `flags` line of `/proc/cpuinfo` and can be forced lower with
`MINISPEED_SIMD=avx512|avx2|scalar` (to exercise the scalar path on a machine with AVX-512, or to
build a cache that runs on older CPUs of a cluster). Forcing a level the CPU lacks is allowed to
*build* but makes `is_compatible()` say no, because running it would crash with SIGILL.

Each level maps to explicit `-m` flags plus one define (`-DMINISPEED_SIMD_AVX512` ...) that the
C++ sources switch on. We do not use `-march=native`: the cache key is a hash of the flags, and
`native` would give two different CPUs the same key for different code.
"""

from __future__ import annotations

import enum
import functools
import os
import platform

__all__ = [
    "SIMD_ENV",
    "SimdLevel",
    "cpu_simd_level",
    "missing_cpu_flags",
    "requested_simd_level",
    "simd_flags",
]

SIMD_ENV = "MINISPEED_SIMD"


class SimdLevel(enum.IntEnum):
    """Vector instruction sets, ordered: a CPU that runs one level runs every lower one."""

    SCALAR = 0  # plain C++; the compiler may still auto-vectorize with the baseline ISA (SSE2)
    AVX2 = 1  # 256-bit: 8 fp32 lanes; needs avx2, fma, f16c
    AVX512 = 2  # 512-bit: 16 fp32 lanes; needs avx512f, avx512bw, avx512vl

    @property
    def label(self) -> str:
        """The lower-case name used in `MINISPEED_SIMD` and in reports."""
        return self.name.lower()


# cpuinfo flags each level needs (x86-64 only; other architectures build the scalar path).
_REQUIRED_CPU_FLAGS: dict[SimdLevel, frozenset[str]] = {
    SimdLevel.AVX512: frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}),
    SimdLevel.AVX2: frozenset({"avx2", "fma", "f16c"}),
    SimdLevel.SCALAR: frozenset(),
}

_COMPILER_FLAGS: dict[SimdLevel, tuple[str, ...]] = {
    SimdLevel.AVX512: (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-DMINISPEED_SIMD_AVX512",
    ),
    SimdLevel.AVX2: ("-mavx2", "-mfma", "-mf16c", "-DMINISPEED_SIMD_AVX2"),
    SimdLevel.SCALAR: ("-DMINISPEED_SIMD_SCALAR",),
}


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in `path`; empty where procfs is absent."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_simd_level() -> SimdLevel:
    """The highest level this CPU supports (what the hardware can run, ignoring the env override)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return SimdLevel.SCALAR
    flags = _cpuinfo_flags()
    for level in (SimdLevel.AVX512, SimdLevel.AVX2):
        if _REQUIRED_CPU_FLAGS[level] <= flags:
            return level
    return SimdLevel.SCALAR


def requested_simd_level() -> SimdLevel:
    """The level ops are built for: `MINISPEED_SIMD` when set, else `cpu_simd_level`.

    Read on every call (not cached) so a test can switch levels with `monkeypatch.setenv`.
    """
    forced = os.environ.get(SIMD_ENV, "").strip().lower()
    if not forced:
        return cpu_simd_level()
    by_label = {level.label: level for level in SimdLevel}
    if forced not in by_label:
        raise ValueError(
            f"{SIMD_ENV}={forced!r} is not a SIMD level; set it to one of "
            f"{sorted(by_label)} or unset it to detect the CPU's level"
        )
    return by_label[forced]


def simd_flags(level: SimdLevel) -> list[str]:
    """The C++ compiler flags (`-m...` and the `-DMINISPEED_SIMD_*` define) for `level`."""
    return list(_COMPILER_FLAGS[level])


def missing_cpu_flags(level: SimdLevel) -> list[str]:
    """cpuinfo flags `level` needs that this CPU lacks (empty: the CPU can run it)."""
    if level == SimdLevel.SCALAR:
        return []
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"x86-64 (this machine is {platform.machine()})"]
    return sorted(_REQUIRED_CPU_FLAGS[level] - _cpuinfo_flags())
