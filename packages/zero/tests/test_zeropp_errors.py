"""ZeRO++ bad input: each is a clear error at ZeroConfig or at shard(), naming the key and the fix,
raised on every rank (never a hang or a silent fallback)."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import make_model
from zeropp_testlib import build, emulate_nodes

import minispeed.zero as zero
from minispeed.comm import api_compat
from minispeed.core.testing import run_distributed


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(stage=2, quantized_weights=True), ["stage=2", "set stage to 3"]),
        (dict(stage=3, quantized_weights=True, quant_block_numel=100), ["power of two", "256"]),
        (dict(stage=3, quantized_gradients=True, quant_block_numel=4), ["power of two", ">= 8"]),
        (dict(stage=3, hpz_partition_size=0), ["zero_hpz_partition_size", "ranks per node"]),
        (dict(stage=3, quantized_gradients=True, quantized_gradient_bits=2), ["8 or 4"]),
    ],
    ids=["not-stage3", "block-100", "block-4", "hpz-0", "bits-2"],
)
def test_zeropp_config_errors_name_the_key_and_the_fix(kwargs, words):
    with pytest.raises(ValueError) as err:
        zero.ZeroConfig(**kwargs)
    for word in words:
        assert word in str(err.value), err.value


def test_zeropp_keys_translate_from_deepspeed():
    cfg = zero.ZeroConfig.from_section(
        {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": 8,
            "zero_quantized_gradients": True,
        }
    )
    assert (cfg.quantized_weights, cfg.hpz_partition_size, cfg.quantized_gradients) == (
        True,
        8,
        True,
    )


def _shard_error(rank: int, world_size: int, case: str) -> str:
    emulate_nodes(4 if case == "hpz-not-node" else 2)
    combo, extra = (False, False, False), {}
    if case == "hpz-not-divide":
        combo, extra = (False, False, False), {"hpz_partition_size": 3}
    elif case == "hpz-not-node":
        combo = (False, True, False)
    elif case == "block-too-big":
        combo, extra = (True, False, False), {"quant_block_numel": 4096}
    elif case == "no-all-to-all":
        combo = (False, False, True)
    try:
        if case == "hpz-not-divide":  # the config refuses nothing here: the world decides
            model = make_model()
            cfg = zero.ZeroConfig(stage=3, **extra)
            zero.shard(model, torch.optim.AdamW(model.parameters()), config=cfg)
        elif case == "no-all-to-all":
            with api_compat.force_fallback("all_to_all"):  # as if the backend lacked it
                build(combo)
        else:
            build(combo, **extra)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "case,words",
    [
        ("hpz-not-divide", ["zero_hpz_partition_size=3", "does not divide", "ranks per node"]),
        ("hpz-not-node", ["zero_hpz_partition_size=2", "node size 4", "LOCAL_WORLD_SIZE"]),
        ("block-too-big", ["zero_quantized_weights", "quant_block_numel=4096", "64 or 256"]),
        ("no-all-to-all", ["zero_quantized_gradients", "all-to-all", "set zero_quantized_grad"]),
    ],
)
def test_zeropp_shard_errors_on_every_rank(case, words):
    for message in run_distributed(_shard_error, world_size=4, args=(case,), timeout_s=120):
        for word in words:
            assert word in message, message
