"""The estimator's offload columns: where each model-state byte lives with offload_optimizer /
offload_param (formula only; the live counterpart is test_offload_memory_rss.py)."""

from __future__ import annotations

import pytest

from minispeed.zero.memory import minispeed_state_bytes, offload_placement

PSI, N = 1200, 4
S = PSI // N  # 300 elements per rank


def test_nothing_offloaded_is_the_ledger_row() -> None:
    for stage in (0, 1, 2, 3):
        row = minispeed_state_bytes(PSI, N, stage, param_bytes=2, grad_bytes=2, state_bytes=8)
        got = offload_placement(PSI, N, stage)
        assert (got.accelerator, got.host, got.files) == (row.total, 0, 0)


@pytest.mark.parametrize(
    "stage,opt,param,expected",
    [
        # 16-bit stage 2: params 2Ψ + grads 2s on the device; the strategy's master 4s stays
        # there too, the host gets masters 4s + gradient copy 4s + Adam 8s (cpu) ...
        (2, "cpu", "none", (2 * PSI + 2 * S + 4 * S, 16 * S, 0)),
        # ... or the Adam states go to files (nvme)
        (2, "nvme", "none", (2 * PSI + 2 * S + 4 * S, 8 * S, 8 * S)),
        # stage 3: shards 2s leave the device too
        (3, "cpu", "cpu", (2 * S + 4 * S, 16 * S + 2 * S, 0)),
    ],
)
def test_offloaded_bytes_move_where_the_section_says(stage, opt, param, expected) -> None:
    got = offload_placement(PSI, N, stage, offload_optimizer=opt, offload_param=param)
    assert (got.accelerator, got.host, got.files) == expected
    # nothing is lost: the row's bytes plus the host copies of masters and gradients
    row = minispeed_state_bytes(PSI, N, stage, param_bytes=2, grad_bytes=2, state_bytes=8)
    assert got.total == row.total + 8 * S


@pytest.mark.parametrize(
    "param,expected",
    [
        # ZeRO-Infinity: masters 4s + Adam 8s + fp32 gradients 4s in files; host keeps none
        ("none", (2 * S, 0, 16 * S)),
        ("nvme", (0, 0, 2 * S + 16 * S)),
        ("cpu", (0, 2 * S, 16 * S)),
    ],
)
def test_infinity_keeps_masters_and_gradients_in_files(param, expected) -> None:
    got = offload_placement(PSI, N, 3, offload_optimizer="nvme", offload_param=param)
    assert (got.accelerator, got.host, got.files) == expected
    # the row's bytes, with the 16-bit gradient shard (2s) kept as fp32 (4s) in its file
    row = minispeed_state_bytes(PSI, N, 3, param_bytes=2, grad_bytes=2, state_bytes=8)
    assert got.total == row.total + 2 * S


def test_fp32_param_offload_gives_the_master_its_own_storage() -> None:
    got = offload_placement(
        PSI, N, 3, param_bytes=4, grad_bytes=4, offload_param="nvme", offload_optimizer="none"
    )
    assert got.files == 4 * S  # the shards
    assert got.accelerator == 4 * S + 4 * S + 8 * S  # grads + master (no longer aliased) + Adam


def test_sections_the_stage_cannot_honour() -> None:
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        offload_placement(PSI, N, 2, offload_param="cpu")
    with pytest.raises(ValueError, match="offload_optimizer needs stage 1, 2 or 3"):
        offload_placement(PSI, N, 0, offload_optimizer="cpu")
