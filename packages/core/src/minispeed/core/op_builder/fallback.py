"""Use the compiled op when it can be had, the pure-PyTorch reference when not, and say so once.

Every op ships a reference implementation with the same signature, so a missing compiler or a
failed build costs speed, never correctness. `MINISPEED_DISABLE_OPS` forces the reference:
`1`/`all` for every op, or a comma list of op names (`cast,quantize`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

from minispeed.core.logging import get_logger, warn_once
from minispeed.core.op_builder.builder import OpBuilder, OpBuildError
from minispeed.core.op_builder.simd import SIMD_ENV

__all__ = ["DISABLE_ENV", "OpLoader", "load_or_fallback", "ops_disabled"]

DISABLE_ENV = "MINISPEED_DISABLE_OPS"
_ALL = frozenset({"1", "all", "true", "yes", "on"})
_NONE = frozenset({"", "0", "false", "no", "off", "none"})


def ops_disabled(name: str) -> bool:
    """Whether `MINISPEED_DISABLE_OPS` turns op `name` off (read on every call: cheap)."""
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in _NONE:
        return False
    if value in _ALL:
        return True
    return name.lower() in {part.strip() for part in value.split(",")}


def load_or_fallback(builder: OpBuilder) -> ModuleType | None:
    """`builder.load()`, or `None` (after ONE warning per op and reason) to use the reference.

    Never raises for an op that cannot be built: the warning names the op, the reason and that
    the pure-PyTorch reference runs instead; the compiler output goes to the debug log.
    """
    if ops_disabled(builder.name):
        warn_once(
            f"op {builder.name!r} is disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}; "
            "using the pure-PyTorch reference"
        )
        return None
    try:
        return builder.load()
    except OpBuildError as err:
        if warn_once(
            f"op {builder.name!r} is unavailable ({err.reason}); using the pure-PyTorch "
            f"reference (slower, same results). Details: python -m minispeed.core.report"
        ):
            get_logger("op_builder").debug("op %r build details:\n%s", builder.name, err.details)
        return None


class OpLoader:
    """An op's builders by device type (`"cpu"`, `"cuda"`), each loaded once per process: the
    one way a package finds its compiled op (its `load_op` returns `OpLoader.load`).

    Asking a builder costs a quarter of a millisecond or more (it fingerprints flags and finds the
    compiler), too much per kernel call, so the module (or `None` after a failed build) is kept
    under the device type and the raw value of `MINISPEED_DISABLE_OPS` (and of `MINISPEED_SIMD`
    with `per_simd_level`; otherwise the level in force at the first call wins): a call that
    finds it costs two environment reads and a dict lookup (25-45x less than asking the builder:
    benchmarks/op_lookup.py), and a test that switches either variable with
    `monkeypatch.setenv` still gets the op in force.
    """

    def __init__(self, builders: Mapping[str, OpBuilder], *, per_simd_level: bool = False) -> None:
        self.builders = dict(builders)
        self.per_simd_level = per_simd_level
        self._loaded: dict[tuple[str, str | None, str | None], ModuleType | None] = {}

    def load(self, device_type: str = "cpu") -> ModuleType | None:
        """The compiled op for `device_type`, or `None`: run the reference (no builder for that
        device, the op disabled, or its build failed: warned once by `load_or_fallback`)."""
        simd = os.environ.get(SIMD_ENV) if self.per_simd_level else None
        key = (device_type, os.environ.get(DISABLE_ENV), simd)
        if key not in self._loaded:
            builder = self.builders.get(device_type)
            self._loaded[key] = None if builder is None else load_or_fallback(builder)
        return self._loaded[key]
