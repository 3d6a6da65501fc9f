"""`deepspeed.utils.groups`: DeepSpeed's process-group queries, answered for minispeed's
default layout: every rank in one data-parallel group (the world), no model, tensor or sequence
parallelism.

```python
from minispeed.engine.utils import groups                  # was: from deepspeed.utils import groups
groups._get_data_parallel_world_size()                     # the world size
```

DeepSpeed keeps one global registry of groups, set up by its engine or by an `mpu`; minispeed's
grid belongs to the engine that built it (`engine.grid`, `docs/engine/3d-parallelism.md`), so
these answer for the plain data-parallel case only: with tensor or pipeline parallelism read
`engine.grid` instead. Sequence parallelism (DeepSpeed-Ulysses) does not exist in minispeed:
asking for its group raises, naming it; its size is 1 and its rank 0, so code that checks the
size takes the ordinary path. Cost: a lookup in `minispeed.comm`.
"""

from __future__ import annotations

from typing import Any

import minispeed.comm as comm
from minispeed.engine.comm import get_world_group

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_model_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
]


def _get_data_parallel_group() -> Any:
    """The data-parallel group: the world's."""
    return get_world_group()


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size()


def _get_data_parallel_rank() -> int:
    return comm.get_rank()


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group() -> Any:
    raise NotImplementedError(
        "sequence parallelism (DeepSpeed-Ulysses) is not part of minispeed: there is no sequence-"
        "parallel group; train without sp_size > 1 (accelerate's ParallelismConfig)"
    )


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
get_model_parallel_world_size = _get_model_parallel_world_size
get_tensor_model_parallel_world_size = _get_model_parallel_world_size


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_rank = get_model_parallel_rank
