"""MiCS's refusals, each naming the problem and the fix, and its memory rows: no processes needed
(the checks are local, so every rank raises the same error before any collective)."""

from __future__ import annotations

import pytest

import minispeed.zero as zero
from minispeed.zero.memory import estimate_modes
from minispeed.zero.memory.modes import Offload
from minispeed.zero.stage3.mics_groups import check_mics


def _cfg(**kw) -> zero.ZeroConfig:
    return zero.ZeroConfig(stage=3, mics_shard_size=2, **kw)


def test_fields_alone_are_checked_in_the_config():
    with pytest.raises(ValueError, match="mics_shard_size=2 shards stage 3's parameters"):
        zero.ZeroConfig(stage=2, mics_shard_size=2)
    with pytest.raises(ValueError, match=r"-1 \(off\) or a group size >= 1, got 0"):
        zero.ZeroConfig(stage=3, mics_shard_size=0)
    with pytest.raises(ValueError, match="mics_shard_size is off"):
        zero.ZeroConfig(stage=3, mics_hierarchical_params_gather=True)
    ds = {"zero_optimization": {"stage": 3, "mics_shard_size": 4}}
    assert zero.ZeroConfig.from_section(ds["zero_optimization"]).mics_shard_size == 4


def test_what_does_not_compose_is_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match=r"does not divide the data-parallel size 4.*\[1, 2, 4\]"):
        check_mics(zero.ZeroConfig(stage=3, mics_shard_size=3), 4)
    with pytest.raises(ValueError, match="zero_hpz_partition_size with mics_shard_size"):
        check_mics(_cfg(hpz_partition_size=2), 4)
    check_mics(_cfg(quantized_weights=True, quantized_gradients=True), 4)  # they compose
    with pytest.raises(ValueError, match="replica_groups"):
        check_mics(_cfg(), 4, replica_groups=[None])
    with pytest.raises(ValueError, match="model_parallel"):
        check_mics(_cfg(), 4, model_parallel=object())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="spanning several whole nodes"):
        check_mics(_cfg(mics_hierarchical_params_gather=True), 4)  # S = node: nothing to split
    check_mics(zero.ZeroConfig(stage=3, mics_shard_size=4, mics_hierarchical_params_gather=True), 4)


def test_estimate_rows_hold_psi_over_s_per_gpu():
    rows = estimate_modes(7e9, gpus_per_node=8, num_nodes=4, mics_shard_size=8)
    plain = {r.offload: r for r in rows if r.stage == 3 and r.zero_init and not r.mics_shard_size}
    mics = {r.offload: r for r in rows if r.mics_shard_size == 8}
    assert set(mics) == {Offload.NONE, Offload.OPTIMIZER_CPU, Offload.PARAMS_CPU}
    # 32 GPUs against shard groups of 8: four times the bytes per GPU, and per node's CPU
    assert mics[Offload.NONE].gpu_bytes == pytest.approx(4 * plain[Offload.NONE].gpu_bytes, 1e-6)
    cpu = mics[Offload.OPTIMIZER_CPU].cpu_bytes_per_node
    assert cpu == pytest.approx(4 * plain[Offload.OPTIMIZER_CPU].cpu_bytes_per_node, 1e-6)
    with pytest.raises(ValueError, match="whole nodes of 8 GPUs"):
        estimate_modes(7e9, gpus_per_node=8, num_nodes=4, mics_shard_size=4)
