"""Peak heap bytes per rank of a fresh contender: glibc's `mallinfo2` sampled after every
tensor op by a `TorchDispatchMode` (see `zero_vs_torch.py`'s docstring for why not the profiler)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from zerobench.contenders import build
from zerobench.rounds import global_batches

#: The phases of a step whose peaks are reported separately.
PHASES = ("forward", "backward", "optimizer")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_reader() -> Callable[[], int]:
    """A function returning the bytes malloc has handed out in this process, all threads."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        raise SystemExit(
            "the memory measurement needs glibc >= 2.33 (mallinfo2); run the benchmark on Linux"
        ) from None

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd  # arena chunks in use + mmapped blocks

    return in_use


class HeapPeak(TorchDispatchMode):
    """Samples the process's heap after every tensor op; keeps the largest value per phase.

    Every torch op, forward or backward, including the collectives, passes through the dispatcher,
    so a sample follows each allocation an op returns. malloc's counters are process-wide, so
    buffers freed by gloo's threads are seen as freed (torch.profiler's memory events are
    per-thread and miss those frees).
    """

    def __init__(self, in_use: Callable[[], int], gathered: Callable[[], int]) -> None:
        super().__init__()
        self.in_use = in_use
        self.gathered = gathered
        self.phase = "forward"
        self.peaks: dict[str, int] = {}
        # Per phase, at its peak: (the op just run, bytes of whole parameters registered then).
        self.at_peak: dict[str, tuple[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        now = self.in_use()
        if now > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = now
            self.at_peak[self.phase] = (func.__name__, self.gathered())
        return out


def gathered_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages behind the model's parameters that are whole right now: a stage-3
    parameter while gathered (released ones have 0-element ``.data``; persistent ones count), an
    FSDP2 block while unsharded (its parameters are then plain tensors sharing one all-gather
    buffer, counted once); not sharded DTensors, nor a gather in flight that no module holds yet."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for p in model.parameters():
        if isinstance(p, DTensor) or p.numel() == 0:
            continue
        st = p.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def peak_memory(args, name: str, dataset, rank: int, world: int) -> dict[str, int]:
    """Peak bytes a fresh `name` adds to this process's heap over `--memory-steps` steps."""
    in_use = _heap_reader()
    batches = global_batches(args, dataset, rank, world, args.memory_steps)
    gc.collect()
    dist.barrier()
    base = in_use()  # everything before the contender exists
    trainer = build(name, args, dataset.tokenizer.vocab_size)
    gc.collect()
    built = in_use() - base
    peak = built
    model = trainer.keep[0] if isinstance(trainer.keep, tuple) else None
    gathered = (lambda: gathered_bytes(model)) if isinstance(model, torch.nn.Module) else lambda: 0
    with HeapPeak(in_use, gathered) as sampler:
        for x, y in batches:
            sampler.peaks.clear()  # after the loop: the last step's peaks, phase by phase
            sampler.phase = "forward"
            loss = trainer.forward(x, y)
            sampler.phase = "backward"
            trainer.backward(loss)
            sampler.phase = "optimizer"
            trainer.optimizer_step()
            peak = max(peak, *(v - base for v in sampler.peaks.values()))
    out = {"peak_bytes": peak, "before_first_step_bytes": built}
    for phase in PHASES:
        out[f"last_step_{phase}_peak_bytes"] = sampler.peaks.get(phase, base) - base
        op, whole = sampler.at_peak.get(phase, ("", 0))
        out[f"last_step_{phase}_peak_op"] = op
        out[f"last_step_{phase}_peak_whole_param_bytes"] = whole
    del trainer, loss
    gc.collect()
    out["end_bytes"] = in_use() - base  # what the contender failed to give back (should be ~0)
    return out
