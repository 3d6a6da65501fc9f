"""`PipelineConfig.from_section` applies DeepSpeed's batch rule: any two of train_batch_size,
train_micro_batch_size_per_gpu and gradient_accumulation_steps give the third, one alone sets
accumulation to 1, contradictions are errors naming the keys. Expected values recorded from
DeepSpeed 0.19.8's `DeepSpeedConfig` (`ds_reference_batch_triple.py`)."""

import pytest

from minispeed.pipeline import PipelineConfig

T, MB, GA = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
_ARGS = {T: "train_batch_size", MB: "micro_batch_size", GA: "gradient_accumulation_steps"}


def _config(ds_config: dict, data_parallel_size: int | None = None) -> PipelineConfig:
    """The batch keys of a ds_config handed to `from_section` as the engine hands them."""
    batch = {_ARGS[k]: v for k, v in ds_config.items()}
    return PipelineConfig.from_section(None, data_parallel_size=data_parallel_size, **batch)


# (ds_config, data-parallel size, DeepSpeed's (train, micro, accumulation) or "error")
DEEPSPEED = [
    ({T: 32, MB: 4}, 1, (32, 4, 8)),
    ({T: 32, MB: 4}, 2, (32, 4, 4)),
    ({T: 32, GA: 4}, 2, (32, 4, 4)),
    ({MB: 2, GA: 4}, 3, (24, 2, 4)),
    ({T: 24}, 3, (24, 8, 1)),
    ({MB: 5}, 2, (10, 5, 1)),
    ({T: 48, MB: 3, GA: 8}, 2, (48, 3, 8)),
    ({T: 30, MB: 4}, 1, "error"),
    ({T: 32, MB: 4, GA: 2}, 2, "error"),
    ({T: 2, MB: 4}, 1, "error"),
    ({GA: 4}, 1, "error"),
    ({}, 1, "error"),
]


@pytest.mark.parametrize("ds_config,dp,expected", DEEPSPEED)
def test_the_batch_triple_follows_deepspeed(ds_config, dp, expected):
    if expected == "error":
        with pytest.raises(ValueError, match="train_batch_size"):
            _config(ds_config, data_parallel_size=dp)
        return
    cfg = _config(ds_config, data_parallel_size=dp)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.micro_batches) == expected
    assert cfg.executor_kwargs()["micro_batches"] == expected[2]


def test_contradictions_name_the_keys_and_the_numbers():
    with pytest.raises(ValueError, match=r"train_batch_size=32 is not .*=4 × .*=2 × .* size 2"):
        _config({T: 32, MB: 4, GA: 2}, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps comes out as 0"):
        _config({T: 2, MB: 4})
    with pytest.raises(ValueError, match=r"must be an int.*auto"):
        _config({T: "auto", MB: 4})


def test_the_data_parallel_size_defaults_to_the_world_over_the_stages():
    # one process, no process group: N = 1
    assert _config({T: 32, MB: 4}).micro_batches == 8
