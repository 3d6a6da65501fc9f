"""Messages between pipeline stages: tuples of tensors over `minispeed.comm` send/recv.

A message is a tuple of tensors (activations forward, gradients backward). The receiver must
post buffers of the right shape and dtype before the data arrives, so shapes are negotiated on
the first micro-batch of each (peer, kind, chunk) link and cached; later messages carry only a
header. Everything goes through `comm.isend` / `comm.recv`, so the comms logger sees each
header and each tensor (`send` records; bytes per step in `costs.p2p_bytes_sent_per_step`).

Note [a header before every message]
    Every message starts with a 2-element int64 header `[code, meta_len]` (H = 16 bytes):
    `OK` (data follows in the negotiated layout), `NEGOTIATE` (a layout of meta_len int64s
    follows, then the data), `MISMATCH` (a layout follows and NO data: the sender's tensors do
    not match the layout it negotiated; both sides raise `PipelineShapeError`), `ABORT` (the
    sender failed; the receiver raises `PipelineAbortedError` and passes the abort on). Without
    it a receiver of a wrongly shaped message would post wrongly sized buffers and hang or read
    garbage; with it every rank raises a clear error at the first bad micro-batch. Cost: one
    extra 16-byte message per message (one more latency on gloo, ~tens of µs).

Layout encoding (int64s): `[n, (dtype, requires_grad, ndim, *shape) × n]`.

Sends are asynchronous (the schedule checker relies on it: a send never waits for its
receiver); their handles and tensors are kept until `wait_sends()`, called at the end of a batch.
Receives block: the time spent there is the "wait" of the timeline.

`comm` has point-to-point calls but no tuple or shape protocol, so this file builds both over
comm's public `isend` / `recv`.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

import minispeed.comm as comm

__all__ = ["Link", "PipelineAbortedError", "PipelineShapeError", "StageMessenger"]

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


class Code(enum.IntEnum):
    """Header codes, see Note [a header before every message]."""

    OK = 0
    NEGOTIATE = 1
    MISMATCH = 2
    ABORT = 3


class PipelineShapeError(RuntimeError):
    """A stage sent tensors whose shapes or dtypes differ from the first micro-batch's."""


class PipelineAbortedError(RuntimeError):
    """Another pipeline stage failed; this one stopped instead of waiting forever."""


Link = tuple[int, str, int]
"""(peer pipeline rank, "act" | "act_eval" | "grad", chunk of the receiving side): one negotiated
layout (eval's activations do not require grad, so they negotiate their own)."""


def encode_layout(tensors: tuple[torch.Tensor, ...]) -> list[int]:
    """The int64 layout of a tuple of tensors (see module docstring)."""
    out = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline messages cannot carry dtype {t.dtype}; use one of {_DTYPES}")
        out += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    return out


def describe_layout(layout: list[int]) -> str:
    """Human-readable layout, e.g. `(float32[4, 8] grad, int64[4])`."""
    parts, i = [], 1
    for _ in range(layout[0]):
        dtype, rg, ndim = layout[i : i + 3]
        shape = layout[i + 3 : i + 3 + ndim]
        parts.append(
            f"{str(_DTYPES[dtype]).removeprefix('torch.')}{list(shape)}{' grad' if rg else ''}"
        )
        i += 3 + ndim
    return "(" + ", ".join(parts) + ")"


def _empty_from_layout(layout: list[int], device: torch.device) -> list[tuple[torch.Tensor, bool]]:
    out, i = [], 1
    for _ in range(layout[0]):
        dtype, rg, ndim = layout[i : i + 3]
        shape = layout[i + 3 : i + 3 + ndim]
        out.append((torch.empty(shape, dtype=_DTYPES[dtype], device=device), bool(rg)))
        i += 3 + ndim
    return out


class StageMessenger:
    """One pipeline rank's sends and receives to its neighbours, with negotiated layouts.

        `pipe_ranks[i]` is the global rank of pipeline stage i in this rank's pipeline; `group` the
    process group the messages travel in (the grid's "pipe" group; `None`: the world).
    """

    def __init__(
        self, stage: int, pipe_ranks: list[int], device: torch.device, group: Any = None
    ) -> None:
        self.stage, self.pipe_ranks, self.device = stage, pipe_ranks, device
        # Note: messages travel in the pipeline's own process group (the grid's "pipe" group),
        # not the world: a failed batch may leave messages unread, and they must not reach the
        # executor of a new grid built to carry on.
        self.group = group
        self._sent_layouts: dict[Link, list[int]] = {}
        self._recv_layouts: dict[Link, list[int]] = {}
        self._pending: list[tuple[Any, tuple]] = []

    def _isend(self, t: torch.Tensor, peer: int) -> None:
        work = comm.isend(t, self.pipe_ranks[peer], group=self.group)
        self._pending.append((work, (t,)))

    def _header(self, code: Code, meta_len: int = 0) -> torch.Tensor:
        return torch.tensor([int(code), meta_len], dtype=torch.int64, device=self.device)

    def send(self, tensors: tuple[torch.Tensor, ...], peer: int, kind: str, chunk: int) -> None:
        """Send `tensors` (detached) to pipeline stage `peer`; `chunk` is the RECEIVER's chunk."""
        link = (peer, kind, chunk)
        layout = encode_layout(tensors)
        known = self._sent_layouts.get(link)
        if known is None:
            self._sent_layouts[link] = layout
            self._isend(self._header(Code.NEGOTIATE, len(layout)), peer)
            self._isend(torch.tensor(layout, dtype=torch.int64, device=self.device), peer)
        elif layout != known:
            self._isend(self._header(Code.MISMATCH, len(layout)), peer)
            self._isend(torch.tensor(layout, dtype=torch.int64, device=self.device), peer)
            raise _from(
                peer, PipelineShapeError(_mismatch_text(self.stage, peer, kind, known, layout))
            )
        else:
            self._isend(self._header(Code.OK), peer)
        for t in tensors:
            self._isend(t.detach().contiguous(), peer)

    def forget_layouts(self) -> None:
        """Negotiate every link's layout again at its next message (the activations' shapes
        change, e.g. a longer sequence: DeepSpeed's `reset_activation_shape`). Only the sender
        keeps a layout to check against; a receiver takes a new one whenever it is sent."""
        self._sent_layouts.clear()

    def recv(self, peer: int, kind: str, chunk: int) -> tuple[torch.Tensor, ...]:
        """Receive the next message from pipeline stage `peer` (blocking); tensors that required
        grad on the sender require grad here (they are leaves of this stage's graph)."""
        link = (peer, kind, chunk)
        src = self.pipe_ranks[peer]
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        comm.recv(header, src, group=self.group)
        code, meta_len = Code(int(header[0])), int(header[1])
        if code is Code.ABORT:
            raise _from(
                peer,
                PipelineAbortedError(
                    f"pipeline stage {peer} failed and aborted the step (see its error); stage "
                    f"{self.stage} stopped instead of waiting"
                ),
            )
        if code in (Code.NEGOTIATE, Code.MISMATCH):
            layout_t = torch.empty(meta_len, dtype=torch.int64, device=self.device)
            comm.recv(layout_t, src, group=self.group)
            layout = layout_t.tolist()
            if code is Code.MISMATCH:
                raise _from(
                    peer,
                    PipelineShapeError(
                        _mismatch_text(peer, self.stage, kind, self._recv_layouts[link], layout)
                    ),
                )
            self._recv_layouts[link] = layout
        buffers = _empty_from_layout(self._recv_layouts[link], self.device)
        out = []
        for t, rg in buffers:
            comm.recv(t, src, group=self.group)
            out.append(t.requires_grad_(rg) if rg else t)
        return tuple(out)

    def abort(self, peers: set[int], deliver_s: float = 0.0) -> None:
        """Tell `peers` (pipeline stages) that this one failed, without waiting for them.

        The abort headers are posted and kept with the other pending sends. A gloo send completes
        only once its receiver posts the matching receive, and a peer that has finished its
        program never will, so by default nothing waits here: the executor's end-of-batch
        agreement (status.py) cannot complete before every peer blocked in a receive has read
        its ABORT, which is all the delivery that matters. `deliver_s > 0` polls that long for
        the headers to leave, for a caller about to tear down without an agreement (an
        interrupt): a process group destroyed at once could drop a send still queued.
        """
        works = []
        for peer in sorted(peers):
            try:
                header = self._header(Code.ABORT)
                work = comm.isend(header, self.pipe_ranks[peer], group=self.group)
            except Exception:
                continue
            works.append(work)
            self._pending.append((work, (header,)))
        deadline = time.monotonic() + deliver_s
        while works and time.monotonic() < deadline:
            try:
                works = [w for w in works if not w.is_completed()]
            except Exception:
                break
            time.sleep(0.005)

    def drop_sends(self) -> None:
        """Forget the pending sends without waiting (after a failed batch: a receiver that
        stopped early will never match them)."""
        self._pending.clear()

    def wait_sends(self) -> None:
        """Wait for every send posted so far (their tensors may be freed after)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def _from(peer: int, exc: RuntimeError) -> RuntimeError:
    """Tag `exc` with the stage that already knows of the failure (no abort message owed to it)."""
    exc.origin = peer  # type: ignore[attr-defined]
    return exc


def _mismatch_text(src: int, dst: int, kind: str, known: list[int], got: list[int]) -> str:
    what = "activations" if kind.startswith("act") else "gradients"
    return (
        f"pipeline stage {src} sends {what} to stage {dst} shaped {describe_layout(got)}, but the "
        f"first micro-batch negotiated {describe_layout(known)}; every micro-batch must have the "
        "same shapes and dtypes (pad or bucket your batches to one sequence length, and keep the "
        "batch size divisible by the micro-batch count)"
    )
