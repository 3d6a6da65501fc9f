"""bf16 and fp16 training stays close to fp32, and an fp16 overflow skips the step cleanly.

Tolerances (TinyGPT, AdamW lr 1e-2, 20 steps, loss ≈ 4.2 -> 3.x): bf16 keeps 8 mantissa bits, so
each bf16 weight is off by up to 2^-9 relative, and the loss drifts by a few 1e-3; we allow a
relative 2e-2 per step. fp16 has 11 mantissa bits: we allow 1e-2. A broken cast, a missing
unscale or a bf16 accumulation of the averaged gradient shows up as a much larger error (a loss
scale left in the gradients makes AdamW's first step differ by orders of magnitude).
"""

from __future__ import annotations

import pytest
import torch
from stage012_testlib import max_relative_error, micro_batches, reference_run, zero_run
from zero_testlib import make_batches, make_model

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

BF16_RTOL = 2e-2
FP16_RTOL = 1e-2

PRECISION_CASES = [
    # (stage, accumulation, precision)
    (2, 1, zero.MixedPrecision(param_dtype=torch.bfloat16)),
    (0, 2, zero.MixedPrecision(param_dtype=torch.bfloat16)),  # fp32 accumulation across micro-steps
    (1, 1, zero.MixedPrecision(param_dtype=torch.float16, initial_scale_power=8)),
]


def _mixed_precision_runs(rank: int, world_size: int):
    out = []
    for stage, accumulation, precision in PRECISION_CASES:
        config = zero.ZeroConfig(
            stage=stage, gradient_accumulation_steps=accumulation, reduce_bucket_numel=4000
        )
        losses, _, opt = zero_run(rank, world_size, "adamw", config, precision)
        model_dtypes = {p.dtype for p in opt.strategy.groups[0]}
        master_dtypes = {m.dtype for ms in opt.strategy.master_params() for m in ms}
        out.append((losses, model_dtypes, master_dtypes, opt.loss_scaler.overflows))
    return out


def test_bf16_and_fp16_losses_track_fp32() -> None:
    ref_losses, _, _ = reference_run("adamw")
    results = run_distributed(_mixed_precision_runs, world_size=2, timeout_s=180)[0]
    for (stage, accumulation, precision), (losses, model_dtypes, master_dtypes, overflows) in zip(
        PRECISION_CASES, results
    ):
        assert model_dtypes == {precision.param_dtype}
        assert master_dtypes == {torch.float32}
        assert overflows == 0
        rtol = BF16_RTOL if precision.param_dtype == torch.bfloat16 else FP16_RTOL
        err = max_relative_error(losses, ref_losses)
        assert err <= rtol, (stage, accumulation, precision.param_dtype, err)
        assert err > 0, "16-bit training cannot be bit-identical to fp32: is param_dtype applied?"


def _snapshot(model, opt):
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for ms in opt.strategy.master_params() for m in ms]
    state = [
        v.clone()
        for s in opt.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    return weights, masters, state


def _overflow_run(rank: int, world_size: int):
    """Per stage: a clean step, then an inf injected into one gradient on rank 1 only."""
    out = []
    for stage in (0, 1, 2):
        model = make_model()
        precision = zero.MixedPrecision(
            param_dtype=torch.float16, initial_scale_power=10, hysteresis=1
        )
        opt = zero.shard(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            zero.ZeroConfig(stage=stage),
            precision,
        )
        batches = make_batches(3, 8)
        ((x, y),) = micro_batches(batches[0], rank, world_size, 1)
        opt.backward(model(x, y))
        first = opt.step()
        before = _snapshot(model, opt)
        scale_before = opt.loss_scaler.scale

        handle = None
        if rank == 1:  # only one rank sees the overflow: every rank must still skip
            handle = model.blocks[0].mlp[0].weight.register_hook(lambda g: g * float("inf"))
        ((x, y),) = micro_batches(batches[1], rank, world_size, 1)
        opt.backward(model(x, y))
        skipped = opt.step()
        if handle is not None:
            handle.remove()
        after = _snapshot(model, opt)
        unchanged = all(
            torch.equal(a, b)
            for group_a, group_b in zip(before, after)
            for a, b in zip(group_a, group_b)
        )
        scale_after = opt.loss_scaler.scale

        ((x, y),) = micro_batches(batches[2], rank, world_size, 1)
        opt.backward(model(x, y))
        recovered = opt.step()
        out.append(
            (first, skipped, unchanged, scale_before, scale_after, recovered, opt.global_step)
        )
        comm.barrier()
    return out


def test_fp16_overflow_skips_step_and_halves_scale() -> None:
    per_rank = run_distributed(_overflow_run, world_size=2, timeout_s=120)
    for rank_result in per_rank:
        for stage, (first, skipped, unchanged, before, after, recovered, steps) in enumerate(
            rank_result
        ):
            assert first is True, stage
            assert skipped is False, f"stage {stage}: the overflowing step was taken"
            assert unchanged, (
                f"stage {stage}: a weight, master or optimizer state changed on overflow"
            )
            assert after == before / 2, (stage, before, after)
            assert recovered is True and steps == 2, stage


@pytest.mark.parametrize("section", ["fp16", "bf16"])
def test_enabled_auto_is_off_as_deepspeed_reads_it(section):
    """`"enabled": "auto"` (a Hugging Face Trainer config used without the Trainer): DeepSpeed
    0.19.8 trains in fp32 (`engine.fp16_enabled()` and `bfloat16_enabled()` are False, the
    parameters stay fp32); a truthy string must not switch 16-bit training on."""
    from minispeed.zero.precision import MixedPrecision

    mp = MixedPrecision.from_sections(**{section: {"enabled": "auto"}})
    assert mp.param_dtype == torch.float32
    with pytest.raises(ValueError, match=rf"{section}\.enabled.*true or false"):
        MixedPrecision.from_sections(**{section: {"enabled": "yes"}})
