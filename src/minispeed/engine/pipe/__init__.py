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

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
