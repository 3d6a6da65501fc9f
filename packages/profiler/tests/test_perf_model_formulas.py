"""The performance model's bytes per stage restate the ZeRO ledger's closed forms, and its step
time is compute + communication from a calibrated machine."""

import dataclasses
import json

import pytest
import torch

from minispeed.profiler.calibrate import (
    fit_alpha_beta,
    measure_adam,
    measure_dram,
    measure_matmul,
)
from minispeed.profiler.perf_model import (
    LinkCost,
    Machine,
    predict_step,
    stage3_gather_calls,
    stage_collectives,
)

PSI, N, A, G, P = 1_000_000, 4, 3, 4, 2


def _bytes(stage):
    calls = stage_collectives(
        stage, PSI, N, grad_bytes=G, param_bytes=P, micro_steps=A, bucket_numel=300_000
    )
    return sum(c.wire_bytes for c in calls), calls


@pytest.mark.parametrize(
    "stage,expected",
    [
        (0, 2 * 3 / 4 * PSI * G),
        (1, 3 / 4 * PSI * (G + P)),
        (2, 3 / 4 * PSI * (A * G + P)),
        (3, A * 3 / 4 * PSI * (G + 2 * P)),
    ],
)
def test_bytes_per_step_follow_the_zero_ledger(stage, expected):
    total, calls = _bytes(stage)
    assert total == pytest.approx(expected)
    assert all(c.op in ("all_reduce", "all_gather", "reduce_scatter") for c in calls)


def test_stage3_sends_more_than_stage2_which_sends_what_stage0_sends_at_a1():
    b0 = sum(c.wire_bytes for c in stage_collectives(0, PSI, N))
    b2 = sum(c.wire_bytes for c in stage_collectives(2, PSI, N))
    b3 = sum(c.wire_bytes for c in stage_collectives(3, PSI, N))
    assert b0 == pytest.approx(b2) and b3 == pytest.approx(1.5 * b2)  # same g and p


def test_prediction_is_flops_over_throughput_plus_alpha_beta_per_call():
    link = LinkCost(alpha_s=1e-3, busbw_bytes_per_s=1e9)
    machine = Machine({256: 1e10, 1024: 4e10}, {"all_reduce": link}, world_size=2)
    pred = predict_step(machine, flops_per_step=2e10, num_params=PSI, stage=0, world_size=2,
                        matmul_size=300, bucket_numel=250_000)  # fmt: skip
    assert pred.compute_s == pytest.approx(2.0)  # nearest calibrated size: 256
    assert pred.calls == 4
    assert pred.comm_s == pytest.approx(4 * 1e-3 + 2 * 0.5 * PSI * 4 / 1e9)
    assert pred.step_s == pytest.approx(pred.compute_s + pred.comm_s)
    # With a memory rate and an operator overhead: element-wise FLOPs at 12 bytes each, AdamW
    # (uncalibrated) at 64 bytes per owned parameter (Ψ/N from stage 1), and the operator calls.
    machine = Machine({256: 1e10}, {"all_reduce": link, "all_gather": link, "reduce_scatter": link},
                      stream_bytes_per_s=1e9, op_overhead_s=1e-5)  # fmt: skip
    pred = predict_step(machine, flops_per_step=2e10 + 1e6, macs_per_step=1e10, ops_per_step=300,
                        num_params=PSI, stage=1, world_size=2)  # fmt: skip
    assert pred.compute_s == pytest.approx(2.0)
    assert pred.memory_s == pytest.approx(12 * 1e6 / 1e9)
    assert pred.optimizer_s == pytest.approx(64 * PSI / 2 / 1e9)
    assert pred.overhead_s == pytest.approx(300 * 1e-5)
    # A measured AdamW cost per parameter replaces the byte estimate.
    timed = dataclasses.replace(machine, adam_s_per_param=3e-9)
    pred = predict_step(timed, flops_per_step=2e10, num_params=PSI, stage=1, world_size=2)
    assert pred.optimizer_s == pytest.approx(PSI / 2 * 3e-9)
    # Per parameter tensor: AdamW's fixed cost (every rank steps a fragment of each tensor) and
    # one gradient hook per tensor and micro-step (Ψ in two buckets: zero hooks every gradient).
    per_tensor = dataclasses.replace(timed, adam_s_per_tensor=2e-4, hook_s_per_grad=5e-5)
    pred_t = predict_step(per_tensor, flops_per_step=2e10, num_params=PSI, num_tensors=28,
                          stage=1, world_size=2, micro_steps=3, bucket_numel=PSI // 2)  # fmt: skip
    assert pred_t.optimizer_s == pytest.approx(PSI / 2 * 3e-9 + 28 * 2e-4)
    assert pred_t.hooks_s == pytest.approx(3 * 28 * 5e-5)
    assert pred_t.step_s == pytest.approx(pred.step_s + 28 * 2e-4 + 3 * 28 * 5e-5, rel=1e-3)
    # ...where zero registers them: none at stages 0-2 for gradients within one bucket (they
    # are collected from param.grad once backward ends), every one at stage 3.
    hooks = dict(num_params=PSI, num_tensors=28, world_size=2, micro_steps=3, bucket_numel=PSI)
    for stage in (0, 1, 2):
        assert predict_step(per_tensor, flops_per_step=2e10, stage=stage, **hooks).hooks_s == 0
    assert predict_step(per_tensor, flops_per_step=2e10, stage=3, **hooks).hooks_s == (
        pytest.approx(3 * 28 * 5e-5)
    )
    one_more = dict(hooks, bucket_numel=PSI - 1)  # two buckets: every gradient hooked
    assert predict_step(per_tensor, flops_per_step=2e10, stage=0, **one_more).hooks_s == (
        pytest.approx(3 * 28 * 5e-5)
    )
    # Stage 3's fixed cost per module with parameters, per micro-step; no other stage pays it.
    units = dict(num_params=PSI, stage3_units=17, stage3_unit_s=1e-3, world_size=2, micro_steps=3)
    with_units = predict_step(per_tensor, flops_per_step=2e10, stage=3, **units)
    assert with_units.units_s == pytest.approx(3 * 17 * 1e-3)
    assert predict_step(per_tensor, flops_per_step=2e10, stage=2, **units).units_s == 0
    # With a DRAM rate D:
    copying = dataclasses.replace(timed, dram_bytes_per_s=2e9)
    pred3 = predict_step(copying, flops_per_step=2e10, num_params=PSI, stage=3, world_size=2,
                         micro_steps=2, param_bytes=2)  # fmt: skip
    # Every stage streams the parameters from DRAM: read in forward and backward, gradients
    # written, per micro-step; stage 3 also copies each pass's gather out (read + write) of a
    # fresh buffer the kernel zeroes (write).
    assert pred3.params_s == pytest.approx(2 * (2 * 2 + 4) * PSI / 2e9)
    assert pred3.unpack_s == pytest.approx(2 * 2 * 3 * 2 * PSI / 2e9)  # 2 passes x A x 3p
    assert (
        predict_step(copying, flops_per_step=1, num_params=PSI, stage=2, world_size=2).unpack_s == 0
    )
    assert pred.step_s == pytest.approx(
        pred.compute_s + pred.memory_s + pred.overhead_s + pred.optimizer_s + pred.comm_s
    )
    with pytest.raises(ValueError, match="no link cost"):
        predict_step(Machine({256: 1e10}), flops_per_step=1, num_params=PSI, stage=3, world_size=2)


def test_calibration_round_trips_and_matmul_throughput_is_measured(tmp_path):
    measured = measure_matmul(sizes=(32, 64), seconds=0.03)
    assert set(measured) == {32, 64} and all(v > 0 for v in measured.values())
    machine = Machine(measured, {"all_gather": LinkCost(1e-4, 2e9)}, world_size=2,
                      stream_bytes_per_s=3e9, op_overhead_s=2e-6, adam_s_per_tensor=1e-4,
                      hook_s_per_grad=4e-5)  # fmt: skip
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(machine.to_json()))
    assert Machine.load(path) == machine
    with pytest.raises(FileNotFoundError, match="calibrate"):
        Machine.load(tmp_path / "missing.json")


def test_matmul_shapes_are_recorded_and_priced_at_their_own_rate():
    from torch import nn

    from minispeed.profiler import FlopsProfiler
    from minispeed.profiler.calibrate import measure_matmul_shapes
    from minispeed.profiler.perf_model import matmul_seconds

    lin = nn.Linear(8, 16)
    with FlopsProfiler(lin) as prof:
        lin(torch.randn(4, 8)).sum().backward()
    shapes = prof.result().matmul_shapes
    assert shapes == {(1, 4, 8, 16): 1, (1, 16, 4, 8): 1}  # forward addmm; dW = dYᵀ·X
    rates = measure_matmul_shapes(list(shapes), seconds=0.01)
    seconds, flops = matmul_seconds(shapes, {s: 1e9 for s in rates})
    assert flops == 2 * (4 * 8 * 16) * 2 and seconds == pytest.approx(flops / 1e9)
    assert all(r > 0 for r in rates.values())


def test_alpha_and_beta_are_fitted_from_several_message_sizes():
    # Exact data t = α + w/β comes back exactly; the fit weighs small and large calls alike.
    wire = [2e3, 1.3e5, 2e6, 8e6]
    fit = fit_alpha_beta(wire, [2e-4 + w / 5e8 for w in wire])
    assert fit.alpha_s == pytest.approx(2e-4) and fit.busbw_bytes_per_s == pytest.approx(5e8)
    # Noise that would make α negative falls back to the smallest call's time, β positive.
    fit = fit_alpha_beta([1e3, 1e6, 4e6], [1e-5, 1e-2, 1.2e-2])
    assert fit.alpha_s >= 0 and fit.busbw_bytes_per_s > 0


def test_adam_is_timed_per_parameter_and_stage3_gathers_follow_the_prefetch_budget():
    t = measure_adam(numel=40_000, tensors=2, steps=2)
    assert 0 < t < 1e-3  # seconds per parameter
    assert measure_dram(numel=100_000, seconds=0.01) > 1e6  # bytes per second
    assert stage3_gather_calls(10_000, units=15, prefetch_numel=50_000) == 2  # one + prefetch
    # zero gathers at most one 4M-element chunk ahead, so at 34.8M the window slides
    assert stage3_gather_calls(34_800_000, units=39, prefetch_numel=50_000_000) == 39
    assert stage3_gather_calls(100_000, units=15, prefetch_numel=50_000) == 15  # sliding window
    assert stage3_gather_calls(100, units=1, prefetch_numel=50) == 1


def _calibrate_in_group(rank, world_size):
    import minispeed.comm as comm
    from minispeed.profiler.calibrate import measure_in_group

    machine = measure_in_group(comm, sizes=(32,), seconds=0.01, link_bytes=(4096, 65536, 262144),
                               adam_numel=16_000, dram_numel=100_000)  # fmt: skip
    return machine.to_json()


def test_calibration_in_a_gloo_group_gives_every_rank_the_same_alpha_beta_per_collective():
    pytest.importorskip("minispeed.comm", reason="collectives go through minispeed.comm")
    from minispeed.core.testing import run_distributed

    results = run_distributed(_calibrate_in_group, world_size=2)
    assert results[0] == results[1]  # the slowest rank's figures, agreed on by all
    machine = Machine.from_json(results[0])
    assert set(machine.links) == {"all_reduce", "all_gather", "reduce_scatter"}
    for link in machine.links.values():
        assert link.alpha_s >= 0 and link.busbw_bytes_per_s > 0
    assert machine.world_size == 2 and machine.adam_s_per_param > 0 and machine.dram_bytes_per_s > 0
    # A tensor's fixed AdamW cost (~10 operator calls) is far above one element's.
    assert machine.adam_s_per_tensor > 10 * machine.adam_s_per_param
    assert machine.hook_s_per_grad > 0
