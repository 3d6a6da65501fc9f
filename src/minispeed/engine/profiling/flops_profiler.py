"""`deepspeed.profiling.flops_profiler`: `get_model_profile` and `FlopsProfiler` of
`minispeed.profiler`, which take DeepSpeed's arguments and print DeepSpeed's report
(`docs/packages/profiler.md` says what is counted and what differs)."""

from minispeed.profiler import FlopsProfiler, get_model_profile
from minispeed.profiler.report import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
