"""Park a `ZeroOptimizer`'s states in host memory between training phases, and bring them back.

An RLHF loop trains a model, then hands the accelerator to an inference engine to generate the
next batch of samples: for that phase the trainer's optimizer states, master weights, 16-bit
weights and gradient buffers are dead weight on the device. `park` copies the chosen kinds of
state to host buffers and frees their device memory; `unpark` gives it back, byte for byte,
and training continues as if nothing happened.

```python
parked = park(opt, model, kinds=("optim_states", "hp_params"), pin_memory=True)
...                                 # the device is free for generation
unpark(parked)                      # same bytes, same tensors: step as before
```

The kinds (DeepSpeed's `OffloadStateTypeEnum` names):

| kind | what | minispeed's tensors |
|---|---|---|
| `optim_states` | the inner optimizer's state (Adam's moments) | `opt.optimizer.state` |
| `hp_params` | the fp32 master weights | `strategy.master_params()` |
| `lp_params` | the model's own weights (stage 3: its shards, and its persistent parameters' full buffers) | the model's parameters |
| `lp_grads` | the gradient buffers kept between steps | the reducer's `held_buffers()` |
| `contiguous_grad_buffer` | the reduce buckets' staging buffers | the reducer's `staging_buffers()` |

How: by storage, not by tensor. Every tensor of a kind is reduced to the storage under it (one
flat buffer carries many views); each storage is copied to a host buffer and then resized to 0
bytes, which frees the device memory while every view, `nn.Parameter` and dictionary entry
pointing into it stays the same object. `unpark` resizes the storage back and copies the bytes
in. Nothing is re-pointed, so nothing can be left pointing at the wrong buffer.

Cost: for `B` bytes in the chosen storages, `park` copies `B` bytes device → host and frees `B`
on the device; `unpark` allocates `B` on the device and copies `B` back. The host buffers (`B`
bytes, page-locked with `pin_memory`) are kept in the `Parked` object for the next `park`, as
DeepSpeed keeps its pinned buffers. No collective: each rank parks its own states.

Storages already in host memory are left where they are (they have nowhere to go: on a CPU-only
machine parking moves nothing, as DeepSpeed's does nothing there), unless `host_too=True`,
which parks them anyway: the tests use it to see the mechanism on a machine without a device.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from minispeed.core.accelerator import get_accelerator

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")

__all__ = ["KINDS", "Parked", "park", "release_gathered", "unpark"]


@dataclasses.dataclass
class _Slot:
    storage: torch.UntypedStorage  # the device storage, 0 bytes while parked
    host: torch.Tensor  # uint8, its bytes while parked
    nbytes: int


@dataclasses.dataclass
class Parked:
    """What `park` took: per kind, the storages it emptied and the host copies of their bytes.
    `nbytes`: the bytes parked, per kind."""

    slots: dict[str, list[_Slot]] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> dict[str, int]:
        return {kind: sum(s.nbytes for s in slots) for kind, slots in self.slots.items()}

    @property
    def empty(self) -> bool:
        return not any(self.slots.values())


def state_tensors(opt: Any, model: torch.nn.Module, kind: str) -> list[torch.Tensor]:
    """The tensors of `kind` (table above) that `opt`, the `ZeroOptimizer` of `model`, keeps
    between steps."""
    strategy = opt.strategy
    if kind == "optim_states":
        return [v for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    if kind == "hp_params":
        return [t for ts in strategy.master_params() for t in ts]
    if kind == "lp_params":
        shards = getattr(strategy, "sharded_params", None)  # stage 3: the shards, then the
        held = [sp.shard for sp in shards()] if shards is not None else []  # gathered buffers
        return held + [p.data for p in model.parameters()]
    reducer = getattr(strategy, "reducer", None)
    if kind == "lp_grads":
        return list(getattr(reducer, "held_buffers", list)())
    if kind == "contiguous_grad_buffer":
        return list(getattr(reducer, "staging_buffers", list)())
    raise ValueError(f"unknown state kind {kind!r}: one of {', '.join(KINDS)}")


def park(
    opt: Any,
    model: torch.nn.Module,
    kinds: Iterable[str] = KINDS,
    *,
    pin_memory: bool = True,
    non_blocking: bool = False,
    reuse: Parked | None = None,
    host_too: bool = False,
) -> Parked:
    """Copy the storages under `kinds` of the states of `opt`, `model`'s `ZeroOptimizer`, to
    host memory and free them (module docstring), then empty the device allocator's cache.
    `reuse`: an earlier (unparked) `Parked` whose host buffers are used again where the sizes
    match. Storages shared by two kinds are parked once, under the first kind named. Call
    between steps: `opt` must not be inside an accumulation window."""
    kinds = list(kinds)
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown state kind {kind!r}: one of {', '.join(KINDS)}")
    if opt.window_micro_steps:
        raise RuntimeError(
            f"cannot park the optimizer's states after micro-step {opt.window_micro_steps} of an "
            "accumulation window: its gradients are half accumulated; call it after the "
            "window's step()"
        )
    spare = {}  # (nbytes, pinned) -> host buffers of an earlier park
    for slots in reuse.slots.values() if reuse is not None else ():
        for s in slots:
            spare.setdefault((s.nbytes, s.host.is_pinned()), []).append(s.host)
    pin = pin_memory and get_accelerator().device().type != "cpu"
    parked, seen = Parked(), set()
    for kind in kinds:
        slots = parked.slots.setdefault(kind, [])
        for t in state_tensors(opt, model, kind):
            storage = t.untyped_storage()
            key = (storage.device, storage.data_ptr())
            nbytes = storage.nbytes()
            if nbytes == 0 or key in seen or (storage.device.type == "cpu" and not host_too):
                continue
            seen.add(key)
            free = spare.get((nbytes, pin))
            host = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            host.untyped_storage().copy_(storage, non_blocking=non_blocking and pin)
            storage.resize_(0)
            slots.append(_Slot(storage, host, nbytes))
    if non_blocking:
        get_accelerator().synchronize()
    get_accelerator().empty_cache()  # the freed blocks back to the device, for the next owner
    return parked


def unpark(parked: Parked, *, non_blocking: bool = False) -> None:
    """Give every storage `park` emptied its bytes back (the host buffers stay in `parked`, for
    the next `park(..., reuse=parked)`). Waits for the copies before returning."""
    for slots in parked.slots.values():
        for s in slots:
            s.storage.resize_(s.nbytes)
            s.storage.copy_(s.host.untyped_storage(), non_blocking=non_blocking)
    if non_blocking:
        get_accelerator().synchronize()


def release_gathered(opt: Any) -> int:
    """Stage 3: release every gathered parameter no module or `GatheredParameters` holds and that
    is not persistent (DeepSpeed's `empty_partition_cache`); between passes there is normally none
    (a pass releases its leftovers when it ends). Then collect garbage and empty the allocator's
    cache. Returns the parameters released; 0 below stage 3."""
    shards = getattr(opt.strategy, "sharded_params", None)
    released: Sequence[Any] = ()
    if shards is not None:
        from minispeed.zero.stage3.params import FetchUnit, ParamState

        loose = [
            sp
            for sp in shards()
            if sp.state is ParamState.GATHERED and not sp.persistent and sp.holds == 0
        ]
        released = FetchUnit(-1, "empty_partition_cache", "", loose).reshard() if loose else ()
    gc.collect()
    get_accelerator().empty_cache()
    return len(released)
