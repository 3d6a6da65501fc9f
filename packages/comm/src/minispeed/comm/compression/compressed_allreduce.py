"""Compressed all-reduce (average): 1-bit with worker and server error feedback, and top-k.

Both go through `minispeed.comm` collectives on uint8 messages, so the comms logger counts
exactly the compressed bytes (formulas in `wire`). Every rank ends with the *same* result.

**1-bit all-reduce** (the scheme of 1-bit Adam), for N elements on n ranks, chunk
`C = 8 ceil(N / 8n)`; rank r is the "server" of chunk r:

```text
worker   c_i = pad(x_i) + e_i              (n C,)  e_i = worker residual
         p_i = onebit(c_i), one scale/chunk         e_i <- c_i - D(p_i)
         all_to_all: rank r gets chunk r of every p_i   -> n messages of 4 + C/8 bytes
server   a_r = (1/n) Σ_i D(p_i)[chunk r]    (C,)
         s_r = onebit(a_r + f_r)                     f_r <- a_r + f_r - D(s_r)  (server residual)
         all_gather: every rank gets every s_r      -> n messages of 4 + C/8 bytes
result   y = concat_r D(s_r)[:N]
```

Error bound of one call (derivation). Write m = (1/n) Σ_i x_i for the exact average, Q for the
1-bit compressor (`||v - Q(v)|| <= q ||v||`, `q = sqrt(1 - 1/C)`, `onebit`; also
`||Q(v)|| <= ||v||`). With zero residuals:

```text
||y - m||  <=  ||Q(a) - a|| + ||a - m||
           <=  q ||a||  +  (1/n) Σ_i ||Q(x_i) - x_i||
           <=  q (1/n) Σ_i ||x_i||  +  q (1/n) Σ_i ||x_i||   =  2 q · mean_i ||x_i||
```

This single-call error is large (1 bit per element); what makes the scheme usable is that it
does not accumulate. Summing the two feedback loops over steps (Note [why error feedback bounds
the accumulated error]) gives the exact identity:

```text
Σ_{t<=T} y_t  =  Σ_{t<=T} m_t  -  (1/n) Σ_i e_i(T)  -  f(T)
```

so the accumulated result is off by the current residuals only, which stay bounded.

**Top-k all-reduce**: each rank sends its k largest compensated elements (values + indices) in
one all_gather; every rank adds the n sparse vectors and divides by n. The result is exact on the
sent elements, so one call errs by `||y - m|| <= sqrt(1 - k/N) · mean_i ||x_i||` and the
accumulated error is `(1/n) ||Σ_i e_i(T)||`.
"""

from __future__ import annotations

from typing import Any

import torch

from minispeed.comm import all_to_all, collectives, validation
from minispeed.comm.call import Call
from minispeed.comm.compression import ops, wire
from minispeed.comm.compression.compressor import ScaledCodes
from minispeed.comm.compression.error_feedback import ErrorFeedback
from minispeed.comm.compression.onebit import OnebitCompressor
from minispeed.comm.compression.topk import TopkCompressor, TopkPacked
from minispeed.comm.validation import CommInputError

__all__ = ["OnebitAllReduce", "TopkAllReduce"]


# What a compressed all-reduce's checks raise; See Note [errors reach every rank] in handshake.py
_REJECTS = (ValueError, TypeError)


def _check_tensor(tensor: torch.Tensor, numel: int | None, what: str) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{what} averages floating-point tensors, got {tensor.dtype}")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(
            f"this {what} was set up for tensors of {numel} elements (its residuals have that "
            f"size) but got {tensor.numel()}; use one {what} per tensor, or call reset()"
        )


class OnebitAllReduce:
    """Average a tensor over `group` in place, sending ~1 bit per element (module docstring).

    Stateful: holds the worker residual (`4 n C` bytes, about the tensor's fp32 size) and the
    server residual (`4 C` bytes), so use one instance per tensor (a flat buffer of all
    momenta in `OnebitAdam`). Bytes sent per call per rank:
    `2 (n-1) (4 + C/8)` (`wire.onebit_allreduce_calls`).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.numel: int | None = None
        self.chunk_numel: int | None = None
        self.worker_feedback: ErrorFeedback | None = None
        self.server_feedback: ErrorFeedback | None = None
        self._padded: torch.Tensor | None = None  # fp32 (n C,): the input, zero-padded

    def reset(self) -> None:
        """Forget both residuals (and the tensor size); the next call starts afresh."""
        self.numel = self.chunk_numel = None
        self.worker_feedback = self.server_feedback = None
        self._padded = None

    def state_dict(self) -> dict[str, Any]:
        """The residuals as host copies (`None` before the first call), with the tensor size and
        chunk they belong to: `load_state_dict` restores them on the same rank and group size."""
        worker, server = self.worker_feedback, self.server_feedback
        return {
            "numel": self.numel,
            "chunk_numel": self.chunk_numel,
            "worker": None if worker is None or worker.residual is None else worker.residual.cpu(),
            "server": None if server is None or server.residual is None else server.residual.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore `state_dict`'s residuals (local) onto `device` (that of the tensors to come;
        default: the CPU); a state without any starts afresh."""
        self.reset()
        if state.get("numel") is None:
            return
        self.numel, self.chunk_numel = int(state["numel"]), int(state["chunk_numel"])
        compressor = OnebitCompressor(chunk_numel=self.chunk_numel)
        self.worker_feedback = ErrorFeedback(compressor)
        self.server_feedback = ErrorFeedback(compressor)
        for feedback, key in ((self.worker_feedback, "worker"), (self.server_feedback, "server")):
            saved = state[key]
            feedback.restore(None if saved is None else saved.to(device or "cpu"))

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace `tensor` by the compressed average over the group; returns it."""
        call = Call(type(self).__name__, self.group, rejects=_REJECTS)
        with call:
            _check_tensor(tensor, self.numel, call.op)
        call.agree(lambda: {"numel": tensor.numel()})
        n = call.n
        if self.numel is None:
            self.numel = tensor.numel()
            self.chunk_numel = wire.onebit_chunk_numel(tensor.numel(), n)
            compressor = OnebitCompressor(chunk_numel=self.chunk_numel)
            self.worker_feedback = ErrorFeedback(compressor)
            self.server_feedback = ErrorFeedback(compressor)
        assert self.worker_feedback is not None and self.server_feedback is not None
        chunk = self.chunk_numel
        if tensor.numel() == 0:
            return tensor

        # Worker: compress the padded, compensated tensor; chunk j goes to rank j.
        if self._padded is None or self._padded.device != tensor.device:
            self._padded = torch.zeros(n * chunk, dtype=torch.float32, device=tensor.device)
        self._padded[: tensor.numel()] = tensor.detach().reshape(-1)  # the tail stays 0
        to_servers = self.worker_feedback.compress(self._padded).to_rows(n)  # (n, 4 + C/8) uint8
        from_workers = torch.empty_like(to_servers)
        all_to_all.all_to_all_single(from_workers, to_servers, group=self.group)

        # Server: row i is worker i's copy of my chunk; average, compress once more.
        received = ScaledCodes.from_rows(from_workers, chunk, 1, chunk)
        mean_chunk = self.server_feedback.compressor.decompress(received).view(n, chunk).mean(0)
        reply = self.server_feedback.compress(mean_chunk).to_bytes()  # (4 + C/8,) uint8

        # Everyone: gather every server's chunk and unpack all of them in one call.
        gathered = torch.empty(n * reply.numel(), dtype=torch.uint8, device=tensor.device)
        collectives.all_gather_into_tensor(gathered, reply, group=self.group)
        result = self.server_feedback.compressor.decompress(
            ScaledCodes.from_rows(gathered.view(n, -1), chunk, 1, chunk)
        )
        tensor.copy_(result[: tensor.numel()].view_as(tensor))
        return tensor


# Note [a rank that cannot compress still sends]
# Top-k has no answer for a NaN input (no order exists), and the rank that finds one must not
# just raise: its peers are about to block in the all-gather of the messages, waiting for it until
# the group's timeout. So it sends a message of the agreed size (8 k bytes) whose first index is
# -1 (bytes 0xFF), which no real message holds (indices are in [0, numel)), and raises after
# the gather; every receiver sees the mark and raises too. The same all-gather, no extra bytes.


class TopkAllReduce:
    """Average a tensor over `group` in place, each rank sending its top-k (with error feedback).

    Holds one fp32 residual of the tensor's size. Bytes sent per call per rank: `(n-1) 8 k`
    (`wire.topk_allreduce_calls`); the result has up to `n k` non-zeros.
    """

    def __init__(self, compressor: TopkCompressor | None = None, group: Any = None) -> None:
        self.compressor = compressor if compressor is not None else TopkCompressor()
        self.group = group
        self.numel: int | None = None
        self.feedback = ErrorFeedback(self.compressor)

    def reset(self) -> None:
        """Forget the residual (and the tensor size)."""
        self.numel = None
        self.feedback.reset()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace `tensor` by the average of every rank's top-k; returns it."""
        call = Call(type(self).__name__, self.group, rejects=_REJECTS)
        with call:
            _check_tensor(tensor, self.numel, call.op)
        call.agree(lambda: {"numel": tensor.numel(), "compressor": repr(self.compressor)})
        name, n = call.op, call.n
        self.numel = tensor.numel()
        if tensor.numel() == 0:
            return tensor
        k = self.compressor.k_for(tensor.numel())
        try:
            message = self.feedback.compress(tensor).to_bytes()  # (8 k,) uint8
            failure = None
        except ValueError as err:  # NaN input: See Note [a rank that cannot compress still sends]
            message = torch.full((8 * k,), 0xFF, dtype=torch.uint8, device=tensor.device)
            failure = err
        gathered = torch.empty(n * message.numel(), dtype=torch.uint8, device=tensor.device)
        collectives.all_gather_into_tensor(gathered, message, group=self.group)
        if failure is not None:
            raise failure
        first_index = gathered.view(n, -1)[:, 4 * k : 4 * k + 4]  # (n, 4): each sender's indices[0]
        failed = (first_index == 0xFF).all(dim=1)
        if bool(failed.any()):
            ranks = validation.group_ranks(self.group)
            raise CommInputError(
                f"{name}: rank(s) {[ranks[i] for i in failed.nonzero().view(-1).tolist()]} could "
                "not compress their tensor (top-k input holds NaN, so no order exists), so no "
                "rank applies this average; find where the gradient overflows (e.g. enable loss "
                "scaling) before compressing"
            )
        total = torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)
        for row in gathered.view(n, -1):  # rank order: the same sum on every rank
            packed = TopkPacked.from_bytes(row, tensor.numel())
            ops.sparse_accumulate_(total, packed.values, packed.indices)
        tensor.copy_(total.div_(n).view_as(tensor))
        return tensor
