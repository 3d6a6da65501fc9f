"""Flat buffers: where every parameter of an optimizer param group lives in one 1-D tensor.

A `FlatLayout` is pure arithmetic (no tensors): it cuts one param group into *buckets*
of consecutive parameters and, for the partitioned stages, pads each bucket to a multiple of N
so it splits into N equal *shards*. Rank r owns shard r of every bucket; its *partition* is the
concatenation of those shards, one contiguous tensor of `partition_numel` elements.

Example: params a (5 el.), b (3 el.), c (6 el.), bucket_numel 8, N = 2:

```text
flat (param dtype):  | c c c c c c | a a a a a b b b _ _ |   buckets are formed from the end
                     |  bucket 0   |      bucket 1       |   (backward order), padded to 2k
shards:                r0: c c c     r0: a a a a a
                       r1: c c c     r1: b b b _ _
rank 0 partition:    c c c a a a a a          (partition_numel = 3 + 5 = 8 = flat / N)
rank 1 partition:    c c c b b b _ _
```

**Note [bucket-major flat layout]**:
a bucket must be one contiguous range of the flat buffer, so that the gradient hooks can fill it
in backward order and reduce it the moment it is complete (`reduce_scatter_tensor` and
`all_gather_into_tensor` need the N shards to be adjacent, equal chunks of one tensor). If instead
the whole group were split once into N contiguous partitions, a bucket near the end of backward
would straddle partitions unevenly and would need N differently sized reductions. So we pad per
bucket (at most N-1 elements each) and every rank's partition is the concatenation of its shards:
still one flat, contiguous fp32 tensor for the optimizer, and the padded flat buffer (the
concatenation of the N partitions' worth of shards) still divides by N.

Costs: none here; the owners of the buffers (`stage12.py`, `reducer.py`) state theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Bucket", "FlatLayout", "Slot", "cut_runs"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its group's flat buffer."""

    param_index: int  # index of the parameter within its param group
    offset: int  # first element in the flat buffer
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of parameters reduced (and gathered) by one collective call."""

    index: int  # position in the group's bucket list (= flat-buffer order)
    start: int  # first element in the flat buffer
    numel: int  # elements of real parameters
    padded_numel: int  # numel rounded up to a multiple of N (== numel when unpadded)
    param_indices: tuple[int, ...]  # the parameters inside, in flat-buffer order
    shard_numel: int  # padded_numel // N: elements each rank owns
    shard_offset: int  # where this bucket's shard starts inside a rank's partition
    wire_dtype: torch.dtype | None = None  # the dtype its gradients travel in; None: the buffer's

    def shard_start(self, rank: int) -> int:
        """First flat-buffer element of `rank`'s shard of this bucket."""
        return self.start + rank * self.shard_numel

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """`rank`'s shard of this bucket inside the flat buffer `flat`: a view."""
        start = self.shard_start(rank)
        return flat[start : start + self.shard_numel]


def cut_runs(
    items: Sequence[Any],
    sizes: Sequence[int],
    limit: int,
    kinds: Sequence[Any] | None = None,
) -> list[list[Any]]:
    """Cut `items` (in the given order) into consecutive runs of total size at most `limit`;
    an item larger than `limit` forms a run of its own, and with `kinds` (one per item) a run
    also ends where the kind changes (gradients travelling in different dtypes: autocast.py).
    How gradient buckets are formed, here and for stage 3 (`stage3/strategy.py`)."""
    runs: list[list[Any]] = []
    current: list[Any] = []
    total = 0
    kinds = kinds if kinds is not None else [None] * len(items)
    last = None
    for item, size, kind in zip(items, sizes, kinds):
        if current and (total + size > limit or kind != last):
            runs.append(current)
            current, total = [], 0
        current.append(item)
        total += size
        last = kind
    if current:
        runs.append(current)
    return runs


class FlatLayout:
    """The flat buffer layout of one param group for `world_size` ranks.

    `pad=False` (stage 0) keeps buckets unpadded and has no partition; `pad=True` (stages
    1-2) pads each bucket to a multiple of `world_size`. See Note [bucket-major flat layout].
    `wire_dtypes[i]`: the dtype parameter i's gradient travels in (None: the buffer's); a bucket
    holds one of them only (`Bucket.wire_dtype`).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        bucket_numel: int,
        world_size: int,
        pad: bool,
        wire_dtypes: Sequence[torch.dtype | None] | None = None,
    ) -> None:
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        self.world_size = world_size
        multiple = world_size if pad else 1

        # Group parameters into buckets walking backwards (the order gradients arrive in), so the
        # last bucket to fill during backward is the (possibly small) remainder at the front.
        backwards = list(reversed(range(len(params))))
        wire = list(wire_dtypes) if wire_dtypes is not None else [None] * len(params)
        sizes = [params[i].numel() for i in backwards]
        runs = cut_runs(backwards, sizes, bucket_numel, [wire[i] for i in backwards])
        runs = [sorted(run) for run in reversed(runs)]  # flat-buffer order

        self.slots: list[Slot] = [None] * len(params)  # type: ignore[list-item]
        self.buckets: list[Bucket] = []
        offset = shard_offset = 0
        for b, run in enumerate(runs):
            start = offset
            for i in run:
                self.slots[i] = Slot(i, offset, params[i].numel(), params[i].shape)
                offset += params[i].numel()
            numel = offset - start
            padded = -(-numel // multiple) * multiple
            shard = padded // world_size if pad else 0
            self.buckets.append(
                Bucket(b, start, numel, padded, tuple(run), shard, shard_offset, wire[run[0]])
            )
            offset = start + padded
            shard_offset += shard
        self.numel = offset  # padded total: sum of padded bucket sizes
        self.partition_numel = shard_offset if pad else 0
        self.bucket_of_param = {i: bk.index for bk in self.buckets for i in bk.param_indices}

    def shard_pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """For `rank`: (param_index, start in the flattened param, numel, offset in partition).

        One entry per parameter that intersects one of `rank`'s shards (a parameter lies in one
        bucket and a shard is one range of it, so at most one piece per parameter).
        """
        pieces = []
        for bk in self.buckets:
            lo = bk.shard_start(rank)
            hi = lo + bk.shard_numel
            for i in bk.param_indices:
                s = self.slots[i]
                a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < z:
                    pieces.append((i, a - s.offset, z - a, bk.shard_offset + a - lo))
        return pieces

    def __repr__(self) -> str:
        return (
            f"FlatLayout(params={len(self.slots)}, buckets={[b.padded_numel for b in self.buckets]}, "
            f"numel={self.numel}, partition_numel={self.partition_numel}, world_size={self.world_size})"
        )
