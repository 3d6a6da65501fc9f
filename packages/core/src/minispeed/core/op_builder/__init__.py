"""JIT-built C++/CUDA ops with a pure-PyTorch fallback.

Reading order: `.simd` (which vector ISA), `.toolchain` (compiler, ninja, nvcc, GPU
archs), `.cache` (where builds live, the cross-process lock), `.builder` (`OpBuilder`:
sources, flags, is_compatible, load), `.fallback` (`OpLoader`: each op loaded once per process; `load_or_fallback`: one warning, then
the reference), `.registry` (entry points
`minispeed.ops` so the report lists every installed op).

Declaring an op in any package:

```python
from pathlib import Path
from minispeed.core.op_builder import OpBuilder, OpLoader

class QuantizeBuilder(OpBuilder):
    name = "quantize"
    csrc_root = Path(__file__).parent / "csrc"
    sources = ("quantize/quantize.cpp",)

_OPS = OpLoader({"cpu": QuantizeBuilder()})
op = _OPS.load("cpu")   # module, or None -> call the reference; loaded once per process
```

Shared C++ helpers (the SIMD level enum, bf16/fp16 conversions, dot/axpy) live once in core's
`csrc/include/minispeed/simd.h`; every builder puts `SHARED_INCLUDE_DIR` on the include path and
hashes it into the cache key, so a source just writes `#include "minispeed/simd.h"`.

"""

from minispeed.core.op_builder.builder import (
    SHARED_INCLUDE_DIR,
    VERBOSE_ENV,
    LoadRecord,
    OpBuilder,
    OpBuildError,
)
from minispeed.core.op_builder.cache import CACHE_ENV, LOCK_TIMEOUT_ENV, op_cache_root
from minispeed.core.op_builder.fallback import (
    DISABLE_ENV,
    OpLoader,
    load_or_fallback,
    ops_disabled,
)
from minispeed.core.op_builder.registry import (
    ENTRY_POINT_GROUP,
    OpRegistry,
    discover_builders,
    register_builder,
)
from minispeed.core.op_builder.simd import (
    SIMD_ENV,
    SimdLevel,
    cpu_simd_level,
    requested_simd_level,
    simd_flags,
)

__all__ = [
    "CACHE_ENV",
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "LOCK_TIMEOUT_ENV",
    "SHARED_INCLUDE_DIR",
    "SIMD_ENV",
    "VERBOSE_ENV",
    "LoadRecord",
    "OpBuildError",
    "OpBuilder",
    "OpLoader",
    "OpRegistry",
    "SimdLevel",
    "cpu_simd_level",
    "discover_builders",
    "load_or_fallback",
    "op_cache_root",
    "ops_disabled",
    "register_builder",
    "requested_simd_level",
    "simd_flags",
]
