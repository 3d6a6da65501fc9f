"""`checkpoint.use_node_local_storage`: two torchrun agents on one machine act as two nodes whose
ranks each get their own directory. Without the key the save is refused on every rank, naming
the problem and the key, before a checkpoint file is written; with it, each node keeps its
ranks' shards plus its own common files, and both save and load."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).resolve().parent / "scripts" / "node_local_job.py"
MINISPEED = [sys.executable, "-m", "minispeed.engine.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_without_a_shared_directory(tmp_path) -> None:
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    common = ["--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    agents = [
        subprocess.Popen(
            [
                *MINISPEED,
                "run",
                *common,
                "--node_rank",
                str(node),
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
        for node in (0, 1)
    ]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["node"] for s in seen] == [0, 1]

    for s in seen:  # refused on every rank, before any checkpoint file exists
        assert "is not shared by all ranks" in s["refused"], s["refused"]
        assert "use_node_local_storage" in s["refused"]
        assert s["files_after_refusal"] == []

    for stage in (0, 1):
        for rank, s in enumerate(seen):
            got = s[f"stage{stage}"]
            assert got["fresh"] != got["saved"]  # training moved the weights
            assert got["loaded"] == got["saved"] and got["steps"] == 3
            assert got["client"] == {"node": rank}
            files = got["files"]
            # this node's own shards (every piece its rank needs), common files and `latest`
            assert f"global_step3/weights.rank{rank:05d}-of-00002.pt" in files, files
            assert f"global_step3/weights.rank{1 - rank:05d}-of-00002.pt" not in files, files
            for name in ("latest", "global_step3/common.pt", "global_step3/metadata.json",
                         "global_step3/grid.json"):  # fmt: skip
                assert name in files, (name, files)
