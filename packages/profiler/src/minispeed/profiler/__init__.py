"""minispeed.profiler: where the FLOPs, the time and the bytes of a step go.

- `FlopsProfiler`: FLOPs, MACs, parameters and latency per module, counted per operator
  (`flops_profiler.py`, priced by `ops.py` with the formulas of `formulas.py`).
- `range`, `module_ranges`: named NVTX / torch.profiler ranges (`nvtx.py`).
"""

from minispeed.profiler import formulas
from minispeed.profiler.config import FlopsProfilerConfig, StepProfiler
from minispeed.profiler.flops_profiler import FlopsProfiler
from minispeed.profiler.formulas import Cost
from minispeed.profiler.nvtx import enable_nvtx, module_ranges, nvtx_enabled, range
from minispeed.profiler.report import ModuleProfile, Profile

__all__ = [
    "Cost",
    "FlopsProfiler",
    "FlopsProfilerConfig",
    "ModuleProfile",
    "Profile",
    "StepProfiler",
    "enable_nvtx",
    "formulas",
    "module_ranges",
    "nvtx_enabled",
    "range",
]
