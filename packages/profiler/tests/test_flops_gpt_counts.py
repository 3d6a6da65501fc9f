"""On a GPT-2-style model the profiler's counts equal the analytic formula and FlopCounterMode."""

import pytest
import torch
from profiler_testlib import load_gpt
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from minispeed.profiler import FlopsProfiler, formulas

B, T, L, C, H, V = 2, 16, 2, 32, 4, 65


@pytest.fixture(scope="module")
def gpt():
    mod = load_gpt()
    torch.manual_seed(0)
    cfg = mod.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C)
    return mod.GPT(cfg), cfg


def _step(model, idx):
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, idx)
    loss.backward()


def test_gpt_forward_equals_the_analytic_count_with_causal_attention(gpt):
    model, _ = gpt
    idx = torch.randint(0, V, (B, T))
    with FlopsProfiler(model) as prof:
        _step(model, idx)
    r = prof.result()
    analytic = formulas.gpt_forward(batch=B, seq=T, n_layer=L, n_embd=C, n_head=H, vocab=V)
    assert r.forward == analytic  # exact: every term of the docstring, nothing else
    n = B * T  # the conventional model FLOPs are the MAC part, attention causal
    assert 2 * r.forward.macs == 2 * n * (12 * L * C * C + V * C) + 2 * L * B * C * T * (T + 1)
    assert r.unknown_ops == {}
    # A block's attention: qkv and proj projections plus causal SDPA.
    attn = r.module("blocks.0.attn").forward
    expected = (
        formulas.matmul(n, C, 3 * C, bias=True)
        + formulas.sdpa(B * H, T, T, C // H, C // H, causal=True)
        + formulas.matmul(n, C, C, bias=True)
    )
    assert attn == expected


def test_gpt_matmuls_equal_flop_counter_mode_and_it_misses_cpu_attention(gpt):
    model, _ = gpt
    idx = torch.randint(0, V, (B, T))
    with FlopsProfiler(model) as prof:
        _step(model, idx)
    r = prof.result()
    with FlopCounterMode(display=False) as fc:
        _step(model, idx)
    theirs = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    for op in ("aten.mm", "aten.addmm"):
        assert 2 * r.op_totals[op].macs == theirs[op]
    assert not any("attention" in name for name in theirs)  # the CPU flash kernel is missed
    assert r.op_totals["aten._scaled_dot_product_flash_attention_for_cpu"].macs > 0
    # Backward is measured, not assumed: the MACs are exactly twice the forward's for the
    # matmuls, and attention backward is 2.5x (scores recomputed).
    fwd_att = formulas.sdpa(B * H, T, T, C // H, C // H, causal=True)
    bwd_att = formulas.sdpa(B * H, T, T, C // H, C // H, causal=True, backward=True)
    assert r.backward.macs - L * bwd_att.macs == 2 * (r.forward.macs - L * fwd_att.macs)


def test_tied_weight_counted_once_and_containers_sum_their_children(gpt):
    model, cfg = gpt
    with FlopsProfiler(model) as prof:
        model(torch.randint(0, V, (B, T)))
    r = prof.result()
    assert r.root.params == cfg.num_params() == sum(p.numel() for p in model.parameters())
    blocks = r.module("blocks")
    assert blocks.calls == 0  # a ModuleList is never called ...
    assert blocks.forward == r.module("blocks.0").forward + r.module("blocks.1").forward
    assert r.module("blocks.0").calls == 1


class Checkpointed(nn.Module):
    def __init__(self, gpt_model):
        super().__init__()
        self.gpt = gpt_model

    def forward(self, idx):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return nn.functional.linear(g.ln_f(x), g.wte.weight)


def test_activation_checkpointing_recomputation_is_counted_in_backward(gpt):
    model, _ = gpt
    wrapped = Checkpointed(model)
    idx = torch.randint(0, V, (B, T))

    # Without early stop, checkpointing recomputes each block's whole forward; with it (torch's
    # default) it stops once the saved tensors are back, and the profiler counts what really ran.
    # Each backward starts without gradients: accumulating into an existing .grad adds one FLOP
    # per parameter, which made the comparison depend on whether an earlier test had run one.
    model.zero_grad(set_to_none=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), FlopsProfiler(wrapped) as prof:
        wrapped(idx).sum().backward()
    ckpt = prof.result()
    blocks_fwd = ckpt.module("gpt.blocks").forward
    assert ckpt.recompute == blocks_fwd  # every block's forward ran twice
    assert ckpt.module("gpt.blocks.0").recompute == ckpt.module("gpt.blocks.0").forward
    with FlopsProfiler(wrapped) as prof:
        wrapped(idx).sum().backward()
    early = prof.result()
    assert 0 < early.recompute.flops < blocks_fwd.flops
    model.zero_grad(set_to_none=True)
    with FlopsProfiler(model) as prof:
        logits, _ = model(idx)
        logits.sum().backward()
    no_ckpt = prof.result()
    assert ckpt.backward.flops == no_ckpt.backward.flops + blocks_fwd.flops


def test_modules_called_twice_and_their_own_hooks_are_counted():
    lin = nn.Linear(4, 4)
    seen = []
    lin.register_forward_hook(lambda m, i, o: seen.append(o @ o.T))  # the model's own hook

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    x = torch.randn(3, 4)
    with FlopsProfiler(Twice()) as prof:
        Twice.forward(prof.model, x)
    r = prof.result()
    per_call = formulas.matmul(3, 4, 4, bias=True) + formulas.matmul(3, 4, 3)  # + the hook's
    assert r.module("lin").calls == 2
    assert r.module("lin").forward == per_call + per_call
    assert len(seen) == 2  # their hook ran, and still runs after we leave
    lin(x)
    assert len(seen) == 3


def test_a_pipeline_stage_profiled_alone_counts_what_it_counts_inside_the_model(gpt):
    model, _ = gpt
    idx = torch.randint(0, V, (B, T))
    with FlopsProfiler(model) as prof:
        _step(model, idx)
    whole = prof.result().module("blocks.1")
    model.zero_grad(set_to_none=True)  # else backward adds into .grad: real, extra FLOPs
    stage = nn.Sequential(model.blocks[1])  # the last blocks as a stage: activations in
    x = torch.randn(B, T, C, requires_grad=True)
    with FlopsProfiler(stage) as prof:
        stage(x).backward(torch.randn(B, T, C))
    alone = prof.result().module("0")
    assert alone.forward == whole.forward
    assert alone.backward == whole.backward
