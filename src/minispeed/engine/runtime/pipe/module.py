"""`deepspeed.runtime.pipe.module`: `PipelineModule`, `LayerSpec`, `TiedLayerSpec` of
`minispeed.engine.pipe`."""

from minispeed.engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
