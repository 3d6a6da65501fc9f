"""Collectives over picklable Python objects, built on the tensor collectives so the logger sees them.

Each object is pickled into a uint8 tensor. All-gather first exchanges the byte lengths (one
all_gather of n int64), pads every payload to the longest, and gathers the payloads (one
all_gather of n · max_len bytes); broadcast sends the length, then the payload. The comms log
therefore shows two records per call, with their real sizes.

Only exchange objects between ranks that trust each other: unpickling runs code.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm import collectives, validation

__all__ = ["all_gather_object", "broadcast_object"]


def _to_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in group-rank order. Sends (n-1) · (8 + max pickled size) bytes per rank."""
    n = validation.check_group("all_gather_object", group)
    device = validation.tensor_device(group)
    payload = _to_tensor(obj, device)  # 1D uint8, numel = pickled size
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    collectives.all_gather_into_tensor(lengths, length, group=group)
    max_len = int(lengths.max())
    padded = torch.zeros(max_len, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = torch.empty(n * max_len, dtype=torch.uint8, device=device)  # rank-major
    collectives.all_gather_into_tensor(gathered, padded, group=group)
    rows = gathered.view(n, max_len).cpu()
    return [pickle.loads(rows[i, : int(lengths[i])].numpy().tobytes()) for i in range(n)]


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """`obj` from global rank `src` on every rank (the argument is ignored elsewhere)."""
    validation.check_group("broadcast_object", group)
    device = validation.tensor_device(group)
    is_src = dist.get_rank() == src
    payload = _to_tensor(obj, device) if is_src else None
    length = torch.tensor(
        [payload.numel() if payload is not None else 0], dtype=torch.int64, device=device
    )
    collectives.broadcast(length, src, group=group)
    if payload is None:
        payload = torch.empty(int(length), dtype=torch.uint8, device=device)
    collectives.broadcast(payload, src, group=group)
    return obj if is_src else pickle.loads(payload.cpu().numpy().tobytes())
