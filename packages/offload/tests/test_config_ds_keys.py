"""offload_optimizer / offload_param / aio: DeepSpeed's keys translated, bad ones refused by name."""

from __future__ import annotations

import pytest

from minispeed.offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig


def test_deepspeed_sections_translate_to_our_fields() -> None:
    opt = OffloadOptimizerConfig.from_section(
        {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 3, "pin_memory": True,
         "pipeline_read": True, "pipeline_write": False, "fast_init": False, "ratio": 1.0}
    )  # fmt: skip
    assert opt == OffloadOptimizerConfig("nvme", "/nvme", 3, True, True, False)
    param = OffloadParamConfig.from_section(
        {"device": "cpu", "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}
    )
    assert param.buffer_numel == 100_000_000 and param.max_in_cpu_numel == 1_000_000_000
    aio = AioConfig.from_section(
        {"block_size": 262144, "queue_depth": 16, "thread_count": 2, "single_submit": False,
         "overlap_events": True}
    )  # fmt: skip
    assert (aio.block_bytes, aio.queue_depth, aio.thread_count, aio.workers) == (262144, 16, 2, 32)
    assert AioConfig.from_section({"intra_op_parallelism": 4}).thread_count == 4
    assert OffloadOptimizerConfig.from_section({"pipeline": True}).pipeline_write
    assert OffloadOptimizerConfig.from_section(None).device == "none"


@pytest.mark.parametrize(
    "cls,section,match",
    [
        (AioConfig, {"block_sise": 4096}, "^aio.block_sise: .*did you mean 'block_size'"),
        (OffloadOptimizerConfig, {"nvme_pth": "/x"}, "did you mean 'nvme_path'"),
        (OffloadParamConfig, {"buffer_szie": 10}, "did you mean 'buffer_size'"),
        (
            OffloadOptimizerConfig,
            {"device": "nvm"},
            "^zero_optimization.offload_optimizer.device: 'nvm' .*did you mean 'nvme'",
        ),
        (
            OffloadOptimizerConfig,
            {"device": "nvme"},
            "^zero_optimization.offload_optimizer.nvme_path: must be given with device 'nvme'",
        ),
        (
            OffloadOptimizerConfig,
            {"ratio": 0.5},
            r"ratio: .*not supported.*not a share of it; remove it \(1.0 is accepted\)",
        ),
        (OffloadOptimizerConfig, {"buffer_count": 1, "pipeline_read": True}, "buffer_count >= 2"),
        (
            OffloadParamConfig,
            {"buffer_size": 0},
            r"^zero_optimization.offload_param.buffer_size: must be >= 1, got 0 "
            r"\(OffloadParamConfig.buffer_numel\)",
        ),
        (AioConfig, {"block_size": 1000}, "^aio.block_size: must be a positive multiple of 4096"),
        (AioConfig, {"queue_depth": 0}, "^aio.queue_depth: must be >= 1"),
        (
            AioConfig,
            {"use_gds": True},
            r"use_gds: .*not supported.*GPUDirect.*\(false is accepted\)",
        ),
    ],
)
def test_bad_sections_name_the_key_and_the_fix(cls, section, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls.from_section(section)


def test_wrong_types_are_refused() -> None:
    with pytest.raises(TypeError, match=r"OffloadOptimizerConfig.buffer_count: must be an integer"):
        OffloadOptimizerConfig(buffer_count=True)
    with pytest.raises(TypeError, match=r"^aio: must be a JSON object"):
        AioConfig.from_section([1])
