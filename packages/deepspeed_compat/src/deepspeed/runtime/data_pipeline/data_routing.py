"""`deepspeed.runtime.data_pipeline.data_routing`: not provided by minispeed; importing it raises, naming what to use.

Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; do not edit."""

from minispeed.engine.deepspeed_paths import refuse

refuse(__name__, package=True)
