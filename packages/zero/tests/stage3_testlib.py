"""Helpers for the stage-3 tests: the single-process reference, odd models, a memory probe.

Everything here runs either in the pytest process (references) or inside a distributed test body.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.zero.stage3 import REGISTRY, ParamState

GLOBAL_BATCH = 8
LR = 1e-2


def reference_losses(steps: int, accum: int = 1, clip: float = 0.0) -> list[float]:
    """Single-process PyTorch on the global batches: the loss of every micro-step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for k, batch in enumerate(make_batches(steps * accum, GLOBAL_BATCH)):
        loss = model(*batch)
        losses.append(loss.item())
        (loss / accum).backward()
        if (k + 1) % accum == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses


def reference_grads(batch: Any) -> dict[str, torch.Tensor]:
    """Full gradients of the initial TinyGPT on one global batch, by parameter name."""
    model = make_model()
    model(*batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def global_loss(loss: torch.Tensor, world_size: int) -> float:
    """The mean over ranks of each rank's local-mean loss = the loss on the global batch."""
    t = loss.detach().float().clone().reshape(1)
    comm.all_reduce(t)
    return t.item() / world_size


def train_losses(model: nn.Module, opt: Any, rank: int, world_size: int, batches) -> list[float]:
    """Train `model` through the sharded `opt` on this rank's slice of each global batch, one
    optimizer step per batch; the global loss of each (collective)."""
    losses = []
    for batch in batches:
        loss = model(*rank_slice(batch, rank, world_size))
        losses.append(global_loss(loss, world_size))
        opt.backward(loss)
        opt.step()
    return losses


def train_stage3(
    rank: int,
    world_size: int,
    steps: int,
    *,
    accum: int = 1,
    clip: float = 0.0,
    **stage3: Any,
) -> tuple[list[float], Any, set[str]]:
    """TinyGPT through zero.shard(stage=3).

    Returns (global loss per micro-step, optimizer, names of non-persistent parameters found
    gathered, or with non-empty ``.data``, after any ``step()``).
    """
    model = make_model()
    cfg = zero.ZeroConfig(stage=3, gradient_accumulation_steps=accum, max_grad_norm=clip, **stage3)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
    losses, leftovers = [], set()
    for batch in make_batches(steps * accum, GLOBAL_BATCH):
        loss = model(*rank_slice(batch, rank, world_size))
        losses.append(global_loss(loss, world_size))
        opt.backward(loss)
        opt.step()
        for sp in opt.strategy.sharded_params():
            if not sp.persistent and (sp.state is not ParamState.SHARDED or sp.param.data.numel()):
                leftovers.add(sp.name)
    return losses, opt, leftovers


# -- models for the divergence and leaf-module tests --------------------------------------------
class RankBranchNet(nn.Module):
    """stem -> branch_a or branch_b -> head. ``mode``: "rank" (odd ranks take branch_b), "a", "b"."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.branch_a = nn.Linear(8, 8)
        self.branch_b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.mode = "rank"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        take_b = self.mode == "b" or (self.mode == "rank" and comm.get_rank() % 2 == 1)
        h = self.branch_b(h) if take_b else self.branch_a(h)
        return self.head(h).pow(2).mean()


class Experts(nn.Module):
    """A toy MoE block: each call runs ONE expert, chosen by the data (so ranks may differ)."""

    def __init__(self, width: int = 8, n: int = 2) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[0 if float(x.mean()) >= 0 else 1](x)


class MoENet(nn.Module):
    """stem -> Experts -> head. Feed rank-dependent data and ranks run different experts."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.moe = Experts()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.stem(x))).pow(2).mean()


class Stack(nn.Module):
    """``layers`` equal Linear layers in a ModuleList plus a small head: for zero.Init's memory test."""

    def __init__(self, width: int = 64, layers: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.head(x), torch.zeros(x.shape[0], 1))


class ParamBytesProbe:
    """Peak bytes of parameter values held while modules are built (full data + stage-3 shards).

    Samples at every parameter creation and every module attachment, *before* zero.Init reacts
    (enter the probe before zero.Init: global hooks run in registration order), and once more on
    ``sample()``. Bytes: each created parameter's ``.data`` (0 once released) plus its shard.
    """

    def __init__(self) -> None:
        self.params: dict[int, nn.Parameter] = {}
        self.peak = 0

    def __enter__(self) -> ParamBytesProbe:
        self._handles = [
            register_module_parameter_registration_hook(self._on_param),
            register_module_module_registration_hook(lambda *a: self.sample()),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    def _on_param(self, module: nn.Module, name: str, p: nn.Parameter | None) -> None:
        if p is not None:
            self.params[id(p)] = p
        self.sample()

    def held(self) -> int:
        total = 0
        for p in self.params.values():
            sp = REGISTRY.get(p)
            if sp is None:
                total += p.data.numel() * p.element_size()
            else:  # not p.data: inside zero.Init reading it gathers the parameter
                total += sp.full_storage_nbytes + sp.shard.numel() * sp.shard.element_size()
        return total

    def sample(self) -> None:
        self.peak = max(self.peak, self.held())


class StorageProbe(TorchDispatchMode):
    """Bytes of every storage an op created that is still alive: now (`live`) and at its largest.

    Samples after every op while active, so it sees what `ParamBytesProbe` cannot: a copy made
    for a broadcast, a buffer some object kept, garbage not collected yet. Storages are held by
    weak reference (the probe keeps nothing alive). Cost: one pass over the storages seen so far
    per op; for small models only.

    Storages are keyed by identity (the StorageImpl), not by address: stage 3 frees a gathered
    parameter's storage in place (`resize_(0)`) and re-allocates it at another address, so keying
    by `data_ptr()` counted it twice whenever the allocator had not reused the old address yet —
    a flake that depended on the allocator's history.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, Any] = {}
        self.made_by: dict[int, str] = {}  # which op made each storage, for failure messages
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs[storage._cdata] = storage._weak_ref()
                self.made_by[storage._cdata] = f"{func} -> {tuple(t.shape)} {t.dtype}"
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        total = 0
        for key, ref in list(self.refs.items()):
            if torch.UntypedStorage._expired(ref):
                del self.refs[key]  # freed: never counted again
            else:
                total += torch.UntypedStorage._new_with_weak_ptr(ref).nbytes()
        return total

    def alive(self, most: int = 12) -> list[str]:
        """The `most` largest storages still alive, each with its bytes and the op that made
        it: what a failed bound is holding."""
        rows = []
        for key, ref in list(self.refs.items()):
            if torch.UntypedStorage._expired(ref):
                continue
            nbytes = torch.UntypedStorage._new_with_weak_ptr(ref).nbytes()
            if nbytes:
                rows.append((nbytes, f"{nbytes} B from {self.made_by[key]}"))
        return [row for _, row in sorted(rows, reverse=True)[:most]]


class AllocatorTrace:
    """Every allocation and free of the CPU allocator inside the block, from the allocator's own
    event stream (`torch.profiler` with `profile_memory=True`): of the blocks allocated inside,
    the bytes still held at the end (`net`) and the most held at once (`peak`). A free of a block
    allocated before the block (an earlier test's tensor dying now) is not counted.

    The cyclic garbage collector is off inside (`gc.disable()`), so garbage held by reference
    cycles counts as held, as it is until a collection happens to run. Only this thread's
    allocator calls are recorded: a tensor freed by another thread (a backend's worker dropping
    the last reference) is not seen freed, which is why a collective must not return while the
    backend still holds its buffers (Note [the backend lets go before we do] in comm/handoff.py).

    The stream itself misses a free now and then (torch 2.13, 2 gloo ranks: about one zero.Init
    build in fifteen ends one parameter's bytes high, a weight or a bias that a weak reference
    to its storage shows freed; never without collectives in the block; cause not found), so a
    test repeats a build and bounds the smallest figures.
    """

    def __enter__(self) -> AllocatorTrace:
        import gc

        from torch.profiler import ProfilerActivity, profile

        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        from torch._C._profiler import _EventType

        self._prof.__exit__(*exc)
        if self._gc_was_enabled:
            gc.enable()
        todo, allocations = list(self._prof.profiler.kineto_results.experimental_event_tree()), []
        while todo:
            node = todo.pop()
            todo.extend(node.children)
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                allocations.append((node.start_time_ns, node.extra_fields))
        held: dict[int, int] = {}  # pointer -> bytes, of the blocks allocated inside
        self.net = self.peak = 0
        for _, event in sorted(allocations, key=lambda a: a[0]):
            if event.alloc_size > 0:
                held[event.ptr] = event.alloc_size
                self.net += event.alloc_size
            elif event.ptr in held:
                self.net -= held.pop(event.ptr)
            self.peak = max(self.peak, self.net)
        self._prof = None


class LateInit(nn.Module):
    """Initialises its layers at the end of __init__, after zero.Init partitioned them (nanoGPT's
    ``self.apply(self._init_weights)``); ``gathered=True`` does it the stage-3 way."""

    def __init__(self, gathered: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.gathered = gathered
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with zero.stage3.GatheredParameters(
                module.bias, modifier_rank=0, enabled=self.gathered
            ):
                nn.init.constant_(module.bias, 0.25)


def infinity_config(nvme_path: str, accum: int = 1) -> zero.ZeroConfig:
    """ZeRO-Infinity on the tiny test model: parameters, masters and Adam states in swap files
    under `nvme_path`, a few parameters persistent in memory, sub-groups of 3000 elements."""
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return zero.ZeroConfig.from_section(
        {
            "stage": 3,
            "stage3_param_persistence_threshold": 30,  # a few persistent (in memory) too
            "sub_group_size": 3000,
            "offload_param": {**nvme, "buffer_count": 2, "buffer_size": 2000},
            "offload_optimizer": {**nvme, "buffer_count": 2, "pipeline_read": True},
        },
        gradient_accumulation_steps=accum,
    )
