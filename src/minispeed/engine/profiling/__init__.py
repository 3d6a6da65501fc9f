"""`deepspeed.profiling`: holds `flops_profiler`."""

from minispeed.engine.profiling import flops_profiler

__all__ = ["flops_profiler"]
