"""DeepSpeed's `deepspeed.runtime.zero` import path: its memory estimators.

```python
from minispeed.engine.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=8, num_nodes=1)
```

`stage_1_and_2` and `stage3` hold DeepSpeed's six estimator names over
`minispeed.zero.memory.estimate_modes`, which reproduces DeepSpeed's figures byte for byte
(recorded from DeepSpeed 0.19.8 in tests/engine/fixtures/ds_estimates.json). The printers print
DeepSpeed's table line for line with one difference: the offload device reads `cpu`, where
DeepSpeed 0.19.8 on Python 3.11+ prints the enum's repr, `OffloadDeviceEnum.cpu`.
Cost: arithmetic, or one walk over a live model's parameters.
"""

from minispeed.engine.runtime.zero import stage3, stage_1_and_2

__all__ = ["stage3", "stage_1_and_2"]
