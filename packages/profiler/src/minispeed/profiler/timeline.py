"""A timeline of one training step across ranks: one Chrome trace JSON, opened in Perfetto.

```bash
python -m minispeed.profiler trace --nproc 2 --out step.json examples/my_train.py --steps 3
```

The script marks its steps with `minispeed.profiler.traced_step()`:

```python
for batch in batches:
    with profiler.traced_step():   # a no-op unless run under `trace`
        train_step(batch)
```

Under `trace`, each rank records the chosen step (`--step`, default 1: step 0 warms up) with
`torch.profiler` and writes `rank<r>.json`; `merge_traces` then builds one trace where each rank
is a process and each collective its own track (Note [tracks]).

Note [tracks]: in a rank's own trace, events sit on the thread that ran them: the main thread
(forward, the optimizer step, the *call* of each collective and its wait), autograd's threads
and the backend's worker threads (gloo runs the transfer itself on one, as `gloo:all_reduce`).
`merge_traces` re-files each event by what it is: an outermost event named like a collective
(`comm.*`, `zero*`, `pipeline.*`, `gloo:*`, `nccl:*`, `c10d::*`, see `COLLECTIVE_PREFIXES`)
opens a track named after it, and everything nested inside it follows it there; the rest of
the main thread is `compute`, and other threads keep a track each (`thread <id>`). So a
stage-3 step shows `compute`, `zero3.gather`, `comm.reduce_scatter`, `gloo:all_gather`, ...
one above the other, per rank, on one clock (all ranks' timestamps come from the same host
clock; across hosts they are only as aligned as the hosts' clocks).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from minispeed.core.accelerator import get_accelerator

__all__ = ["COLLECTIVE_PREFIXES", "merge_traces", "record_step", "traced_step"]

COLLECTIVE_PREFIXES = ("comm.", "zero", "pipeline.p2p", "gloo:", "nccl:", "c10d::", "moe.")
TRACE_DIR_ENV = "MINISPEED_TRACE_DIR"
TRACE_STEP_ENV = "MINISPEED_TRACE_STEP"
_step_counter = 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def record_step(out_dir: str | os.PathLike[str], rank: int | None = None) -> Iterator[None]:
    """Record what runs inside with `torch.profiler` (CPU, and CUDA when present) and write it
    to `out_dir/rank<rank>.json` (rank from `RANK`, else 0). Written atomically."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if get_accelerator().device().type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    rank = _rank() if rank is None else rank
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        yield
    fd, tmp = tempfile.mkstemp(dir=out, suffix=".json.tmp")
    os.close(fd)
    prof.export_chrome_trace(tmp)
    os.replace(tmp, out / f"rank{rank}.json")


@contextlib.contextmanager
def traced_step() -> Iterator[None]:
    """Mark one training step. Under `python -m minispeed.profiler trace` (which sets
    `MINISPEED_TRACE_DIR`), the step numbered `MINISPEED_TRACE_STEP` is recorded; otherwise
    this does nothing."""
    global _step_counter
    step, _step_counter = _step_counter, _step_counter + 1
    out_dir = os.environ.get(TRACE_DIR_ENV)
    if out_dir is None or step != int(os.environ.get(TRACE_STEP_ENV, "1")):
        yield
        return
    with record_step(out_dir):
        yield


def _is_collective(name: str) -> bool:
    return name.startswith(COLLECTIVE_PREFIXES)


def _tracks_of_rank(events: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(track name, event) for each complete ("X") event of one rank (Note [tracks])."""
    xs = [
        e
        for e in events
        if e.get("ph") == "X" and "ts" in e and "dur" in e and e.get("cat") != "Trace"
    ]  # "Trace": the profiler's own span around the recording, not work
    main_tid = min((e["tid"] for e in xs if e.get("tid") == e.get("pid")), default=None)
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in xs:
        by_tid.setdefault(e["tid"], []).append(e)
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))  # parents before children
        default = "compute" if tid == main_tid or main_tid is None else f"thread {tid}"
        open_roots: list[tuple[float, str]] = []  # (end, track) of enclosing collectives
        for e in evs:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            while open_roots and open_roots[-1][0] <= start:
                open_roots.pop()
            if open_roots:
                track = open_roots[-1][1]
            elif _is_collective(e["name"]):
                track = e["name"]
                open_roots.append((end, track))
            else:
                track = default
            if open_roots and track == open_roots[-1][1] and end > open_roots[-1][0]:
                open_roots[-1] = (end, track)  # clock jitter: a child may end a hair late
            yield track, e


def merge_traces(rank_files: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> dict:
    """Merge per-rank Chrome traces (`rank_files[r]` is rank r's) into one trace at `out`:
    process `rank r`, tracks `compute`, one per collective name, one per other thread.
    Returns the merged trace (a dict with `traceEvents`)."""
    merged: list[dict[str, Any]] = []
    for rank, path in enumerate(rank_files):
        with open(path) as f:
            data = json.load(f)
        track_ids: dict[str, int] = {}
        for track, event in _tracks_of_rank(data.get("traceEvents", [])):
            tid = track_ids.setdefault(track, len(track_ids))
            merged.append({**event, "pid": rank, "tid": tid})
        merged.append(_meta("process_name", rank, 0, name=f"rank {rank}"))
        merged.append(_meta("process_sort_index", rank, 0, sort_index=rank))
        order = sorted(track_ids, key=lambda t: (t != "compute", t.startswith("thread"), t))
        for i, track in enumerate(order):
            merged.append(_meta("thread_name", rank, track_ids[track], name=track))
            merged.append(_meta("thread_sort_index", rank, track_ids[track], sort_index=i))
    trace = {"traceEvents": merged, "displayTimeUnit": "ms"}
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump(trace, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return trace


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def track_names(trace: dict, rank: int) -> list[str]:
    """The track names of `rank` in a merged trace (for tests and quick looks)."""
    return [
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == rank
    ]


def events_on(trace: dict, rank: int, track: str) -> Iterable[dict[str, Any]]:
    """The complete events of `rank` on the track called `track`."""
    tid = next(
        e["tid"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == rank
        and e["args"]["name"] == track
    )  # fmt: skip
    return [
        e
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e["pid"] == rank and e["tid"] == tid
    ]
