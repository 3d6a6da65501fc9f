"""The distributed test harness: results, failure reports, timeouts, crashes, and worker reuse.

Every body here runs in real gloo processes from the pool. Bodies use torch.distributed
directly because minispeed.core sits below minispeed.comm (the harness is the one core module
allowed to touch process groups).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from minispeed.core.testing import (
    DistributedTestError,
    distributed_test,
    run_distributed,
    worker_pids,
)

TIMEOUT_S = 120.0


# -- bodies (module level: workers look them up by module and name) ------------------------------


def _all_reduce_body(rank: int, world_size: int, scale: float) -> torch.Tensor:
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)]) * scale
    dist.all_reduce(t)
    return t


def _env_body(rank: int, world_size: int) -> dict[str, object]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    keys += ("MINISPEED_ACCELERATOR", "HARNESS_TEST_FLAG", "HARNESS_TEST_PARENT")
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "threads": torch.get_num_threads(),
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "pid": os.getpid(),
    }


def _raise_on_rank1_body(rank: int, world_size: int) -> int:
    if rank == 1:
        value = 3
        assert value == 4, "rank one disagrees"
    return rank


def _hang_body(rank: int, world_size: int, sleep_s: float) -> None:
    if rank == 1:
        time.sleep(sleep_s)  # the hanging rank
    dist.barrier()  # rank 0 waits here for rank 1


def _exit_body(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _unpicklable_return_body(rank: int, world_size: int) -> object:
    return (lambda: rank) if rank == 0 else rank


def _pid_body(rank: int, world_size: int) -> int:
    return os.getpid()


def _kwargs_body(rank: int, world_size: int, a: int, *, b: str = "x") -> tuple[int, int, str]:
    return rank, a, b


# -- results --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_returns_the_sum_on_every_rank(world_size: int) -> None:
    results = run_distributed(_all_reduce_body, world_size, args=(0.5,), timeout_s=TIMEOUT_S)
    expected = sum(torch.tensor([r + 1.0, 10.0 * (r + 1)]) * 0.5 for r in range(world_size))
    assert len(results) == world_size
    for tensor in results:
        torch.testing.assert_close(tensor, expected)


def test_args_and_kwargs_reach_the_body_and_results_come_back_in_rank_order() -> None:
    results = run_distributed(_kwargs_body, 2, args=(7,), kwargs={"b": "y"}, timeout_s=TIMEOUT_S)
    assert results == [(0, 7, "y"), (1, 7, "y")]


def test_workers_see_torchrun_env_cpu_and_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_TEST_PARENT", "from-parent")  # set after the pool started
    monkeypatch.setenv("MINISPEED_ACCELERATOR", "cuda")  # the harness forces cpu by default
    results = run_distributed(_env_body, 2, env={"HARNESS_TEST_FLAG": "on"}, timeout_s=TIMEOUT_S)
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, r in enumerate(results):
        env = r["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MINISPEED_ACCELERATOR"] == "cpu"
        assert env["HARNESS_TEST_FLAG"] == "on"
        assert env["HARNESS_TEST_PARENT"] == "from-parent"
        assert (r["dist_rank"], r["dist_world"], r["threads"]) == (rank, 2, 1)
    assert results[0]["pid"] != results[1]["pid"] != os.getpid()


@distributed_test(world_size=[2, 4], timeout_s=TIMEOUT_S)
def test_decorated_body_runs_on_every_rank(rank: int, world_size: int) -> None:
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world_size)
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, rank)
    assert gathered == list(range(world_size))


def test_decorator_parametrizes_over_world_sizes_with_readable_ids() -> None:
    marks = [
        m for m in test_decorated_body_runs_on_every_rank.pytestmark if m.name == "parametrize"
    ]
    assert len(marks) == 1
    assert marks[0].args == ("world_size", [2, 4])
    assert marks[0].kwargs["ids"] == ["ws2", "ws4"]


def test_decorator_rejects_a_body_without_rank_and_world_size() -> None:
    with pytest.raises(TypeError, match="rank, world_size"):

        @distributed_test(world_size=2)
        def test_bad() -> None: ...


# -- failures -------------------------------------------------------------------------------------


def test_a_raising_rank_is_reported_with_its_traceback_and_rank_tag() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1_body, 2, timeout_s=TIMEOUT_S)
    err = info.value
    message = str(err)
    assert isinstance(err, RuntimeError)
    assert "first failure: rank 1 raised" in message
    assert "[rank 1] AssertionError: rank one disagrees" in message
    assert "[rank 1] assert 3 == 4" in message  # pytest's assert rewriting works in workers
    assert "[rank 1]" in message and "_raise_on_rank1_body" in message
    assert "[rank 0]" not in message  # rank 0 succeeded: no traceback of it
    assert list(err.tracebacks) == [1] and err.finished == [0]


def test_a_hanging_rank_times_out_naming_it_and_the_next_run_is_clean() -> None:
    before = run_distributed(_pid_body, 2, timeout_s=TIMEOUT_S)
    timeout_s = 3.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_body, 2, args=(60.0,), timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.timed_out and 1 in err.unfinished
    assert elapsed < timeout_s + 10.0, f"hang reported after {elapsed:.1f} s"
    message = str(err)
    assert "timed out after 3 s" in message
    # rank 0 waits in the barrier; rank 1, the culprit, is named and its stack shows the sleep.
    assert "busy elsewhere (look here first): ranks [1]" in message
    assert any("[rank 1]" in line and "_hang_body" in line for line in message.splitlines())
    after = run_distributed(_pid_body, 2, timeout_s=TIMEOUT_S)
    assert after[1] != before[1], "the hung worker must be replaced, not reused"
    assert run_distributed(_all_reduce_body, 2, args=(1.0,), timeout_s=TIMEOUT_S)[0].tolist() == [
        3.0,
        30.0,
    ]


def test_a_dying_worker_is_reported_with_its_exit_code_before_the_timeout() -> None:
    run_distributed(_pid_body, 2, timeout_s=TIMEOUT_S)  # workers up: time only the failing run
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_body, 2, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert info.value.exit_codes == {1: 3}
    assert "first failure: rank 1 died (exit code 3)" in str(info.value)
    assert elapsed < 30.0, f"death reported after {elapsed:.1f} s (timeout was {TIMEOUT_S} s)"
    assert run_distributed(_kwargs_body, 2, args=(1,), timeout_s=TIMEOUT_S) == [
        (0, 1, "x"),
        (1, 1, "x"),
    ]


def test_an_unpicklable_return_value_names_the_rank() -> None:
    with pytest.raises(
        DistributedTestError, match=r"\[rank 0\] rank 0 returned a value that cannot be pickled"
    ):
        run_distributed(_unpicklable_return_body, 2, timeout_s=TIMEOUT_S)


def test_lambdas_closures_and_unpicklable_args_are_refused_before_any_process_runs() -> None:
    def closure(rank: int, world_size: int) -> int:
        return rank

    with pytest.raises(ValueError, match="define the body at module level"):
        run_distributed(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError, match="define the body at module level"):
        run_distributed(closure, 2)
    with pytest.raises(TypeError, match="cannot be pickled"):
        run_distributed(_kwargs_body, 2, args=(lambda: 1,))
    with pytest.raises(TypeError, match="signature"):
        run_distributed(_kwargs_body, 2)  # missing `a`
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_pid_body, 0)
    with pytest.raises(ValueError, match="backend"):
        run_distributed(_pid_body, 2, backend="glooo")


# -- reuse and module lookup ----------------------------------------------------------------------


def test_workers_are_reused_across_runs_and_after_a_clean_failure() -> None:
    first = run_distributed(_pid_body, 2, timeout_s=TIMEOUT_S)
    with pytest.raises(DistributedTestError):
        run_distributed(_raise_on_rank1_body, 2, timeout_s=TIMEOUT_S)
    second = run_distributed(_pid_body, 2, timeout_s=TIMEOUT_S)
    assert first == second == [worker_pids()[0], worker_pids()[1]]


_GENERATED_TEST = """
def body(rank, world_size):
    import harness_generated_helper  # lives beside this file; not importable by the parent
    return harness_generated_helper.VALUE * (rank + 1)
"""


def test_a_body_in_an_unimportable_module_finds_its_helper_module(tmp_path) -> None:
    (tmp_path / "test_generated_body.py").write_text(_GENERATED_TEST)
    (tmp_path / "harness_generated_helper.py").write_text("VALUE = 21\n")
    name = f"generated_{tmp_path.name.replace('-', '_')}.test_generated_body"
    spec = importlib.util.spec_from_file_location(name, tmp_path / "test_generated_body.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as pytest's importlib mode does: a name no worker can import
    try:
        spec.loader.exec_module(module)
        assert run_distributed(module.body, 2, timeout_s=TIMEOUT_S) == [21, 42]
    finally:
        del sys.modules[name]
