"""MiCS against PyTorch FSDP2's HSDP on the same mesh: HF GPT-2 (from a config), 4 gloo ranks as
2 "nodes" × 2, clipping on. FSDP2 shards every block and the root over the mesh's ``shard`` axis
(2 ranks) and replicates over ``replicate`` (2 groups) — the same layout as
``ZeroConfig(stage=3, mics_shard_size=2)``. Both must give single-process PyTorch's losses, to
1e-5, step by step.
"""

from __future__ import annotations

import pytest
import torch

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, CLIP, LR = 6, 8, 16, 0.5, 1e-2


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=67,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _batches() -> list[torch.Tensor]:
    """Two global batches in turn: learnable in a few steps."""
    g = torch.Generator().manual_seed(3)
    two = [torch.randint(0, 67, (BATCH, SEQ), generator=g) for _ in range(2)]
    return [two[k % 2] for k in range(STEPS)]


def _reference() -> list[float]:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return losses


def _mean(loss: torch.Tensor, world_size: int) -> float:
    import minispeed.comm as comm

    t = loss.detach().reshape(1).clone()
    comm.all_reduce(t)
    return t.item() / world_size


def _body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n = BATCH // world_size
    mine = [ids[rank * n : (rank + 1) * n] for ids in _batches()]
    out = {"mics": [], "hsdp": []}

    model = _gpt2()
    cfg = zero.ZeroConfig(stage=3, mics_shard_size=2, max_grad_norm=CLIP)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
    for ids in mine:
        loss = model(input_ids=ids, labels=ids).loss
        out["mics"].append(_mean(loss, world_size))
        opt.backward(loss)
        opt.step()
    opt.close()

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _gpt2()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    hsdp_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for ids in mine:
        loss = model(input_ids=ids, labels=ids).loss
        out["hsdp"].append(_mean(loss, world_size))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        hsdp_opt.step()
        hsdp_opt.zero_grad()
    return out


def test_mics_trains_hf_gpt2_like_fsdp2_hsdp_and_pytorch():
    results = run_distributed(_body, world_size=4, timeout_s=240)
    reference = _reference()
    assert reference[-1] < reference[0]  # it trains
    for r in results:
        torch.testing.assert_close(r["mics"], reference, rtol=0, atol=1e-5)
        torch.testing.assert_close(r["hsdp"], reference, rtol=0, atol=1e-5)
