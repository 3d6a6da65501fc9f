"""minispeed.profiler: where the FLOPs, the time and the bytes of a step go.

- `FlopsProfiler`: FLOPs, MACs, parameters and latency per module, counted per operator
  (`flops_profiler.py`, priced by `ops.py` with the formulas of `formulas.py`), with
  DeepSpeed's `start_profile` / `stop_profile` / `end_profile` / `get_total_*` too;
  `get_model_profile`, DeepSpeed's one-call profile of a forward (`model_profile.py`).
- `range`, `module_ranges`: named NVTX / torch.profiler ranges (`nvtx.py`).
- `traced_step`, `merge_traces`: a Chrome trace of one step across ranks (`timeline.py`;
  `python -m minispeed.profiler trace`).
- `monitor`: DeepSpeed's monitors (CSV, TensorBoard, W&B, Comet) and the events an engine
  writes to them (`monitor.py`; `MonitorMaster`, `MonitorConfig`).
- `predict_step`, `Machine`: the step-time model (`perf_model.py`), calibrated by
  `python -m minispeed.profiler calibrate` (`calibrate.py`).
"""

from minispeed.profiler import formulas
from minispeed.profiler.config import FlopsProfilerConfig, StepProfiler
from minispeed.profiler.flops_profiler import FlopsProfiler, ProfilerState
from minispeed.profiler.formulas import Cost
from minispeed.profiler.model_profile import get_model_profile
from minispeed.profiler.nvtx import enable_nvtx, module_ranges, nvtx_enabled, range
from minispeed.profiler.perf_model import Machine, StepPrediction, predict_step
from minispeed.profiler.report import ModuleProfile, Profile
from minispeed.profiler.timeline import merge_traces, record_step, traced_step

__all__ = [
    "Cost",
    "FlopsProfiler",
    "FlopsProfilerConfig",
    "Machine",
    "ModuleProfile",
    "Profile",
    "ProfilerState",
    "StepPrediction",
    "StepProfiler",
    "enable_nvtx",
    "formulas",
    "get_model_profile",
    "merge_traces",
    "module_ranges",
    "nvtx_enabled",
    "predict_step",
    "range",
    "record_step",
    "traced_step",
]
