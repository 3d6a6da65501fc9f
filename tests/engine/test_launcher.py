"""`minispeed run` launches through torch.distributed.run: one machine, two agents acting as two
nodes, a DeepSpeed hostfile, a failing rank named with its exit code, and bad input refused
before anything starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minispeed.engine.cli import local_rank_arg
from minispeed.engine.cli.launcher import HostfileError, LaunchArgs, LaunchError, torchrun_argv

JOB = Path(__file__).resolve().parent / "scripts" / "allreduce_job.py"
MINISPEED = [sys.executable, "-m", "minispeed.engine.cli"]


def _minispeed(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [*MINISPEED, *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_on_one_machine(tmp_path) -> None:
    proc = _minispeed("run", "--num_gpus", "2", str(JOB), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(s["world"] == 2 and s["sum"] == 1.0 for s in seen)
    # DeepSpeed's launcher: `--local_rank=N` before the script's own arguments, LOCAL_RANK set
    for r, s in enumerate(seen):
        assert s["argv"] == [f"--local_rank={r}", "--out", str(tmp_path)]
        assert s["LOCAL_RANK"] == str(r)


def test_deepspeeds_commands_run_minispeeds(tmp_path) -> None:
    """The `deepspeed` distribution installs DeepSpeed's `deepspeed` launcher and `ds_report`."""
    from importlib import metadata

    try:
        scripts = {e.name: e.value for e in metadata.distribution("deepspeed").entry_points}
    except metadata.PackageNotFoundError:
        pytest.skip("packages/deepspeed_compat is not installed")
    assert scripts["deepspeed"] == "minispeed.engine.cli.main:deepspeed_main"
    assert scripts["ds_report"] == "minispeed.engine.cli.main:ds_report_main"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [Path(sys.executable).parent / "deepspeed", "--num_gpus=2", str(JOB), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180, env={**env, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["argv"][0] for s in seen] == ["--local_rank=0", "--local_rank=1"]


def test_no_local_rank_passes_the_arguments_as_given(tmp_path) -> None:
    proc = _minispeed("run", "--no_local_rank", str(JOB), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["argv"] == ["--out", str(tmp_path)] and seen["LOCAL_RANK"] == "0"


def test_a_script_without_local_rank_stops_with_argparses_error(tmp_path) -> None:
    """As under DeepSpeed's launcher: the script must declare `--local_rank` (or the job runs
    with `--no_local_rank`)."""
    script = tmp_path / "strict.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    proc = _minispeed("run", str(script))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unrecognized arguments: --local_rank=0" in proc.stdout + proc.stderr
    assert _minispeed("run", "--no_local_rank", str(script)).returncode == 0


def test_the_rank_command_puts_local_rank_between_the_script_and_its_arguments() -> None:
    assert local_rank_arg.command(["train.py", "--x", "1"], "3")[2:] == [
        "train.py", "--local_rank=3", "--x", "1"
    ]  # fmt: skip
    assert local_rank_arg.command(["-m", "pkg.train"], "0")[2:] == [
        "-m", "pkg.train", "--local_rank=0"
    ]  # fmt: skip
    argv = torchrun_argv(LaunchArgs(script="pkg.train", module=True))
    assert argv[-3:] == [local_rank_arg.__file__, "-m", "pkg.train"] and "--module" not in argv
    plain = torchrun_argv(LaunchArgs(script="pkg.train", module=True, no_local_rank=True))
    assert plain[-2:] == ["--module", "pkg.train"]


def test_two_agents_act_as_two_nodes(tmp_path) -> None:
    port = str(_free_port())
    common = ["--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    agents = [
        subprocess.Popen(
            [
                *MINISPEED,
                "run",
                *common,
                "--node_rank",
                str(n),
                "--nproc_per_node",
                "1",
                str(JOB),
                "--out",
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for n in (0, 1)
    ]
    outputs = [a.communicate(timeout=180)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["node"] for s in seen] == ["0", "1"] and all(s["sum"] == 1.0 for s in seen)


def test_a_failing_rank_stops_the_job_and_is_named(tmp_path) -> None:
    proc = _minispeed(
        "run", "--nproc_per_node", "2", str(JOB), "--out", str(tmp_path), "--fail-rank", "1"
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"rank 1 (local rank 1) on host {socket.gethostname()}" in proc.stdout
    assert "exit code 3" in proc.stdout
    summary = proc.stdout[proc.stdout.index("minispeed run: rank 1") :]
    assert "RuntimeError: rank 1 was told to fail" in summary  # its traceback, shown again


def test_an_uncaught_chained_exception_is_shown_to_its_last_line(tmp_path) -> None:
    """After init_process_group torch prefixes a rank's stderr with `[rank1]: `; the summary
    still finds the traceback and follows its chained cause to the final exception."""
    proc = _minispeed(
        "run", "--nproc_per_node", "2", str(JOB), "--out", str(tmp_path), "--fail-rank", "1",
        "--uncaught",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = proc.stdout[proc.stdout.index("minispeed run: rank 1") :]
    assert "ValueError: the cause" in summary
    assert summary.rstrip().endswith("RuntimeError: rank 1 raised"), summary


def test_hostfile_gives_nodes_rank_slots_and_master(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nworker-0 slots=4\nworker-1 slots=2  # the small one\n")
    argv = torchrun_argv(
        LaunchArgs(script=str(JOB), hostfile=str(hosts), node_rank=1, master_port=_free_port())
    )
    assert argv[:4] == ["--nproc_per_node=2", "--nnodes=2", "--node_rank=1",
                        "--master_addr=worker-0"]  # fmt: skip
    only = torchrun_argv(
        LaunchArgs(script=str(JOB), hostfile=str(hosts), include="worker-1", node_rank=0)
    )
    assert "--nproc_per_node=2" in only and "--nnodes=1" in only


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        (dict(script="no_such_script.py"), LaunchError, "does not exist"),
        (dict(nproc_per_node=0), LaunchError, "--nproc_per_node must be >= 1"),
        (dict(hostfile="HOSTS", include="worker-9"), HostfileError, "does not list"),
        (dict(hostfile="BAD"), HostfileError, "line 2"),
        (dict(hostfile="HOSTS", node_rank=None), HostfileError, "is not among the hosts"),
        (dict(nnodes=2, node_rank=0, master_port="BUSY"), LaunchError, "in use"),
        (dict(include="worker-0"), LaunchError, "need a --hostfile"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(tmp_path, args, error, words) -> None:
    (tmp_path / "HOSTS").write_text("worker-0 slots=1\nworker-1 slots=1\n")
    (tmp_path / "BAD").write_text("worker-0 slots=1\nworker-1 slots=two\n")
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    try:
        args = {
            "script": str(JOB),
            **args,
            **({"hostfile": str(tmp_path / args["hostfile"])} if "hostfile" in args else {}),
            **({"master_port": busy.getsockname()[1]} if args.get("master_port") == "BUSY" else {}),
        }
        with pytest.raises(error, match=words):
            torchrun_argv(LaunchArgs(**args))
    finally:
        busy.close()


def test_cli_bad_input_exits_2_with_the_reason(tmp_path) -> None:
    proc = _minispeed("run", "--nproc_per_node", "0", str(JOB))
    assert proc.returncode == 2 and "--nproc_per_node must be >= 1" in proc.stderr
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 8,}')
    proc = _minispeed("report", "--config", str(bad))
    assert proc.returncode == 2 and "line 1, column 24" in proc.stderr


DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
DEMO_ARGS = ["--steps", "3", "--no-progress", "--no-checkpoint", "--eval-batches", "1",
             "--eval-interval", "1000"]  # fmt: skip


@pytest.mark.timeout(400)
def test_two_agents_train_the_demo_like_one_agent(tmp_path) -> None:
    """Two nodes of one process each (two agents, one machine) give the losses one agent with
    two processes gives: the same ranks, the same collectives, the same bits."""
    cfg = str(DEMO.parent / "configs" / "zero2.json")
    one = _minispeed("run", "--num_gpus", "2", str(DEMO), "--config", cfg, "--out-dir",
                     str(tmp_path / "one"), *DEMO_ARGS, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    agents = [
        subprocess.Popen(
            [
                *MINISPEED,
                "run",
                "--num_nodes",
                "2",
                "--node_rank",
                str(n),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "--num_gpus",
                "1",
                str(DEMO),
                "--config",
                cfg,
                "--out-dir",
                str(tmp_path / "two"),
                *DEMO_ARGS,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for n in (0, 1)
    ]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    want = json.loads((tmp_path / "one" / "metrics.json").read_text())
    got = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert got["world_size"] == want["world_size"] == 2
    assert got["losses"] == want["losses"] and len(got["losses"]) == 3
