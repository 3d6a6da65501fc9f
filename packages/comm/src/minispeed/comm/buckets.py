"""Gradient buckets: pack many small tensors into a few large collectives, launched during backward.

The naive version first (STYLE habit 9): :func:`all_reduce_unbucketed` issues one all-reduce per
tensor. With hundreds of parameters that pays the per-call latency (alpha in the alpha-beta model)
hundreds of times and cannot start until backward has finished.

:class:`GradientBucketer` copies each tensor, as it becomes ready (e.g. from a per-parameter grad
hook), into a flat bucket of ``bucket_numel`` elements. When a bucket fills it launches ONE async
collective on it and starts the next bucket, so communication of early buckets overlaps with the
backward computation of later layers. ``flush()`` launches the last, partly filled bucket;
``wait()`` waits for every handle and delivers results: copied back into the tensors
(all-reduce) or handed to a callback with this rank's shard (reduce-scatter, for ZeRO-2).

Note [bucket packing]
Tensors are packed back to back and a tensor that straddles a bucket boundary is split across two
buckets, so every bucket but the last is exactly full. A tensor larger than a bucket is not split:
it gets a collective of its own, issued at once. Hence the number of collectives is
``ceil(Σ small numel / bucket_numel) + #large`` (:func:`num_collectives`), independent of order.

Costs (B = bucket_numel, e = element bytes, n = group size):
bytes kept: one B·e buffer per bucket not yet waited on, and a copy of each large tensor (padded
to a multiple of n for reduce-scatter); bytes sent per bucket: 2(n-1)/n · B·e (all-reduce)
or (n-1)/n · B·e (reduce-scatter); collectives: :func:`num_collectives`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from minispeed.comm import collectives
from minispeed.comm.groups import get_rank, get_world_size
from minispeed.comm.validation import CommInputError
from minispeed.comm.work import CommWork

__all__ = [
    "Bucket",
    "BucketConfig",
    "BucketEntry",
    "BucketState",
    "GradientBucketer",
    "all_reduce_unbucketed",
    "num_collectives",
]


@dataclass(frozen=True)
class BucketConfig:
    """How gradients are bucketed."""

    bucket_numel: int
    """Elements per bucket (not bytes). DeepSpeed's ``reduce_bucket_size`` has this meaning."""
    reduction: Literal["all_reduce", "reduce_scatter"] = "all_reduce"
    """``all_reduce``: every rank gets the whole result (DDP, ZeRO-1). ``reduce_scatter``: each rank
    gets a 1/n shard of each bucket (ZeRO-2/3)."""
    average: bool = True
    """Divide by the group size. Done before the reduction (pre-division) so fp16 sums stay in range."""

    def __post_init__(self) -> None:
        if isinstance(self.bucket_numel, bool) or not isinstance(self.bucket_numel, int):
            raise TypeError(f"bucket_numel must be an int (elements), got {self.bucket_numel!r}")
        if self.bucket_numel <= 0:
            raise ValueError(
                f"bucket_numel must be a positive number of elements, got {self.bucket_numel}; "
                "use e.g. 500_000_000 for DeepSpeed's default reduce_bucket_size, or call "
                "all_reduce_unbucketed() to send one collective per tensor"
            )
        if self.reduction not in ("all_reduce", "reduce_scatter"):
            raise ValueError(
                f"reduction={self.reduction!r} is not supported; use 'all_reduce' or 'reduce_scatter'"
            )


class BucketState(enum.Enum):
    """Lifecycle of a :class:`Bucket`. FILLING: ``flat`` is being written. IN_FLIGHT: a collective
    owns ``flat`` (do not touch it). DONE: results delivered; ``flat`` may be freed."""

    FILLING = "filling"
    IN_FLIGHT = "in_flight"
    DONE = "done"


@dataclass(frozen=True)
class BucketEntry:
    """Elements ``[tensor_offset, tensor_offset + numel)`` of ``tensor`` (flattened) live at
    ``[bucket_offset, bucket_offset + numel)`` of the bucket."""

    key: Any
    tensor: torch.Tensor | None  # kept only to copy results back; None lets the caller free it
    tensor_offset: int
    bucket_offset: int
    numel: int


@dataclass
class Bucket:
    """One flat buffer and the tensor pieces packed in it."""

    index: int
    flat: torch.Tensor  # 1D, numel = capacity (bucket_numel, or a large tensor's size, padded to n)
    entries: list[BucketEntry] = field(default_factory=list)
    used: int = 0  # elements written so far
    state: BucketState = BucketState.FILLING
    shard: torch.Tensor | None = None  # reduce-scatter: 1D, numel = padded used / n
    work: CommWork | None = None

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Bucket offsets ``[start, end)`` of the shard that group rank ``rank`` receives."""
        m = 0 if self.shard is None else self.shard.numel()
        return rank * m, (rank + 1) * m

    def to_in_flight(self, work: CommWork | None) -> None:
        """FILLING -> IN_FLIGHT, when its collective is launched."""
        assert self.state is BucketState.FILLING, f"bucket {self.index} is {self.state}"
        self.state, self.work = BucketState.IN_FLIGHT, work

    def to_done(self) -> None:
        """IN_FLIGHT -> DONE, after its results were delivered."""
        assert self.state is BucketState.IN_FLIGHT, f"bucket {self.index} is {self.state}"
        self.state, self.work = BucketState.DONE, None


def num_collectives(sizes: Sequence[int], bucket_numel: int) -> int:
    """Collectives a :class:`GradientBucketer` issues for tensors of ``sizes`` elements.

    See Note [bucket packing]: ``ceil(Σ small / bucket_numel) + #large``, large meaning
    ``numel > bucket_numel``.
    """
    small = sum(s for s in sizes if s <= bucket_numel)
    return math.ceil(small / bucket_numel) + sum(1 for s in sizes if s > bucket_numel)


def all_reduce_unbucketed(
    tensors: Sequence[torch.Tensor], group: Any = None, average: bool = True
) -> None:
    """The naive loop: one synchronous all-reduce per tensor, in place. len(tensors) collectives."""
    n = get_world_size(group)
    for t in tensors:
        if average:
            t.div_(n)
        collectives.all_reduce(t, group=group)


class GradientBucketer:
    """Packs tensors into flat buckets and reduces each bucket with one async collective.

    ``add(tensor)`` in any order (typically from grad hooks during backward), then ``flush()`` and
    ``wait()``. With ``reduction="all_reduce"`` the reduced values are copied back into the added
    tensors at ``wait()`` (unless ``copy_back=False``). With ``reduction="reduce_scatter"``
    ``on_shard(bucket, shard)`` is called per bucket at ``wait()`` with this rank's shard
    (``bucket.entries`` and ``bucket.shard_range(rank)`` map shard elements back to tensors).
    When copying back, the bucketer holds each added tensor until ``wait()`` and writes into it
    then (do not modify it in between); otherwise it keeps no reference, so the caller may free a
    gradient as soon as ``add`` returns (ZeRO-2 does).
    """

    def __init__(
        self,
        config: BucketConfig,
        group: Any = None,
        on_shard: Callable[[Bucket, torch.Tensor], None] | None = None,
        copy_back: bool = True,
    ) -> None:
        if config.reduction == "reduce_scatter" and on_shard is None:
            raise ValueError(
                "reduction='reduce_scatter' needs on_shard(bucket, shard) to receive each shard"
            )
        self.config = config
        self.group = group
        self.on_shard = on_shard
        self.copy_back = copy_back
        self.world_size = get_world_size(group)
        self.rank = get_rank(group)
        self.buckets: list[Bucket] = []  # every bucket not yet delivered, in launch order
        self.num_launched = 0
        self._filling: Bucket | None = None
        self._dtype: torch.dtype | None = None
        self._next_index = 0
        self._writes_back = config.reduction == "all_reduce" and copy_back

    # -- filling --------------------------------------------------------------------------------
    def add(self, tensor: torch.Tensor, key: Any = None) -> None:
        """Copy ``tensor`` into the current bucket(s); launch every bucket it fills."""
        if self._dtype is None:
            self._dtype = tensor.dtype
        elif tensor.dtype != self._dtype:
            raise CommInputError(
                f"GradientBucketer: tensor {key!r} is {tensor.dtype} but earlier ones are "
                f"{self._dtype}; use one bucketer per dtype"
            )
        flat = tensor.detach().reshape(-1)  # a view when contiguous
        numel = flat.numel()
        capacity = self.config.bucket_numel
        if numel > capacity:  # See Note [bucket packing]: a large tensor gets its own collective.
            own = self._new_bucket(numel, tensor)
            self._put(own, key, tensor, flat, 0, numel)
            self._launch(own)
            return
        done = 0
        while done < numel:
            if self._filling is None:
                self._filling = self._new_bucket(capacity, tensor)
            bucket = self._filling
            take = min(numel - done, capacity - bucket.used)
            self._put(bucket, key, tensor, flat, done, take)
            done += take
            if bucket.used == capacity:
                self._filling = None
                self._launch(bucket)

    def flush(self) -> None:
        """Launch the partly filled bucket, if any (call once backward has finished)."""
        if self._filling is not None and self._filling.used > 0:
            bucket, self._filling = self._filling, None
            self._launch(bucket)

    def wait(self) -> None:
        """Wait for every launched bucket and deliver its results, in launch order."""
        if self._filling is not None and self._filling.used > 0:
            raise RuntimeError(
                "GradientBucketer.wait(): a bucket is still filling; call flush() first"
            )
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            self._deliver(bucket)
            bucket.to_done()
        self.buckets.clear()

    # -- internals ------------------------------------------------------------------------------
    def _padded(self, numel: int) -> int:
        if self.config.reduction == "reduce_scatter":
            return -(-numel // self.world_size) * self.world_size
        return numel

    def _new_bucket(self, capacity: int, like: torch.Tensor) -> Bucket:
        flat = torch.empty(self._padded(capacity), dtype=like.dtype, device=like.device)
        self._next_index += 1
        return Bucket(index=self._next_index - 1, flat=flat)

    def _put(
        self,
        bucket: Bucket,
        key: Any,
        tensor: torch.Tensor,
        flat: torch.Tensor,
        start: int,
        numel: int,
    ) -> None:
        bucket.flat[bucket.used : bucket.used + numel].copy_(flat[start : start + numel])
        keep = tensor if self._writes_back else None  # See BucketEntry.tensor.
        bucket.entries.append(BucketEntry(key, keep, start, bucket.used, numel))
        bucket.used += numel

    def _launch(self, bucket: Bucket) -> None:
        n = self.world_size
        # Zero the padding (and unused tail) so it reduces to zeros, not garbage.
        bucket.flat[bucket.used :].zero_()
        data = bucket.flat[: self._padded(bucket.used)]  # 1D; reduce-scatter needs a multiple of n
        if self.config.average:
            data.div_(n)
        if self.config.reduction == "all_reduce":
            work = collectives.all_reduce(data, group=self.group, async_op=True)
        else:
            bucket.shard = data.new_empty(data.numel() // n)
            work = collectives.reduce_scatter_tensor(
                bucket.shard, data, group=self.group, async_op=True
            )
        bucket.to_in_flight(work)
        self.buckets.append(bucket)
        self.num_launched += 1

    def _deliver(self, bucket: Bucket) -> None:
        if self.config.reduction == "reduce_scatter":
            assert self.on_shard is not None and bucket.shard is not None
            self.on_shard(bucket, bucket.shard)
            return
        if not self.copy_back:
            return
        for e in bucket.entries:
            assert e.tensor is not None
            target = e.tensor.detach().view(-1) if e.tensor.is_contiguous() else None
            piece = bucket.flat[e.bucket_offset : e.bucket_offset + e.numel]
            if target is not None:
                target[e.tensor_offset : e.tensor_offset + e.numel].copy_(piece)
            else:  # non-contiguous: write through a flat copy of the whole tensor
                whole = e.tensor.detach().reshape(-1).clone()
                whole[e.tensor_offset : e.tensor_offset + e.numel].copy_(piece)
                e.tensor.detach().copy_(whole.view_as(e.tensor))
