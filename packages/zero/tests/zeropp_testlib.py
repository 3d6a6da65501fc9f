"""Helpers for the ZeRO++ tests: 4 gloo ranks arranged as 2 "nodes" × 2, and the 8 combinations."""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.comm as comm
import minispeed.zero as zero

NODE_SIZE = 2  # ranks per emulated node; 4 ranks = 2 nodes
THRESHOLD = 30  # layer norms, shared_gain and `unused` stay gathered; matrices are sharded
BLOCK = 64  # quantization block: TinyGPT's shards are 24-432 elements on 4 ranks
GLOBAL_BATCH = 8
LR = 1e-2

#: (quantized_weights, hpz, quantized_gradients), plain stage 3 first.
COMBOS = list(itertools.product((False, True), repeat=3))


def combo_id(combo: tuple[bool, bool, bool]) -> str:
    names = [n for n, on in zip(("qwZ", "hpZ", "qgZ"), combo) if on]
    return "+".join(names) or "plain"


def emulate_nodes(node_size: int = NODE_SIZE) -> None:
    """What torchrun sets on a real cluster: ranks per node (the harness resets it per body)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(node_size)


def config(combo: tuple[bool, bool, bool], **extra: Any) -> zero.ZeroConfig:
    qw, hpz, qg = combo
    fields = dict(
        stage=3,
        stage3_param_persistence_threshold_numel=THRESHOLD,
        quantized_weights=qw,
        hpz_partition_size=NODE_SIZE if hpz else 1,
        quantized_gradients=qg,
        quant_block_numel=BLOCK,
    )
    return zero.ZeroConfig(**{**fields, **extra})


def build(combo: tuple[bool, bool, bool], precision: Any = None, **extra: Any):
    """TinyGPT and its ZeroOptimizer under ``combo`` (same initial weights on every rank)."""
    model = make_model()
    opt = zero.shard(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        config=config(combo, **extra),
        precision=precision,
    )
    return model, opt


def global_loss(loss: torch.Tensor, world_size: int) -> float:
    t = loss.detach().float().reshape(1).clone()
    comm.all_reduce(t)
    return t.item() / world_size


def train(model, opt, rank: int, world_size: int, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` steps on the global batches; (global loss, this rank's local loss) per step."""
    global_losses, local = [], []
    for batch in make_batches(steps, GLOBAL_BATCH):
        loss = model(*rank_slice(batch, rank, world_size))
        local.append(loss.item())
        global_losses.append(global_loss(loss, world_size))
        opt.backward(loss)
        opt.step()
    return global_losses, local
