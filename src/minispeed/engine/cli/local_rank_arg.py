"""Start a training script with `--local_rank=<LOCAL_RANK>` before its own arguments, as
DeepSpeed's launcher does (`deepspeed/launcher/launch.py`: `cmd.append(f"--local_rank={...}")`
between the script and its arguments, unless `--no_local_rank`).

`minispeed run` hands `torch.distributed.run` this file, run by its path
(`python -u local_rank_arg.py [-m] script args`), because torch starts the same command on every
rank and only the rank's own process knows its `LOCAL_RANK`. It replaces itself (`os.execv`:
the same process id, environment and output streams, so torch's agent watches, signals and
logs the script itself) with `python -u [-m] script --local_rank=N args`. It imports nothing of
minispeed or torch: its cost is one more interpreter start per rank (tens of milliseconds).
"""

from __future__ import annotations

import os
import sys


def command(argv: list[str], local_rank: str) -> list[str]:
    """The script's command line: `argv` is `[-m] script args`."""
    module = argv[:1] == ["-m"]
    target, *rest = argv[1:] if module else argv
    return [sys.executable, "-u", *(["-m"] if module else []), target,
            f"--local_rank={local_rank}", *rest]  # fmt: skip


if __name__ == "__main__":
    cmd = command(sys.argv[1:], os.environ["LOCAL_RANK"])
    os.execv(cmd[0], cmd)
