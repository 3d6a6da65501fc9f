"""zero.checkpoint: gradients equal plain autograd exactly, dropout included, while keeping less."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zero_testlib import make_batches, make_model

from minispeed.zero.activation import checkpoint


def _gpt_loss(model, idx, targets, ckpt: bool, offload: bool = False) -> torch.Tensor:
    """TinyGPT's forward with each block optionally run under zero.checkpoint."""
    T = idx.shape[1]
    x = model.wte(idx) + model.wpe(torch.arange(T))
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for block in model.blocks:
        h = x * model.shared_gain
        x = checkpoint(block, h, mask, offload_to_cpu=offload) if ckpt else block(h, mask)
    logits = model.ln_f(x) @ model.wte.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("offload", [False, True])
def test_gpt_gradients_equal_plain_autograd_exactly(offload):
    idx, tgt = make_batches(1, global_batch=4)[0]
    ref, ck = make_model(0), make_model(0)
    ref_loss = _gpt_loss(ref, idx, tgt, ckpt=False)
    ref_loss.backward()
    loss = _gpt_loss(ck, idx, tgt, ckpt=True, offload=offload)
    loss.backward()
    assert torch.equal(loss, ref_loss)
    ref_g, g = _grads(ref), _grads(ck)
    assert set(g) == set(ref_g)
    for name in ref_g:
        torch.testing.assert_close(g[name], ref_g[name], rtol=0, atol=0, msg=name)


class _DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), p=0.5, training=True))


def test_dropout_recomputation_replays_the_same_mask_and_keeps_the_rng_stream():
    def run(ckpt: bool):
        torch.manual_seed(0)
        mlp = _DropoutMLP()
        x = torch.randn(16, 8, requires_grad=True)
        torch.manual_seed(123)
        y = checkpoint(mlp, x) if ckpt else mlp(x)
        y.square().sum().backward()
        after = torch.rand(4)  # the caller's random stream must continue as without checkpointing
        return y.detach(), x.grad, mlp.fc1.weight.grad, after

    ref, got = run(False), run(True)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_parameters_get_gradients_when_no_input_requires_grad():
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    x = torch.randn(5, 6)  # a plain input: only the parameters need gradients
    checkpoint(lin, x).sum().backward()
    ref = nn.Linear(6, 3)
    ref.load_state_dict(lin.state_dict())
    ref(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=0, atol=0)


def test_tuple_outputs_and_non_tensor_arguments():
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)

    def fn(x, scale, y):
        return x * scale + y.sin(), (x * y).sum()

    out1, out2 = checkpoint(fn, a, 3.0, b)
    (out1.sum() + 2 * out2).backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    r1, r2 = fn(a, 3.0, b)
    (r1.sum() + 2 * r2).backward()
    torch.testing.assert_close(ga, a.grad, rtol=0, atol=0)
    torch.testing.assert_close(gb, b.grad, rtol=0, atol=0)


def _live_bytes_after(fn) -> int:
    """Bytes allocated by ``fn`` and still alive when it returns (CPU allocator, via the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    return sum(e.self_cpu_memory_usage for e in prof.events())


def test_checkpoint_frees_the_intermediates_in_forward():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 16))
    x = torch.randn(32, 16, requires_grad=True)
    out_bytes, hidden_bytes = 32 * 16 * 4, 32 * 256 * 4
    rng_bytes = torch.get_rng_state().numel()  # the generator state kept for the replay
    plain = _live_bytes_after(lambda: mlp(x))
    kept = _live_bytes_after(lambda: checkpoint(mlp, x))
    assert plain >= out_bytes + 2 * hidden_bytes  # Linear's output and GELU's output are saved
    assert kept <= out_bytes + rng_bytes + 1024  # the input is the caller's; nothing else stays


def test_a_parameter_shared_by_two_checkpointed_blocks_gets_one_gradient_hook_call():
    """ZeRO's reducers need each parameter's gradient exactly once per backward."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    calls: list[str] = []
    for name, p in shared.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.append(name))
    x = torch.randn(4, 8)
    y = checkpoint(shared, checkpoint(shared, x).tanh())
    y.sum().backward()
    assert sorted(calls) == ["bias", "weight"]
    grads = [p.grad.clone() for p in shared.parameters()]
    for p in shared.parameters():
        p.grad = None
    shared(shared(x).tanh()).sum().backward()
    for g, p in zip(grads, shared.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


def test_autograd_grad_and_retain_graph_work():
    x = torch.randn(5, requires_grad=True)
    y = checkpoint(lambda t: (t.sin() * t.exp()).sum(), x)
    (g1,) = torch.autograd.grad(y, x, retain_graph=True)
    (g2,) = torch.autograd.grad(y, x)  # the second backward recomputes again
    ref = (x.cos() * x.exp() + x.sin() * x.exp()).detach()
    torch.testing.assert_close(g1, ref)
    torch.testing.assert_close(g2, g1, rtol=0, atol=0)


def test_modifying_an_input_in_place_before_backward_is_an_error():
    x = torch.randn(4, requires_grad=True)
    h = x * 2
    y = checkpoint(torch.sin, h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_no_grad_mode_just_calls_the_function():
    lin = nn.Linear(3, 3)
    with torch.no_grad():
        out = checkpoint(lin, torch.randn(2, 3))
    assert out.grad_fn is None
