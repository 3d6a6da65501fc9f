"""`deepspeed.profiling.flops_profiler`: `get_model_profile` and `FlopsProfiler` of
`minispeed.profiler`, which take DeepSpeed's arguments and print DeepSpeed's report
(`docs/packages/profiler.md` says what is counted and what differs)."""

from minispeed.profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
