"""Each split layer equals the unsplit one (forward output, input gradient, weight gradients
gathered back) to 1e-5 on 2 and 4 gloo ranks, and issues exactly the collectives its formula in
`minispeed.tensor_parallel.costs` lists, of the stated sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import minispeed.comm as comm
import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed
from minispeed.tensor_parallel.sharding import ShardSpec, shard

pytestmark = pytest.mark.timeout(300)

B, T, K, N, V = 2, 8, 12, 24, 40  # T, K, N, V divisible by 1, 2, 4 (and N by 3·4)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g))
        lin.bias.copy_(torch.randn(N, generator=g))
    return {
        "w": lin.weight.detach().clone(),
        "b": lin.bias.detach().clone(),
        "x": torch.randn(B, T, K, generator=g),
        "gy": torch.randn(B, T, N, generator=g),
        "emb": torch.randn(V, K, generator=g),
        "ids": torch.randint(0, V, (B, T), generator=g),
        "logits": torch.randn(B, T, V, generator=g) * 3,
        "targets": torch.randint(0, V, (B, T), generator=g).index_fill_(1, torch.tensor([2]), -100),
    }


def _linear(d: dict) -> nn.Linear:
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(d["w"])
        lin.bias.copy_(d["b"])
    return lin


def _records(log: comm.CommsLogger) -> list[tuple[str, int, int, str]]:
    return [(r.op, r.msg_bytes, r.wire_bytes, r.impl) for r in log.records]


def _layer_body(rank: int, world_size: int, kind: str, opts: dict) -> dict:
    d, tg = _inputs(), tp.TensorGroup.of(None)
    sp = opts.get("sequence_parallel", False)
    seq = ShardSpec(1)  # sequence shards of a (B, T, ·) activation
    if kind == "column":
        layer = tp.ColumnParallelLinear.from_module(_linear(d), None, **opts)
        parts = opts.get("parts", 1)
        x = shard(d["x"], seq, rank, world_size) if sp else d["x"].clone()
        gy = (
            d["gy"]
            if opts.get("gather_output")
            else shard(d["gy"], ShardSpec(2, parts), rank, world_size)
        )
    elif kind == "row":
        layer = tp.RowParallelLinear.from_module(_linear(d), None, **opts)
        parallel_in = opts.get("input_is_parallel", True)
        x = shard(d["x"], ShardSpec(2), rank, world_size) if parallel_in else d["x"].clone()
        gy = shard(d["gy"], seq, rank, world_size) if sp else d["gy"]
    else:
        emb = nn.Embedding(V, K)
        with torch.no_grad():
            emb.weight.copy_(d["emb"])
        layer = tp.VocabParallelEmbedding.from_module(emb, None, **opts)
        x = d["ids"]
        gy = d["gy"][..., :K]
        gy = shard(gy, seq, rank, world_size) if sp else gy
    if x.is_floating_point():
        x.requires_grad_(True)
    with comm.CommsLogger() as log:
        y = layer(x)
        y.backward(gy)
    out = {"y": y.detach(), "records": _records(log)}
    out["x_grad"] = None if x.grad is None else x.grad
    out["grads"] = tp.unshard_module(layer, tg, grads=True)
    return out


def _reference(kind: str) -> dict:
    d = _inputs()
    if kind == "embedding":
        emb = nn.Embedding(V, K)
        with torch.no_grad():
            emb.weight.copy_(d["emb"])
        y = emb(d["ids"])
        y.backward(d["gy"][..., :K])
        return {"y": y.detach(), "x_grad": None, "grads": {"weight": emb.weight.grad}}
    lin, x = _linear(d), d["x"].clone().requires_grad_(True)
    y = lin(x)
    y.backward(d["gy"])
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "grads": {"weight": lin.weight.grad, "bias": lin.bias.grad},
    }


CASES = {
    "column": ("column", {}),
    "column-gather-3parts": ("column", {"gather_output": True, "parts": 3}),
    "column-3parts": ("column", {"parts": 3}),
    # parts of unequal widths (Phi-3's q of 4 heads, k and v of 1): rows 16, 4, 4
    "column-gather-unequal-parts": ("column", {"gather_output": True, "parts": (4, 1, 1)}),
    "column-sequence": ("column", {"sequence_parallel": True}),
    "row": ("row", {}),
    "row-whole-input": ("row", {"input_is_parallel": False}),
    "row-sequence": ("row", {"sequence_parallel": True}),
    "embedding": ("embedding", {}),
    "embedding-sequence": ("embedding", {"sequence_parallel": True}),
}


def _formula(kind: str, opts: dict, n: int) -> list[tp.Collective]:
    M = B * T
    if kind == "column":
        return tp.column_collectives(M, K, N, n, **opts_without(opts, "parts"))
    if kind == "row":
        return tp.row_collectives(M, K, N, n, **opts)
    return tp.embedding_collectives(M, K, n, **opts)


def opts_without(opts: dict, key: str) -> dict:
    return {k: v for k, v in opts.items() if k != key}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_split_layer_equals_unsplit_and_sends_the_formula(
    case, world_size, rel_close, logged_bytes
):
    kind, opts = CASES[case]
    results = run_distributed(_layer_body, world_size=world_size, args=(kind, opts))
    want = _reference(kind)
    sp, parts = opts.get("sequence_parallel", False), opts.get("parts", 1)
    for rank, got in enumerate(results):
        y = want["y"]
        if kind == "column" and not opts.get("gather_output"):
            y = shard(y, ShardSpec(2, parts), rank, world_size)
        if sp and kind != "column":
            y = shard(y, ShardSpec(1), rank, world_size)
        rel_close(got["y"], y)
        if want["x_grad"] is not None:
            gx = want["x_grad"]
            if kind == "row" and opts.get("input_is_parallel", True):
                gx = shard(gx, ShardSpec(2), rank, world_size)
            if kind == "column" and sp:
                gx = shard(gx, ShardSpec(1), rank, world_size)
            rel_close(got["x_grad"], gx)
        assert set(got["grads"]) == set(want["grads"])
        for name, g in want["grads"].items():
            rel_close(got["grads"][name], g)
        logged_bytes(got["records"], _formula(kind, opts, world_size), world_size)


def _cross_entropy_body(rank: int, world_size: int) -> dict:
    d = _inputs()
    local = shard(d["logits"], ShardSpec(2), rank, world_size).requires_grad_(True)
    with comm.CommsLogger() as log:
        loss = tp.vocab_parallel_cross_entropy(local, d["targets"], None)
        loss.backward()
    return {"loss": loss.detach(), "grad": local.grad, "records": _records(log)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_cross_entropy_equals_torch(world_size, rel_close, logged_bytes):
    results = run_distributed(_cross_entropy_body, world_size=world_size)
    d = _inputs()
    logits = d["logits"].clone().requires_grad_(True)
    want = F.cross_entropy(logits.flatten(0, 1), d["targets"].flatten())  # ignore_index=-100
    want.backward()
    for rank, got in enumerate(results):
        rel_close(got["loss"], want.detach())
        rel_close(got["grad"], shard(logits.grad, ShardSpec(2), rank, world_size))
        logged_bytes(got["records"], tp.cross_entropy_collectives(B * T, world_size), world_size)


def test_a_size_that_does_not_split_names_the_layer():
    d = _inputs()
    with pytest.raises(ValueError, match=r"output features: dimension 0 has size 24.*over 5"):
        tp.ColumnParallelLinear.from_module(_linear(d), tp.TensorGroup(0, 5))
    with pytest.raises(
        ValueError, match=r"size 24, which does not split in parts \(16, 4, 4\) over 8 .*dividing 4"
    ):
        tp.ColumnParallelLinear.from_module(_linear(d), tp.TensorGroup(0, 8), parts=(4, 1, 1))
    with pytest.raises(ValueError, match=r"parts \(\(4, 1\)\) do not divide it"):
        tp.ColumnParallelLinear.from_module(_linear(d), tp.TensorGroup(0, 2), parts=(4, 1))
    with pytest.raises(ValueError, match=r"vocabulary: dimension 0 has size 40.*over 3"):
        tp.VocabParallelEmbedding(d["emb"], tp.TensorGroup(0, 3))
