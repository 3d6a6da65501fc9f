"""MiCS through the engine: `zero_optimization.mics_shard_size` is checked against the grid on
every rank before any collective (a local ConfigError naming the key and the sizes that fit),
and the top-level spelling is pointed to its section. (Training through `initialize` with two
launcher agents as two nodes: the MiCS tutorial, tests/engine/test_tutorials.py.)"""

from __future__ import annotations

import pytest

from minispeed.core.config import ConfigError
from minispeed.engine.config import EngineConfig
from minispeed.engine.grid import check_mics_size


def test_a_shard_size_that_does_not_divide_the_data_axis_is_a_config_error():
    with pytest.raises(ConfigError, match=r"mics_shard_size.*3 does not divide.*\[1, 2, 4\]"):
        check_mics_size({"pipe": 1, "data": 4, "tensor": 1}, 3)
    with pytest.raises(ConfigError, match="tensor or pipeline parallelism"):
        check_mics_size({"pipe": 1, "data": 2, "tensor": 2}, 2)
    check_mics_size({"pipe": 1, "data": 4, "tensor": 1}, 2)
    check_mics_size({"pipe": 1, "data": 2, "tensor": 2}, -1)  # off: anything goes


def test_the_keys_are_read_in_zero_optimization_and_refused_at_the_top_level():
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    zero = {"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": False}
    cfg = EngineConfig.from_ds_config({**base, "zero_optimization": zero}, data_parallel_size=4)
    assert cfg.zero.mics_shard_size == 2
    with pytest.raises(ConfigError, match="belongs in zero_optimization"):
        EngineConfig.from_ds_config({**base, "mics_shard_size": 2}, data_parallel_size=4)
