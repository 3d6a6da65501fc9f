"""How ZeRO cuts gradients into buckets and when it hooks each gradient: one set of rules, read
by the code that plans the buckets and registers the hooks (`minispeed.zero`'s config and
reducer) and by the step-time model that prices them (`minispeed.profiler.perf_model`). Both
depend on core and on neither of each other, so the rules live here rather than as a copy in
each (docs/architecture.md, "Who may import whom").
"""

from __future__ import annotations

__all__ = [
    "BUCKET_CAP_BYTES",
    "DEFAULT_BUCKET_NUMEL",
    "hooks_each_gradient",
    "planned_bucket_numel",
]

DEFAULT_BUCKET_NUMEL = 500_000_000
"""The default bound on a bucket's elements: DeepSpeed's `reduce_bucket_size` and
`allgather_bucket_size` (5e8), and so `ZeroConfig.reduce_bucket_numel`'s."""

BUCKET_CAP_BYTES = 25 * 2**20
"""The most bytes a gradient bucket holds, whatever larger bound is given (PyTorch DDP's 25 MiB;
why: Note [bucket sizes are upper bounds] in zero's `config.py`)."""


def planned_bucket_numel(bound_numel: int, element_size: int) -> int:
    """Elements per gradient bucket as `minispeed.zero` plans them: at most `bound_numel`
    (`ZeroConfig.reduce_bucket_numel`) and at most `BUCKET_CAP_BYTES` of `element_size`-byte
    elements. At the default bound: 6,553,600 fp32 elements (13,107,200 of 2 bytes)."""
    return max(1, min(bound_numel, BUCKET_CAP_BYTES // element_size))


def hooks_each_gradient(grad_numel: int, bucket_numel: int) -> bool:
    """Whether stages 0-2 of `minispeed.zero` put a hook on every gradient, for gradients of
    `grad_numel` elements in all (every parameter's, as laid out in the flat buffers) cut into
    buckets of `bucket_numel` elements (`planned_bucket_numel`).

    Only when they span more than one bucket: then a bucket's collective can start while
    backward still computes the earlier layers, and the hooks (one Python call and one copy into
    the bucket per gradient) buy that overlap. Within one bucket there is nothing to overlap, so
    no hook is registered and the gradients are collected from `param.grad` once backward ends
    (Note [a model in one bucket has no gradient hooks] in zero's `reducer.py`). Stage 3 hooks
    every gradient whatever the size (its gradients are reduced as their module's backward
    ends, to free the gathered parameters).
    """
    return grad_numel > bucket_numel
