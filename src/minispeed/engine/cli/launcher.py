"""`minispeed run`: start a training script on every rank, with PyTorch's own launcher.

```bash
minispeed run --nproc_per_node 2 train.py --deepspeed_config ds.json        # one machine
minispeed run --nnodes 2 --node_rank 0 --master_addr node0 --master_port 29500 \\
    --nproc_per_node 8 train.py ...                                         # on each node
minispeed run --hostfile hosts --include node1 train.py ...                 # DeepSpeed's hostfile
```

Everything here turns DeepSpeed's launcher flags into `torch.distributed.run` arguments and hands
over: the processes are started, watched and torn down by torch's elastic agent and c10d
rendezvous, so a job scales out with nothing of ours running beside it. What this module adds:

- **DeepSpeed's names**: `--num_gpus` is `--nproc_per_node`, `--num_nodes` is `--nnodes`.
- **DeepSpeed's `--local_rank=N`**, passed to the script before its own arguments (torch sets
  only `LOCAL_RANK`, which stays set), unless `--no_local_rank`: a script written for
  DeepSpeed declares it (`parser.add_argument("--local_rank", type=int, default=-1)`), and
  one that does not stops with argparse's error, as under DeepSpeed (`local_rank_arg.py`).
- **A DeepSpeed hostfile** (`host slots=N` per line, `#` comments): with `--include` /
  `--exclude` (DeepSpeed's `host1@host2` lists) it gives the node count, this node's rank (its
  place in the list, found by host name or `--node_rank`), its process count (its slots) and the
  master address (the first host). Start `minispeed run --hostfile ...` on every listed host.
- **Checks before anything starts**: the script exists, counts are positive, the hostfile
  parses and names the hosts given, the master port is free on this machine (node 0).
- **A failed rank stops the job**, and the error names the rank, its host, its exit code and
  its first traceback, through its chained causes to the final exception (read back from the
  rank's stderr log, torch's `[rankN]: ` prefixes removed), then exits with that rank's code.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Host",
    "HostfileError",
    "LaunchError",
    "UsageError",
    "read_hostfile",
    "run",
    "torchrun_argv",
]


class UsageError(ValueError):
    """Bad `minispeed` command-line input, found before anything starts (exit code 2)."""


class LaunchError(UsageError):
    """Bad launcher input, found before any process starts."""


class HostfileError(LaunchError):
    """A DeepSpeed hostfile that does not parse or does not name the hosts asked for."""


@dataclass(frozen=True)
class Host:
    """One line of a hostfile: `name slots=N`."""

    name: str
    slots: int


def read_hostfile(path: str | os.PathLike) -> list[Host]:
    """The hosts of a DeepSpeed hostfile, in order; each bad line is an error naming it."""
    p = Path(path)
    if not p.is_file():
        raise HostfileError(f"hostfile {os.fspath(p)!r} does not exist")
    hosts: list[Host] = []
    for number, raw in enumerate(p.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = parts[1].removeprefix("slots=") if len(parts) == 2 else ""
        if len(parts) != 2 or not parts[1].startswith("slots=") or not slots.isdigit():
            raise HostfileError(
                f"{os.fspath(p)}, line {number}: {raw.strip()!r} is not 'hostname slots=N'"
            )
        if int(slots) < 1:
            raise HostfileError(f"{os.fspath(p)}, line {number}: slots must be >= 1, got {slots}")
        if any(h.name == parts[0] for h in hosts):
            raise HostfileError(f"{os.fspath(p)}, line {number}: host {parts[0]!r} listed twice")
        hosts.append(Host(parts[0], int(slots)))
    if not hosts:
        raise HostfileError(f"hostfile {os.fspath(p)!r} lists no host")
    return hosts


def _select(hosts: list[Host], include: str | None, exclude: str | None) -> list[Host]:
    """DeepSpeed's `--include` / `--exclude` (`host1@host2`; a `:slots` suffix is refused)."""
    known = {h.name for h in hosts}

    def names(spec: str, flag: str) -> set[str]:
        out = set()
        for item in spec.split("@"):
            if ":" in item:
                raise HostfileError(
                    f"{flag} {item!r}: choosing GPUs per host is not supported; name whole hosts"
                )
            if item not in known:
                raise HostfileError(
                    f"{flag} names {item!r}, which the hostfile does not list ({sorted(known)})"
                )
            out.add(item)
        return out

    if include and exclude:
        raise HostfileError("give --include or --exclude, not both")
    if include:
        keep = names(include, "--include")
        return [h for h in hosts if h.name in keep]
    if exclude:
        drop = names(exclude, "--exclude")
        return [h for h in hosts if h.name not in drop]
    return hosts


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class LaunchArgs:
    """The launcher's inputs (as `minispeed run` parsed them)."""

    script: str
    script_args: Sequence[str] = ()
    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    module: bool = False
    no_local_rank: bool = False


def torchrun_argv(a: LaunchArgs) -> list[str]:
    """The `torch.distributed.run` arguments for `a`, after every check."""
    if not a.module and not Path(a.script).is_file():
        raise LaunchError(f"training script {a.script!r} does not exist")
    nproc, nnodes, node_rank, addr = a.nproc_per_node, a.nnodes, a.node_rank, a.master_addr
    if a.hostfile is not None:
        hosts = _select(read_hostfile(a.hostfile), a.include, a.exclude)
        if not hosts:
            raise HostfileError("--include/--exclude left no host to run on")
        names = [h.name for h in hosts]
        if node_rank is None:
            me = {socket.gethostname(), socket.getfqdn(), "localhost"}
            mine = [i for i, n in enumerate(names) if n in me]
            if not mine:
                raise HostfileError(
                    f"this machine ({socket.gethostname()}) is not among the hosts {names}; "
                    f"run on one of them or pass --node_rank"
                )
            node_rank = mine[0]
        if not 0 <= node_rank < len(hosts):
            raise HostfileError(f"--node_rank {node_rank} is outside the {len(hosts)} hosts")
        if nnodes is not None and nnodes != len(hosts):
            raise HostfileError(f"--nnodes {nnodes} but the hostfile selects {len(hosts)} hosts")
        nnodes, addr = len(hosts), addr or names[0]
        nproc = nproc if nproc is not None else hosts[node_rank].slots
    elif a.include or a.exclude:
        raise LaunchError("--include/--exclude need a --hostfile")
    nproc = 1 if nproc is None else nproc
    nnodes = 1 if nnodes is None else nnodes
    for name, value in (("--nproc_per_node", nproc), ("--nnodes", nnodes)):
        if value < 1:
            raise LaunchError(f"{name} must be >= 1, got {value}")
    argv = [f"--nproc_per_node={nproc}", f"--nnodes={nnodes}"]
    if nnodes == 1 and addr is None and a.master_port is None:
        argv.append("--standalone")  # a private rendezvous on a free local port
    else:
        node_rank = 0 if node_rank is None else node_rank
        if not 0 <= node_rank < nnodes:
            raise LaunchError(f"--node_rank must be in [0, {nnodes}), got {node_rank}")
        port = 29500 if a.master_port is None else a.master_port
        if not 0 < port < 65536:
            raise LaunchError(f"--master_port must be in 1..65535, got {port}")
        if node_rank == 0 and not _port_free(port):
            raise LaunchError(
                f"--master_port {port} is in use on this machine; pick a free port "
                f"(node 0 listens on it for the rendezvous)"
            )
        argv += [
            f"--node_rank={node_rank}",
            f"--master_addr={addr or '127.0.0.1'}",
            f"--master_port={port}",
        ]
    if a.no_local_rank:
        return [*argv, *(["--module"] if a.module else []), a.script, *a.script_args]
    # Each rank's `--local_rank=N` is added by local_rank_arg.py, in the rank's own process.
    module = ["-m"] if a.module else []
    return [*argv, _LOCAL_RANK_ARG, *module, a.script, *a.script_args]


_LOCAL_RANK_ARG = str(Path(__file__).with_name("local_rank_arg.py"))


def run(a: LaunchArgs) -> int:
    """Launch `a` with `torch.distributed.run`; returns the job's exit code (0: every rank
    succeeded; otherwise the first failed rank's code, after printing which rank failed, on which
    host, and its traceback)."""
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torch_run

    argv = torchrun_argv(a)
    with tempfile.TemporaryDirectory(prefix="minispeed-run-") as logs:
        # Each rank's stderr goes to the console as usual and to a file (`--tee 2`), so the
        # failed rank's traceback can be shown again under the summary.
        try:
            torch_run(get_args_parser().parse_args(["--log-dir", logs, "--tee", "2", *argv]))
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            print(
                f"minispeed run: rank {rank} (local rank {failure.local_rank}) on host "
                f"{socket.gethostname()} failed with exit code {failure.exitcode}; the job was "
                f"stopped"
            )
            trace = _first_traceback(Path(logs), failure.local_rank)
            if trace:
                print("its traceback:\n  " + "\n  ".join(trace))
            return failure.exitcode if failure.exitcode > 0 else 1
    return 0


#: What torch puts before a rank's stderr lines: `--tee`'s `[default0]:`, and `[rank0]: ` once
#: the process group exists.
_LOG_PREFIX = re.compile(r"^(\[default\d+\]:)?(\[rank\d+\]:\s?)?")

#: The lines Python prints between the tracebacks of a chained exception.
_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


def strip_log_prefix(line: str) -> str:
    """`line` without torch's rank prefixes (`[default0]:[rank0]: `)."""
    return _LOG_PREFIX.sub("", line, count=1)


def _first_traceback(logs: Path, local_rank: int, max_lines: int = 40) -> list[str]:
    """The first traceback in local rank `local_rank`'s stderr log, through its chained causes
    to the final exception line (the middle elided past `max_lines`), or `[]`."""
    for path in sorted(logs.glob(f"**/{local_rank}/stderr.log")):
        lines = [strip_log_prefix(x) for x in path.read_text(errors="replace").splitlines()]
        start = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
        if start is None:
            continue
        end = len(lines) - 1
        for i in range(start + 1, len(lines)):
            line = lines[i]
            if not line or line.startswith((" ", "Traceback")) or line in _CHAINED:
                continue
            following = next((x for x in lines[i + 1 :] if x.strip()), "")
            if following not in _CHAINED:  # an exception line no chained traceback follows
                end = i
                break
        block = lines[start : end + 1]
        if len(block) > max_lines:
            block = [*block[:5], "  ...", *block[-(max_lines - 6) :]]
        return block
    return []
