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
- at the block's backward its ``A`` bytes exist again, but for one block at a time;
- with ``partition_group`` (n model-parallel ranks whose inputs are equal, as Megatron's
  replicated activations are): ``ceil(numel / n)`` elements of each floating input kept per rank
  instead of ``numel``, and one all-gather of the input in backward (sends ``(n-1)/n · S_in`` per
  rank).

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
accelerator generator states and the tracked ones (`minispeed.core.rng`: dropout inside
`rng_tracker().fork()`) before the first forward, restore them around the recomputation, and
then put back the states the caller had, so every random stream continues exactly as without
checkpointing (See Note [replaying every stream] in `minispeed.core.rng`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import minispeed.comm as comm
from minispeed.core.accelerator import get_accelerator
from minispeed.core.rng import RngSnapshot
from minispeed.core.sections import Section, Unsupported, ds_only, key

__all__ = ["ActivationCheckpointingConfig", "ReentrantCheckpoint", "checkpoint"]


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
    }

    partition_activations: bool = key("partition_activations", False)
    """Keep each rank's 1/n slice of the checkpointed inputs over the n model-parallel ranks
    and all-gather them in backward (`checkpoint(..., partition_group=...)`); with one
    model-parallel rank there is nothing to split and the inputs are kept whole."""
    offload_to_cpu: bool = key("cpu_checkpointing", False)
    """Keep the checkpointed inputs in host memory (`checkpoint(..., offload_to_cpu=True)`)."""
    num_checkpoints: int | None = key("number_checkpoints", None)
    """Checkpoints per forward: DeepSpeed sizes its contiguous buffer with it; minispeed has no
    such buffer, so it is accepted and unused (null: every call)."""
    synchronize: bool = key("synchronize_checkpoint_boundary", False)
    """Synchronize the accelerator before and after each checkpointed forward."""
    profile: bool = key("profile", False)
    """Log the time of each checkpointed forward and of its recomputation in backward (rank 0;
    `deepspeed.checkpointing`'s option: the accelerator is synchronized around each, which
    serializes the device's work)."""


class _KeptInputs:
    """The tensors among a call's arguments as kept until backward: whole (sharing the caller's
    storage), on the host (``offload_to_cpu``: pinned copies), or this rank's slice (over a
    ``partition_group`` of n ranks that hold the same inputs: ``ceil(numel / n)`` elements of
    each floating tensor, on the host too with offload). `restore()` gives back whole tensors on
    their devices (one all-gather per partitioned tensor, collective over the group)."""

    def __init__(
        self, tensors: list[torch.Tensor], offload_to_cpu: bool, partition_group: Any
    ) -> None:
        self.shapes = [t.shape for t in tensors]
        self.devices = [t.device for t in tensors]
        self.requires_grad = [t.requires_grad for t in tensors]
        self.versions = [t._version for t in tensors]
        self.group = partition_group
        self.size = 1 if partition_group is None else comm.get_world_size(partition_group)
        self.sliced = [self.size > 1 and t.is_floating_point() for t in tensors]
        # Whole device tensors share the caller's storage, so holding them costs nothing and lets
        # `restore` see an in-place change (version counter); copies and slices cannot.
        self.refs = [] if offload_to_cpu or self.size > 1 else tensors
        self.kept = [self._keep(t, cut, offload_to_cpu) for t, cut in zip(tensors, self.sliced)]

    def _keep(self, t: torch.Tensor, sliced: bool, offload_to_cpu: bool) -> torch.Tensor:
        t = t.detach()
        if sliced:
            chunk = -(-t.numel() // self.size)  # ceil: the last slice is padded with zeros
            flat = torch.nn.functional.pad(t.reshape(-1), (0, chunk * self.size - t.numel()))
            rank = comm.get_rank(self.group)
            t = flat[rank * chunk : (rank + 1) * chunk].clone()
        if offload_to_cpu:
            # Page-locked host copies: the device inputs can be freed after forward; pinned
            # memory makes the copy back a DMA transfer.
            return get_accelerator().pin_memory(t.to("cpu", copy=True))
        return t

    def restore(self) -> list[torch.Tensor]:
        """Whole tensors on their devices with the inputs' `requires_grad` (so autograd saves
        the same tensors as in forward), detached from the caller's graph."""
        for t, v in zip(self.refs, self.versions):
            if t._version != v:
                raise RuntimeError(
                    "an input of zero.checkpoint was modified in place after the checkpointed call; "
                    "the recomputation would see the new values. Clone the input before changing it"
                )
        out = []
        for t, shape, device, rg, sliced in zip(
            self.kept, self.shapes, self.devices, self.requires_grad, self.sliced
        ):
            t = t.to(device, non_blocking=True)
            if sliced:
                full = torch.empty(t.numel() * self.size, dtype=t.dtype, device=device)
                comm.all_gather_into_tensor(full, t, group=self.group)
                t = full[: shape.numel()].view(shape)
            out.append(t.detach().requires_grad_(rg))
        return out


class _Replay:
    """What re-running a checkpointed call needs: the function, its non-tensor arguments, the
    kept inputs, the random streams and the autocast state it started from."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        offload_to_cpu: bool,
        partition_group: Any,
    ) -> None:
        self.fn = fn
        self.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.args = tuple(None if isinstance(a, torch.Tensor) else a for a in args)
        self.inputs = _KeptInputs(
            [args[i] for i in self.positions], offload_to_cpu, partition_group
        )
        self.rng = RngSnapshot.capture()
        self.device_type = get_accelerator().name
        self.autocast = (
            torch.is_autocast_enabled(self.device_type),
            torch.get_autocast_dtype(self.device_type),
        )

    def rerun(self, *contexts: Any) -> tuple[Any, list[Any]]:
        """``fn``'s outputs again and the arguments it ran on, with grad enabled, the forward's
        random streams (See Note [RNG replay]) and autocast, inside ``contexts``."""
        args = list(self.args)
        for pos, t in zip(self.positions, self.inputs.restore()):
            args[pos] = t
        caller_rng = RngSnapshot.capture()
        self.rng.restore()
        try:
            enabled, dtype = self.autocast
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autocast(self.device_type, dtype=dtype, enabled=enabled))
                for context in contexts:
                    stack.enter_context(context)
                return self.fn(*args), args
        finally:
            caller_rng.restore()


class _Frame:
    """One checkpointed call (saved-tensor hooks): its replay and the tensors the re-run saved.

    Bytes held from forward to backward: the kept inputs (``S_in``, on the host with offload,
    ``S_in / n`` partitioned). During the block's backward, additionally the recomputed saved
    tensors, each dropped once autograd has taken it.
    """

    def __init__(self, replay: _Replay) -> None:
        self.replay = replay
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
        saved: list[torch.Tensor | None] = []

        def collect(t: torch.Tensor) -> int:
            saved.append(t)
            return len(saved) - 1

        self.replay.rerun(torch.autograd.graph.saved_tensors_hooks(collect, _never_unpacked))
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


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    offload_to_cpu: bool = False,
    partition_group: Any = None,
) -> Any:
    """Run ``fn(*args)`` keeping only its inputs for backward; recompute the rest in backward.

    Returns what ``fn`` returns. Gradients equal those of ``fn(*args)`` without checkpointing
    (also with dropout, inside `minispeed.core.rng.rng_tracker().fork()` too, see Note [RNG
    replay], and for parameters shared between checkpointed blocks, see Note [saved-tensor hooks,
    not a nested backward]). ``args`` may mix tensors and other values; the tensors are kept
    (detached) until backward.

    ``offload_to_cpu=True`` keeps the saved inputs in pinned host memory instead of on the device
    (on a CPU-only machine the inputs already live in host memory, so this only adds a copy).
    ``partition_group`` (a `minispeed.comm` group of n ranks whose inputs are equal, such as a
    tensor-parallel group's replicated activations) keeps each rank's ``ceil(numel / n)``
    elements of every floating input and all-gathers them in backward (collective: every rank
    of the group must run the same backward).

    Bytes kept per call until backward: the inputs' bytes (or 1/n of the floating ones). Extra
    compute: one forward of ``fn``. ``fn`` must run the same operations when called again with
    the same inputs, and its inputs must not be modified in place before backward (an error says
    so if they are). Under ``torch.no_grad()`` it simply calls ``fn``.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    frame = _Frame(_Replay(fn, args, offload_to_cpu, partition_group))
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args)


class ReentrantCheckpoint(torch.autograd.Function):
    """The reentrant form (``torch.utils.checkpoint(use_reentrant=True)``, DeepSpeed's
    `CheckpointFunction`): one autograd node whose forward runs ``fn`` without grad and whose
    backward re-runs it with grad and calls a nested ``torch.autograd.backward``.

    ``ReentrantCheckpoint.apply(fn, all_outputs, keep, *args)``: ``keep`` is
    ``(offload_to_cpu, partition_group)``; ``all_outputs`` (a list) receives every output of
    ``fn``, non-tensors included (an autograd function returns tensors only). Kept and recomputed
    as `checkpoint` (same bytes, same RNG replay). Its limits are why `checkpoint` is the
    saved-tensor-hooks form (Note [saved-tensor hooks, not a nested backward]): parameters get
    no gradient when no tensor input requires grad, ``torch.autograd.grad`` is refused, and a
    parameter shared by two checkpointed blocks gets one gradient hook call per block.
    """

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], all_outputs: list, keep: Any, *args: Any) -> Any:
        offload_to_cpu, partition_group = keep
        ctx.replay = _Replay(fn, args, offload_to_cpu, partition_group)
        with torch.no_grad():
            outputs = fn(*args)
        single = isinstance(outputs, torch.Tensor)
        listed = [outputs] if single else list(outputs)
        all_outputs += listed
        tensors = [o for o in listed if isinstance(o, torch.Tensor)]
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return outputs if single else tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "the reentrant checkpoint cannot run under torch.autograd.grad(); call "
                ".backward(), or use minispeed.zero.checkpoint (the non-reentrant form)"
            )
        outputs, args = ctx.replay.rerun()
        ctx.replay = None  # free the kept inputs
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(tensors, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[a.grad if isinstance(a, torch.Tensor) else None for a in args])
