"""Random-number generator states: the accelerator's generator, named states kept beside it, and
a snapshot of all of them that activation checkpointing replays.

Tensor parallelism needs two random streams on every rank (Megatron-LM's design, which
DeepSpeed's `deepspeed.checkpointing` keeps):

- the **default** generator, seeded alike on the ranks of a tensor-parallel group, for dropout on
  activations every rank of the group holds whole (they must drop the same elements);
- a **tracked** state per name (`RngTracker`), seeded differently per tensor-parallel rank, for
  dropout on the rank's own slice (`with rng_tracker().fork(): ...`): each slice gets its own mask.

`fork(name)` swaps the named state into the accelerator's generator for the block and swaps it
back out (advanced) at the end, so both streams advance only where they are drawn from. The
accelerator's generator is the device's (CUDA's per-device philox state, 16 bytes) or, on a
CPU-only accelerator, the CPU generator (mt19937, 5,056 bytes): the same object DeepSpeed's CPU
accelerator forks.

Note [replaying every stream]
A checkpointed block re-run in backward must draw the same numbers as in its forward, from every
stream it draws from: the CPU generator, the accelerator's, and each tracked state (dropout
inside `fork()`). `RngSnapshot.capture()` records all of them before the forward and
`restore()` puts them back around the recomputation, after which the caller's own states (a
second snapshot) are restored, so every stream continues as without checkpointing. Costs per
snapshot: one state per generator (5,056 B on the CPU, 16 B per CUDA state) copied once, and a
shallow copy of the tracker's dictionary (the states themselves are never changed in place:
`fork` stores a new tensor, so sharing them is safe).

See docs/architecture.md (core: cross-cutting primitives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from minispeed.core.accelerator import get_accelerator

__all__ = [
    "MODEL_PARALLEL_RNG",
    "RngSnapshot",
    "RngStateError",
    "RngTracker",
    "device_manual_seed",
    "device_rng_state",
    "rng_tracker",
    "set_device_rng_state",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracked state `fork()` uses by default: the per-tensor-parallel-rank stream (Megatron's and
DeepSpeed's name for it)."""


class RngStateError(Exception):
    """A tracked state asked for wrongly: an unknown name, a name or seed added twice.
    (DeepSpeed raises a bare `Exception` here; this subclass is caught wherever that is.)"""


def _device_module() -> object | None:
    """`torch.cuda` (or the accelerator's module), None on a CPU-only accelerator."""
    acc = get_accelerator()
    return None if acc.name == "cpu" else torch.get_device_module(acc.name)


def device_rng_state() -> torch.Tensor:
    """The accelerator's generator's state (the current device's; the CPU generator's on a
    CPU-only accelerator): a new tensor, never changed afterwards."""
    module = _device_module()
    if module is None:
        return torch.get_rng_state()
    return module.get_rng_state(get_accelerator().current_device_index())


def set_device_rng_state(state: torch.Tensor, index: int | None = None) -> None:
    """Put `state` (from `device_rng_state`) into the accelerator's generator (device `index`;
    None: the current one)."""
    module = _device_module()
    if module is None:
        torch.set_rng_state(state)
    else:
        module.set_rng_state(
            state, get_accelerator().current_device_index() if index is None else index
        )


def device_manual_seed(seed: int) -> None:
    """Seed the accelerator's generator (on a CPU-only accelerator: the CPU generator, as
    `torch.manual_seed`; on a device: the current device's only)."""
    module = _device_module()
    if module is None:
        torch.manual_seed(seed)
    else:
        module.manual_seed(seed)


class RngTracker:
    """Named generator states kept beside the accelerator's generator (see the module docstring).

    Bytes kept: one generator state per name (16 B per CUDA state, 5,056 B on the CPU).
    """

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()  # bookkeeping only: no seed may serve two names

    def reset(self) -> None:
        """Forget every state and seed."""
        self._states = {}
        self._seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A new dictionary of the current states (shallow: the state tensors are shared, safe
        because a state is replaced, never changed in place)."""
        return dict(self._states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Use `states` (from `get_states`) from now on; a copy is kept, so a later `fork` does
        not change the caller's dictionary."""
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new state `name`: the accelerator's generator as seeded with `seed`. The
        generator itself is left as it was."""
        if seed in self._seeds:
            raise RngStateError(
                f"seed {seed} already exists: another tracked state was added with it, and two "
                "states from one seed draw the same numbers; pick a different seed (or call "
                "reset() first to start over)"
            )
        if name in self._states:
            raise RngStateError(
                f"cuda rng state {name!r} already exists; use another name, or call reset() "
                "first to replace every state"
            )
        self._seeds.add(seed)
        before = device_rng_state()
        device_manual_seed(seed)
        self._states[name] = device_rng_state()
        set_device_rng_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the state `name` inside the block; on exit store its advanced state and
        give the accelerator's generator back its own. Cost: two state copies each way."""
        if name not in self._states:
            known = ", ".join(map(repr, self._states)) or "none"
            raise RngStateError(
                f"cuda rng state {name!r} is not added (tracked: {known}); call add({name!r}, "
                "seed) first, or model_parallel_cuda_manual_seed(seed), which adds "
                f"{MODEL_PARALLEL_RNG!r}"
            )
        outside = device_rng_state()
        set_device_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = device_rng_state()
            set_device_rng_state(outside)


_TRACKER = RngTracker()


def rng_tracker() -> RngTracker:
    """The process's tracker: the one `RngSnapshot` replays and tensor-parallel seeding fills."""
    return _TRACKER


@dataclass
class RngSnapshot:
    """Every random stream's state at one moment (see Note [replaying every stream])."""

    cpu: torch.Tensor
    device: torch.Tensor | None  # None on a CPU-only accelerator (the CPU generator is it)
    device_index: int = 0  # whose generator `device` is (backward may run on another thread)
    tracked: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def capture() -> RngSnapshot:
        """The states now: the CPU generator, the current device's, the tracker's."""
        if _device_module() is None:
            return RngSnapshot(torch.get_rng_state(), None, 0, _TRACKER.get_states())
        index = get_accelerator().current_device_index()
        return RngSnapshot(torch.get_rng_state(), device_rng_state(), index, _TRACKER.get_states())

    def restore(self) -> None:
        """Put every stream back to this snapshot (the snapshot stays usable again)."""
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            set_device_rng_state(self.device, self.device_index)
        _TRACKER.set_states(self.tracked)
