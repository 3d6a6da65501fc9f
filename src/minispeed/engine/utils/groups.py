"""`deepspeed.utils.groups`: DeepSpeed's process-group queries, answered for minispeed's
default layout (every rank in one data-parallel group, no model or tensor parallelism) and for
DeepSpeed-Ulysses sequence parallelism.

```python
from minispeed.engine.utils import groups                  # was: from deepspeed.utils import groups
groups._get_data_parallel_world_size()                     # the world size
groups._get_sequence_parallel_group()                      # this rank's Ulysses group
```

DeepSpeed keeps one global registry of groups, set up by its engine or by an `mpu`; minispeed's
pipe x data x tensor grid belongs to the engine that built it (`engine.grid`,
`docs/engine/3d-parallelism.md`), so the data-parallel answers are the plain case's: with tensor
or pipeline parallelism read `engine.grid` instead. The sequence-parallel ones read the one
registry of the data x sequence grid (`minispeed.engine.sequence_groups`), built by
`parallel_state_sp.initialize_sequence_parallel` or by `initialize` with
`sequence_parallel_size`: without it the sequence-parallel size is 1, its rank 0, the
sequence-data group the data group, and asking for the sequence group raises, naming how to
build it. Cost: a lookup in `minispeed.comm`.
"""

from __future__ import annotations

from typing import Any

import minispeed.comm as comm
from minispeed.engine import sequence_groups
from minispeed.engine.comm import get_world_group

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
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
    """The data-parallel group: the world's, or the data axis of the data x sequence grid."""
    groups = sequence_groups.current()
    return get_world_group() if groups is None else groups.grid.group("data")


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size(_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return comm.get_rank(_get_data_parallel_group())


def _get_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    """S: the ranks that split each sequence (1 without sequence-parallel groups)."""
    groups = sequence_groups.current()
    return 1 if groups is None else groups.sequence_parallel_size


def _get_sequence_parallel_rank() -> int:
    """This rank's place in its sequence group (0 without one)."""
    groups = sequence_groups.current()
    return 0 if groups is None else groups.grid.rank_in("sequence")


def _get_sequence_parallel_group() -> Any:
    """This rank's sequence group; raises naming how to build one when there is none."""
    return sequence_groups.require(
        "deepspeed.utils.groups._get_sequence_parallel_group"
    ).sequence_group


def _get_sequence_data_parallel_group() -> Any:
    """The ranks holding the same parameters: data x sequence (the data group without one)."""
    groups = sequence_groups.current()
    return _get_data_parallel_group() if groups is None else groups.sequence_data_group


def _get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(_get_sequence_data_parallel_group())


def _get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(_get_sequence_data_parallel_group())


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
get_model_parallel_world_size = _get_model_parallel_world_size
get_tensor_model_parallel_world_size = _get_model_parallel_world_size


def get_model_parallel_rank() -> int:
    return 0


get_tensor_model_parallel_rank = get_model_parallel_rank
