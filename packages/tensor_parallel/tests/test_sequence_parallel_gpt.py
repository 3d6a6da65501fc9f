"""minispeed's GPT (examples/gpt.py) split by `gpt_plan` on 2 and 4 gloo ranks, with and without
sequence parallelism: loss and every gradient (slices gathered back) equal the unsplit model's to
1e-5; a block's saved activations per rank equal `block_activation_bytes` (the norms' share
replicated under TP alone, everything 1/n under SP); one training step issues exactly the sum of
its layers' collectives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import minispeed.comm as comm
import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed
from minispeed.tensor_parallel.memory import block_activation_bytes, saved_activation_bytes

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
B, T, C, H, L, V = 2, 16, 32, 4, 2, 64


def _gpt_module():
    if "minispeed_example_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "minispeed_example_gpt", REPO / "examples/gpt.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["minispeed_example_gpt"] = module
        spec.loader.exec_module(module)
    return sys.modules["minispeed_example_gpt"]


def _gpt():
    gpt = _gpt_module()
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _step_collectives(n: int, sp: bool) -> list[tp.Collective]:
    """One forward and backward of the split GPT, summed from the layers' formulas."""
    M = B * T
    out = tp.embedding_collectives(M, C, n, sequence_parallel=sp)
    for _ in range(L):
        out += tp.column_collectives(M, C, 3 * C, n, sequence_parallel=sp)
        out += tp.row_collectives(M, C, C, n, sequence_parallel=sp)
        out += tp.column_collectives(M, C, 4 * C, n, sequence_parallel=sp)
        out += tp.row_collectives(M, 4 * C, C, n, sequence_parallel=sp)
    if sp:  # ln_f on shards feeds the tied head: all-gather, reduce-scatter in backward
        out += [tp.Collective("all_gather", 4 * M * C, "forward")]
        out += [tp.Collective("reduce_scatter", 4 * M * C, "backward")]
        # the norms' weights and biases saw shards: one all-reduce each (2 per block + ln_f)
        out += [tp.Collective("all_reduce", 4 * C, "backward")] * (2 * (2 * L + 1))
        # wpe's (T, C) output was scattered: its gradient is all-gathered, whole on every rank
        out += [tp.Collective("all_gather", 4 * T * C, "backward")]
    else:  # the tied head's input gradient is a partial sum
        out += [tp.Collective("all_reduce", 4 * M * C, "backward")]
    return out + tp.cross_entropy_collectives(M, n)


def _body(rank: int, world_size: int, sp: bool) -> dict:
    model = _gpt()
    tp.parallelize(model, tp.gpt_plan(model, sequence_parallel=sp), None)
    idx, targets = _batch()
    with comm.CommsLogger() as log:
        logits, _ = model(idx)  # (B, T, V/n)
        loss = tp.vocab_parallel_cross_entropy(logits, targets, None)
        loss.backward()
    x = torch.randn(
        B, T // world_size if sp else T, C, generator=torch.Generator().manual_seed(rank)
    )
    _, saved = saved_activation_bytes(lambda: model.blocks[0](x.requires_grad_(True)), model)
    return {
        "loss": loss.detach(),
        "grads": tp.unshard_module(model, tp.TensorGroup.of(None), grads=True),
        "records": [(r.op, r.msg_bytes, r.wire_bytes, r.impl) for r in log.records],
        "saved": saved,
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_gpt_split_equals_unsplit_with_the_formula_memory_and_bytes(
    sp, world_size, rel_close, logged_bytes
):
    results = run_distributed(_body, world_size=world_size, args=(sp,), timeout_s=240)
    model = _gpt()
    idx, targets = _batch()
    logits, _ = model(idx)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    want.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    x = torch.randn(B, T, C)
    _, unsplit_saved = saved_activation_bytes(
        lambda: model.blocks[0](x.requires_grad_(True)), model
    )
    assert unsplit_saved == block_activation_bytes(B, T, C, H, 1)
    for got in results:
        rel_close(got["loss"], want.detach())
        assert set(got["grads"]) == set(grads)
        for n, g in grads.items():
            rel_close(got["grads"][n], g)
        assert got["saved"] == block_activation_bytes(B, T, C, H, world_size, sp)
        logged_bytes(got["records"], _step_collectives(world_size, sp), world_size)
    if sp:  # everything 1/n: the replicated share of TP alone is gone
        assert results[0]["saved"] * world_size == unsplit_saved
