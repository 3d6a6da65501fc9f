"""DeepSpeed's pipeline keys translate into PipelineConfig; what we cannot honour is refused."""

import pytest

from minispeed.pipeline import PipelineConfig


def test_deepspeed_keys_translate():
    cfg = PipelineConfig.from_ds_config({
        "train_batch_size": 32,
        "gradient_accumulation_steps": 8,
        "pipeline": {"stages": 4, "partition": "best", "activation_checkpoint_interval": 1,
                     "seed_layers": True, "schedule": "interleaved_1f1b", "virtual_stages": 2},
    })  # fmt: skip
    assert cfg == PipelineConfig(stages=4, micro_batches=8, schedule="interleaved_1f1b",
                                 partition_method="parameters", virtual_stages=2,
                                 activation_checkpointing=True, seed=0,
                                 micro_batch_size=4)  # fmt: skip
    assert cfg.partition_kwargs()["method"] == "parameters"
    assert cfg.executor_kwargs() == {"micro_batches": 8, "schedule": "interleaved_1f1b"}
    one = {"train_micro_batch_size_per_gpu": 1}
    assert PipelineConfig.from_ds_config(one) == PipelineConfig(micro_batch_size=1)
    assert PipelineConfig.from_ds_config({**one, "pipeline": {"seed_layers": False}}).seed is None


@pytest.mark.parametrize(
    "section,match",
    [
        ({"stagez": 2}, r"pipeline.stagez: unknown key \(did you mean .stages."),
        ({"stages": "auto"}, "'auto' is not supported"),
        ({"activation_checkpoint_interval": 2}, "use 0 \\(off\\) or 1"),
        ({"pipe_partitioned": True}, "tensor-parallel"),
        ({"partition": "uniform", "partition_method": "parameters"}, "keep one"),
        ({"schedule": "pipedream"}, "unknown; use one of"),
        ({"partition_method": "flops"}, "type:<regex>"),
    ],
)
def test_what_we_cannot_honour_is_refused(section, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig.from_ds_config({"train_batch_size": 8, "pipeline": section})
