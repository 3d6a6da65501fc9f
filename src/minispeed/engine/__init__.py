"""minispeed.engine — the meta-package's composition layer (`initialize()`, ds_config, launcher).

Not yet implemented: it will read a DeepSpeed-compatible config and apply, in a fixed order, the
pipeline partition, MoE groups, ZeRO with its offload policy and the profiler hooks. Until then, use
each package's own entry point (for example `minispeed.zero` from a plain training loop).
"""

__all__: list[str] = []
