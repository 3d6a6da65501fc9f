"""One checkpoint directory for the whole process grid, over `minispeed.zero.checkpoints`.

Reading order: `grid.py` (the layout: one part per pipeline stage, tensor rank and expert
rank, `grid.json`, the save protocol) → `background.py` (one save at a time, written on the
caller's thread or in the background) → `load.py` (a part back, any data-parallel size) →
`resplit.py` (another tensor-parallel size) → `deepspeed_tag.py` (what a DeepSpeed tag holds,
its pickles opened safely) → `deepspeed_files.py` (a checkpoint DeepSpeed itself wrote, joined
per parameter) → `universal.py` (DeepSpeed's universal checkpoints, read and written) →
`calls.py` (DeepSpeed's `save_checkpoint` / `load_checkpoint`, written once for every engine).
What this package uses of zero is the public face of `minispeed.zero.checkpoints` (its files,
its atomic writes, its agreement).
"""

from minispeed.engine.checkpoint.background import Checkpointer, checkpointer_of, place_of
from minispeed.engine.checkpoint.calls import CheckpointCalls, Restore
from minispeed.engine.checkpoint.grid import CheckpointConfig, GridPlace, Part

__all__ = [
    "CheckpointCalls",
    "CheckpointConfig",
    "Checkpointer",
    "GridPlace",
    "Part",
    "Restore",
    "checkpointer_of",
    "place_of",
]
