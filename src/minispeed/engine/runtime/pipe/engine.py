"""`deepspeed.runtime.pipe.engine`: `PipelineEngine`, what `initialize` returns for a
`PipelineModule`."""

from minispeed.engine.pipe_engine import PipelineEngine

__all__ = ["PipelineEngine"]
