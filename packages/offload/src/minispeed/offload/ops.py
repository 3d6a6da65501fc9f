"""The offload op: ONE C++ extension holding the CPU optimizer kernels and the async I/O engine.

Sources live in ``csrc/``: ``cpu_optim/`` (Adam/AdamW, Adagrad, Lion; AVX-512, AVX2 and scalar
paths), ``aio/`` (the thread-pool I/O engine) and ``binding/`` (the pybind11 module). None of them
includes torch's headers, so the first build takes seconds, not a minute; every later load imports
the cached ``.so`` (see `minispeed.core.op_builder`).

The SIMD level is chosen at build time from the CPU (``MINISPEED_SIMD`` forces one); a build
contains every level up to its own and each call picks one (``simd_levels()``), so the tests
compare every path this CPU can run from one build. Without a compiler, `load_op` returns
``None`` and the callers run their pure-PyTorch references (`.cpu_optim_reference`,
`.aio_reference`) after one warning.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from minispeed.core.op_builder import OpBuilder, OpLoader

__all__ = ["OffloadBuilder", "load_op"]

_CSRC = Path(__file__).resolve().parent / "csrc"


class OffloadBuilder(OpBuilder):
    """CPU optimizers + async I/O, one pybind11-only extension, OpenMP over chunks."""

    name = "offload"
    csrc_root = _CSRC
    sources = (
        "cpu_optim/cpu_optim.cpp",
        "aio/aio.cpp",
        "binding/offload_binding.cpp",
    )
    include_dirs = (".",)
    # See Note [bit-equal to torch.optim, but for sqrt] in csrc/cpu_optim/cpu_optim.h: no implicit FMA.
    extra_cxx_flags = ("-ffp-contract=off",)
    extra_ld_flags = ("-pthread",)


_OPS = OpLoader({"cpu": OffloadBuilder()}, per_simd_level=True)  # MINISPEED_SIMD: a build each


def load_op() -> ModuleType | None:
    """The compiled op, or ``None`` to use the references (warned once per process)."""
    return _OPS.load("cpu")
