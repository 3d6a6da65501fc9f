"""`deepspeed.runtime.pipe`: DeepSpeed's long path for `deepspeed.pipe` (`minispeed.engine.pipe`),
with its `topology`, `module` and `engine` modules."""

from minispeed.engine.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec
from minispeed.engine.runtime.pipe import engine, module, topology

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "engine",
    "module",
    "topology",
]
