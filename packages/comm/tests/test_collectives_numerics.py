"""Every collective's result equals the same computation done in one process with plain torch.

Each rank builds every rank's input from a seed (so it can compute the expected result locally),
runs the collective, and compares. Sync and async forms, 2 and 4 ranks, uneven all-to-all,
coalesced all-gather of different-size tensors, point-to-point, objects, and the backend fallbacks.
"""

import os
import subprocess
import sys
import warnings
from contextlib import nullcontext

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import minispeed.comm as comm
from minispeed.comm import api_compat
from minispeed.core.testing import distributed_test, run_distributed


def _data(rank: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(*shape, generator=g).to(dtype)


def _finish(work, async_op: bool) -> None:
    if async_op:
        assert isinstance(work, comm.CommWork)
        work.wait()
    else:
        assert work is None


@distributed_test(world_size=[2, 4])
def test_dense_collectives_match_single_process(rank, world_size):
    n = world_size
    for async_op in (False, True):
        everyone = [_data(r, 3, 4) for r in range(n)]  # (3, 4) per rank

        t = everyone[rank].clone()
        _finish(comm.all_reduce(t, async_op=async_op), async_op)
        assert_close(t, torch.stack(everyone).sum(0))

        t = everyone[rank].clone()
        _finish(comm.all_reduce(t, op=comm.ReduceOp.MAX, async_op=async_op), async_op)
        assert_close(t, torch.stack(everyone).amax(0))

        full = [_data(r, 2 * n, 3) for r in range(n)]  # (2n, 3) per rank
        out = torch.empty(2, 3)
        _finish(comm.reduce_scatter_tensor(out, full[rank], async_op=async_op), async_op)
        assert_close(out, torch.stack(full).sum(0)[2 * rank : 2 * rank + 2])

        out = torch.empty(3 * n, 4)
        _finish(comm.all_gather_into_tensor(out, everyone[rank], async_op=async_op), async_op)
        assert_close(out, torch.cat(everyone))

        src = n - 1
        t = everyone[rank].clone()
        _finish(comm.broadcast(t, src=src, async_op=async_op), async_op)
        assert_close(t, everyone[src])

        # equal all-to-all: rank r sends row block j to rank j
        blocks = [_data(r, 2 * n, 2) for r in range(n)]
        out = torch.empty(2 * n, 2)
        _finish(comm.all_to_all_single(out, blocks[rank], async_op=async_op), async_op)
        assert_close(out, torch.cat([blocks[j][2 * rank : 2 * rank + 2] for j in range(n)]))
    comm.barrier()


def _splits(n: int) -> list[list[int]]:
    """splits[i][j] = rows rank i sends to rank j (some zero, all different)."""
    return [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]


@distributed_test(world_size=[2, 4])
def test_uneven_all_to_all(rank, world_size):
    n = world_size
    s = _splits(n)
    inputs = [_data(i, sum(s[i]), 3) for i in range(n)]
    for async_op in (False, True):
        in_splits = s[rank]
        out_splits = [s[j][rank] for j in range(n)]
        out = torch.full((sum(out_splits), 3), float("nan"))
        work = comm.all_to_all_single(out, inputs[rank], out_splits, in_splits, async_op=async_op)
        _finish(work, async_op)
        expected = []
        for j in range(n):  # what rank j sends to me: its rows for destination `rank`
            start = sum(s[j][:rank])
            expected.append(inputs[j][start : start + s[j][rank]])
        assert_close(out, torch.cat(expected))


class _CopiedElements(TorchDispatchMode):
    """Elements written by copies (`copy_`, `cat`) on this thread while active."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("copy_", "cat"):
            self.numel += out.numel()
        return out


@distributed_test(world_size=[2, 4])
def test_coalesced_all_gather_of_different_sizes(rank, world_size):
    n = world_size
    big = comm.collectives.DIRECT_NUMEL
    broadcasts = api_compat.all_gather_impl(None) == "broadcasts"
    # Small inputs are packed into one buffer and unpacked; one input, and on gloo (broadcasts)
    # inputs of DIRECT_NUMEL elements on average, land straight in their outputs: no other copy.
    for shapes, direct in (
        ([(3,), (2, 5), (1,), (4, 1, 2)], False),
        ([(2, 5)], True),
        ([(big // 2, 2), (big + 3,)], broadcasts),
    ):
        for async_op in (False, True):
            ins = [_data(10 * rank + i, *shape) for i, shape in enumerate(shapes)]
            expected = [
                torch.cat([_data(10 * r + i, *shape).reshape(-1) for r in range(n)])
                for i, shape in enumerate(shapes)
            ]
            outs = [torch.empty(n * t.numel()) for t in ins]
            with comm.CommsLogger() as log, _CopiedElements() as copied:
                _finish(comm.all_gather_coalesced(outs, ins, async_op=async_op), async_op)
            assert log.count() == 1, "coalesced all-gather must issue exactly one collective"
            numel = sum(t.numel() for t in ins)
            assert copied.numel == (numel if direct else (n + 1) * numel), (shapes, copied.numel)
            for out, want in zip(outs, expected):
                assert_close(out, want)

            # Lazy outputs: made only when the data has somewhere to land: at issue where it is
            # received straight into them, else once it is there (in wait() for an async call).
            # Either way an in-flight gather holds one copy.
            made: list[list[torch.Tensor]] = []

            def allocate(made=made, ins=ins) -> list[torch.Tensor]:
                made.append([torch.empty(n * t.numel()) for t in ins])
                return made[-1]

            work = comm.all_gather_coalesced(allocate, ins, async_op=async_op)
            assert len(made) == (0 if async_op and not direct else 1)
            _finish(work, async_op)
            assert len(made) == 1
            for out, want in zip(made[0], expected):
                assert_close(out, want)


@distributed_test(world_size=[2, 4])
def test_point_to_point_ring_and_pairs(rank, world_size):
    n = world_size
    # batched ring: everyone sends to the right and receives from the left at once
    recv_buf = torch.empty(4)
    works = comm.batch_isend_irecv(
        [
            comm.P2POp(comm.isend, _data(rank, 4), (rank + 1) % n),
            comm.P2POp(comm.irecv, recv_buf, (rank - 1) % n),
        ]
    )
    for w in works:
        w.wait()
    assert_close(recv_buf, _data((rank - 1) % n, 4))
    # blocking pairs (0<->1, 2<->3): even ranks send first
    peer = rank ^ 1
    buf = torch.empty(2, 2)
    if rank % 2 == 0:
        comm.send(_data(rank, 2, 2), peer)
        comm.recv(buf, peer)
    else:
        comm.recv(buf, peer)
        comm.send(_data(rank, 2, 2), peer)
    assert_close(buf, _data(peer, 2, 2))
    # async pair
    w_send = comm.isend(_data(rank + 50, 3), peer)
    w_recv = comm.irecv(buf := torch.empty(3), peer)
    w_send.wait()
    w_recv.wait()
    assert_close(buf, _data(peer + 50, 3))


@distributed_test(world_size=[2])
def test_objects_and_subgroups(rank, world_size):
    assert comm.all_gather_object({"rank": rank, "pad": "x" * rank}) == [
        {"rank": r, "pad": "x" * r} for r in range(world_size)
    ]
    assert comm.broadcast_object(["hello", 3] if rank == 1 else None, src=1) == ["hello", 3]
    solo = comm.new_group([0])
    if rank == 0:
        t = torch.ones(2)
        comm.all_reduce(t, group=solo)  # a group of one: unchanged
        assert_close(t, torch.ones(2))
        assert comm.get_world_size(solo) == 1 and comm.is_member(solo)
    else:
        assert not comm.is_member(solo)


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_to_all"])
def test_fallbacks_match_native(op):
    """The replacements used where a backend lacks an op give the same numbers (Note [backend fallbacks])."""
    res = run_distributed(_fallback_body, world_size=2, args=(op,), timeout_s=120)
    assert res == [op] * 2


def _fallback_body(rank: int, world_size: int, op: str) -> str:
    n = world_size
    full = [_data(r, 2 * n, 3) for r in range(n)]
    for async_op in (False, True):
        with api_compat.force_fallback(op), comm.CommsLogger() as log:
            if op == "reduce_scatter":
                out = torch.empty(2, 3)
                _finish(comm.reduce_scatter_tensor(out, full[rank], async_op=async_op), async_op)
                expected = torch.stack(full).sum(0)[2 * rank : 2 * rank + 2]
            elif op == "all_gather":
                out = torch.empty(2 * n * n, 3)
                _finish(comm.all_gather_into_tensor(out, full[rank], async_op=async_op), async_op)
                expected = torch.cat(full)
            else:
                out = torch.empty(2 * n, 3)
                _finish(comm.all_to_all_single(out, full[rank], async_op=async_op), async_op)
                expected = torch.cat([full[j][2 * rank : 2 * rank + 2] for j in range(n)])
        assert_close(out, expected)
        assert log.records[0].impl == api_compat._FALLBACK_NAMES[op]
    return op


@distributed_test(world_size=[2, 4])
def test_in_place_flat_collectives(rank, world_size):
    """Output = this rank's chunk of the input (reduce-scatter) / input = this rank's chunk of the
    output (all-gather): ZeRO relies on it to skip a copy (Note [in-place flat collectives])."""
    n, m = world_size, 7
    for fallback in (False, True):
        for async_op in (False, True):
            with (
                api_compat.force_fallback("reduce_scatter", "all_gather")
                if fallback
                else nullcontext()
            ):
                buf = _data(rank, n * m).clone()
                mine = buf[rank * m : (rank + 1) * m]
                _finish(comm.reduce_scatter_tensor(mine, buf, async_op=async_op), async_op)
                expected = torch.stack([_data(r, n * m) for r in range(n)]).sum(0)
                assert_close(mine, expected[rank * m : (rank + 1) * m])

                full = torch.zeros(n * m)
                full[rank * m : (rank + 1) * m] = _data(rank, m)
                chunk = full[rank * m : (rank + 1) * m]
                _finish(comm.all_gather_into_tensor(full, chunk, async_op=async_op), async_op)
                assert_close(full, torch.cat([_data(r, m) for r in range(n)]))


def _gloo_reduce_scatter_body(rank: int, world_size: int) -> list:
    n, m = world_size, 5
    full = [_data(r, n * m) for r in range(n)]
    expected = torch.stack(full).sum(0)[rank * m : (rank + 1) * m]
    got, records = {}, {}
    for impl in ("ring_p2p", "all_reduce"):
        with comm.CommsLogger() as log, api_compat.reduce_scatter_as(impl):
            inp = full[rank].clone()
            out = torch.empty(m)
            comm.reduce_scatter_tensor(out, inp)  # out of place: the input is the caller's
            assert_close(out, expected)
            assert torch.equal(inp, full[rank])
            buf = full[rank].clone()
            comm.reduce_scatter_tensor(buf[rank * m : (rank + 1) * m], buf)  # in place
            assert_close(buf[rank * m : (rank + 1) * m], expected)
            got[impl] = (out, buf[rank * m : (rank + 1) * m])
            maxed = full[rank].clone()  # not a SUM: the ring does not run it
            comm.reduce_scatter_tensor(
                maxed[rank * m : (rank + 1) * m], maxed, op=comm.ReduceOp.MAX
            )
            assert_close(
                maxed[rank * m : (rank + 1) * m],
                torch.stack(full).amax(0)[rank * m : (rank + 1) * m],
            )
        records[impl] = [(r.impl, r.wire_bytes) for r in log.records]
    # with 2 ranks the ring's one addition is the all-reduce's: bit-equal
    exact = all(torch.equal(a, b) for a, b in zip(got["ring_p2p"], got["all_reduce"]))
    return [records, exact]


@pytest.mark.parametrize("n", [2, 4])
def test_gloo_reduce_scatter_runs_as_a_ring(n):
    """gloo's reduce-scatter is an all-reduce of a clone (Note [gloo's reduce-scatter is an
    all-reduce]): comm runs a SUM as its own ring over p2p ((n-1)/n · S sent, Note [ring
    reduce-scatter over p2p]); other ops, and `reduce_scatter_as("all_reduce")`, as the all-reduce
    of main before it (in place without the clone), each logged with the bytes it sends."""
    results = run_distributed(_gloo_reduce_scatter_body, world_size=n)
    s = 5 * n * 4
    ring, all_reduce = (n - 1) * s // n, 2 * (n - 1) * s // n
    by_all_reduce = [("all_reduce+slice", all_reduce), ("all_reduce_in_place", all_reduce)]
    expected = {
        "ring_p2p": [("ring_p2p", ring)] * 2 + [("all_reduce_in_place", all_reduce)],
        "all_reduce": [*by_all_reduce, ("all_reduce_in_place", all_reduce)],
    }
    assert [r[0] for r in results] == [expected] * n
    if n == 2:
        assert all(r[1] for r in results)


def _ring_in_flight_body(rank: int, world_size: int) -> None:
    """Several async ring reduce-scatters in flight at once (ZeRO overlaps its buckets), of
    different sizes and dtypes, waited out of order, with an all-reduce between them; and on a
    group whose ranks are not its members' global ranks."""
    n = world_size
    groups = [None, comm.new_group([0, n - 1])]
    for group in groups:
        if not comm.is_member(group):
            continue
        g = 2 if group is not None else n
        me = comm.get_rank(group)
        members = list(range(n)) if group is None else [0, n - 1]
        sizes, dtypes = (7, 1, 3), (torch.float32, torch.bfloat16, torch.float64)
        bufs = [
            _data(rank + 10 * i, g * m, dtype=dt) for i, (m, dt) in enumerate(zip(sizes, dtypes))
        ]
        works = [
            comm.reduce_scatter_tensor(b[me * m : (me + 1) * m], b, group=group, async_op=True)
            for b, m in zip(bufs, sizes)
        ]
        between = torch.full((4,), float(rank))
        comm.all_reduce(between, group=group)
        for w in reversed(works):
            assert w.wait()
            assert w.is_completed()
        assert torch.equal(between, torch.full((4,), float(sum(members))))
        for i, (b, m, dt) in enumerate(zip(bufs, sizes, dtypes)):
            everyone = torch.stack([_data(r + 10 * i, g * m, dtype=dt) for r in members])
            assert_close(b[me * m : (me + 1) * m], everyone.sum(0)[me * m : (me + 1) * m])


@pytest.mark.parametrize("n", [2, 4])
def test_ring_reduce_scatters_in_flight_at_once(n):
    run_distributed(_ring_in_flight_body, world_size=n)


def _gloo_all_gather_body(rank: int, world_size: int) -> list:
    m = 3
    # the world, and a group whose ranks are not its members' global ranks (broadcast's src is)
    groups = [None, comm.new_group([1, 3])]
    with comm.CommsLogger() as log:
        for group in groups:
            if not comm.is_member(group):
                continue
            members = [0, 1, 2, 3] if group is None else [1, 3]
            n, me = len(members), members.index(rank)
            expected = torch.cat([_data(r, m) for r in members])
            for async_op in (False, True):
                full = torch.zeros(n * m)
                _finish(
                    comm.all_gather_into_tensor(full, _data(rank, m), group, async_op), async_op
                )
                assert_close(full, expected)  # out of place
                full = torch.zeros(n * m)
                full[me * m : (me + 1) * m] = _data(rank, m)
                chunk = full[me * m : (me + 1) * m]
                _finish(comm.all_gather_into_tensor(full, chunk, group, async_op), async_op)
                assert_close(full, expected)  # in place
            outs = [torch.zeros(n * 2), torch.zeros(n * m)]
            comm.all_gather_coalesced(outs, [_data(rank, 2), _data(rank, m)], group)
            assert_close(outs[1], expected)
    return [(r.op, r.impl, r.group_size, r.msg_bytes, r.wire_bytes) for r in log.records]


def test_gloo_all_gather_runs_as_broadcasts():
    """gloo's flat all-gather costs several times the CPU of broadcasting the same bytes (Note
    [gloo's all-gather is broadcasts]): comm runs it as one broadcast per rank, on the world and
    on a sub-group, in place and not, sync and async, coalesced too, and logs the ring's bytes."""
    results = run_distributed(_gloo_all_gather_body, world_size=4, timeout_s=120)
    for rank, records in enumerate(results):
        flat = [("all_gather", "broadcasts", 4, 4 * 3 * 4, 3 * 3 * 4)] * 4
        coalesced = [("all_gather_coalesced", "broadcasts", 4, 4 * 5 * 4, 3 * 5 * 4)]
        pair = [("all_gather", "broadcasts", 2, 2 * 3 * 4, 3 * 4)] * 4
        pair += [("all_gather_coalesced", "broadcasts", 2, 2 * 5 * 4, 5 * 4)]
        assert records == flat + coalesced + (pair if rank in (1, 3) else []), rank


def _no_deprecation_body(rank: int, world_size: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.empty(2)
        comm.reduce_scatter_tensor(out, torch.ones(2 * world_size))
        gathered = torch.empty(2 * world_size)
        comm.all_gather_into_tensor(gathered, torch.ones(2))
        comm.all_gather_coalesced([torch.empty(world_size)], [torch.ones(1)])
    return [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]


def test_no_deprecation_warning_from_flat_collectives():
    """torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor; we must not trigger it."""
    assert run_distributed(_no_deprecation_body, world_size=2) == [[], []]


def test_init_distributed_without_launcher_is_a_single_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert not comm.is_initialized()
    comm.init_distributed()
    try:
        comm.init_distributed()  # a second call is a no-op
        assert (comm.get_rank(), comm.get_world_size()) == (0, 1)
        t = torch.arange(3.0)
        comm.all_reduce(t)
        assert_close(t, torch.arange(3.0))
    finally:
        comm.destroy_process_group()
    assert not comm.is_initialized()


_EXIT_SCRIPT = """
import atexit, sys
import torch
import torch.distributed as dist
from minispeed import comm

# Registered before init_distributed's hook, so it runs after it (atexit is last-in, first-out).
atexit.register(lambda: print("group alive at exit:", dist.is_initialized(), flush=True))
comm.init_distributed()
t = torch.ones(2)
comm.all_reduce(t)
if sys.argv[1] == "raise":
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("ending", ["clean", "raise"])
def test_a_script_that_never_destroys_the_group_has_it_destroyed_at_a_clean_exit(tmp_path, ending):
    """Note [destroy before finalization]: gloo's threads torn down during interpreter
    finalization abort the process now and then, so a clean exit destroys the group first; an
    exit by an uncaught exception leaves it (a peer's unfinished work could make it wait)."""
    script = tmp_path / "script.py"
    script.write_text(_EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, str(script), ending], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == (0 if ending == "clean" else 1), out.stderr
    assert f"group alive at exit: {ending == 'raise'}" in out.stdout, out.stdout + out.stderr
