"""Monitors: a training run's scalars (learning rate, loss scale, losses, timers) written as
events to CSV files, TensorBoard, Weights & Biases or Comet (DeepSpeed's `tensorboard`,
`csv_monitor`, `wandb` and `comet` sections).

```python
cfg = MonitorConfig.from_ds_config(ds_config)           # the four sections
monitor = MonitorMaster(cfg, rank=comm.get_rank())      # writes on rank 0 only
monitor.write_events([("Train/Samples/lr", 1e-3, 64)])  # (name, value, step) each
```

An event is `(name, value, step)`; DeepSpeed's engines name theirs `Train/Samples/<what>` and
count the step in samples (`global_samples`). `step_events`, `timer_events` and `loss_event`
build the lists the engine writes (docs/packages/profiler.md, "Monitors", says which, when).

What each backend does, as DeepSpeed 0.19.8's:

- **CSV** (`csv_monitor`): one file per event name, `<output_path>/<job_name>/<name with "/"
  and " " made "_">.csv`, rows `step,<last part of the name>`. Files are opened for appending:
  each monitor writes the header row the first time it writes a name, so a second run into the
  same job appends a second header and its rows below the first run's. Cost: one open, one
  row written and one close per event (no fsync: a crash loses at most the rows of that step).
- **TensorBoard** (`tensorboard`): `torch.utils.tensorboard.SummaryWriter(<output_path>/
  <job_name>)`, one `add_scalar(name, value, step)` per event and a flush per `write_events`
  (needs the `tensorboard` package).
- **Weights & Biases** (`wandb`): `wandb.init(project, group, entity=team)` once, then
  `wandb.log({name: value}, step=step)` per event (needs `wandb`; `WANDB_MODE=offline` keeps
  it local).
- **Comet** (`comet`): `comet_ml.start(...)` once; each name is logged when at least
  `samples_log_interval` steps passed since it was last logged (needs `comet_ml>=3.41.0`).

Only rank 0 builds backends and writes (`MonitorMaster(rank=...)`): the other ranks' paths are
never created, so they may differ per rank. An empty `output_path` is the working directory.
"""

from __future__ import annotations

import csv
import importlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from minispeed.core.sections import Section, key

__all__ = [
    "CometConfig",
    "CometMonitor",
    "CsvMonitor",
    "CsvMonitorConfig",
    "Event",
    "EventsLogScheduler",
    "MonitorConfig",
    "MonitorMaster",
    "TensorBoardConfig",
    "TensorBoardMonitor",
    "WandbConfig",
    "WandbMonitor",
    "library",
    "loss_event",
    "step_events",
    "timer_events",
]

Event = tuple[str, Any, int]
"""`(name, value, step)`: a scalar, and the step it belongs to (DeepSpeed's engines: the count
of samples trained so far)."""

# DeepSpeed's engines name every event under this prefix.
PREFIX = "Train/Samples/"
# The timers DeepSpeed writes under `wall_clock_breakdown`, in its order (the engine's names).
TIMERS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


@dataclass(frozen=True)
class _JobFolderConfig(Section):
    """A monitor writing files into `<output_path>/<job_name>/` (TensorBoard's, the CSV one)."""

    enabled: bool = key("enabled", False)
    """Write this monitor's events on rank 0."""
    output_path: str = key("output_path", "")
    """The folder holding the job's folder (empty: the working directory)."""
    job_name: str = key("job_name", "DeepSpeedJobName")
    """The job's folder inside `output_path`, which holds the files."""

    @property
    def log_dir(self) -> str:
        """`<output_path>/<job_name>`, where the files go."""
        return os.path.join(self.output_path, self.job_name)


@dataclass(frozen=True)
class TensorBoardConfig(_JobFolderConfig):
    """TensorBoard event files, by `torch.utils.tensorboard.SummaryWriter` (DeepSpeed section
    `tensorboard`; needs `pip install tensorboard`)."""

    ds_path: ClassVar[str] = "tensorboard"


@dataclass(frozen=True)
class CsvMonitorConfig(_JobFolderConfig):
    """CSV files, one per event name, appended to (DeepSpeed section `csv_monitor`)."""

    ds_path: ClassVar[str] = "csv_monitor"


@dataclass(frozen=True)
class WandbConfig(Section):
    """Weights & Biases (DeepSpeed section `wandb`; needs `pip install wandb`)."""

    ds_path: ClassVar[str] = "wandb"

    enabled: bool = key("enabled", False)
    """Log each event with `wandb.log` on rank 0 (`WANDB_MODE=offline`: to local files)."""
    group: str | None = key("group", None)
    """The W&B group the run joins (`wandb.init(group=...)`)."""
    team: str | None = key("team", None)
    """The W&B team, or entity (`wandb.init(entity=...)`)."""
    project: str = key("project", "deepspeed")
    """The W&B project."""


@dataclass(frozen=True)
class CometConfig(Section):
    """Comet (DeepSpeed section `comet`; needs `pip install "comet_ml>=3.41.0"`). Every key
    but `enabled` and `samples_log_interval` is handed to `comet_ml.start` (None: Comet's own
    configuration file or environment decides)."""

    ds_path: ClassVar[str] = "comet"

    enabled: bool = key("enabled", False)
    """Log events to a Comet experiment on rank 0."""
    samples_log_interval: int = key("samples_log_interval", 100)
    """Log an event name again only once this many samples (steps) passed since its last."""
    project: str | None = key("project", None)
    """The Comet project."""
    workspace: str | None = key("workspace", None)
    """The Comet workspace."""
    api_key: str | None = key("api_key", None)
    """The Comet API key."""
    experiment_name: str | None = key("experiment_name", None)
    """The experiment's name."""
    experiment_key: str | None = key("experiment_key", None)
    """The key of the experiment to log to (32 to 50 alphanumeric characters)."""
    online: bool | None = key("online", None)
    """False: an offline experiment, stored locally (None: Comet's default, online)."""
    mode: str | None = key("mode", None)
    """`"get"`, `"create"` or `"get_or_create"` (Comet's default)."""


@dataclass(frozen=True)
class MonitorConfig:
    """The four monitor sections together (DeepSpeed's `DeepSpeedMonitorConfig`)."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CsvMonitorConfig = field(default_factory=CsvMonitorConfig)
    comet: CometConfig = field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        """Whether any monitor is on."""
        return any(s.enabled for s in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))

    @classmethod
    def from_ds_config(cls, ds: Mapping[str, Any]) -> MonitorConfig:
        """The four sections of a ds_config dict, each read by its class (absent: its
        defaults, off)."""
        return cls(**{name: c.from_section(ds.get(name)) for name, c in _SECTIONS.items()})


_SECTIONS: dict[str, type[Section]] = {
    "tensorboard": TensorBoardConfig,
    "wandb": WandbConfig,
    "csv_monitor": CsvMonitorConfig,
    "comet": CometConfig,
}


class Monitor(Protocol):
    """A backend: writes a list of events."""

    def write_events(self, events: Sequence[Event]) -> None: ...


# section -> (module, what to pip install, oldest version accepted)
LIBRARIES: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "tensorboard": ("tensorboard", "tensorboard", (0,)),
    "wandb": ("wandb", "wandb", (0,)),
    "comet": ("comet_ml", '"comet_ml>=3.41.0"', (3, 41, 0)),
}


def library(section: str) -> Any:
    """The library the monitor of `section` writes with, imported; `ImportError` naming the
    section and the `pip install` when it is missing or too old (DeepSpeed's `check_*`)."""
    module, pip, oldest = LIBRARIES[section]
    try:
        lib = importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"{section}.enabled is true, but the `{module}` package is not installed: "
            f"pip install {pip} (or set {section}.enabled to false)"
        ) from None
    version = getattr(lib, "__version__", "")
    if _version(version) < oldest:
        raise ImportError(
            f"{section}.enabled is true, but {module} {version} is older than "
            f"{'.'.join(map(str, oldest))}: pip install {pip}"
        )
    return lib


class CsvMonitor:
    """One CSV file per event name in `<output_path>/<job_name>`, appended to (module
    docstring)."""

    def __init__(self, config: CsvMonitorConfig) -> None:
        self.log_dir = config.log_dir
        os.makedirs(self.log_dir, exist_ok=True)
        self._headed: set[str] = set()  # the files this monitor wrote a header into

    def write_events(self, events: Sequence[Event]) -> None:
        """Append each event's `step,value` row to its file (a header row first, the first
        time this monitor writes that name)."""
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            # csv's default line ending ("\r\n") and no newline translation: DeepSpeed's bytes.
            with open(os.path.join(self.log_dir, filename + ".csv"), "a") as f:
                writer = csv.writer(f)
                if filename not in self._headed:
                    self._headed.add(filename)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])


class TensorBoardMonitor:
    """`torch.utils.tensorboard.SummaryWriter` in `<output_path>/<job_name>`."""

    def __init__(self, config: TensorBoardConfig) -> None:
        library("tensorboard")  # torch.utils.tensorboard needs it
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(config.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=config.log_dir)

    def write_events(self, events: Sequence[Event], flush: bool = True) -> None:
        """`add_scalar(name, value, step)` per event, then flush the file."""
        for event in events:
            self.summary_writer.add_scalar(*event)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        """Write what is buffered to the event file."""
        self.summary_writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.summary_writer.close()


class WandbMonitor:
    """A W&B run started once (`wandb.init`), one `wandb.log` per event."""

    def __init__(self, config: WandbConfig) -> None:
        self._wandb = wandb = library("wandb")
        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def log(self, data: Mapping[str, Any], step: int | None = None, commit: bool | None = None):
        """`wandb.log(data, step=step, commit=commit)`."""
        return self._wandb.log(dict(data), step=step, commit=commit)

    def write_events(self, events: Sequence[Event]) -> None:
        """`wandb.log({name: value}, step=step)` per event."""
        for name, value, step in events:
            self.log({name: value}, step=step)

    def close(self) -> None:
        """Finish the run (its files are complete)."""
        self.run.finish()


class EventsLogScheduler:
    """Which events Comet logs: a name's first event, then one at least `samples_log_interval`
    steps after the last one logged."""

    def __init__(self, samples_log_interval: int) -> None:
        self.samples_log_interval = samples_log_interval
        self._last: dict[str, int] = {}

    def needs_logging(self, name: str, step: int) -> bool:
        """Whether to log `name` at `step` (and remember it when so)."""
        last = self._last.get(name)
        if last is not None and step - last < self.samples_log_interval:
            return False
        self._last[name] = step
        return True


class CometMonitor:
    """A Comet experiment started once (`comet_ml.start`); events thinned by
    `EventsLogScheduler`."""

    def __init__(self, config: CometConfig) -> None:
        comet_ml = library("comet")
        self.experiment = comet_ml.start(
            api_key=config.api_key,
            project=config.project,
            workspace=config.workspace,
            experiment_key=config.experiment_key,
            mode=config.mode,
            online=config.online,
        )
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self.scheduler = EventsLogScheduler(config.samples_log_interval)

    def write_events(self, events: Sequence[Event]) -> None:
        """Log each event the scheduler lets through as a metric at its step."""
        for name, value, step in events:
            if self.scheduler.needs_logging(name, step):
                # the call DeepSpeed makes (Experiment.log_metric checks names it has no use for)
                self.experiment.__internal_api__log_metric__(name=name, value=value, step=step)

    def close(self) -> None:
        """End the experiment (an offline one is then written out as its archive)."""
        self.experiment.end()


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


class MonitorMaster:
    """Every enabled backend, on rank 0 (DeepSpeed's `MonitorMaster`).

    `rank`: this process's global rank; only rank 0 builds backends (creating their folders,
    files or runs) and writes, so another rank's `write_events` does nothing and its paths may
    name anything. `enabled` is the config's, on every rank (the engine builds its events only
    when it is on, and only rank 0 writes them). A backend whose library is missing raises
    `ImportError` naming the section and the `pip install` on rank 0."""

    def __init__(self, config: MonitorConfig, rank: int = 0) -> None:
        self.config = config
        self.enabled = config.enabled
        self.rank = rank
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.csv_monitor: CsvMonitor | None = None
        self.comet_monitor: CometMonitor | None = None
        if rank != 0:
            return
        if config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(config.tensorboard)
        if config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(config.wandb)
        if config.csv_monitor.enabled:
            self.csv_monitor = CsvMonitor(config.csv_monitor)
        if config.comet.enabled:
            self.comet_monitor = CometMonitor(config.comet)

    @property
    def monitors(self) -> list[Monitor]:
        """The backends this rank writes to (none off rank 0), in DeepSpeed's order."""
        found = (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor)
        return [m for m in found if m is not None]

    def write_events(self, events: Sequence[Event]) -> None:
        """Hand `events` to every backend (nothing off rank 0)."""
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        """Close the backends that hold a file, a run or an experiment open."""
        for monitor in (self.tb_monitor, self.wandb_monitor, self.comet_monitor):
            if monitor is not None:
                monitor.close()


def step_events(lr: float, loss_scale: float | None, samples: int) -> list[Event]:
    """What DeepSpeed's engines write after each optimizer step: the first param group's
    learning rate, and the loss scale when training in fp16 (`loss_scale` not None)."""
    events: list[Event] = [(PREFIX + "lr", lr, samples)]
    if loss_scale is not None:
        events.append((PREFIX + "loss_scale", loss_scale, samples))
    return events


def timer_events(elapsed_ms: Mapping[str, float], samples: int) -> list[Event]:
    """DeepSpeed's `wall_clock_breakdown` events: `elapsed_time_ms_<timer>` for each of
    `TIMERS`, the milliseconds of the step's window (0.0 for a timer `elapsed_ms` lacks)."""
    return [
        (f"{PREFIX}elapsed_time_ms_{name}", float(elapsed_ms.get(name, 0.0)), samples)
        for name in TIMERS
    ]


def loss_event(kind: str, value: float, samples: int) -> list[Event]:
    """A pipeline's loss (`kind`: "train_loss" after `train_batch`, "eval_loss" after
    `eval_batch`)."""
    return [(PREFIX + kind, value, samples)]
