"""Process grids give each rank the right coordinates and groups; the two-level all-gather equals the flat one."""

import pytest
import torch
from torch.testing import assert_close

import minispeed.comm as comm
from minispeed.core.testing import run_distributed


def test_coordinates_row_major_last_axis_fastest():
    topo = comm.ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 1])
    assert topo.world_size == 4
    assert [topo.get_coord(r) for r in range(4)] == [
        {"pipe": 0, "data": 0, "model": 0},
        {"pipe": 0, "data": 1, "model": 0},
        {"pipe": 1, "data": 0, "model": 0},
        {"pipe": 1, "data": 1, "model": 0},
    ]
    assert topo.get_rank(pipe=1, data=0, model=0) == 2
    assert topo.axis_groups("data") == [[0, 1], [2, 3]]
    assert topo.axis_groups("pipe") == [[0, 2], [1, 3]]
    assert topo.axis_groups("model") == [[0], [1], [2], [3]]
    assert topo.ranks_with(pipe=1) == [2, 3]


def test_topology_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one size per axis"):
        comm.ProcessTopology(axes=["a", "b"], dims=[2])
    with pytest.raises(ValueError, match="distinct names"):
        comm.ProcessTopology(axes=["a", "a"], dims=[2, 2])
    with pytest.raises(ValueError, match="unknown axis 'tensor'"):
        comm.ProcessTopology(axes=["data"], dims=[2]).axis_groups("tensor")


def _grid_body(rank: int, world_size: int) -> dict:
    grid = comm.ProcessGrid(comm.ProcessTopology(axes=["pipe", "data"], dims=[2, 2]))
    out = {"coord": grid.coord}
    for axis in ("pipe", "data"):
        # all_reduce of the global rank along the axis: the sum of the group's ranks
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=grid.group(axis))
        out[axis] = (
            grid.group_ranks(axis),
            t.item(),
            grid.rank_in(axis),
            comm.get_rank(grid.group(axis)),
        )
    return out


def test_grid_groups_on_four_ranks():
    results = run_distributed(_grid_body, world_size=4)
    for rank, res in enumerate(results):
        pipe, data = divmod(rank, 2)
        assert res["coord"] == {"pipe": pipe, "data": data}
        data_ranks = [2 * pipe, 2 * pipe + 1]
        pipe_ranks = [data, data + 2]
        assert res["data"] == (data_ranks, float(sum(data_ranks)), data, data)
        assert res["pipe"] == (pipe_ranks, float(sum(pipe_ranks)), pipe, pipe)


def _hierarchical_body(rank: int, world_size: int) -> dict:
    hier = comm.HierarchicalAllGather(node_size=2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 2, generator=g)
    flat = torch.empty(world_size * 3, 2)
    comm.all_gather_into_tensor(flat, x)
    two_level = torch.empty(world_size * 3, 2)
    with comm.CommsLogger() as log:
        hier.all_gather_into_tensor(two_level, x)
    assert_close(two_level, flat)
    # a sub-set of ranks: {1, 3} as one "node" pair... built collectively by all ranks
    pair = comm.HierarchicalAllGather(node_size=1, ranks=[1, 3])
    if rank in (1, 3):
        out = torch.empty(2 * 3, 2)
        pair.all_gather_into_tensor(out, x)
        assert_close(out, torch.cat([flat[3:6], flat[9:12]]))
    else:
        with pytest.raises(comm.CommInputError, match="not one of the ranks"):
            pair.all_gather_into_tensor(torch.empty(6, 2), x)
    return [(r.op, r.group_size, r.msg_bytes) for r in log.records]


def test_hierarchical_all_gather_equals_flat_on_four_ranks():
    for records in run_distributed(_hierarchical_body, world_size=4):
        m = 3 * 2 * 4  # bytes per rank
        # intra-node: 2 ranks gather 2m; inter-node: 2 nodes gather the 4m result
        assert records == [("all_gather", 2, 2 * m), ("all_gather", 2, 4 * m)]


def test_hierarchical_node_size_must_divide():
    with pytest.raises(ValueError, match="must divide the number of ranks 3"):
        comm.HierarchicalAllGather(node_size=2, ranks=[0, 1, 2])
