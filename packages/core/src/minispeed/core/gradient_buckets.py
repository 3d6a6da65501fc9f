"""When ZeRO hooks each gradient: one rule, read by the code that registers the hooks
(`minispeed.zero`'s reducer, stages 0-2) and by the step-time model that prices them
(`minispeed.profiler.perf_model`). Both depend on core and on neither of each other, so the rule
lives here rather than as a copy in each (docs/architecture.md, "Who may import whom").
"""

from __future__ import annotations

__all__ = ["hooks_each_gradient"]


def hooks_each_gradient(grad_numel: int, bucket_numel: int) -> bool:
    """Whether stages 0-2 of `minispeed.zero` put a hook on every gradient, for gradients of
    `grad_numel` elements in all (every parameter's, as laid out in the flat buffers) cut into
    buckets of `bucket_numel` elements.

    Only when they span more than one bucket: then a bucket's collective can start while
    backward still computes the earlier layers, and the hooks (one Python call and one copy into
    the bucket per gradient) buy that overlap. Within one bucket there is nothing to overlap, so
    no hook is registered and the gradients are collected from `param.grad` once backward ends
    (Note [a model in one bucket has no gradient hooks] in zero's `reducer.py`). Stage 3 hooks
    every gradient whatever the size (its gradients are reduced as their module's backward
    ends, to free the gathered parameters).
    """
    return grad_numel > bucket_numel
