"""The one error a distributed test raises, and how its message is laid out.

A failing distributed run has up to four kinds of ranks, and the message names each kind so the
reader knows where to look first:

- **raised**: the body raised; its traceback is shown, every line tagged `[rank N]`;
- **died**: the process exited without reporting (`os._exit`, a segfault, the OOM killer); shown
  with its exit code or signal name;
- **did not finish**: still running when the run gave up (timeout, or the grace period after
  another rank failed); shown with its Python stack, dumped by `faulthandler` just before the
  process was killed;
- **finished**: returned normally; listed by number only (their output is not the problem).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping

__all__ = ["DistributedTestError", "describe_exit", "tag_lines", "trim_stack_dump"]


class DistributedTestError(RuntimeError):
    """A distributed run failed: a rank raised, died, hung, or returned something unpicklable.

    The message is self-contained (every failing rank's traceback, tagged `[rank N]`). The same
    facts are kept as attributes so tests of the harness, and callers that expect a failure, can
    check them without parsing text:

    - `tracebacks`: `{rank: formatted traceback}` of ranks that raised, in failure order;
    - `exit_codes`: `{rank: exitcode}` of ranks whose process died (negative = signal);
    - `finished`: ranks that returned normally;
    - `unfinished`: ranks still running when the run gave up;
    - `timed_out`: True when the run hit `timeout_s`.
    """

    def __init__(
        self,
        message: str,
        *,
        tracebacks: Mapping[int, str] | None = None,
        exit_codes: Mapping[int, int] | None = None,
        finished: Iterable[int] = (),
        unfinished: Iterable[int] = (),
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.tracebacks = dict(tracebacks or {})
        self.exit_codes = dict(exit_codes or {})
        self.finished = sorted(finished)
        self.unfinished = sorted(unfinished)
        self.timed_out = timed_out


def tag_lines(rank: int, text: str) -> str:
    """Prefix every line of `text` with `[rank N] ` so interleaved reports stay attributable."""
    return "\n".join(f"[rank {rank}] {line}" for line in text.rstrip("\n").splitlines())


def describe_exit(exitcode: int | None) -> str:
    """Human words for a `multiprocessing` exit code: `exit code 3`, `signal SIGSEGV, exit code -11`."""
    if exitcode is None:
        return "no exit code (still running)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"signal {name}, exit code {exitcode}"
    return f"exit code {exitcode}"


def trim_stack_dump(text: str, harness_file: str, watchdog_function: str) -> str:
    """Keep what a reader needs from a `faulthandler` dump of a hung worker.

    Drops the harness's watchdog thread, and in every other thread the frames from the
    harness's own `harness_file` downwards (worker loop, multiprocessing bootstrap): they are
    the same in every report. The frames above them are the body's and the library's.
    """
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    kept = []
    for block in blocks:
        lines = block.splitlines()
        if any(
            harness_file in line and line.endswith(f" in {watchdog_function}") for line in lines
        ):
            continue
        cut = next((i for i, line in enumerate(lines) if i and harness_file in line), len(lines))
        if cut == 1:  # caught inside the harness itself (e.g. tearing down): keep its frames
            cut = len(lines)
        kept.append("\n".join(lines[:cut]))
    return "\n\n".join(kept)


def _waits_in_torch_distributed(stack: str) -> bool:
    """True if the innermost frame of the dump's first thread with frames is in torch.distributed."""
    for line in stack.splitlines():
        if line.lstrip().startswith("File "):
            return "torch/distributed/" in line.replace("\\", "/")
    return False


def format_failure(
    label: str,
    world_size: int,
    *,
    first_failure: str | None,
    tracebacks: Mapping[int, str],
    exit_codes: Mapping[int, int],
    finished: Iterable[int],
    unfinished: Iterable[int],
    not_started: Iterable[int],
    stacks: Mapping[int, str],
    timeout_s: float,
    timed_out: bool,
) -> str:
    """The full report of a failed run: one summary line per kind of rank, then the details.

    For ranks that did not finish, the summary separates those waiting inside torch.distributed
    (usually victims, blocked in a collective) from those elsewhere (usually the culprit).
    """
    finished, unfinished, not_started = sorted(finished), sorted(unfinished), sorted(not_started)
    if timed_out:
        head = f"{label} on {world_size} ranks timed out after {timeout_s:g} s"
    else:
        head = f"{label} on {world_size} ranks failed"
    lines = [head + ":"]
    if first_failure is not None:
        lines.append(f"  first failure: {first_failure}")
    if tracebacks:
        lines.append(f"  raised: ranks {sorted(tracebacks)}")
    for rank, code in sorted(exit_codes.items()):
        lines.append(f"  died: rank {rank} ({describe_exit(code)})")
    lines.append(f"  finished: ranks {finished}")
    if unfinished:
        why = "timeout" if timed_out else "grace period after the first failure"
        lines.append(f"  did not finish: ranks {unfinished} (killed at the {why})")
        waiting = [r for r in unfinished if _waits_in_torch_distributed(stacks.get(r, ""))]
        elsewhere = [r for r in unfinished if r not in waiting and "File " in stacks.get(r, "")]
        if waiting:
            lines.append(f"    waiting inside torch.distributed (a collective?): ranks {waiting}")
        if elsewhere:
            lines.append(f"    busy elsewhere (look here first): ranks {elsewhere}")
    if not_started:
        lines.append(f"  not started: ranks {not_started} (rank 0 failed before the rendezvous)")
    for rank, text in tracebacks.items():
        lines.append("")
        lines.append(tag_lines(rank, text))
    if stacks:
        lines.append("")
        lines.append("Python stacks of the ranks that did not finish (most recent call first):")
        for rank, text in sorted(stacks.items()):
            lines.append(tag_lines(rank, text or "(no stack dump received)"))
    return "\n".join(lines)
