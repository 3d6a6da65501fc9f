"""DeepSpeed names scripts test against or call at the end of a run: `deepspeed.DeepSpeedEngine`
(isinstance) and `deepspeed.comm.log_summary`, on 2 gloo ranks."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from minispeed.core.testing import run_distributed


def _body(rank: int, world_size: int, logged: bool | str) -> dict:
    import minispeed.engine as deepspeed
    from minispeed.engine import comm as dist

    model = nn.Linear(4, 2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "comms_logger": {"enabled": bool(logged), "debug": logged == "debug"},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    for _ in range(3):
        x = torch.randn(2, 4)
        t = x.sum().reshape(1)
        dist.all_reduce(t)  # the script's own collective, logged too
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    stats = dist.log_summary(return_dict=True)
    with pytest.raises(NotImplementedError, match="show_straggler"):
        dist.log_summary(show_straggler=True)
    engine.destroy()
    return {"is_engine": isinstance(engine, deepspeed.DeepSpeedEngine), "stats": stats}


@pytest.mark.parametrize("logged", [True, False, "debug"])
def test_engine_is_a_deepspeed_engine_and_log_summary_reports_the_log(logged):
    for res in run_distributed(_body, world_size=2, args=(logged,), timeout_s=180):
        assert res["is_engine"]
        if not logged:
            assert res["stats"] is None  # no comms_logger section: nothing recorded
            continue
        ops = res["stats"]["summary"]
        # the script's three 4-byte all-reduces, in DeepSpeed's layout; with `debug`, under
        # DeepSpeed's record name naming the script's function (not the adapter's)
        mine = ops["all_reduce | [Caller Func: _body]" if logged == "debug" else "all_reduce"][4]
        assert mine["count"] == 3 and mine["msg_size_bytes"] == 4
        assert mine["avg_latency_ms"] > 0 and mine["busbw_avg_gbps"] >= 0
        assert res["stats"]["metadata"]["world_size"] == 2


def _every_collective(rank: int, world_size: int) -> dict:
    import minispeed.comm as mcomm
    from minispeed.engine import comm as dist

    n = world_size
    with mcomm.CommsLogger() as log:
        out = [torch.empty(2) for _ in range(n)]
        dist.all_gather(out, torch.full((2,), float(rank)))
        later = [torch.empty(2) for _ in range(n)]
        work = dist.all_gather(later, torch.full((2,), rank + 0.5), async_op=True)
        while not work.is_completed():  # a script polling before it waits must not spin forever
            time.sleep(0.001)
        work.wait()
        objs = [{"from": rank}, rank] if rank == 1 else [None, None]
        dist.broadcast_object_list(objs, src=1)
        swapped = torch.empty(n)
        dist.all_to_all_single(swapped, torch.arange(n, dtype=torch.float32) + 10 * rank)
        t = torch.ones(3) * (rank + 1)
        dist.reduce(t, dst=0)
        gathered = [torch.empty(1) for _ in range(n)] if rank == 0 else None
        dist.gather(torch.tensor([float(rank)]), gathered, dst=0)
        got = torch.empty(1)
        dist.scatter(got, [torch.tensor([7.0 + j]) for j in range(n)] if rank == 0 else None, src=0)
    return {
        "all_gather": [o.tolist() for o in out],
        "async": [o.tolist() for o in later],
        "objs": objs,
        "swapped": swapped.tolist(),
        "reduced": t.tolist() if rank == 0 else None,
        "gathered": [g.item() for g in gathered] if gathered else None,
        "got": got.item(),
        "ops": sorted({r.op for r in log.records}),
    }


def test_deepspeed_comm_collectives_go_through_minispeed_comm():
    """Every collective of `deepspeed.comm` gives torch's values and reaches the comms log."""
    for rank, res in enumerate(run_distributed(_every_collective, world_size=2, timeout_s=120)):
        assert res["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert res["async"] == [[0.5, 0.5], [1.5, 1.5]]
        assert res["objs"] == [{"from": 1}, 1]
        assert res["swapped"] == [float(rank), 10.0 + rank]
        assert res["got"] == 7.0 + rank
        if rank == 0:
            assert res["reduced"] == [3.0, 3.0, 3.0] and res["gathered"] == [0.0, 1.0]
        assert res["ops"] == [
            "all_gather", "all_to_all", "broadcast", "gather", "reduce", "scatter",
        ]  # fmt: skip


def _list_forms_and_p2p(rank: int, world_size: int) -> dict:
    """The same calls through `deepspeed.comm` and through torch.distributed, same data."""
    import torch.distributed as tdist

    from minispeed.engine import comm as dist

    n, peer = world_size, 1 - rank
    g = torch.Generator().manual_seed(rank)
    ins = [torch.randn(j + 2, generator=g) for j in range(n)]  # uneven sizes per destination
    # all_to_all: input j goes to rank j; rank j's arrives in output j (sized as it sends it)
    outs = {k: [torch.empty(rank + 2) for _ in range(n)] for k in ("ours", "torch")}
    dist.all_to_all(outs["ours"], ins)
    for j in range(n):  # gloo has no list all_to_all: torch's own meaning, pairwise
        if j == rank:
            outs["torch"][j].copy_(ins[j])
    for work in tdist.batch_isend_irecv(
        [
            tdist.P2POp(tdist.isend, ins[peer], peer),
            tdist.P2POp(tdist.irecv, outs["torch"][peer], peer),
        ]
    ):
        work.wait()
    # reduce_scatter (list form), async
    parts = [torch.randn(3, generator=g) for _ in range(n)]
    ours_rs, torch_rs = torch.empty(3), torch.empty(3)
    dist.reduce_scatter(ours_rs, parts, async_op=True).wait()
    summed = torch.cat(parts)
    tdist.all_reduce(summed)
    torch_rs.copy_(summed.view(n, 3)[rank])
    # all_reduce_coalesced: several tensors, one call, in place
    coalesced = [torch.randn(2, 2, generator=g), torch.randn(5, generator=g)]
    expected = [t.clone() for t in coalesced]
    for t in expected:
        tdist.all_reduce(t)
    dist.all_reduce_coalesced(coalesced)
    # point to point: blocking pair ordered by rank, then a batch that would deadlock blocking
    sent = torch.full((4,), float(rank))
    got = torch.empty(4)
    if rank == 0:
        dist.send(sent, 1)
        src = dist.recv(got, 1)
    else:
        src = dist.recv(got, 0)
        dist.send(sent, 0)
    swapped = torch.empty(4)
    for work in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, sent + 10, peer), dist.P2POp(dist.irecv, swapped, peer)]
    ):
        work.wait()
    async_got = torch.empty(1)
    pending = dist.irecv(async_got, peer) if rank == 0 else dist.isend(torch.ones(1), peer)
    pending.wait()
    dist.monitored_barrier(wait_all_ranks=True)
    errors = []
    for call in (lambda: dist.recv(got, None), lambda: dist.send(sent, peer, tag=3)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return {
        "a2a": [[o.tolist() for o in outs[k]] for k in ("ours", "torch")],
        "rs": (ours_rs.tolist(), torch_rs.tolist()),
        "coalesced": ([t.tolist() for t in coalesced], [t.tolist() for t in expected]),
        "p2p": (got.tolist(), src, swapped.tolist()),
        "errors": errors,
        "launcher": (dist.get_world_rank_from_launcher(), dist.get_world_size_from_launcher()),
        "async_got": async_got.item() if rank == 0 else None,
    }


def test_deepspeed_comm_list_forms_and_point_to_point_match_torch():
    """DeepSpeed's remaining torch-shaped calls (`all_to_all` and `reduce_scatter` on lists,
    `all_reduce_coalesced`, send/recv and their batch) give torch.distributed's values; a
    receive from any rank or a tagged message is refused naming the fix."""
    for rank, res in enumerate(run_distributed(_list_forms_and_p2p, world_size=2, timeout_s=120)):
        assert res["a2a"][0] == res["a2a"][1]
        assert res["rs"][0] == pytest.approx(res["rs"][1])
        assert res["coalesced"][0] == res["coalesced"][1]
        got, src, swapped = res["p2p"]
        assert got == [float(1 - rank)] * 4 and src == 1 - rank
        assert swapped == [11.0 - rank] * 4
        assert "pass the sending rank as src" in res["errors"][0]
        assert "leave tag at 0" in res["errors"][1]
        assert res["launcher"] == (rank, 2)
        assert res["async_got"] == (1.0 if rank == 0 else None)
        assert res["async_got"] == (1.0 if rank == 0 else None)
