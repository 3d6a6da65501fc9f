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

__all__ = ["print_schedule", "schedule_grid", "schedule_table"]

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


def schedule_table(schedule: PipeSchedule | Simulation) -> Table:
    """A rich `Table` of the schedule (checked first: a schedule that deadlocks raises)."""
    sim = schedule if isinstance(schedule, Simulation) else check(schedule)
    grid = schedule_grid(sim)
    title = (
        f"{sim.schedule!r}: bubble {sim.bubble_fraction():.1%}, "
        f"peak in-flight micro-batches per stage {sim.peak_in_flight}"
    )
    table = Table(title=title, show_lines=False, pad_edge=False)
    table.add_column("stage", justify="right")
    for t in range(len(grid[0]) if grid else 0):
        table.add_column(str(t), justify="center")
    for s, (row, intervals) in enumerate(zip(grid, sim.intervals)):
        styles = {i.label: _STYLE[type(i)] for _, _, i in intervals}
        table.add_row(str(s), *(f"[{styles[c]}]{c}[/]" if c else "·" for c in row))
    return table


def print_schedule(schedule: PipeSchedule | Simulation, width: int = 200) -> str:
    """Print the table to the terminal and return it as plain text (for docs)."""
    table = schedule_table(schedule)
    Console().print(table)
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(table)
    return buf.getvalue()
