"""Sharded, parallelism-agnostic ZeRO checkpoints.

Reading order: `layout.py` (the files, the atomic-write protocol, damage checks), `agree.py`
(an error on one rank is an error on every rank), `storage.py` (who shares the directory),
`save.py` (the collective snapshot of each rank's fragments), `pending.py` (writing and sealing,
locally: on a background thread if the caller likes),
`load.py` (any world size or stage reads them back), `consolidate.py` (one fp32 state_dict,
streaming), `model16.py` (one 16-bit state_dict, gathered: `save_16bit_model`).

**The public face** below is what a protocol built over these files may use (the engine's
grid checkpoints, `minispeed.engine.checkpoint`, one zero checkpoint per part of its grid): the
calls above, the file names and records of `layout.py` and its atomic `torch.save`
(`atomic_save`; other files go through `minispeed.core.files`), `together` (an error on one
rank is an error on every rank), `probe_storage` and `snapshot` (the collective half of a save,
whose `PendingSave` writes and seals). The modules' other names are private.

(The package is `checkpoints`, plural: `zero.checkpoint` is activation checkpointing, and a
submodule of that name would replace the function on the package when imported.)
"""

from minispeed.zero.checkpoints.agree import together
from minispeed.zero.checkpoints.consolidate import ConsolidationReport, consolidate
from minispeed.zero.checkpoints.layout import (
    COMMON_FILE,
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    ParamRecord,
    ShardRecord,
    atomic_save,
    iter_pieces,
    load_shard,
    optim_file,
    pack_pieces,
    read_metadata,
    weights_file,
)
from minispeed.zero.checkpoints.load import load_checkpoint
from minispeed.zero.checkpoints.model16 import save_16bit_model
from minispeed.zero.checkpoints.pending import PendingSave
from minispeed.zero.checkpoints.save import save_checkpoint, snapshot
from minispeed.zero.checkpoints.storage import StorageGroups, probe_storage

__all__ = [
    "COMMON_FILE",
    "FORMAT_VERSION",
    "LATEST_FILE",
    "METADATA_FILE",
    "CheckpointError",
    "CheckpointMetadata",
    "ConsolidationReport",
    "ParamRecord",
    "PendingSave",
    "ShardRecord",
    "StorageGroups",
    "atomic_save",
    "consolidate",
    "iter_pieces",
    "load_checkpoint",
    "load_shard",
    "optim_file",
    "pack_pieces",
    "probe_storage",
    "read_metadata",
    "save_16bit_model",
    "save_checkpoint",
    "snapshot",
    "together",
    "weights_file",
]
