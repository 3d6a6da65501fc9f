"""`minispeed tune`: short real trials of a training script, the fastest config kept.

Reading order: `candidate.py` (the knobs of one trial) → `memory.py` (a candidate's predicted
peak bytes, before it runs) → `search.py` (the search and its outputs) → `trial.py` (the
trial's side, inside the training job).

The engine does not import this package: `initialize` (the composition root) asks
`trial.Trial.from_env()` whether the job is a trial and hands the engine the trial's recorder
as one more step observer (`Engine(observers=...)`, docs/architecture.md).
"""

from minispeed.engine.tune.candidate import Candidate
from minispeed.engine.tune.search import (
    Outcome,
    TrialResult,
    TuneReport,
    TuneSettings,
    last_error_line,
    parse_budget,
    run_trial,
    tune,
)

__all__ = [
    "Candidate",
    "Outcome",
    "TrialResult",
    "TuneReport",
    "TuneSettings",
    "last_error_line",
    "parse_budget",
    "run_trial",
    "tune",
]
