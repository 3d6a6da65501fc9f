"""3D parallelism through the engine: minispeed's GPT blocks as a `PipelineModule` on a 2 pipe ×
2 data × 2 tensor grid (8 gloo ranks), its stages cut by a tensor-parallel plan, ZeRO-2 over
the data axis, the embedding tied to the output head across the two stages, gradient
accumulation and a clipping that bites: 10 steps equal to one process in plain PyTorch on the
same global batch to 1e-5 (losses, and the gradient norm of the whole model: split parameters'
squares summed over the tensor group, replicated ones and the tied copy counted once)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minispeed.core.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS, GAS, CLIP, LR = 10, 2, 0.05, 2.0


class Embed(nn.Module):
    """Token plus position embeddings; its `wte` is tied to the output head."""

    def __init__(self, vocab: int, block: int, width: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))


def head(embed: Embed, h: torch.Tensor) -> torch.Tensor:
    """The tied output head: (B, T, C) -> (B, T, V), or this rank's V/n under the plan."""
    return F.linear(h, embed.wte.weight)


def layers(pipe):
    import gpt_tp

    g, c = gpt_tp.gpt_module(), gpt_tp
    cfg = g.GPTConfig(vocab_size=c.V, block_size=c.T, n_layer=c.L, n_head=c.H, n_embd=c.C)
    return [
        pipe.TiedLayerSpec("embed", Embed, c.V, c.T, c.C, tied_weight_attr=["wte.weight"]),
        *[pipe.LayerSpec(g.Block, cfg) for _ in range(c.L)],
        pipe.LayerSpec(nn.LayerNorm, c.C),
        pipe.TiedLayerSpec(
            "embed", Embed, c.V, c.T, c.C, forward_fn=head, tied_weight_attr=["wte.weight"]
        ),
    ]


def plan():
    """The whole model's plan over the stages' paths; each stage applies what it holds."""
    import gpt_tp

    import minispeed.tensor_parallel as tp

    ln_f = 1 + gpt_tp.L
    return tp.Plan(
        {
            "tied.embed.wte": tp.Vocab(),
            "chunks.*.layers.*.attn": tp.Heads(("n_head",)),
            "chunks.*.layers.*.attn.qkv": tp.Column(parts=3),
            "chunks.*.layers.*.attn.proj": tp.Row(),
            "chunks.*.layers.*.mlp.fc": tp.Column(),
            "chunks.*.layers.*.mlp.proj": tp.Row(),
            f"chunks.*.layers.{ln_f}": tp.HeadInput(),
        },
        {"heads": gpt_tp.H, "MLP width": 4 * gpt_tp.C, "vocabulary": gpt_tp.V},
    )


def config(zero_stage: int, tensor: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero_stage},
        "tensor_parallel": {"autotp_size": tensor},
    }


def build(world_size: int, zero_stage: int = 2, tensor: int = 2, stages: int = 2):
    """The pipeline engine on a stages × data × tensor grid of `world_size` ranks."""
    import minispeed.engine as deepspeed
    import minispeed.engine.pipe as pipe
    import minispeed.tensor_parallel as tp

    topo = pipe.PipeModelDataParallelTopology(
        num_pp=stages, num_mp=tensor, num_dp=world_size // (stages * tensor)
    )
    model = pipe.PipelineModule(
        layers(pipe),
        topology=topo,
        loss_fn=lambda logits, y: tp.vocab_parallel_cross_entropy(logits, y, model.grid),
        seed_layers=True,
        partition_method="uniform",
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),  # re-pointed at the slices
        config=config(zero_stage, tensor),
        tensor_parallel_plan=plan(),
    )
    return engine


def _train(rank, world_size, root):
    import gpt_tp

    engine = build(world_size)
    grid = engine.grid
    data = iter(gpt_tp.micro_batches(grid.rank_in("data"), STEPS * GAS))
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(float(engine.train_batch(data)))
        norms.append(engine.get_global_grad_norm())
    coord = tuple(grid.rank_in(a) for a in ("pipe", "data", "tensor"))
    # the checkpoint of the 3D grid, loaded at tensor 1 (2 pipe x 4 data, ZeRO-1)
    evaluation = gpt_tp.micro_batches(99, GAS)  # the same on every replica
    before = float(engine.eval_batch(iter(evaluation)))
    engine.save_checkpoint(f"{root}/ckpt", tag="3d")
    flat = build(world_size, zero_stage=1, tensor=1)
    flat.load_checkpoint(f"{root}/ckpt", tag="3d")
    after = float(flat.eval_batch(iter(evaluation)))
    return {"coord": coord, "losses": losses, "norms": norms, "eval": (before, after)}


def reference_model():
    """The whole model on one process, built with the stages' seeds."""
    import minispeed.engine.pipe as pipe
    from minispeed.pipeline import build_unsplit

    return build_unsplit(layers(pipe), seed=1234)


def reference(replicas: int = 2, steps: int = STEPS):
    import gpt_tp

    model = reference_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = [gpt_tp.micro_batches(r, steps * GAS) for r in range(replicas)]
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for r in range(replicas):
            for m in range(GAS):
                x, y = data[r][step * GAS + m]
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / (replicas * GAS)
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def test_pipe_data_tensor_trains_like_one_process(tmp_path):
    """... and its checkpoint evaluates the same loaded at tensor size 1."""
    want, want_norms = reference()
    assert min(want_norms) > 5 * CLIP  # the clipping bites at every step
    runs = run_distributed(_train, world_size=8, args=(str(tmp_path),), timeout_s=540)
    # tensor fastest, then data, then pipe (Megatron's and DeepSpeed's order)
    assert [r["coord"] for r in runs] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]
    for r in runs:
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert r["norms"] == pytest.approx(want_norms, rel=1e-5)
        before, after = r["eval"]
        assert after == pytest.approx(before, rel=1e-6)


def _bad_pipeline(rank, world_size, case):
    import minispeed.engine as deepspeed
    import minispeed.engine.pipe as pipe
    import minispeed.tensor_parallel as tp

    topo = pipe.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    given = plan()
    if case == "topology":  # a (pipe, data) grid while the config asks for 2 tensor ranks
        topo = pipe.PipeDataParallelTopology(num_pp=2, num_dp=2)
    elif case == "missing":
        given = tp.Plan({**given.styles, "chunks.*.layers.*.attn.qkvv": tp.Column()})
    elif case == "tied":
        whole = plan()

        def given(stage):  # the tied embedding cut on stage 0 only
            styles = dict(whole.styles)
            if stage.stage != 0:
                del styles["tied.embed.wte"]
            return tp.Plan(styles, whole.divides)

    model = pipe.PipelineModule(
        layers(pipe), topology=topo, loss_fn=lambda out, y: out.sum(), partition_method="uniform"
    )
    try:
        deepspeed.initialize(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            config=config(1, 2),
            tensor_parallel_plan=given,
        )
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "case, words",
    [
        ("topology", ["asks for 2 tensor-parallel ranks", "PipeModelDataParallelTopology"]),
        ("missing", ["'chunks.*.layers.*.attn.qkvv' matches no module on any pipeline stage"]),
        ("tied", ["tied module 'tied.embed.wte' is VocabParallelEmbedding", "but Embedding"]),
    ],
)
def test_bad_3d_input_is_an_error_on_every_rank(case, words):
    for message in run_distributed(_bad_pipeline, world_size=4, args=(case,), timeout_s=120):
        for w in words:
            assert w in message, message


def _train_unsharded(rank, world_size, steps):
    import gpt_tp

    engine = build(world_size, zero_stage=0)  # fp32 without ZeRO: the engine clips itself
    data = iter(gpt_tp.micro_batches(0, steps * GAS))
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    return {"losses": losses, "norm": engine.get_global_grad_norm()}


def test_pipe_by_tensor_without_zero_clips_by_the_whole_models_norm():
    """pipe 2 x tensor 2 (4 ranks), the torch optimizer stepped by the pipeline engine, which
    sums the squares over the pipe and tensor groups itself (replicated ones once)."""
    want, want_norms = reference(replicas=1, steps=3)
    for r in run_distributed(_train_unsharded, world_size=4, args=(3,), timeout_s=120):
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert r["norm"] == pytest.approx(want_norms[-1], rel=1e-5)
