"""``sub_group_numel`` (DeepSpeed ``sub_group_size``) bounds the optimizer step's temporaries.

The inner optimizer runs once per sub-group of at most ``sub_group_numel`` master elements
(Note [optimizer sub-groups] in optimizer.py). torch's multi-tensor AdamW (``foreach=True``, the
CUDA default) allocates its temporaries for every tensor of a call at once, so the peak bytes of
temporaries alive during ``opt.step()`` follow the sub-group size: measured here by counting the
bytes of every tensor an operator allocates while the step runs, alive at once (a
``TorchDispatchMode``; exact on the CPU, where there is no caching allocator to blur it). The
weights must not depend on the sub-grouping (the update is elementwise).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

LAYERS, WIDTH = 8, 64  # 8 weights of 4096 elements; 2 ranks: 2048 elements per stage-3 shard


class TemporaryBytes(TorchDispatchMode):
    """Peak bytes of tensors allocated by operators inside the mode and still alive (an output
    sharing storage with an input, as in-place operators and views return, is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in given:  # new memory
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                given.add(_storage(t))
                weakref.finalize(t, self._free, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def _body(rank: int, world_size: int, stage: int, sub_group_numel: int):
    model = _model()
    config = zero.ZeroConfig(
        stage=stage, sub_group_numel=sub_group_numel, stage3_param_persistence_threshold_numel=0
    )
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True), config)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    peaks = []
    for _ in range(3):
        opt.backward(model(x).pow(2).mean())
        probe = TemporaryBytes()
        with probe:
            assert opt.step()
        peaks.append(probe.peak)
    largest = max(f.numel for f in opt.fragments())
    if stage == 3:
        with zero.GatheredParameters(list(model.parameters())):
            weights = [p.detach().clone() for p in model.parameters()]
    else:
        weights = [p.detach().clone() for p in model.parameters()]
    return max(peaks[1:]), largest, weights  # step 1 also creates the optimizer state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_peak_step_temporaries_follow_the_sub_group_size(stage: int) -> None:
    whole = run_distributed(_body, world_size=2, args=(stage, 1_000_000_000))
    small = run_distributed(_body, world_size=2, args=(stage, 2048))
    for (peak_whole, largest, w_whole), (peak_small, _, w_small) in zip(whole, small):
        for a, b in zip(w_whole, w_small):
            assert torch.equal(a, b), "sub-grouping changed the update"
        held = LAYERS * WIDTH * WIDTH // 2 * 4  # this rank's master bytes
        bound = max(2048, largest) * 4  # one sub-group's bytes
        # foreach AdamW's peak: one fp32 temporary (sqrt of exp_avg_sq) per element it steps.
        assert peak_whole >= held, (peak_whole, held)
        assert peak_small <= 1.5 * bound, (peak_small, bound)
        assert peak_small * 3 <= peak_whole, (peak_small, peak_whole)
