"""DeepSpeed's `deepspeed.pipe` import path: `PipelineModule`, `LayerSpec`, `TiedLayerSpec`.

```python
from minispeed.engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # was deepspeed.pipe
```

Thin adapters taking DeepSpeed's signatures onto `minispeed.pipeline` (see `module.py` for
what is the same, what differs and what is refused); the training loop is
`minispeed.engine.pipe_engine.PipelineEngine`. `ProcessTopology` is `minispeed.comm`'s.
"""

from minispeed.comm import ProcessTopology
from minispeed.engine.pipe.module import PipelineModule
from minispeed.engine.pipe.specs import LayerSpec, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]


def PipeDataParallelTopology(num_pp: int, num_dp: int) -> ProcessTopology:
    """DeepSpeed's `PipeDataParallelTopology`: axes `(pipe, data)`, data-parallel ranks
    adjacent."""
    return ProcessTopology(("pipe", "data"), (num_pp, num_dp))


def PipeModelDataParallelTopology(num_pp: int, num_mp: int, num_dp: int) -> ProcessTopology:
    """DeepSpeed's `PipeModelDataParallelTopology`: axes `(pipe, data, tensor)` (DeepSpeed
    calls the last `model`), tensor-parallel ranks adjacent, then data, then pipe: the 3D
    grid of `minispeed.engine.grid`. `num_mp` must equal the config's
    `tensor_parallel.autotp_size`."""
    return ProcessTopology(("pipe", "data", "tensor"), (num_pp, num_dp, num_mp))
