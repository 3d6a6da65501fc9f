"""`LaunchQueue`: buckets reduced in one fixed order whatever order their members arrive in, with
a bounded window in flight; the bucketed results equal the unbucketed loop's."""

import pytest
import torch
from torch.testing import assert_close

import minispeed.comm as comm
from minispeed.core.testing import run_distributed

# Fake gradients, grouped into buckets of consecutive tensors.
SHAPES = [(5,), (7,), (3,), (4, 10), (3, 3), (1,), (2, 3)]
BUCKETS = [[0, 1, 2], [3], [4, 5, 6]]


def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(*shape, generator=g) for shape in SHAPES]


def test_launch_order_is_fixed_whatever_the_arrival_order():
    launched: list[int] = []
    queue = comm.LaunchQueue([2, 1, 3], lambda b: (launched.append(b), comm.InFlight(None))[1])
    queue.arrived(1)  # bucket 1 complete first: it must wait for bucket 0
    assert launched == [] and not queue.launched(1)
    queue.arrived(0)
    queue.arrived(0)  # bucket 0 complete: 0 and then 1 go
    assert launched == [0, 1]
    queue.arrived(2, launch=False)
    queue.flush()  # bucket 2 never completed: launched anyway, last
    assert launched == [0, 1, 2]
    queue.reset()
    assert queue.pending == [2, 1, 3] and queue.next == 0


class _Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")

    def is_completed(self) -> bool:
        return False


def test_at_most_max_in_flight_collectives_wait_at_once():
    log: list[str] = []

    def launch(b: int) -> comm.InFlight:
        log.append(f"launch {b}")
        return comm.InFlight(_Work(log, str(b)), lambda: log.append(f"done {b}"))

    queue = comm.LaunchQueue([1, 1, 1, 1], launch, max_in_flight=2)
    for b in range(4):
        queue.arrived(b)
    # the third launch overfills the window of 2: the oldest is finished right after it
    expected = ["launch 0", "launch 1", "launch 2", "wait 0", "done 0"]
    expected += ["launch 3", "wait 1", "done 1"]
    assert log == expected
    queue.wait_all()
    assert log[-4:] == ["wait 2", "done 2", "wait 3", "done 3"]
    with pytest.raises(ValueError, match="max_in_flight"):
        comm.LaunchQueue([1], launch, max_in_flight=0)


def _bucketed_body(rank: int, world_size: int, arrival: list[int]) -> int:
    reference = _grads(rank)
    comm.all_reduce_unbucketed(reference)

    grads = _grads(rank)
    flats = [torch.zeros(sum(grads[i].numel() for i in b)) for b in BUCKETS]

    def launch(b: int) -> comm.InFlight:
        work = comm.all_reduce(flats[b], async_op=True)

        def finish() -> None:
            offset = 0
            for i in BUCKETS[b]:
                n = grads[i].numel()
                grads[i].copy_(flats[b][offset : offset + n].view_as(grads[i]) / world_size)
                offset += n

        return comm.InFlight(work, finish, (flats[b],))

    bucket_of = {i: b for b, members in enumerate(BUCKETS) for i in members}
    queue = comm.LaunchQueue([len(b) for b in BUCKETS], launch, max_in_flight=1)
    with comm.CommsLogger() as log:
        for i in arrival:  # each rank its own order, as grad hooks may see
            b = bucket_of[i]
            offset = sum(grads[j].numel() for j in BUCKETS[b][: BUCKETS[b].index(i)])
            flats[b][offset : offset + grads[i].numel()].copy_(grads[i].reshape(-1))
            queue.arrived(b)
        queue.flush()
    for got, want in zip(grads, reference):
        assert_close(got, want)
    return log.count("all_reduce")


ORDERS = [[6, 5, 4, 3, 2, 1, 0], [0, 3, 1, 6, 2, 4, 5]]


def _per_rank_order_body(rank: int, world_size: int) -> int:
    return _bucketed_body(rank, world_size, ORDERS[rank])


def test_bucketed_all_reduce_equals_the_unbucketed_loop_for_any_arrival_order():
    results = run_distributed(_per_rank_order_body, world_size=2)
    assert results == [len(BUCKETS)] * 2
