"""`OpLoader`: each device's op is built once per process (per SIMD level when asked), a device
without a builder and a disabled op give the reference (`None`), and the disable switch is read
on every call."""

from __future__ import annotations

import types

import torch

from minispeed.core.op_builder import DISABLE_ENV, SIMD_ENV, OpLoader, SimdLevel


class _CountingBuilder:
    """Stands in for an `OpBuilder`: counts `load()` calls, returns a fresh module each time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loads = 0

    def simd_level(self) -> SimdLevel:
        from minispeed.core.op_builder import requested_simd_level

        return requested_simd_level()

    def load(self) -> types.ModuleType:
        self.loads += 1
        return types.ModuleType(f"{self.name}_{self.loads}")


def test_each_device_is_loaded_once_and_kept(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    cpu, cuda = _CountingBuilder("fake_cpu"), _CountingBuilder("fake_cuda")
    loader = OpLoader({"cpu": cpu, "cuda": cuda})
    first = loader.load("cpu")
    assert loader.load("cpu") is first and loader.load() is first
    assert (cpu.loads, cuda.loads) == (1, 0)
    assert loader.load("cuda") is not first and cuda.loads == 1
    assert loader.load("xpu") is None  # no builder for that device: the reference runs


def test_the_disable_switch_is_read_on_every_call(monkeypatch):
    cpu = _CountingBuilder("fake_disabled")
    loader = OpLoader({"cpu": cpu})
    monkeypatch.setenv(DISABLE_ENV, "fake_disabled")
    assert loader.load("cpu") is None and cpu.loads == 0
    monkeypatch.delenv(DISABLE_ENV)
    assert loader.load("cpu") is not None and cpu.loads == 1


def test_per_simd_level_keeps_one_module_per_level(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    per_level, first_wins = _CountingBuilder("fake_a"), _CountingBuilder("fake_b")
    loaders = OpLoader({"cpu": per_level}, per_simd_level=True), OpLoader({"cpu": first_wins})
    monkeypatch.setenv(SIMD_ENV, "scalar")
    scalar = [loader.load() for loader in loaders]
    monkeypatch.setenv(SIMD_ENV, "avx2")
    avx2 = [loader.load() for loader in loaders]
    assert avx2[0] is not scalar[0] and per_level.loads == 2
    assert avx2[1] is scalar[1] and first_wins.loads == 1  # the level at the first call wins
    monkeypatch.setenv(SIMD_ENV, "scalar")
    assert loaders[0].load() is scalar[0] and per_level.loads == 2


def test_cast_asks_its_builder_once_not_on_every_call(monkeypatch):
    # Asking a builder costs ~0.3 ms (flags fingerprinted, compiler found): once per process.
    from minispeed.core.ops import cast

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    asked = []
    real_load = cast.CastBuilder.load
    monkeypatch.setattr(cast.CastBuilder, "load", lambda self: asked.append(1) or real_load(self))
    monkeypatch.setattr(cast, "_OPS", OpLoader(cast._OPS.builders, per_simd_level=True))
    x = torch.randn(64)
    for _ in range(3):
        cast.unflatten(cast.flatten([x], dtype=torch.bfloat16), [x.clone()])
        cast.bf16_to_float(cast.float_to_bf16(x))
    assert len(asked) == 1
