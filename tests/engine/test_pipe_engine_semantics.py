"""PipelineModule / PipelineEngine semantics beyond the recorded script: DeepSpeed's partition
arithmetic (recorded from DeepSpeed 0.19.8 in fixtures/pipe_partitions.json), clipping by the
whole model's gradient norm (against the unsplit model in plain PyTorch), data-parallel replicas
made equal when layers are not seeded, and an exhausted data iterator raising on every rank."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed
from minispeed.engine.pipe import partition

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize(
    "case", json.loads((FIXTURES / "pipe_partitions.json").read_text())["cases"]
)
def test_partition_arithmetic_is_deepspeeds(case):
    assert partition.partition_balanced(case["weights"], case["parts"]) == case["balanced"]
    assert partition.partition_uniform(len(case["weights"]), case["parts"]) == case["uniform"]


def _clipped_pipeline(rank, world_size, clip):
    script = ds_scripts.load("record_ds_pipe.py", ds_scripts.PIPE_IMPORTS)
    script.CONFIG["gradient_clipping"] = clip
    return script.main()["losses"]


def _unsplit_reference(script, clip):
    """The same model on one process, each layer i built under torch.manual_seed(1234 + i) and
    run under DeepSpeed's per-forward seed (its blocks have dropout)."""
    torch.manual_seed(1234)
    emb = nn.Embedding(script.VOCAB, script.DIM)
    blocks = []
    for i in range(1, 5):
        torch.manual_seed(1234 + i)
        blocks.append(script.Block(script.DIM))
    torch.manual_seed(1234 + 5)
    norm = nn.LayerNorm(script.DIM)
    params = [p for m in (emb, *blocks, norm) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    data = script.micro_batches(0, script.STEPS * script.GAS)
    losses = []
    forwards = script.FORWARDS_BEFORE_TRAINING  # the script's evaluations before training

    def seeded(i, layer, *args):  # DeepSpeed's seed_layers reseeding before each layer
        torch.manual_seed(1234 * (forwards + 1) + i)
        return layer(*args)

    for _ in range(script.STEPS):
        total = 0.0
        for _ in range(script.GAS):
            x, y = next(data)
            forwards += 1
            h = seeded(0, emb, x)
            for i, b in enumerate(blocks, start=1):
                h = seeded(i, b, h)
            logits = seeded(6, script.head, emb, seeded(5, norm, h))
            loss = script.lm_loss(logits, y) / script.GAS
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def test_clipping_uses_the_whole_models_norm_across_stages():
    clip = 1.0  # below every step's norm (4 to 8): every step clips
    script = ds_scripts.load("record_ds_pipe.py", ds_scripts.PIPE_IMPORTS)
    want = _unsplit_reference(script, clip)
    for losses in run_distributed(_clipped_pipeline, world_size=2, args=(clip,), timeout_s=180):
        assert losses == pytest.approx(want, abs=1e-4)


def _unseeded_replicas(rank, world_size):
    import minispeed.engine.pipe as pipe
    from minispeed.engine.pipe_engine import PipelineEngine

    torch.manual_seed(100 + rank)  # every rank draws different weights
    layers = [pipe.LayerSpec(nn.Linear, 4, 4) for _ in range(4)]
    model = pipe.PipelineModule(layers, num_stages=2, loss_fn=nn.functional.mse_loss)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2}
    engine = PipelineEngine(model, opt, config)
    after = [p.detach().clone() for p in model.parameters()]
    stage0_empty = engine.is_first_stage()
    data = iter([] if stage0_empty else [(torch.ones(2, 4), torch.ones(2, 4))] * 2)
    with pytest.raises(Exception) as info:
        engine.train_batch(data)
    return {
        "stage": model.stage_id,
        "micro": engine.train_micro_batch_size_per_gpu(),
        "before": before,
        "after": after,
        "error": f"{type(info.value).__name__}: {info.value}",
    }


def test_unseeded_replicas_start_equal_and_a_dry_iterator_fails_every_rank():
    res = run_distributed(_unseeded_replicas, world_size=4, timeout_s=120)
    assert [r["stage"] for r in res] == [0, 0, 1, 1]  # data-parallel neighbours adjacent
    assert all(r["micro"] == 2 for r in res)  # 8 = 2 × 2 accumulation × 2 replicas
    for a, b in ((0, 1), (2, 3)):
        # Ranks seeded differently: the module's build already broadcast each stage's weights
        # from its first replica (minispeed.pipeline.partition), and they stay equal.
        for key in ("before", "after"):
            for x, y in zip(res[a][key], res[b][key], strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert "StopIteration" in res[0]["error"]
    assert "could not read its micro-batches" in res[2]["error"]


def _loss_from_forward(rank, world_size):
    import minispeed.engine.pipe as pipe
    from minispeed.engine.pipe_engine import PipelineEngine

    def mean_square(h):
        return h.square().mean()

    layers = [pipe.LayerSpec(nn.Linear, 4, 4) for _ in range(3)] + [mean_square]
    model = pipe.PipelineModule(layers, num_stages=2, seed_layers=True, partition_method="uniform")
    engine = PipelineEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_batch_size": 2}
    )
    x = torch.arange(8.0).reshape(2, 4) / 8
    loss = engine.train_batch(iter([(x, torch.zeros(2))]))
    return float(loss), model.parts


def test_without_loss_fn_the_last_output_is_the_loss():
    h = torch.arange(8.0).reshape(2, 4) / 8
    for i in range(3):
        torch.manual_seed(1234 + i)
        h = nn.Linear(4, 4)(h)
    want = float(h.square().mean().detach())
    # one micro-batch on two stages (DeepSpeed runs it; the engine picks GPipe for M < P)
    for loss, parts in run_distributed(_loss_from_forward, world_size=2):
        assert parts == [0, 2, 4]
        assert loss == pytest.approx(want, rel=1e-6)
