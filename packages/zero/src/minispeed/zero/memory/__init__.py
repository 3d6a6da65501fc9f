"""The memory ledger: what each ZeRO stage keeps per rank, predicted and measured.

Reading order: ``formulas.py`` (the ZeRO paper's formulas and minispeed's two named
differences, written once), ``estimate.py`` (which stages fit: a table), ``measure.py`` (count
what a live optimizer and model hold, beside the formula), ``offload.py`` (what offload moved to
swap files and pools), ``modes.py`` (DeepSpeed's per-GPU and per-node figures for every stage and
offload mode, as `minispeed estimate` prints them).
"""

from minispeed.zero.memory.estimate import MemoryEstimate, estimate
from minispeed.zero.memory.formulas import (
    GiB,
    ModelStateBytes,
    forward_only_state_bytes,
    hpz_secondary_bytes,
    minispeed_state_bytes,
    model_state_bytes,
    optimizer_bytes_per_param,
    padding_elements,
    partition_numel,
)
from minispeed.zero.memory.measure import (
    MeasuredBytes,
    ledger_table,
    measure,
    padding_allowance,
    predict,
)
from minispeed.zero.memory.modes import ModeEstimate, Offload, estimate_modes, largest_params
from minispeed.zero.memory.offload import (
    OffloadBytes,
    Placement,
    measure_offload,
    offload_placement,
    predict_offload,
)

__all__ = [
    "GiB",
    "MeasuredBytes",
    "MemoryEstimate",
    "ModeEstimate",
    "ModelStateBytes",
    "Offload",
    "OffloadBytes",
    "Placement",
    "estimate",
    "estimate_modes",
    "forward_only_state_bytes",
    "hpz_secondary_bytes",
    "largest_params",
    "ledger_table",
    "measure",
    "measure_offload",
    "minispeed_state_bytes",
    "model_state_bytes",
    "offload_placement",
    "optimizer_bytes_per_param",
    "padding_allowance",
    "padding_elements",
    "partition_numel",
    "predict",
    "predict_offload",
]
