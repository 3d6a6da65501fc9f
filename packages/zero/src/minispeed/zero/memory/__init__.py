"""The memory ledger: what each ZeRO stage keeps per rank, predicted and measured.

Reading order: ``formulas.py`` (the ZeRO paper's formulas and minispeed's two named
differences, written once), ``estimate.py`` (which stages fit: a table), ``measure.py`` (count
what a live optimizer and model hold, beside the formula).
"""

from minispeed.zero.memory.estimate import MemoryEstimate, estimate
from minispeed.zero.memory.formulas import (
    GiB,
    ModelStateBytes,
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

__all__ = [
    "GiB",
    "MeasuredBytes",
    "MemoryEstimate",
    "ModelStateBytes",
    "estimate",
    "hpz_secondary_bytes",
    "ledger_table",
    "measure",
    "minispeed_state_bytes",
    "model_state_bytes",
    "optimizer_bytes_per_param",
    "padding_allowance",
    "padding_elements",
    "partition_numel",
    "predict",
]
