"""The bucketer gives the unbucketed loop's results with ceil(Σ small / bucket_numel) + #large collectives."""

import pytest
import torch
from torch.testing import assert_close

import minispeed.comm as comm
from minispeed.core.testing import run_distributed

# Element counts of fake gradients: small ones that straddle bucket boundaries and one (40)
# larger than the bucket of 16, which must get a collective of its own.
SIZES = [5, 7, 3, 40, 9, 1, 6]
SHAPES = [(5,), (7,), (3,), (4, 10), (3, 3), (1,), (2, 3)]
BUCKET = 16


def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(*shape, generator=g) for shape in SHAPES]


def test_expected_count_by_hand():
    # small: 5+7+3+9+1+6 = 31 elements -> 2 buckets of 16; the 40-element tensor -> 1 of its own
    assert comm.num_collectives(SIZES, BUCKET) == 3
    assert comm.num_collectives([16, 16, 16], 16) == 3
    assert comm.num_collectives([17], 16) == 1
    assert comm.num_collectives([], 16) == 0


def _all_reduce_body(rank: int, world_size: int, average: bool) -> tuple[int, int]:
    reference = _grads(rank)
    comm.all_reduce_unbucketed(reference, average=average)

    grads = _grads(rank)
    bucketer = comm.GradientBucketer(comm.BucketConfig(bucket_numel=BUCKET, average=average))
    with comm.CommsLogger() as log:
        for i, t in enumerate(grads):  # as grad hooks would, in backward order
            bucketer.add(t, key=i)
        launched_before_flush = bucketer.num_launched
        bucketer.flush()
        bucketer.wait()
    for got, want in zip(grads, reference):
        assert_close(got, want)
    # every full bucket was launched during add(), before flush()
    assert launched_before_flush == comm.num_collectives(SIZES, BUCKET) - 1
    assert all(r.async_op for r in log.records)
    return log.count("all_reduce"), bucketer.num_launched


@pytest.mark.parametrize("average", [True, False])
def test_bucketed_all_reduce_equals_unbucketed_loop(average):
    for count, launched in run_distributed(_all_reduce_body, world_size=2, args=(average,)):
        assert count == launched == comm.num_collectives(SIZES, BUCKET) == 3


def _reduce_scatter_body(rank: int, world_size: int) -> int:
    n = world_size
    everyone = [_grads(r) for r in range(n)]
    # what each element should become: the average over ranks
    mean = [torch.stack([everyone[r][i] for r in range(n)]).mean(0) for i in range(len(SHAPES))]
    seen: dict[tuple[int, int], float] = {}  # (tensor index, flat element) -> value from my shards

    def on_shard(bucket: comm.Bucket, shard: torch.Tensor) -> None:
        start, end = bucket.shard_range(comm.get_rank())
        assert shard.numel() == end - start
        for e in bucket.entries:  # map shard elements back to (tensor, element)
            lo, hi = max(start, e.bucket_offset), min(end, e.bucket_offset + e.numel)
            for pos in range(lo, hi):
                seen[(e.key, e.tensor_offset + pos - e.bucket_offset)] = shard[pos - start].item()

    bucketer = comm.GradientBucketer(
        comm.BucketConfig(bucket_numel=BUCKET, reduction="reduce_scatter"), on_shard=on_shard
    )
    with comm.CommsLogger() as log:
        for i, t in enumerate(everyone[rank]):
            bucketer.add(t, key=i)
        bucketer.flush()
        bucketer.wait()
    assert seen, "each rank receives a non-empty part of the result"
    for (i, j), value in seen.items():
        assert value == pytest.approx(mean[i].reshape(-1)[j].item(), rel=1e-5, abs=1e-6)
    return log.count("reduce_scatter"), len(seen)


def test_bucketed_reduce_scatter_shards_cover_the_average():
    results = run_distributed(_reduce_scatter_body, world_size=2)
    assert [c for c, _ in results] == [3, 3]
    assert sum(covered for _, covered in results) == sum(SIZES), "shards partition every element"


def test_reduce_scatter_needs_a_callback():
    with pytest.raises(ValueError, match="needs on_shard"):
        comm.GradientBucketer.__init__(
            object.__new__(comm.GradientBucketer),
            comm.BucketConfig(bucket_numel=4, reduction="reduce_scatter"),
        )


def test_unknown_reduction_names_the_choices():
    with pytest.raises(ValueError, match="'all_reduce' or 'reduce_scatter'"):
        comm.BucketConfig(bucket_numel=4, reduction="all_gather")  # type: ignore[arg-type]
