"""The memory ledger: bytes each rank really holds equal the formula, per stage; the estimator
reproduces the ZeRO paper's numbers."""

from __future__ import annotations

import pytest
import torch
from ckpt_testlib import batches, rank_slice, train
from rich.console import Console
from zero_testlib import make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.memory import (
    estimate,
    measure,
    minispeed_state_bytes,
    model_state_bytes,
    padding_allowance,
    predict,
)


def _ledger_body(rank: int, world_size: int, stage: int, dtype: torch.dtype):
    model = make_model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zero.ZeroConfig(
        stage=stage,
        reduce_bucket_numel=3000,  # several buckets: several paddings
        stage3_param_persistence_threshold_numel=30,  # LayerNorms whole, matrices sharded
    )
    opt = zero.shard(model, inner, config=config, precision=zero.MixedPrecision(param_dtype=dtype))
    train(model, opt, rank, world_size, range(0, 1))  # the optimizer state exists after a step
    idx, tgt = rank_slice(batches()[1], rank, world_size)
    opt.backward(model(idx, tgt))
    got = measure(opt, model)  # before the step: every model state exists (gradients included)
    opt.step()
    return got, predict(opt), padding_allowance(opt)


CASES = [(s, torch.bfloat16) for s in (0, 1, 2, 3)] + [(s, torch.float32) for s in (0, 1, 2, 3)]


@pytest.mark.parametrize("stage,dtype", CASES, ids=[f"stage{s}-{str(d)[6:]}" for s, d in CASES])
def test_measured_bytes_equal_the_formula_within_padding(stage, dtype):
    for got, want, slack in run_distributed(
        _ledger_body, world_size=2, args=(stage, dtype), timeout_s=120
    ):
        assert abs(got.params - want.params) <= slack.params, (got, want)
        assert abs(got.grads - want.grads) <= slack.grads, (got, want)
        assert abs(got.optimizer - want.optimizer) <= slack.optimizer, (got, want)
        assert got.other < 1024, got.where  # flags and scalar state only


def test_the_formulas_give_the_papers_figure_1():
    """ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12, mixed precision (p = g = 2)."""
    psi, n = 7_500_000_000, 64
    totals = [model_state_bytes(psi, n, s).total / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_minispeed_differences_are_the_named_ones():
    psi, n = 1000, 4
    kw = {"param_bytes": 2, "grad_bytes": 2, "state_bytes": 8}
    assert minispeed_state_bytes(psi, n, 0, **kw) == model_state_bytes(psi, n, 0)
    assert minispeed_state_bytes(psi, n, 2, **kw) == model_state_bytes(psi, n, 2)
    assert minispeed_state_bytes(psi, n, 1, **kw) == model_state_bytes(psi, n, 1)
    fp32 = minispeed_state_bytes(psi, n, 0, param_bytes=4, grad_bytes=4, state_bytes=8)
    assert fp32.optimizer == 8 * psi  # the master is the parameter itself
    fp32 = minispeed_state_bytes(psi, n, 1, param_bytes=4, grad_bytes=4, state_bytes=8)
    assert fp32.optimizer == 8 * psi // n  # the master is this rank's shard of the parameters
    pers = minispeed_state_bytes(psi, n, 3, **kw, persistent_params=100)
    assert pers.params == 2 * (100 + 100 // n + (psi - 100) // n)


def test_estimator_says_which_stages_fit_and_prints_a_table():
    est = estimate(175e9, world_size=1024, gpu_memory_gib=80)
    assert est.stages_that_fit() == [3]
    assert est.row(0).total == 16 * 175_000_000_000
    assert est.row(3).total == 16 * -(-175_000_000_000 // 1024)
    console = Console(record=True, width=120)
    console.print(est)
    text = console.export_text()
    assert "175B parameters" in text and "yes" in text and "no" in text


def test_estimator_counts_a_live_model_once_per_tied_parameter():
    model = make_model(0)
    model.lm_head = torch.nn.Linear(24, 67, bias=False)
    model.lm_head.weight = model.wte.weight  # a second name, not a second tensor
    psi = sum(p.numel() for p in model.parameters())
    est = estimate(
        model, world_size=2, stages=(1,), optimizer_bytes=torch.optim.Adam(model.parameters())
    )
    assert est.row(1) == model_state_bytes(psi, 2, 1)
