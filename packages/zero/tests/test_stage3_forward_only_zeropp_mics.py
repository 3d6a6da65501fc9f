"""Stage 3 without an optimizer (`zero.shard(model, None, config)`, ZeRO-Inference) with ZeRO++ and
MiCS, on 2 gloo ranks, against single-process PyTorch on each rank's slice of the batch:

- qwZ (`quantized_weights`): the forward computes with the weights its int8 gathers carry, so
  each rank's loss equals, bit for bit, the unsharded model's whose non-persistent weights went
  through the same block quantization (each rank's shard of the padded flat parameter,
  zero-padded to whole blocks, compressed and decompressed), and lies near the unquantized
  loss; `close()` (an exact gather) gives back the true weights;
- MiCS (`mics_shard_size` 1: every rank a whole replica; 2: one shard group over both ranks):
  the loss equals the unsharded model's exactly, two passes (the second follows the trace);
- hpZ and qgZ, which serve backward alone, are refused on every rank before any collective,
  naming the key and the fix (Note [ZeRO++ without an optimizer] in stage3/forward_only.py):
  hpZ's secondary copy used to be allocated and written at every forward and never read.

The tensor-parallel grid's case runs through the engine: tests/engine/test_engine_forward_only_tp.py.
"""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.comm.compression import BlockQuantizer
from minispeed.core.testing import run_distributed

THRESHOLD = 30  # layer norms and small biases persist (exact); the matrices are sharded
BLOCK = 64
VARIANTS = {
    "qwZ": dict(quantized_weights=True, quant_block_numel=BLOCK),
    "MiCS 1": dict(mics_shard_size=1),
    "MiCS 2": dict(mics_shard_size=2),
}
REFUSED = {"hpZ": dict(hpz_partition_size=2), "qgZ": dict(quantized_gradients=True)}


def _config(**extra) -> zero.ZeroConfig:
    return zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=THRESHOLD, **extra)


def _forward(rank: int, world_size: int) -> dict:
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # one node: hpZ's only valid size is 2
    batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    out: dict = {}
    for name, extra in VARIANTS.items():
        model = make_model()
        shards = zero.shard(model, None, _config(**extra))
        with torch.no_grad():
            out[name] = [model(*batch) for _ in range(2)]
        shards.close()  # collective: the model whole again, exactly
        out[name + " closed"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), make_model().parameters())
        )
    for name, extra in REFUSED.items():
        with pytest.raises(ValueError) as err:
            zero.shard(make_model(), None, _config(**extra))
        out[name] = str(err.value)
    return out


def _quantized_like_qwz(world_size: int) -> torch.nn.Module:
    """The unsharded model with each non-persistent weight as qwZ's gathers deliver it: the flat
    parameter padded to N·s, each rank's shard of s elements zero-padded to whole blocks,
    block-quantized to int8 and back (stage3/zeropp.py)."""
    model = make_model()
    q = BlockQuantizer(8, BLOCK)
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            if n <= THRESHOLD:
                continue
            s = -(-n // world_size)
            full = torch.zeros(world_size * s)
            full[:n] = p.flatten()
            for row in full.view(world_size, s):
                x = torch.zeros(q.padded_numel(s))
                x[:s] = row
                row.copy_(q.decompress(q.compress(x))[:s])
            p.copy_(full[:n].view_as(p))
    return model


def test_forward_only_with_qwz_and_mics_matches_pytorch_and_hpz_qgz_are_refused() -> None:
    results = run_distributed(_forward, world_size=2, timeout_s=120)
    exact, quantized = make_model(), _quantized_like_qwz(2)
    for rank, res in enumerate(results):
        batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, 2)
        want, want_q = exact(*batch), quantized(*batch)
        for got in res["qwZ"]:
            torch.testing.assert_close(got, want_q, rtol=0, atol=0)
            assert got != want  # the weights were quantized...
            torch.testing.assert_close(got, want, rtol=1e-3, atol=0)  # ...by little
        for name in ("MiCS 1", "MiCS 2"):
            for got in res[name]:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert all(res[f"{name} closed"] for name in VARIANTS)
        assert "hpz_partition_size=2" in res["hpZ"] and "backward" in res["hpZ"]
        assert "set hpz_partition_size (zero_hpz_partition_size) to 1" in res["hpZ"]
        assert "quantized_gradients" in res["qgZ"] and "to false" in res["qgZ"]
