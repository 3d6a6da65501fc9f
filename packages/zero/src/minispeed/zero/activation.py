"""Activation checkpointing: keep a block's inputs, drop its intermediates, recompute them in backward.

Plain autograd keeps every tensor a block's backward needs (its *activations*) from the forward
until the backward reaches that block. For a transformer layer of width C on a (B, T) batch those
are ~34·B·T·C bytes in half precision (plus 5·B·T²·heads for attention scores), far more than
the layer's input, 2·B·T·C bytes. `checkpoint` runs the block's forward as usual but
replaces every tensor autograd would save by a small index, keeps only the block's inputs, and
re-runs the block inside backward the first time autograd asks for one of those tensors.

Costs, for a block whose inputs are ``S_in`` bytes and whose forward saves ``A`` bytes:

- bytes kept between forward and backward: ``S_in`` instead of ``A`` (with ``offload_to_cpu``:
  0 device bytes and ``S_in`` pinned host bytes, plus one device-to-host copy in forward and one
  host-to-device copy in backward);
- compute: one extra forward of the block (for a transformer layer, forward ≈ 1/3 of
  forward+backward, so about +33%);
- at the block's backward its ``A`` bytes exist again, but for one block at a time.

The measured ratio for a small GPT is in ``benchmarks/zero_activation.py``.

Note [saved-tensor hooks, not a nested backward]
We implement checkpointing with ``torch.autograd.graph.saved_tensors_hooks`` (the graph of the
block is recorded once, in the forward; only its saved tensors are dropped and rebuilt), not by
wrapping the block in an ``autograd.Function`` that runs a second, nested backward. The nested
("reentrant") form delivers a parameter's gradient once per checkpointed block that uses it, so a
parameter shared by two blocks (tied weights) gets two gradient hooks per backward, which ZeRO's
reducers rightly refuse; it also breaks ``torch.autograd.grad``. With hooks, autograd sums all
contributions of a parameter before its hook fires, exactly as without checkpointing.

Note [RNG replay]
A block that draws random numbers (dropout) must draw the *same* numbers when it is recomputed,
or its gradient belongs to a different function than its output. We record the CPU and
accelerator generator states before the first forward, restore them around the recomputation,
and then put back the states the caller had, so the program's random stream continues exactly as
without checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from minispeed.core.accelerator import get_accelerator
from minispeed.core.config import ConfigError, join_path
from minispeed.core.sections import Section, Unsupported, ds_only, key

__all__ = ["ActivationCheckpointingConfig", "checkpoint"]


@dataclass(frozen=True)
class ActivationCheckpointingConfig(Section):
    """How `checkpoint` keeps a block's inputs (DeepSpeed section `activation_checkpointing`,
    which DeepSpeed's `deepspeed.checkpointing.configure` reads; minispeed's adapter of that
    path, `minispeed.engine.checkpointing`, reads it through this class)."""

    ds_path: ClassVar[str] = "activation_checkpointing"
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "contiguous_memory_optimization": ds_only(
            False,
            "it lays partitioned activations out in one buffer; minispeed's checkpointed inputs "
            "are ordinary tensors, so either value gives the same numbers and memory",
            also=(True,),  # Megatron-DeepSpeed's configs turn it on with partition_activations
        ),
        "profile": ds_only(False, "time checkpointed regions with minispeed.profiler"),
    }

    partition_activations: bool = key("partition_activations", False)
    """Split the kept inputs over the model-parallel ranks. minispeed keeps them whole, so true
    is accepted only without model parallelism (one rank: nothing to split, as in DeepSpeed) and
    refused over a tensor-parallel group (`check_model_parallel`)."""
    offload_to_cpu: bool = key("cpu_checkpointing", False)
    """Keep the checkpointed inputs in host memory (`checkpoint(..., offload_to_cpu=True)`)."""
    num_checkpoints: int | None = key("number_checkpoints", None)
    """Checkpoints per forward: DeepSpeed sizes its contiguous buffer with it; minispeed has no
    such buffer, so it is accepted and unused (null: every call)."""
    synchronize: bool = key("synchronize_checkpoint_boundary", False)
    """Synchronize the accelerator before and after each checkpointed forward."""

    def check_model_parallel(self, size: int, path: str | None = None) -> None:
        """Refuse `partition_activations` over `size` > 1 model-parallel ranks (a
        `ConfigError` naming the key)."""
        if self.partition_activations and size > 1:
            raise ConfigError(
                join_path(self.ds_path if path is None else path, "partition_activations"),
                f"true splits the checkpointed inputs over the {size} model-parallel ranks, "
                "which minispeed does not implement (it keeps them whole); set it to false",
            )


@dataclass
class _RngState:
    """The generator states one forward started from (see Note [RNG replay])."""

    cpu: torch.Tensor
    device: torch.Tensor | None  # None on a CPU-only accelerator
    device_index: int

    @staticmethod
    def capture() -> _RngState:
        acc = get_accelerator()
        if acc.name == "cpu":
            return _RngState(torch.get_rng_state(), None, 0)
        index = acc.current_device_index()
        module = torch.get_device_module(acc.name)
        return _RngState(torch.get_rng_state(), module.get_rng_state(index), index)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(get_accelerator().name).set_rng_state(
                self.device, self.device_index
            )


class _Frame:
    """One checkpointed call: its inputs, how to re-run it, and the tensors the re-run saved.

    Bytes held from forward to backward: the inputs (``S_in``, on the host with offload). During
    the block's backward, additionally the recomputed saved tensors, each dropped once autograd
    has taken it.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], offload_to_cpu: bool) -> None:
        self.fn = fn
        self.args = args  # tensors replaced below by what we keep
        self.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        tensors = [args[i] for i in self.positions]
        self.requires_grad = [t.requires_grad for t in tensors]
        self.devices = [t.device for t in tensors]
        self.versions = [t._version for t in tensors]
        self.inputs_ref = tensors  # only to check for in-place changes (version counters)
        if offload_to_cpu:
            # Page-locked host copies: the caller's device inputs can be freed after forward;
            # pinned memory makes the copy back a DMA transfer.
            acc = get_accelerator()
            self.kept = [acc.pin_memory(t.detach().to("cpu", copy=True)) for t in tensors]
            self.inputs_ref = []
        else:
            self.kept = [t.detach() for t in tensors]
        self.rng = _RngState.capture()
        device_type = get_accelerator().name
        self.device_type = device_type
        self.autocast = (
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        self.num_packed = 0
        self.saved: list[torch.Tensor | None] | None = None  # filled by the recomputation

    # -- forward: autograd hands us each tensor it wants to keep; we keep an index instead --------
    def pack(self, t: torch.Tensor) -> int:
        self.num_packed += 1
        return self.num_packed - 1

    # -- backward: the first request re-runs the block and collects what it saves ------------------
    def unpack(self, index: int) -> torch.Tensor:
        if self.saved is None or self.saved[index] is None:  # first use, or a retain_graph rerun
            self._recompute()
        t = self.saved[index]
        self.saved[index] = None  # autograd holds it now; free it when autograd does
        return t

    def _recompute(self) -> None:
        for t, v in zip(self.inputs_ref, self.versions):
            if t._version != v:
                raise RuntimeError(
                    "an input of zero.checkpoint was modified in place after the checkpointed call; "
                    "the recomputation would see the new values. Clone the input before changing it"
                )
        args = list(self.args)
        for pos, t, device, rg in zip(self.positions, self.kept, self.devices, self.requires_grad):
            # Same requires_grad as the original inputs, so autograd saves the same tensors.
            args[pos] = t.to(device, non_blocking=True).detach().requires_grad_(rg)
        saved: list[torch.Tensor | None] = []

        def collect(t: torch.Tensor) -> int:
            saved.append(t)
            return len(saved) - 1

        caller_rng = _RngState.capture()
        self.rng.restore()  # See Note [RNG replay]
        try:
            enabled, dtype = self.autocast
            with (
                torch.enable_grad(),
                torch.autocast(self.device_type, dtype=dtype, enabled=enabled),
                torch.autograd.graph.saved_tensors_hooks(collect, _never_unpacked),
            ):
                self.fn(*args)
        finally:
            caller_rng.restore()
        if len(saved) != self.num_packed:
            raise RuntimeError(
                f"zero.checkpoint: the recomputation saved {len(saved)} tensors for backward but "
                f"the forward saved {self.num_packed}; the checkpointed function must run the same "
                "operations every time it is called with the same inputs (no control flow on "
                "global state that changes between forward and backward)"
            )
        self.saved = saved


def _never_unpacked(index: int) -> torch.Tensor:
    raise AssertionError("the recomputation's own graph is discarded and never run backward")


def checkpoint(fn: Callable[..., Any], *args: Any, offload_to_cpu: bool = False) -> Any:
    """Run ``fn(*args)`` keeping only its inputs for backward; recompute the rest in backward.

    Returns what ``fn`` returns. Gradients equal those of ``fn(*args)`` without checkpointing
    (also with dropout, see Note [RNG replay], and for parameters shared between checkpointed
    blocks, see Note [saved-tensor hooks, not a nested backward]). ``args`` may mix tensors and
    other values; the tensors are kept (detached) until backward.

    ``offload_to_cpu=True`` keeps the saved inputs in pinned host memory instead of on the device
    (on a CPU-only machine the inputs already live in host memory, so this only adds a copy).

    Bytes kept per call until backward: the inputs' bytes. Extra compute: one forward of ``fn``.
    ``fn`` must run the same operations when called again with the same inputs, and its inputs
    must not be modified in place before backward (an error says so if they are). Under
    ``torch.no_grad()`` it simply calls ``fn``.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    frame = _Frame(fn, args, offload_to_cpu)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        out = fn(*args)
    frame.args = tuple(None if isinstance(a, torch.Tensor) else a for a in args)
    return out
