"""`engine.describe()` tells what `initialize` did, from the record its steps wrote as they ran
(`minispeed.engine.composition`), and the record agrees with the model as it is after training:

- the hooks it lists, step by step, are the hooks on the model's modules and parameters,
  counted here from torch's own hook dicts (the model had none before `initialize`), and all of
  them were installed by `zero.shard`;
- at ZeRO stage 3, every parameter it lists as placed holds no bytes of its own on any rank
  (released), and the pieces the ranks' masters hold tile each parameter exactly;
- the steps appear in the composition order, with the keys that chose them.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from minispeed.core.testing import run_distributed

# torch's hook dicts on a module and their names in the record (`_forward_pre_hooks`:
# `forward_pre`); the `_with_kwargs` / `_always_called` dicts are flags of those, not hooks.
HOOK_DICTS = {
    "forward_pre": "_forward_pre_hooks",
    "forward": "_forward_hooks",
    "backward_pre": "_backward_pre_hooks",
    "backward": "_backward_hooks",
    "state_dict_pre": "_state_dict_pre_hooks",
    "state_dict": "_state_dict_hooks",
    "load_state_dict_pre": "_load_state_dict_pre_hooks",
    "load_state_dict_post": "_load_state_dict_post_hooks",
}


def _hooks_now(model: nn.Module) -> dict[str, Counter]:
    """Every hook on `model`, read from torch's own dicts here, not through the engine."""
    out: dict[str, Counter] = {}
    for path, m in model.named_modules():
        counts = Counter()
        for kind, attribute in HOOK_DICTS.items():
            if getattr(m, attribute):
                counts[kind] = len(getattr(m, attribute))
        if counts:
            out[path] = counts
    for name, p in model.named_parameters():
        counts = Counter()
        if p._post_accumulate_grad_hooks:
            counts["post_accumulate_grad"] = len(p._post_accumulate_grad_hooks)
        if p._backward_hooks:
            counts["grad"] = len(p._backward_hooks)
        if type(p) is not nn.Parameter:  # ZeRO-3 guards a released parameter's attributes
            counts["attribute_guard"] = 1
        if counts:
            out[name] = counts
    return out


def _described(rank: int, world_size: int, stage: int) -> dict:
    import minispeed.comm as comm
    import minispeed.engine as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 3))
    assert _hooks_now(model) == {}
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            # stage 3: every parameter partitioned (none kept whole as "persistent")
            "zero_optimization": {"stage": stage}
            | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
        },
    )
    for _ in range(2):
        x, y = torch.randn(2, 6), torch.randn(2, 3)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    record = engine.composition
    by_step = {s.name: s for s in record.steps}
    placed = record.placements()
    pieces = comm.all_gather_object({n: p.fragment for n, p in placed.items()})
    return {
        "text": engine.describe(),
        "names": [s.name for s in record.steps],
        "recorded": {k: dict(v) for k, v in record.hooks().items()},
        "actual": {k: dict(v) for k, v in _hooks_now(model).items()},
        "installed_by_shard": {k: dict(v) for k, v in by_step["zero.shard"].hooks.items()},
        "model_bytes": {n: p.model_bytes for n, p in placed.items()},
        "bytes_now": {n: p.untyped_storage().nbytes() for n, p in model.named_parameters()},
        "numel": {n: p.numel() for n, p in model.named_parameters()},
        "pieces": pieces,
        "keys": dict((s.name, s.keys) for s in record.steps),
    }


def test_describe_matches_the_models_hooks_and_stage3_partitions():
    for r in run_distributed(_described, world_size=2, args=(3,), timeout_s=180):
        assert r["names"] == [
            "config", "process group and grid", "optimizer", "zero.shard", "scheduler",
        ]  # fmt: skip
        assert r["recorded"] == r["actual"] != {}
        assert r["installed_by_shard"] == r["actual"]  # every hook is zero.shard's
        assert set(r["model_bytes"]) == set(r["numel"])
        assert all(b == 0 for b in r["model_bytes"].values())  # released at build
        assert all(b == 0 for b in r["bytes_now"].values())  # and again after each step
        for name, numel in r["numel"].items():  # the ranks' pieces tile the parameter
            spans = sorted(p[name] for p in r["pieces"] if p[name] is not None and p[name][1])
            covered = 0
            for start, n in spans:
                assert start == covered, (name, spans)
                covered += n
            assert covered == numel, (name, spans)
        assert r["keys"]["optimizer"] == ("optimizer.type", "optimizer.params")
        text = r["text"]
        assert text.index("1. config") < text.index("zero.shard") < text.index("scheduler")
        assert "stage 3 over a data-parallel group of 2 ranks" in text
        assert f"hooks installed on {len(r['actual'])} modules/parameters" in text


def test_describe_at_stage_1_lists_no_gradient_hook_in_one_bucket_and_whole_parameters():
    for r in run_distributed(_described, world_size=2, args=(1,), timeout_s=180):
        assert r["recorded"] == r["actual"]
        # every gradient fits one bucket: the reducer takes them after backward and marks them
        # used itself, so nothing is hooked on the parameters (the step-time model's price)
        assert {k for kinds in r["actual"].values() for k in kinds} == set()
        # each rank keeps whole fp32 parameters (views into its flat buffer)
        assert r["model_bytes"] == {n: 4 * numel for n, numel in r["numel"].items()}
        assert all(b > 0 for b in r["bytes_now"].values())
