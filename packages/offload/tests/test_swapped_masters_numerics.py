"""`SwappedMastersOptimizer` alone: masters, Adam states and gradients all in swap files, stepped
through meta handles, follows torch.optim.AdamW (odd sizes, 3 partitions, gradients added twice
per step as under accumulation, a clipping scale), its state_dict loads into torch's AdamW and
continues identically, and `on_stepped` sees every new master. Host memory holds only the pools.
A gradient file cut short under the running job is an error naming it; a step that fails
part-way (a partition file deleted) stops with nothing in flight and every buffer free.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

from minispeed.offload import OffloadOptimizerConfig, SwappedGrads, SwappedMastersOptimizer
from minispeed.offload.swapper import SwapState

SIZES = (37, 1001, 5, 260)
STEPS = 6


def _config(path) -> OffloadOptimizerConfig:
    return OffloadOptimizerConfig(
        device="nvme", nvme_path=str(path), buffer_count=3, pipeline_read=True, pipeline_write=True
    )


def test_swapped_masters_follow_torch_adamw(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=g) for n in SIZES]
    ref = [v.clone().requires_grad_(True) for v in values]
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    handles = [torch.empty(n, device="meta") for n in SIZES]
    seen: dict[int, torch.Tensor] = {}
    opt = SwappedMastersOptimizer(
        handles,
        _config(tmp_path),
        sub_group_numel=1000,  # partitions [37] [1001] [5, 260]
        lr=1e-2,
        weight_decay=0.1,
        decoupled_weight_decay=True,
        on_stepped=lambda h, v: seen.__setitem__(id(h), v.clone()),
    )
    assert len(opt.partitions) == 3
    index = {id(h): i for i, h in enumerate(handles)}
    opt.fill_masters(lambda h: values[index[id(h)]])
    for step in range(STEPS):
        scale = 0.5 if step % 2 else 1.0
        for i, h in enumerate(handles):
            a = torch.randn(SIZES[i], generator=g)
            b = torch.randn(SIZES[i], generator=g)
            opt.grads.add(h, a)
            opt.grads.add(h, b)  # a second micro-step: read, add, write
            ref[i].grad = (a + b) * scale
            h.grad = torch.empty_like(h)  # meta marker: step this one
        if scale != 1.0:
            opt.grads.set_scale(scale)
        opt.step()
        torch_opt.step()
        opt.grads.new_window()
        for i, h in enumerate(handles):
            torch.testing.assert_close(seen[id(h)], ref[i].detach(), rtol=1e-6, atol=1e-6)
    # only pools in host memory; files hold 12 B (master, m, v) + 4 B (grad) per element
    assert opt.resident_state_bytes() == opt.swapper.pool.nbytes + opt.grads.resident_bytes
    assert opt.swapped_state_bytes() == 16 * sum(SIZES)
    # the state_dict is torch's: it loads into torch's AdamW and both continue alike
    saved = opt.state_dict()
    assert all(p.device.type == "meta" for p in opt.param_groups[0]["params"])  # handles back
    other = [r.detach().clone().requires_grad_(True) for r in ref]
    torch2 = torch.optim.AdamW(other, lr=1e-2, weight_decay=0.1)
    torch2.load_state_dict(copy.deepcopy(saved))  # as if through a file (torch shares `step`)
    for i, h in enumerate(handles):
        grad = torch.randn(SIZES[i], generator=g)
        opt.grads.add(h, grad)
        other[i].grad = grad.clone()
        h.grad = torch.empty_like(h)
    opt.step()
    torch2.step()
    for i, h in enumerate(handles):
        torch.testing.assert_close(seen[id(h)], other[i].detach(), rtol=1e-6, atol=1e-6)
    opt.close()


def test_write_master_changes_what_the_next_step_starts_from(tmp_path) -> None:
    handles = [torch.empty(9, device="meta")]
    got = {}
    opt = SwappedMastersOptimizer(
        handles, _config(tmp_path), lr=0.0, on_stepped=lambda h, v: got.update(v=v.clone())
    )
    opt.fill_masters(lambda h: torch.zeros(9))
    opt.write_master(handles[0], torch.full((4,), 3.0), start=2)
    opt.grads.add(handles[0], torch.ones(9))
    handles[0].grad = torch.empty_like(handles[0])
    opt.step()  # lr 0: the master is unchanged, and reported
    assert got["v"].tolist() == [0, 0, 3, 3, 3, 3, 0, 0, 0]
    opt.close()


def test_a_truncated_gradient_file_is_an_error_naming_it(tmp_path) -> None:
    grads = SwappedGrads([[("a", 5000), ("b", 7)]], str(tmp_path), buffer_count=1)
    grads.add("a", torch.ones(5000))
    grads.add("b", torch.ones(7))
    assert grads.square_sum() == 5007.0  # kept as written: the clipping norm's input
    grads.swapper.wait_all()
    path = grads.files["a"].path
    os.truncate(path, 4096)  # a swap file cut short under the running job
    with pytest.raises(OSError, match=re.escape(str(path))):
        grads.wait_read(0)
    assert len(grads.read_pool.free) == 2  # the read buffer came back
    grads.close()


def _all_free(opt: SwappedMastersOptimizer) -> bool:
    pools = (opt.swapper.pool, opt.grads.swapper.pool, opt.grads.read_pool)
    idle = (SwapState.NEW, SwapState.ON_DISK)
    tensors = [*opt.swapper.tensors.values(), *opt.grads.swapper.tensors.values()]
    return all(len(p.free) == len(p.buffers) for p in pools) and all(
        st.state in idle for st in tensors
    )


def test_a_step_that_fails_part_way_stops_cleanly(tmp_path) -> None:
    """A partition file deleted under the job: the step raises naming it with nothing in flight
    and every buffer free (ZeRO-Infinity then agrees on the error across ranks); once the file
    is back, the same optimizer steps again."""
    handles = [torch.empty(n, device="meta") for n in SIZES]
    opt = SwappedMastersOptimizer(handles, _config(tmp_path), sub_group_numel=1000, lr=1e-2)
    opt.fill_masters(lambda h: torch.ones(h.numel()))
    victim = opt.partitions[1].swap.path  # the middle one: the pipeline is mid-way
    saved = victim.read_bytes()
    victim.unlink()
    for h in handles:
        opt.grads.add(h, torch.ones(h.numel()))
        h.grad = torch.empty_like(h)
    with pytest.raises(OSError, match=re.escape(str(victim))):
        opt.step()
    assert _all_free(opt)
    victim.write_bytes(saved)
    opt.step()
    assert _all_free(opt)
    opt.close()
