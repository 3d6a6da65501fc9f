"""Draw a schedule as a time × stage table: one row per stage, one column per time unit.

```python
from minispeed.pipeline import OneFOneB, print_schedule
print_schedule(OneFOneB(micro_batches=4, stages=2))
```

Cells hold the compute instruction that occupies the unit (`F3`: forward of micro-batch 3, `B3`
backward, `b3` / `W3` the zero-bubble input and weight passes, `F3.1` chunk 1 of an interleaved
stage); an empty cell is a bubble. Times come from `checker.check`'s simulation (forward 1 unit,
full backward 2), so the drawing is also a proof that the schedule runs.
"""

from __future__ import annotations

import io
import math

from rich.console import Console
from rich.table import Table

from minispeed.pipeline.checker import Simulation, check
from minispeed.pipeline.instructions import Backward, BackwardInput, BackwardWeight, Forward
from minispeed.pipeline.schedules import PipeSchedule

__all__ = ["print_schedule", "schedule_grid", "schedule_table", "schedule_tables"]

_STYLE = {Forward: "cyan", Backward: "magenta", BackwardInput: "yellow", BackwardWeight: "green"}


def schedule_grid(sim: Simulation) -> list[list[str]]:
    """Per stage, one label per time unit ("" for idle): the table's text, for tests and docs."""
    width = math.ceil(sim.makespan)
    grid = [[""] * width for _ in sim.intervals]
    for s, intervals in enumerate(sim.intervals):
        for start, end, instr in intervals:
            for t in range(math.floor(start), math.ceil(end)):
                grid[s][t] = instr.label
    return grid


def schedule_table(
    schedule: PipeSchedule | Simulation, times: range | None = None, title: str | None = None
) -> Table:
    """A rich `Table` of the schedule (checked first: a schedule that deadlocks raises), of the
    time units in `times` (default: all of them)."""
    sim = schedule if isinstance(schedule, Simulation) else check(schedule)
    grid = schedule_grid(sim)
    span = range(len(grid[0]) if grid else 0)
    times = span if times is None else times
    if title is None:
        title = (
            f"{sim.schedule!r}: bubble {sim.bubble_fraction():.1%}, "
            f"peak in-flight micro-batches per stage {sim.peak_in_flight}"
        )
    # every label at full width: rich would otherwise shrink columns to "…" to fit
    cell = max((len(c) for row in grid for c in row), default=1)
    table = Table(title=title, show_lines=False, pad_edge=False)
    table.add_column("stage", justify="right", no_wrap=True)
    for t in times:
        table.add_column(str(t), justify="center", no_wrap=True, min_width=cell)
    for s, (row, intervals) in enumerate(zip(grid, sim.intervals)):
        styles = {i.label: _STYLE[type(i)] for _, _, i in intervals}
        cells = (row[t] for t in times)
        table.add_row(str(s), *(f"[{styles[c]}]{c}[/]" if c else "·" for c in cells))
    return table


def schedule_tables(schedule: PipeSchedule | Simulation, width: int = 200) -> list[Table]:
    """The schedule as tables of at most `width` characters: time is cut into consecutive
    windows that fit, so every label stays whole however long the schedule (e.g. 4 stages ×
    8 micro-batches × 2 chunks: 70 time units of up to 4 characters)."""
    sim = schedule if isinstance(schedule, Simulation) else check(schedule)
    grid = schedule_grid(sim)
    span = len(grid[0]) if grid else 0
    cell = max((len(c) for row in grid for c in row), default=1)
    stage_col = len("stage") + 3  # padding 1 each side and the border after it
    per_table = max(1, (width - stage_col - 1) // (max(cell, len(str(span))) + 3))
    if span <= per_table:
        return [schedule_table(sim)]
    windows = [range(t, min(t + per_table, span)) for t in range(0, span, per_table)]
    return [schedule_table(sim, windows[0])] + [
        schedule_table(sim, w, f"time {w.start}–{w.stop - 1}") for w in windows[1:]
    ]


def print_schedule(schedule: PipeSchedule | Simulation, width: int = 200) -> str:
    """Print the table to the terminal and return it as plain text (for docs), cut into time
    windows of at most `width` characters (see `schedule_tables`)."""
    sim = schedule if isinstance(schedule, Simulation) else check(schedule)
    console = Console()
    for table in schedule_tables(sim, min(width, console.width)):
        console.print(table)
    buf = io.StringIO()
    plain = Console(file=buf, width=width, color_system=None)
    for table in schedule_tables(sim, width):
        plain.print(table)
    return buf.getvalue()
