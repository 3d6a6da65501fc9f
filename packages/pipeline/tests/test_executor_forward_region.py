"""`PipelineExecutor(forward_region=)`: each stage's forward runs inside the region, the loss
outside it. Under `torch.autocast` bf16 a 2-stage pipeline trains as the unsplit model does with
its forward under the same autocast and its loss outside: losses and weights equal to 1e-6
relative after 3 SGD steps (the same bf16 products; the stages send bf16 activations and bf16
gradients, as the unsplit graph holds them), while an fp32 forward's losses differ by > 1e-4."""

import copy

import torch
from torch import nn

import minispeed.pipeline as pipeline
from minispeed.core.testing import run_distributed

DIM, STEPS, MICRO = 8, 3, 2
SEEN: list[tuple[bool, torch.dtype]] = []  # (autocast on in loss_fn, its input's dtype)


def _loss(out, labels):
    SEEN.append((torch.is_autocast_enabled("cpu"), out.dtype))
    return (out.float() - labels).pow(2).mean()


def _layers():
    torch.manual_seed(3)
    return [nn.Linear(DIM, DIM), nn.Tanh(), nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.Tanh()]


def _data():
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)) for _ in range(3)]


def _region():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _pipelined(rank, world_size):
    layers = _layers()
    module = pipeline.partition(layers, stages=2, loss_fn=_loss, method="uniform")
    ex = pipeline.PipelineExecutor(
        module,
        torch.optim.SGD(module.parameters(), lr=0.1),
        micro_batches=MICRO,
        forward_region=_region,
    )
    losses = [ex.train_batch(x, y) for x, y in _data()]
    held = {id(p) for p in module.parameters()}
    params = {
        i: [p.detach().clone() for p in layer.parameters()]
        for i, layer in enumerate(layers)
        if any(id(p) in held for p in layer.parameters())
    }
    # the references in the same process (the same CPU threads: bf16 kernels round by them)
    return losses, params, list(SEEN), _unsplit(_region), _unsplit(torch.enable_grad)


def _unsplit(region):
    layers = _layers()
    model = nn.Sequential(*copy.deepcopy(layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _data():
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            with region():
                out = model(xm)
            loss = (out.float() - ym).pow(2).mean() / MICRO
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {i: [p.detach() for p in m.parameters()] for i, m in enumerate(model)}


def test_each_stage_runs_in_the_region_and_the_loss_outside_it():
    results = run_distributed(_pipelined, world_size=2)
    held = set()
    for rank, (losses, params, seen, (ref_losses, ref_params), (fp32_losses, _)) in enumerate(
        results
    ):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0, msg=f"rank {rank}")
        for i, tensors in params.items():
            held.add(i)
            for ours, ref in zip(tensors, ref_params[i], strict=True):
                torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7, msg=f"layer {i}")
        if rank == 1:  # the last stage: its loss_fn saw a bf16 output, with autocast off
            assert seen and all(s == (False, torch.bfloat16) for s in seen), seen
        # the region is what makes the difference: an fp32 forward's losses differ
        assert max(abs(a - b) for a, b in zip(fp32_losses, ref_losses)) > 1e-4
    assert held == {0, 2, 3}
