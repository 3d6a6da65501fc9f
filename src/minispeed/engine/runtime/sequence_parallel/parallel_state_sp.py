"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: build the sequence-parallel groups
and ask for them, the `mpu=` accelerate's ALST path hands to `initialize`.

```python
from minispeed.engine.runtime.sequence_parallel import parallel_state_sp as mpu
mpu.initialize_sequence_parallel(2)             # collective: data x sequence over the world
attn = DistributedAttention(local_attn, mpu.get_sequence_parallel_group())
engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=mpu)
```

Names and meanings are DeepSpeed's (the model-parallel names alias the sequence ones, as
there); each answers from `minispeed.engine.sequence_groups`, which holds the grid and its
layout (sequence ranks adjacent). Cost: building is one `new_group` per line of each axis;
asking is a lookup.
"""

from __future__ import annotations

from typing import Any

import minispeed.comm as comm
from minispeed.engine import sequence_groups

__all__ = [
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the data x sequence groups over the world (collective; once per world)."""
    sequence_groups.initialize_sequence_parallel(sequence_parallel_size)


def _release_sequence_parallel_groups() -> None:
    sequence_groups.release()


def get_sequence_parallel_group() -> Any:
    return sequence_groups.require("get_sequence_parallel_group").sequence_group


def get_sequence_data_parallel_group() -> Any:
    return sequence_groups.require("get_sequence_data_parallel_group").sequence_data_group


def get_sequence_parallel_world_size() -> int:
    return sequence_groups.require("get_sequence_parallel_world_size").sequence_parallel_size


def get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return sequence_groups.require("get_sequence_parallel_rank").grid.rank_in("sequence")


def get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(get_sequence_data_parallel_group())


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
