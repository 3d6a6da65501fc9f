"""minispeed.zero: ZeRO stages 0-3, mixed precision, sharded checkpoints and a memory estimator.

```python
import minispeed.zero as zero
opt = zero.shard(model, torch.optim.AdamW(model.parameters()), config=zero.ZeroConfig(stage=2),
                 precision=zero.MixedPrecision(param_dtype=torch.bfloat16))
opt.backward(model(x, y)); opt.step()
```

Reading order: see packages/zero/README.md.
"""

from minispeed.zero import full_values
from minispeed.zero.activation import ActivationCheckpointingConfig, ReentrantCheckpoint, checkpoint
from minispeed.zero.api import shard
from minispeed.zero.autocast import Autocast, TorchAutocastConfig, autocast_region
from minispeed.zero.checkpoints import (
    consolidate,
    load_checkpoint,
    save_16bit_model,
    save_checkpoint,
)
from minispeed.zero.config import ZeroConfig
from minispeed.zero.memory import estimate, measure
from minispeed.zero.model_parallel import ModelParallel, SharedGrad
from minispeed.zero.optimizer import ParamFragment, ShardStrategy, ZeroOptimizer
from minispeed.zero.precision import (
    Bf16Config,
    DataTypesConfig,
    Fp16Config,
    LossScaler,
    MixedPrecision,
)
from minispeed.zero.setup_agreement import OffloadSetupError
from minispeed.zero.stage3 import GatheredParameters, Init, full_state_dict, set_leaf_module
from minispeed.zero.stage3.forward_only import ForwardOnly
from minispeed.zero.stage3.io_failures import OffloadIOError
from minispeed.zero.stage3.mics_groups import MicsGroups

__all__ = [
    "ActivationCheckpointingConfig",
    "Autocast",
    "Bf16Config",
    "DataTypesConfig",
    "ForwardOnly",
    "Fp16Config",
    "GatheredParameters",
    "Init",
    "LossScaler",
    "MicsGroups",
    "MixedPrecision",
    "ModelParallel",
    "OffloadIOError",
    "OffloadSetupError",
    "ParamFragment",
    "ReentrantCheckpoint",
    "ShardStrategy",
    "SharedGrad",
    "TorchAutocastConfig",
    "ZeroConfig",
    "ZeroOptimizer",
    "autocast_region",
    "checkpoint",
    "consolidate",
    "estimate",
    "full_state_dict",
    "full_values",
    "load_checkpoint",
    "measure",
    "save_16bit_model",
    "save_checkpoint",
    "set_leaf_module",
    "shard",
]
