"""SwappedOptimizer (Adam states on NVMe, pipelined) trains exactly like the in-memory CPUAdam."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from minispeed.offload import (
    CPUAdamW,
    OffloadOptimizerConfig,
    SwappedOptimizer,
    SwapState,
    offload_optimizer,
)


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (1001, 37, 5000, 3, 800)]


def _grads(params, gen) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=gen) for p in params]


@pytest.mark.parametrize(
    "pipeline_read,pipeline_write,buffer_count",
    [(False, False, 1), (True, False, 2), (False, True, 2), (True, True, 2), (True, True, 4)],
)
def test_swapped_steps_equal_in_memory_steps(
    tmp_path: Path, pipeline_read, pipeline_write, buffer_count
) -> None:
    ours, ref = _params(0), _params(0)
    cfg = OffloadOptimizerConfig(
        device="nvme", nvme_path=str(tmp_path), buffer_count=buffer_count,
        pipeline_read=pipeline_read, pipeline_write=pipeline_write,
    )  # fmt: skip
    opt = SwappedOptimizer(ours, cfg, sub_group_numel=2000, lr=1e-2, weight_decay=0.1,
                           decoupled_weight_decay=True)  # fmt: skip
    ref_opt = CPUAdamW(ref, lr=1e-2, weight_decay=0.1)
    assert [p.numel for p in opt.partitions] == [1038, 5000, 803]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b, g in zip(ours, ref, _grads(ours, gen)):
            a.grad, b.grad = g, g.clone()
        opt.step()
        ref_opt.step()
        assert all(p.swap.state == SwapState.ON_DISK for p in opt.partitions)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    # Each step reads and writes every partition's two states once (4 KiB-padded files).
    state_bytes = sum(-(-8 * p.numel // 4096) * 4096 for p in opt.partitions)
    assert opt.swapper.bytes_written == 5 * state_bytes
    assert opt.swapper.bytes_read == 4 * state_bytes  # the first step reads nothing (NEW: zeros)
    opt.close()


def test_state_dict_reads_the_swapped_states_in_torch_format(tmp_path: Path) -> None:
    ours, ref = _params(0), [torch.nn.Parameter(p.detach().clone()) for p in _params(0)]
    cfg = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), pipeline_read=True)
    opt = offload_optimizer(ours, cfg, sub_group_numel=3000, lr=1e-2)
    torch_opt = torch.optim.Adam(ref, lr=1e-2)  # CPUAdam's default: torch's Adam
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b, g in zip(ours, ref, _grads(ours, gen)):
            a.grad, b.grad = g, g.clone()
        opt.step()
        torch_opt.step()
    mine, theirs = opt.state_dict(), torch_opt.state_dict()
    ours_groups = [
        {k: v for k, v in g.items() if k != "bias_correction"} for g in mine["param_groups"]
    ]
    assert ours_groups == theirs["param_groups"]  # plus DeepSpeed's bias_correction key
    for k in theirs["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                mine["state"][k][key], theirs["state"][k][key], rtol=1e-6, atol=1e-8
            )
    # And back: a fresh swapped optimizer loads torch's checkpoint into its files.
    buf = io.BytesIO()
    torch.save(theirs, buf)
    buf.seek(0)
    again = SwappedOptimizer(ours, cfg, sub_group_numel=3000, lr=1e-2)
    again.load_state_dict(torch.load(buf))
    assert "exp_avg" not in again.state[ours[0]]  # the states went to disk, only step stays
    reloaded = again.state_dict()
    torch.testing.assert_close(reloaded["state"][2]["exp_avg_sq"], theirs["state"][2]["exp_avg_sq"])
    opt.close()
    again.close()


def test_offload_optimizer_cpu_device_is_cpu_adam() -> None:
    opt = offload_optimizer(_params(0), OffloadOptimizerConfig(device="cpu"), lr=1e-3)
    assert type(opt).__name__ == "CPUAdam"
    with pytest.raises(ValueError, match="offloads nothing"):
        offload_optimizer(_params(0), OffloadOptimizerConfig(device="none"))
