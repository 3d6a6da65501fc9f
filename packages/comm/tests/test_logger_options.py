"""The comms logger's options, DeepSpeed's `comms_logger` keys: `prof_all: false` with `prof_ops`
records only the named collectives, `verbose` prints each record on rank 0 as it is added, and
`debug` records the function that called each collective, splitting the summary by it."""

import logging

import pytest
import torch

import minispeed.comm as comm
from minispeed.core.config import ConfigError
from minispeed.core.testing import run_distributed


def _reduce_in_forward() -> None:
    comm.all_reduce(torch.ones(4))


def _reduce_in_backward() -> None:
    comm.all_reduce(torch.ones(4))


def _options_run(rank: int, world_size: int) -> dict:
    printed: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: printed.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("minispeed").addHandler(handler)
    try:
        # DeepSpeed's names: all_gather_into_tensor is our all_gather
        only = comm.CommsLoggerConfig.from_section(
            {"enabled": True, "prof_all": False, "prof_ops": ["all_gather_into_tensor"]}
        )
        with comm.CommsLogger.from_config(only) as selected:
            comm.all_reduce(torch.ones(8))
            comm.all_gather_into_tensor(torch.empty(2 * world_size), torch.ones(2))
            comm.all_reduce(torch.ones(8), async_op=True).wait()
            comm.broadcast(torch.ones(3), src=0)
        quiet = len(printed)
        loud = comm.CommsLoggerConfig.from_section(
            {"enabled": True, "verbose": True, "debug": True}
        )
        with comm.CommsLogger.from_config(loud) as traced:
            _reduce_in_forward()
            _reduce_in_backward()
            _reduce_in_backward()
    finally:
        logging.getLogger("minispeed").removeHandler(handler)
    return {
        "selected": [r.op for r in selected.records],
        "quiet": quiet,
        "callers": [r.caller for r in traced.records],
        "rows": sorted((row["caller"], row["count"]) for row in traced.aggregate()),
        "printed": printed,
    }


def test_prof_ops_verbose_and_debug_as_deepspeed_means_them() -> None:
    results = run_distributed(_options_run, world_size=2, timeout_s=60)
    for res in results:
        assert res["selected"] == ["all_gather"]  # the all-reduces and the broadcast: untimed
        assert res["quiet"] == 0  # verbose is off by default
        forward, backward = "_reduce_in_forward", "_reduce_in_backward"
        assert res["callers"] == [forward, backward, backward]
        assert res["rows"] == [("_reduce_in_backward", 2), ("_reduce_in_forward", 1)]
    lines = results[0]["printed"]
    assert len(lines) == 3 and all(x.startswith("comm op: all_reduce | caller: ") for x in lines)
    assert "| msg size: 16 B | algbw (Gbps): " in lines[0] and "busbw (Gbps)" in lines[0]
    assert results[1]["printed"] == []  # rank 0 prints, as DeepSpeed's log_dist(ranks=[0])


def test_prof_ops_names_an_unknown_collective_with_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        comm.CommsLoggerConfig.from_section({"prof_ops": ["all_reduce", "allreduce"]})
    assert err.value.path == "comms_logger.prof_ops"
    assert "did you mean 'all_reduce'" in err.value.reason and "all_to_all_single" in str(err.value)


def test_the_default_section_records_every_op() -> None:
    """prof_all is true by default (DeepSpeed's): the logger records every op, prints nothing."""
    log = comm.CommsLogger.from_config(comm.CommsLoggerConfig.from_section({"enabled": True}))
    assert log.ops is None and not log.verbose and not log.callers
