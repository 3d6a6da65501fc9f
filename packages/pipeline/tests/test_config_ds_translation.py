"""DeepSpeed's pipeline keys translate into PipelineConfig; what we cannot honour is refused."""

import pytest

from minispeed.pipeline import PipelineConfig


def test_deepspeed_keys_translate():
    cfg = PipelineConfig.from_section(
        {"stages": 4, "partition": "best", "activation_checkpoint_interval": 1,
         "seed_layers": True, "schedule": "interleaved_1f1b", "virtual_stages": 2},
        train_batch_size=32,
        gradient_accumulation_steps=8,
    )  # fmt: skip
    assert cfg == PipelineConfig(stages=4, micro_batches=8, schedule="interleaved_1f1b",
                                 partition_method="parameters", virtual_stages=2,
                                 activation_checkpointing=True, seed=0,
                                 micro_batch_size=4)  # fmt: skip
    assert cfg.partition_kwargs()["method"] == "parameters"
    assert cfg.executor_kwargs() == {"micro_batches": 8, "schedule": "interleaved_1f1b"}
    assert PipelineConfig.from_section(None, micro_batch_size=1) == PipelineConfig(
        micro_batch_size=1
    )
    assert PipelineConfig.from_section({"seed_layers": False}, micro_batch_size=1).seed is None
    with pytest.deprecated_call():  # the whole-config reader picks the same keys
        assert PipelineConfig.from_ds_config({"train_batch_size": 32, "pipeline": {}}) == (
            PipelineConfig.from_section({}, train_batch_size=32)
        )


def test_stages_follow_one_rule():
    """Left out or "auto": the stage count the caller knows (a PipelineModule's); an int must
    equal it; without one, "auto" cannot be resolved. The schedule left out is 1F1B, or GPipe
    with fewer micro-batches than stages (the package's 1F1B needs M >= P)."""
    known = {"train_batch_size": 2, "known_stages": 4}
    assert PipelineConfig.from_section({"stages": "auto"}, **known).stages == 4
    assert PipelineConfig.from_section(None, **known).stages == 4
    assert PipelineConfig.from_section(None, **known).schedule == "gpipe"  # M = 1 < P = 4
    four = {"micro_batch_size": 1, "gradient_accumulation_steps": 4, "known_stages": 4}
    assert PipelineConfig.from_section(None, **four).schedule == "1f1b"
    with pytest.raises(ValueError, match=r"^pipeline.stages: 2 but the PipelineModule has 4"):
        PipelineConfig.from_section({"stages": 2}, **known)
    assert PipelineConfig.from_section(None, train_batch_size=2).stages == 1


@pytest.mark.parametrize(
    "section,match",
    [
        ({"stagez": 2}, r"^pipeline.stagez: unknown key \(did you mean .stages."),
        (
            {"stages": "auto"},
            '^pipeline.stages: "auto" needs the stage count from a PipelineModule',
        ),
        (
            {"activation_checkpoint_interval": 2},
            "^pipeline.activation_checkpoint_interval: .*use 0 \\(off\\) or 1",
        ),
        (
            {"partition": "uniform", "partition_method": "parameters"},
            "^pipeline.partition: .*keep only",
        ),
        ({"schedule": "pipedream"}, "^pipeline.schedule: .*unknown; use one of"),
        ({"partition_method": "flops"}, "^pipeline.partition_method: .*type:<regex>"),
    ],
)
def test_what_we_cannot_honour_is_refused(section, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig.from_section(section, train_batch_size=8)
