"""minispeed.pipeline: pipeline parallelism with schedules you can print, check and read.

```python
import minispeed.pipeline as pipeline
module = pipeline.partition(layers, stages=2, loss_fn=F.cross_entropy)   # this rank's stage only
executor = pipeline.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1),
                                     micro_batches=4, schedule="1f1b")
loss = executor.train_batch(inputs, labels)
pipeline.print_schedule(pipeline.OneFOneB(micro_batches=4, stages=2))
```

Reading order (see packages/pipeline/README.md): instructions → schedules → checker → printer →
partitioning → module → p2p → executor → intake → status → reduction → sharded →
split_backward → timeline → costs → config.
"""

from collections.abc import Callable, Sequence
from typing import Any

import minispeed.comm as comm
from minispeed.pipeline import costs, status
from minispeed.pipeline.checker import ScheduleError, Simulation, check
from minispeed.pipeline.config import PipelineConfig
from minispeed.pipeline.costs import bubble_fraction, in_flight_bound, p2p_bytes_sent_per_step
from minispeed.pipeline.executor import PipelineExecutor
from minispeed.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from minispeed.pipeline.intake import RepeatingLoader, pull_batch
from minispeed.pipeline.module import (
    LayerSpec,
    PipelineModule,
    TiedLayerSpec,
    build_unsplit,
    layer_boundaries,
)
from minispeed.pipeline.p2p import PipelineAbortedError, PipelineShapeError
from minispeed.pipeline.partitioning import PartitionError
from minispeed.pipeline.printer import (
    print_schedule,
    schedule_grid,
    schedule_table,
    schedule_tables,
)
from minispeed.pipeline.schedules import (
    SCHEDULES,
    GPipe,
    InferenceSchedule,
    Interleaved1F1B,
    OneFOneB,
    PipeSchedule,
    ScheduleConfigError,
    ZeroBubbleH1,
    get_schedule,
)
from minispeed.pipeline.status import NonFiniteLossError
from minispeed.pipeline.timeline import StageTimeline, pipeline_bubble

__all__ = [
    "SCHEDULES",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Forward",
    "GPipe",
    "InferenceSchedule",
    "Instruction",
    "Interleaved1F1B",
    "LayerSpec",
    "LoadMicroBatch",
    "NonFiniteLossError",
    "OneFOneB",
    "OptimizerStep",
    "PartitionError",
    "PipeSchedule",
    "PipelineAbortedError",
    "PipelineConfig",
    "PipelineExecutor",
    "PipelineModule",
    "PipelineShapeError",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "RepeatingLoader",
    "ScheduleConfigError",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "Simulation",
    "StageTimeline",
    "TiedLayerSpec",
    "ZeroBubbleH1",
    "bubble_fraction",
    "build_unsplit",
    "check",
    "costs",
    "get_schedule",
    "in_flight_bound",
    "layer_boundaries",
    "p2p_bytes_sent_per_step",
    "partition",
    "pipeline_bubble",
    "print_schedule",
    "pull_batch",
    "schedule_grid",
    "schedule_table",
    "schedule_tables",
]


def _check_stages(stages: Any, world: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if world % stages:
        raise ValueError(
            f"world size {world} is not divisible by stages={stages}; use a stage count that "
            "divides the number of processes (the rest is data parallelism)"
        )


def partition(
    layers: Sequence[Any],
    *,
    stages: int,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    method: str | Sequence[int] = "parameters",
    virtual_stages: int = 1,
    seed: int | None = 0,
    activation_checkpointing: bool = False,
    grid: comm.ProcessGrid | None = None,
) -> PipelineModule:
    """Build this rank's stage of the model described by `layers`: the package's entry point.

    Collective (creates process groups): every rank calls it with the same arguments. Without
    `grid`, the world is laid out as a `("pipe", "data")` grid of `stages` × world/stages ranks
    (data-parallel neighbours adjacent). The layers are cut into `stages · virtual_stages` parts
    by `method` (see `partitioning.py`); this rank builds parts `stage, stage + P, ...` only.
    Bytes kept per rank: its own layers' parameters plus each tied layer it uses. Bytes sent
    once, at build: each stage's parameters broadcast from its replica of data rank 0 (so
    replicas start equal whatever each rank's RNG holds), and each tied layer from its lowest
    holding stage.
    """
    if grid is None:
        # Note: checked on every rank before the grid's first collective; a check failing on one
        # rank alone (say, a different `stages`) raises on all of them (status.agree_on_world)
        failure: Exception | None = None
        try:
            _check_stages(stages, comm.get_world_size())
        except Exception as exc:
            failure = exc
        status.agree_on_world(
            failure,
            {"stages": stages if isinstance(stages, int) else -1},
            "checking pipeline.partition's arguments",
        )
        world = comm.get_world_size()
        grid = comm.ProcessGrid(comm.ProcessTopology(("pipe", "data"), (stages, world // stages)))
    return PipelineModule(
        layers,
        stages=stages,
        stage=grid.rank_in("pipe"),
        loss_fn=loss_fn,
        method=method,
        virtual_stages=virtual_stages,
        seed=seed,
        activation_checkpointing=activation_checkpointing,
        grid=grid,
    )
