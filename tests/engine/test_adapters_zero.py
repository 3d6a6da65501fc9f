"""`minispeed.engine.zero` (DeepSpeed's `deepspeed.zero`): `Init` with DeepSpeed's arguments
partitions a model built with a different seed on each rank into the first rank's values,
`GatheredParameters(modifier_rank=0)` keeps rank 0's change on every rank, and what is not
implemented is refused by name before any collective."""

import pytest
import torch
from torch import nn

from minispeed.core.testing import run_distributed

# "auto" (a Hugging Face config the Trainer has not filled yet) is the key's default, as in DeepSpeed
CONFIG = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}


def _init_and_gather(rank, world_size):
    import minispeed.engine.zero as zero

    torch.manual_seed(rank)
    with zero.Init(config_dict_or_path=CONFIG, remote_device="none"):
        model = nn.Linear(6, 4)
    held = [p.data.numel() for p in model.parameters()]  # p.numel() is the full shape
    w = model.weight
    # DeepSpeed's attributes, which clients read (TRL gathers where ds_status says released)
    released = (w.ds_status, w.ds_numel, tuple(w.ds_shape), w.ds_tensor.numel(), w.ds_persist)
    ids = {p.ds_id for p in model.parameters()}
    with zero.GatheredParameters(list(model.parameters())):
        full = model.weight.detach().clone()
        gathered = w.ds_status
    with zero.GatheredParameters(model.weight, modifier_rank=0):
        if rank == 0:
            model.weight.data.fill_(0.5)
    with zero.GatheredParameters(model.weight):
        kept = bool((model.weight == 0.5).all())
    return {
        "held": held,
        "full": full,
        "kept": kept,
        "released": released,
        "gathered": gathered,
        "ids": len(ids),
        "plain": hasattr(nn.Linear(2, 2).weight, "ds_status"),
    }


def test_init_partitions_and_gathered_parameters_keeps_the_modifiers_change():
    import minispeed.engine.zero as zero

    res = run_distributed(_init_and_gather, world_size=2, timeout_s=120)
    torch.manual_seed(0)
    want = nn.Linear(6, 4).weight.detach()
    for r in res:
        torch.testing.assert_close(r["full"], want, rtol=0, atol=0)  # rank 0's values
        assert r["kept"]
        assert sum(r["held"]) < 6 * 4 + 4  # a shard, not the whole layer
        assert r["released"] == (zero.ZeroParamStatus.NOT_AVAILABLE, 24, (4, 6), 12, False)
        assert r["gathered"] == zero.ZeroParamStatus.AVAILABLE
        assert r["ids"] == 2 and not r["plain"]


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"dtype": torch.half}, "dtype"),
        ({"module": nn.Linear(2, 2)}, "module"),
        ({"zero_quantized_weights": True}, "zero_quantized_weights"),
        ({"remote_device": "cpu", "config_dict_or_path": CONFIG}, "remote_device"),
    ],
)
def test_init_refuses_what_is_not_implemented_by_name(kwargs, word):
    import minispeed.engine.zero as zero

    with pytest.raises((NotImplementedError, ValueError), match=word):
        zero.Init(**kwargs)


def test_gathered_parameters_refuses_fwd_module():
    import minispeed.engine.zero as zero

    with pytest.raises(NotImplementedError, match="fwd_module"):
        zero.GatheredParameters([], fwd_module=nn.Linear(2, 2))


def test_init_starts_the_process_group_as_deepspeeds_does():
    """DeepSpeed's `zero.Init` calls `init_distributed()` itself: a script may build its model
    under it before `initialize()`. One plain process (no torchrun) here."""
    import subprocess
    import sys

    code = (
        "import torch.distributed as dist, torch.nn as nn\n"
        "import minispeed.engine as deepspeed\n"
        "assert not dist.is_initialized()\n"
        "with deepspeed.zero.Init(config_dict_or_path={'zero_optimization': {'stage': 3}}):\n"
        "    model = nn.Linear(4, 4)\n"
        "print(dist.is_initialized(), dist.get_world_size(), tuple(model.weight.shape))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True 1 (4, 4)"


class _ReadsTheEmbedding(nn.Module):
    """A head that reads the embedding's weight in the parent's forward (an external parameter,
    which DeepSpeed scripts declare with register_external_parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, x, y):
        h = torch.tanh(self.mid(self.emb(x)))
        logits = torch.nn.functional.linear(h, self.emb.weight)
        return torch.nn.functional.cross_entropy(logits.view(-1, 50), y.view(-1))


def _external(rank, world_size, stage):
    import minispeed.engine as deepspeed

    torch.manual_seed(0)
    model = _ReadsTheEmbedding()
    deepspeed.zero.register_external_parameter(model, model.emb.weight)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        },
    )
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randint(0, 50, (2, 5), generator=g), torch.randint(0, 50, (2, 5), generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with pytest.raises(TypeError, match=r"must be an nn\.Parameter"):
        deepspeed.zero.unregister_external_parameter(model, model.emb.weight.data)
    engine.destroy()
    return losses


def test_a_registered_external_parameter_trains_at_stage_3_as_at_stage_0():
    at3 = run_distributed(_external, world_size=2, args=(3,), timeout_s=120)
    at0 = run_distributed(_external, world_size=2, args=(0,), timeout_s=120)
    for ours, replicated in zip(at3, at0, strict=True):
        assert ours == pytest.approx(replicated, rel=1e-6)


def test_deepspeeds_top_level_names_of_zero3_and_inference_are_the_adapters():
    """`deepspeed.zero.ZeroParamStatus` / `ZeroParamType` (what a save loop compares `ds_status`
    with) and `deepspeed.InferenceEngine` (what clients check `isinstance` against)."""
    import minispeed.engine as deepspeed
    from minispeed.engine.inference import InferenceEngine
    from minispeed.engine.runtime.zero import partition_parameters

    assert deepspeed.zero.ZeroParamStatus is partition_parameters.ZeroParamStatus
    assert deepspeed.zero.ZeroParamType is partition_parameters.ZeroParamType
    assert [s.name for s in deepspeed.zero.ZeroParamType] == ["NORMAL", "PARTITIONED", "REMOTE"]
    assert deepspeed.InferenceEngine is InferenceEngine
