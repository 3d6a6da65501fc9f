"""`deepspeed.runtime.zero` (also `deepspeed.zero`): stage 3's contexts and DeepSpeed's memory
estimators.

```python
from minispeed.engine.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=8, num_nodes=1)
```

`Init`, `GatheredParameters`, `register_external_parameter`, `unregister_external_parameter`
are `minispeed.engine.zero`'s (DeepSpeed's `deepspeed.zero` is this module);
`partition_parameters` adds `ZeroParamStatus`. `stage_1_and_2` and `stage3` hold DeepSpeed's
six estimator names over `minispeed.zero.memory.estimate_modes`, which reproduces DeepSpeed's
figures byte for byte (recorded from DeepSpeed 0.19.8 in tests/engine/fixtures/ds_estimates.json).
The printers print DeepSpeed's table line for line with one difference: the offload device reads
`cpu`, where DeepSpeed 0.19.8 on Python 3.11+ prints the enum's repr, `OffloadDeviceEnum.cpu`.
`stage3.unwrap_model_for_generation` gathers a whole model for generation. `config` and
`offload_config` hold DeepSpeed's config models (`DeepSpeedZeroConfig`, `ZeroStageEnum`,
`OffloadDeviceEnum`, ...) over the packages' sections.
Cost: arithmetic, or one walk over a live model's parameters.
"""

from minispeed.engine.runtime.zero import (
    config,
    offload_config,
    partition_parameters,
    stage3,
    stage_1_and_2,
)
from minispeed.engine.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from minispeed.engine.runtime.zero.stage3 import unwrap_model_for_generation

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "config",
    "offload_config",
    "partition_parameters",
    "register_external_parameter",
    "stage3",
    "stage_1_and_2",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
