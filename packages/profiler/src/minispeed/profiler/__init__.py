"""minispeed.profiler: where the FLOPs, the time and the bytes of a step go.

- `FlopsProfiler`: FLOPs, MACs, parameters and latency per module, counted per operator
  (`flops_profiler.py`, priced by `ops.py` with the formulas of `formulas.py`).
"""

from minispeed.profiler import formulas
from minispeed.profiler.config import FlopsProfilerConfig, StepProfiler
from minispeed.profiler.flops_profiler import FlopsProfiler
from minispeed.profiler.formulas import Cost
from minispeed.profiler.report import ModuleProfile, Profile

__all__ = [
    "Cost",
    "FlopsProfiler",
    "FlopsProfilerConfig",
    "ModuleProfile",
    "Profile",
    "StepProfiler",
    "formulas",
]
