"""The entry point ZeRO will call: flat fp32 master partitions in, bf16 weights written back.

`offload_optimizer(masters, config, lr=...)` over ZeRO-style flat fp32 partitions (one tensor per
sub-group, `.grad` filled with the reduced gradient partition) steps like torch.optim.AdamW on
the same tensors, and `step(write_back=[bf16 partition])` leaves the bf16 copy a ZeRO rank would
all-gather / copy to its device: bit-equal to casting the updated master.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minispeed.offload import OffloadOptimizerConfig, offload_optimizer


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_flat_masters_step_like_torch_and_write_back_bf16(tmp_path: Path, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in (10_001, 3_333)]  # two sub-groups
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    cfg = OffloadOptimizerConfig(
        device=device, nvme_path=str(tmp_path) if device == "nvme" else None,
        pipeline_read=True, pipeline_write=True,
    )  # fmt: skip
    opt = offload_optimizer(
        masters, cfg, sub_group_numel=10_001, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    )
    torch_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    bf16 = [torch.empty(m.numel(), dtype=torch.bfloat16) for m in masters]
    for _ in range(4):
        for m, r in zip(masters, reference):
            m.grad = torch.randn(m.shape, generator=gen)
            r.grad = m.grad.clone()
        opt.step(write_back=bf16)
        torch_opt.step()
    for m, r, b in zip(masters, reference, bf16):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(b, m.to(torch.bfloat16))
    if device == "nvme":
        opt.close()
