"""Sharded, parallelism-agnostic ZeRO checkpoints.

Reading order: `layout.py` (the files, the atomic-write protocol, damage checks), `agree.py`
(an error on one rank is an error on every rank), `storage.py` (who shares the directory),
`save.py` (the collective snapshot of each rank's fragments), `pending.py` (writing and sealing,
locally: on a background thread if the caller likes),
`load.py` (any world size or stage reads them back), `consolidate.py` (one fp32 state_dict,
streaming), `model16.py` (one 16-bit state_dict, gathered: `save_16bit_model`).

(The package is `checkpoints`, plural: `zero.checkpoint` is activation checkpointing, and a
submodule of that name would replace the function on the package when imported.)
"""

from minispeed.zero.checkpoints.consolidate import ConsolidationReport, consolidate
from minispeed.zero.checkpoints.layout import FORMAT_VERSION, CheckpointError, CheckpointMetadata
from minispeed.zero.checkpoints.load import load_checkpoint
from minispeed.zero.checkpoints.model16 import save_16bit_model
from minispeed.zero.checkpoints.save import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointMetadata",
    "ConsolidationReport",
    "consolidate",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
]
