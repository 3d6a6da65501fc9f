"""A plan applied on every rank of a grid: which plan, applied to what, agreed by every rank.

The tensor-parallel step of `minispeed.engine.initialize` (docs/architecture.md: grid →
pipeline partition → **this** → optimizer → `zero.shard` over the data axis), usable without the
engine: `parallelize_everywhere(model, plan, grid, per_stage=False, optimizer=opt,
model_parameters=None)`. With a tensor axis of T > 1 ranks:

1. **The plan.** `initialize(..., tensor_parallel_plan=...)` (minispeed's keyword) takes a
   `minispeed.tensor_parallel.Plan`, or a callable `(module) -> Plan` (for a `PipelineModule`
   it gets this rank's stage). Without one, a ready plan is picked by the model's type:
   `GPT2LMHeadModel` → `gpt2_plan`, `LlamaForCausalLM` → `llama_plan`, minispeed's GPT
   (`examples/gpt.py`, a `GPT` with a `GPTConfig` as `cfg`) → `gpt_plan`; any other model gets
   the plan read from its structure (`auto_plan`, DeepSpeed's AutoTP: whole logits), as does a
   model given to `tp_model_init` (the Trainer's path) whatever its type. Every
   `PipelineModule`, whose layer paths are the user's, needs a plan.
2. **One model to cut.** Every parameter and buffer is broadcast from the tensor group's first
   rank before the cut, so the n slices come from one model whatever each rank's seed (Ψ·4
   bytes once, over the tensor group).
3. **The cut** (`minispeed.tensor_parallel.parallelize`), local. In a pipeline a pattern may
   match nothing on one stage (a plan for the whole model, applied stage by stage) but must
   match on some stage.
4. **Agreement.** One `all_gather_object` over the world of each rank's outcome: a plan that
   failed on any rank (a missing module, a size that does not divide, a tied weight split
   unlike its head, a module split twice) raises on every rank, with that rank's message,
   before the first collective of training; so does a pattern no stage matched, or a tied
   module cut differently on two stages.

The optimizer given to `initialize` was built over the unsplit parameters: `rebind` points its
param groups at the slices, by parameter name (it must have no state yet); `model_parameters`
alike, read before the cut (DeepSpeed's usual `model.parameters()` is a generator, which read
after the cut would yield the slices, and an `id` of a parameter freed by the cut may be
reused). `parallelize_everywhere` runs steps 1-4 and the rebinding. What the caller sets up on
each rank alone after the cut (the optimizer, the model-parallel check of its parameters) is
agreed the same way (`agreed`): an error on one rank is raised on every rank before the next
collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.tensor_parallel import plans as ready
from minispeed.tensor_parallel.auto import auto_plan
from minispeed.tensor_parallel.plan import Plan, parallelize

__all__ = ["PlanLike", "agreed", "apply_plan", "parallelize_everywhere", "ready_plan", "rebind"]

PlanLike = Plan | Callable[[nn.Module], Plan] | None


def ready_plan(model: nn.Module) -> Plan:
    """The ready plan for `model`'s type (its head's logits split by vocabulary), or else the
    plan read from its structure (`auto_plan`: whole logits), which refuses a module it does
    not recognise by path."""
    kind = type(model).__name__
    if kind == "GPT2LMHeadModel":
        return ready.gpt2_plan(model)
    if kind == "LlamaForCausalLM":
        return ready.llama_plan(model)
    if kind == "GPT" and type(getattr(model, "cfg", None)).__name__ == "GPTConfig":
        return ready.gpt_plan(model)
    return auto_plan(model)


def _resolve(module: nn.Module, plan: PlanLike, per_stage: bool) -> Plan:
    if plan is None:
        if per_stage:
            raise ValueError(
                "a PipelineModule with tensor_parallel.autotp_size > 1 needs "
                "initialize(..., tensor_parallel_plan=...): a Plan over the stage's paths "
                "(e.g. 'chunks.*.layers.*.attn.qkv', 'tied.<key>') or a callable of the stage"
            )
        return ready_plan(module)
    if isinstance(plan, Plan):
        return plan
    if callable(plan):
        made = plan(module)
        if not isinstance(made, Plan):
            raise TypeError(
                f"tensor_parallel_plan(module) must return a minispeed.tensor_parallel.Plan, "
                f"got {type(made).__name__}"
            )
        return made
    raise TypeError(
        f"tensor_parallel_plan must be a minispeed.tensor_parallel.Plan or a callable of the "
        f"module, got {type(plan).__name__}"
    )


def _on_this_stage(module: nn.Module, plan: Plan) -> tuple[Plan, list[str]]:
    """The plan's patterns that match a module of this stage, and their names."""
    import fnmatch

    paths = [p for p, _ in module.named_modules() if p]
    hit = [pat for pat in plan.styles if any(fnmatch.fnmatchcase(p, pat) for p in paths)]
    return Plan({pat: plan.styles[pat] for pat in hit}, plan.divides), hit


def apply_plan(module: nn.Module, plan: PlanLike, grid: comm.ProcessGrid, *, per_stage: bool) -> None:  # fmt: skip
    """Steps 2-4 of the module docstring (collective over the world)."""
    group, ranks = grid.group("tensor"), grid.group_ranks("tensor")
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            comm.broadcast(t.data, src=ranks[0], group=group)
    error: Exception | None = None
    matched: list[str] = []
    patterns: list[str] = []
    tied: dict[str, str] = {}
    try:
        resolved = _resolve(module, plan, per_stage)
        patterns = list(resolved.styles)
        if per_stage:
            resolved, matched = _on_this_stage(module, resolved)
        parallelize(module, resolved, grid)
        if per_stage:  # how each tied module (a path on several stages) was cut here
            tied = {
                path: type(m).__name__ for path, m in module.named_modules() if path.startswith("tied.")
            }  # fmt: skip
    except Exception as exc:  # agreed below, then raised on every rank
        error = exc
    outcomes = _agree(error, "the tensor-parallel plan", matched, patterns, tied)
    if per_stage:
        _check_across_stages(outcomes)


def _agree(error: Exception | None, what: str, *extra: Any) -> list[Any]:
    """Every rank's `(error message, *extra)` (one `all_gather_object` over the world); `error`
    raised here, or, where another rank failed, an error naming that rank and its message."""
    outcomes = comm.all_gather_object(
        (None if error is None else f"{type(error).__name__}: {error}", *extra)
    )
    if error is not None:
        raise error
    failed = [(r, msg) for r, (msg, *_) in enumerate(outcomes) if msg]
    if failed:
        rank, msg = failed[0]
        raise ValueError(
            f"{what} failed on global rank {rank} (of ranks {[r for r, _ in failed]}): {msg}"
        )
    return outcomes


def agreed(step: Callable[[], Any], what: str = "the set-up under tensor parallelism") -> Any:
    """`step()`, a local part of a set-up (no collective), on every rank; an error on any rank
    is raised on every rank (one `all_gather_object` over the world), so no rank goes on into
    a collective its peers never reach."""
    error, result = None, None
    try:
        result = step()
    except Exception as exc:  # agreed, then raised on every rank
        error = exc
    _agree(error, what)
    return result


def _check_across_stages(outcomes: list[Any]) -> None:
    hits = {pat for _, matched, _, _ in outcomes for pat in matched}
    asked = dict.fromkeys(pat for _, _, patterns, _ in outcomes for pat in patterns)
    missing = [pat for pat in asked if pat not in hits]
    if missing:
        raise ValueError(
            f"tensor-parallel plan: {missing[0]!r} matches no module on any pipeline stage; "
            "stage paths look like 'chunks.0.layers.<layer index>.<submodule>' and "
            "'tied.<key>' (print(engine.module) for this rank's)"
        )
    seen: dict[str, tuple[int, str]] = {}
    for rank, (_, _, _, tied) in enumerate(outcomes):
        for path, kind in tied.items():
            first = seen.setdefault(path, (rank, kind))
            if first[1] != kind:
                raise ValueError(
                    f"tensor-parallel plan: the tied module {path!r} is {first[1]} on global "
                    f"rank {first[0]} but {kind} on global rank {rank}: a tied embedding must be "
                    "split the same way on every stage that holds it (Vocab on each)"
                )


def names_by_id(module: nn.Module) -> dict[int, str]:
    """`id(parameter) -> name` of `module`'s parameters (before the cut, for `rebind`)."""
    return {id(p): n for n, p in module.named_parameters()}


def rebind(given: Any, before: dict[int, str], module: nn.Module) -> Any:
    """The optimizer (or parameter list / param-group dicts) given to `initialize`, pointed at
    the cut module's parameters by name. An optimizer with state already is refused."""
    after = dict(module.named_parameters())

    def swap(p: Any) -> Any:
        name = before.get(id(p))
        return p if name is None or name not in after else after[name]

    if isinstance(given, torch.optim.Optimizer):
        if any(given.state.values()):
            raise ValueError(
                "the optimizer given to initialize() has state already; with tensor "
                "parallelism the engine re-points it at the parameter slices, so build it fresh "
                "(or pass a callable of the parameters, or the config's optimizer section)"
            )
        for group in given.param_groups:
            group["params"] = [swap(p) for p in group["params"]]
        return given
    if given is None:
        return None
    out = []
    for item in given:
        if isinstance(item, dict):
            out.append({**item, "params": [swap(p) for p in item["params"]]})
        else:
            out.append(swap(item))
    return out


def parallelize_everywhere(
    model: nn.Module,
    plan: PlanLike,
    grid: comm.ProcessGrid,
    *,
    per_stage: bool,
    optimizer: Any,
    model_parameters: Any,
) -> tuple[Any, Any]:
    """`apply_plan`, then `initialize`'s `optimizer` and `model_parameters` re-pointed at the
    slices (`rebind`): the step before the optimizer is built, for any model or pipeline
    stage. Returns `(optimizer, model_parameters)`."""
    before = names_by_id(model)
    if model_parameters is not None:  # read now: a generator read after the cut gives slices
        model_parameters = [
            {**x, "params": list(x["params"])} if isinstance(x, dict) else x
            for x in model_parameters
        ]
    apply_plan(model, plan, grid, per_stage=per_stage)
    return rebind(optimizer, before, model), rebind(model_parameters, before, model)
