"""The engine recognises a model's parts by the packages' own types (docs/architecture.md): a
`minispeed.pipeline.PipelineModule` built with `pipeline.partition`, and a model holding
`minispeed.moe.MoE` layers, handed to `initialize`, train exactly as the same model built with
DeepSpeed's adapter classes (`minispeed.engine.pipe.PipelineModule`, `minispeed.engine.moe.layer.MoE`)
and the same weights: per-step losses and final parameters equal bit for bit.

Before, the core looked for the adapter classes only: the package's pipeline went down the dense
path (no `train_batch`), and the package's experts were averaged with the other ranks' (different)
experts as if they were dense parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from minispeed.core.testing import run_distributed

STEPS = 3


# -- pipelines -------------------------------------------------------------------------------------
def _pipe_layers(spec):
    return [spec(nn.Linear, 6, 12), nn.Tanh(), spec(nn.Linear, 12, 12), spec(nn.Linear, 12, 3)]


def _pipe_config():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
    }


def _train_pipe(model):
    import minispeed.engine as deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_pipe_config()
    )
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(8)]
    losses = [float(engine.train_batch(iter(batches[2 * s : 2 * s + 2]))) for s in range(STEPS)]
    return losses, [p.detach().clone() for p in engine.module.parameters()], engine


def _pipelines(rank, world_size):
    import minispeed.pipeline as pipeline
    from minispeed.engine.pipe import LayerSpec, PipelineModule

    mse = nn.functional.mse_loss
    adapter = PipelineModule(
        _pipe_layers(LayerSpec), num_stages=2, loss_fn=mse, seed_layers=True, base_seed=7,
        partition_method="uniform",
    )  # fmt: skip
    ours = pipeline.partition(
        _pipe_layers(lambda cls, *args: pipeline.LayerSpec(cls, args)),
        stages=2,
        loss_fn=mse,
        method=adapter.parts,
        seed=7,
    )
    want, want_params, _ = _train_pipe(adapter)
    got, got_params, engine = _train_pipe(ours)
    return {
        "want": want,
        "got": got,
        "params_equal": all(
            torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True)
        ),
        "is_last": engine.is_last_stage(),
    }


def test_the_pipeline_packages_module_trains_as_deepspeeds():
    for r in run_distributed(_pipelines, world_size=2, timeout_s=240):
        assert r["got"] == r["want"]
        assert r["params_equal"]


# -- MoE -----------------------------------------------------------------------------------------
HIDDEN, EXPERTS, COEF = 8, 2, 0.01


def _expert():
    return nn.Sequential(nn.Linear(HIDDEN, 16), nn.ReLU(), nn.Linear(16, HIDDEN))


class _Net(nn.Module):
    """in -> MoE -> head; the loss adds COEF times the router's load-balancing loss."""

    def __init__(self, moe_layer, returns_aux: bool) -> None:
        super().__init__()
        self.inp, self.moe, self.head = nn.Linear(4, HIDDEN), moe_layer, nn.Linear(HIDDEN, 2)
        self.returns_aux = returns_aux

    def forward(self, x, y):
        h = self.inp(x)
        if self.returns_aux:  # DeepSpeed's MoE: (output, l_aux, exp_counts)
            h, aux, _ = self.moe(h)
        else:  # the package's MoE: the output; the router's losses on the layer
            h = self.moe(h)
            aux = self.moe.last_routing.aux_loss
        return nn.functional.mse_loss(self.head(h), y) + COEF * aux


def _train_moe(model, params):
    import minispeed.engine as deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    g = torch.Generator().manual_seed(100 + engine.global_rank)  # each rank its own samples
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _moes(rank, world_size):
    import minispeed.moe as moe
    from minispeed.engine.moe.layer import MoE
    from minispeed.engine.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(0)
    adapter = _Net(
        MoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=2, k=1, drop_tokens=False,
            use_rts=False),
        returns_aux=True,
    )  # fmt: skip
    layer = moe.MoE(
        HIDDEN, _expert(), moe.MoEConfig(num_experts=EXPERTS, expert_parallel_degree=2, top_k=1,
                                         drop_tokens=False), moe.ExpertGroups(2),
    )  # fmt: skip
    ours = _Net(layer, returns_aux=False)
    ours.inp.load_state_dict(adapter.inp.state_dict())
    ours.head.load_state_dict(adapter.head.state_dict())
    layer.load_state_dict(adapter.moe.deepspeed_moe.state_dict())
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(adapter.parameters()), "name": "params"}
    )
    want, want_params = _train_moe(adapter, groups)
    got, got_params = _train_moe(
        ours, [{"params": moe.dense_parameters(ours)}, {"params": moe.expert_parameters(ours)}]
    )
    renamed = {n.replace("moe.deepspeed_moe.", "moe."): p for n, p in want_params.items()}
    return {
        "want": want,
        "got": got,
        "params_equal": sorted(renamed) == sorted(got_params)
        and all(torch.equal(got_params[n], renamed[n]) for n in got_params),
    }


def test_the_moe_packages_layer_trains_as_deepspeeds():
    for r in run_distributed(_moes, world_size=2, timeout_s=240):
        assert r["got"] == r["want"]
        assert r["params_equal"]
