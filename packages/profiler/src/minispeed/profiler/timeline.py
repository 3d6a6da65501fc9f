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
is a process and compute and each collective get their own tracks (Note [tracks]).

Note [tracks]: in a rank's own trace, events sit on the thread that ran them: the main thread
(forward, the optimizer step, the *call* of each collective and its wait), autograd's threads
and the backend's worker threads (gloo runs the transfer itself on one or more, as
`gloo:all_reduce`). `merge_traces` re-files each thread's events by what they are:

- a **collective** (`is_collective`: `comm.*`, `gloo:*`, `nccl:*`, `c10d::*`, or a package
  range named for a transfer, whose last dotted part says gather, scatter, reduce, all_to_all,
  broadcast, send, recv or barrier: `zero3.gather`, `zero3.reduce_scatter`, `pipeline.send`)
  that no other collective encloses opens a track named after it, and everything nested in it
  follows it there: one track per collective name and thread;
- everything else is compute: **phase ranges** (`zero.backward`, `zero.step`,
  `pipeline.forward`, ...) stay on their thread's compute track with the matrix products they
  enclose, and only the collectives nested in them move out. The main thread's compute track
  is `compute`, another thread's `compute [thread i]`, a CUDA stream's (kernels, copies)
  `gpu stream <id>`, with NCCL's kernels (`ncclDevKernel_*`) on a track of their own.

A name produced on several threads (gloo's workers take turns) gets one track per thread,
`gloo:all_reduce [thread i]` (i counts the threads of that rank, in order of first event), so
no two threads share a track. Slices on every track are properly nested: on one thread they
nest by construction, and a child that ends a clock tick after its parent is cut at the
parent's end. All ranks' timestamps come from the same host clock (across hosts they are only
as aligned as the hosts' clocks).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from minispeed.core.accelerator import get_accelerator
from minispeed.core.files import atomic_replace, atomic_write_json

__all__ = ["COLLECTIVE_PREFIXES", "is_collective", "merge_traces", "record_step", "traced_step"]

COLLECTIVE_PREFIXES = ("comm.", "gloo:", "nccl:", "c10d::", "ncclKernel", "ncclDevKernel")
"""Names of the communication calls themselves: minispeed.comm's ranges, the backends' calls
and NCCL's GPU kernels."""
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
"""Events a GPU ran: their "thread" is a CUDA stream, filed as `gpu stream <id>`."""
TRANSFER_WORDS = ("gather", "scatter", "reduce", "all_to_all", "broadcast", "send", "recv",
                  "barrier")  # fmt: skip
"""A package range whose last dotted part holds one of these is a collective too."""
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
    with atomic_replace(out / f"rank{rank}.json") as tmp:
        prof.export_chrome_trace(str(tmp))


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


def is_collective(name: str) -> bool:
    """Whether an event named `name` is communication (Note [tracks]); phases are not."""
    if name.startswith(COLLECTIVE_PREFIXES):
        return True
    if "::" in name or "." not in name:  # an aten/autograd operator, or an unqualified name
        return False
    last = name.rsplit(".", 1)[1]
    return any(word in last for word in TRANSFER_WORDS)


def _ns(x: Any) -> int:
    return round(float(x) * 1000)


def _tracks_of_rank(events: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(track name, event) for each complete ("X") event of one rank (Note [tracks]); events
    come back with their `dur` cut to their parent's end where the clock made them overhang."""
    xs = [
        e
        for e in events
        if e.get("ph") == "X" and "ts" in e and "dur" in e and e.get("cat") != "Trace"
    ]  # "Trace": the profiler's own span around the recording, not work
    # A thread is (pid, tid): a GPU's streams are (device, stream), which may reuse a number.
    main = min(((e["pid"], e["tid"]) for e in xs if e.get("tid") == e.get("pid")), default=None)
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for e in xs:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    if main is None and by_thread:
        main = next(iter(by_thread))
    # Order threads by their first event so "[thread i]" reads the same on every rank.
    threads = sorted(
        by_thread, key=lambda t: (t != main, min(float(e["ts"]) for e in by_thread[t]))
    )
    filed: list[tuple[tuple[int, str], dict[str, Any]]] = []  # ((thread index, name), event)
    for index, thread in enumerate(threads):
        evs = sorted(by_thread[thread], key=lambda e: (_ns(e["ts"]), -_ns(e["dur"])))  # parents 1st
        stack: list[tuple[int, str]] = []  # (end in ns, track name) of the enclosing events
        on_gpu = all(e.get("cat") in GPU_CATEGORIES for e in evs)
        base = f"gpu stream {thread[1]}" if on_gpu else "compute"
        for e in evs:
            start, end = _ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])
            while stack and stack[-1][0] <= start:
                stack.pop()
            if stack and end > stack[-1][0]:  # clock jitter: cut the child at its parent's end
                end = stack[-1][0]
                e = {**e, "dur": (end - start) / 1000}
            outer = stack[-1][1] if stack else base
            track = e["name"] if outer == base and is_collective(e["name"]) else outer
            stack.append((end, track))
            filed.append(((index, track), e))
    threads_of: dict[str, set[int]] = {}
    for (index, track), _ in filed:
        threads_of.setdefault(track, set()).add(index)
    for (index, track), e in filed:
        if track == "compute":
            label = "compute" if index == 0 else f"compute [thread {index}]"
        elif track.startswith("gpu stream "):
            label = track
        else:
            label = track if len(threads_of[track]) == 1 else f"{track} [thread {index}]"
        yield label, e


def merge_traces(rank_files: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> dict:
    """Merge per-rank Chrome traces (`rank_files[r]` is rank r's) into one trace at `out`:
    process `rank r`, tracks `compute` (and `compute [thread i]` for other threads' compute)
    and one per collective name and thread (Note [tracks]).
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
        order = sorted(track_ids, key=lambda t: (not t.startswith("compute"), t))
        for i, track in enumerate(order):
            merged.append(_meta("thread_name", rank, track_ids[track], name=track))
            merged.append(_meta("thread_sort_index", rank, track_ids[track], sort_index=i))
    trace = {"traceEvents": merged, "displayTimeUnit": "ms"}
    atomic_write_json(out, trace, indent=None)
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
