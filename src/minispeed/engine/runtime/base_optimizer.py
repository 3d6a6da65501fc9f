"""`deepspeed.runtime.base_optimizer`: the class every optimizer the engine builds is.

DeepSpeed's `DeepSpeedOptimizer` is the base of its ZeRO, fp16 and bf16 wrappers; clients test
`isinstance(state_item, DeepSpeedOptimizer)` to find the engine's optimizer among what a user
hands them (Lightning's `DeepSpeedStrategy.load_checkpoint` does, to decide whether to load the
optimizer's state). The engine's optimizer at every stage is a `minispeed.zero.ZeroOptimizer`,
a `torch.optim.Optimizer`, so both names are that class: the same test finds it.
"""

from minispeed.zero import ZeroOptimizer

DeepSpeedOptimizer = ZeroOptimizer
ZeROOptimizer = ZeroOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
