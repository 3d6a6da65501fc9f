"""CPU optimizer kernels (every SIMD path and the reference) match torch.optim after 100 steps.

Sizes are odd (not multiples of 8 or 16 lanes) so every vector path also runs its scalar tail.
"Within 1e-6 relative": |ours - torch| <= 1e-6 * |torch| + 1e-6 * max|torch| per tensor (the
second term because an element near 0 has no meaningful relative error; torch's own sqrt is not
correctly rounded, see Note [bit-equal to torch.optim, but for sqrt]).
"""

from __future__ import annotations

import pytest
import torch

from minispeed.offload import cpu_optim

SIZES = (1, 7, 37, 4099)
STEPS = 100


def _simd(path: str) -> int | None:
    return None if path == "reference" else int(path.removeprefix("simd"))


def _fn(path: str, name: str):
    return getattr(cpu_optim.reference if path == "reference" else cpu_optim, name)


def _assert_close_rel(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * max(scale, 1e-30))


@pytest.mark.parametrize(
    "weight_decay,decoupled",
    [(0.0, False), (0.1, False), (0.1, True)],
    ids=["plain", "l2", "adamw"],
)
def test_adam_matches_torch_after_100_steps(
    path: str, weight_decay: float, decoupled: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    ms = [torch.zeros(n) for n in SIZES]
    vs = [torch.zeros(n) for n in SIZES]
    lr, betas, eps = 1e-2, (0.9, 0.999), 1e-8
    opt = torch.optim.Adam(
        theirs, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        decoupled_weight_decay=decoupled,
    )  # fmt: skip
    for step in range(1, STEPS + 1):
        grads = [torch.randn(n, generator=gen) for n in SIZES]
        _fn(path, "adam_step")(
            params, grads, ms, vs, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
            weight_decay=weight_decay, decoupled_weight_decay=decoupled, simd=_simd(path),
        )  # fmt: skip
        for t, g in zip(theirs, grads):
            t.grad = g
        opt.step()
    for p, t in zip(params, theirs):
        _assert_close_rel(p, t.detach())
        _assert_close_rel(ms[SIZES.index(p.numel())], opt.state[t]["exp_avg"])


def test_adagrad_matches_torch_after_100_steps(path: str) -> None:
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    sums = [torch.full((n,), 0.1) for n in SIZES]
    kw = dict(lr=0.05, lr_decay=0.01, eps=1e-10, weight_decay=0.05)
    opt = torch.optim.Adagrad(theirs, initial_accumulator_value=0.1, **kw)
    for step in range(1, STEPS + 1):
        grads = [torch.randn(n, generator=gen) for n in SIZES]
        _fn(path, "adagrad_step")(params, grads, sums, step=step, simd=_simd(path), **kw)
        for t, g in zip(theirs, grads):
            t.grad = g
        opt.step()
    for p, t, s in zip(params, theirs, sums):
        _assert_close_rel(p, t.detach())
        _assert_close_rel(s, opt.state[t]["sum"])


def test_lion_matches_the_reference_after_100_steps(path: str) -> None:
    """torch.optim has no Lion: the pure-PyTorch reference is the specification."""
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    expected = [p.clone() for p in params]
    ms = [torch.zeros(n) for n in SIZES]
    ms_ref = [torch.zeros(n) for n in SIZES]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    for _ in range(STEPS):
        grads = [torch.randn(n, generator=gen) for n in SIZES]
        _fn(path, "lion_step")(params, grads, ms, simd=_simd(path), **kw)
        cpu_optim.reference.lion_step(expected, grads, ms_ref, **kw)
    for p, e, m, mr in zip(params, expected, ms, ms_ref):
        _assert_close_rel(p, e)
        _assert_close_rel(m, mr)
    # Lion moves every weight by exactly lr * sign(...) (+ decay): not a no-op.
    assert not torch.equal(
        params[-1], torch.randn(SIZES[-1], generator=torch.Generator().manual_seed(2))
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_back_is_the_updated_master_rounded_to_nearest_even(path: str, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 1031
    p = torch.randn(n, generator=gen) * 100  # wide range: exercises rounding, fp16 subnormals too
    p[:4] = torch.tensor([1e-7, -3e-6, 70000.0, 65519.0])
    g = torch.randn(n, generator=gen)
    m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=dtype)
    _fn(path, "adam_step")(
        [p], [g], [m], [v], step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        decoupled_weight_decay=False, write_back=[out], simd=_simd(path),
    )  # fmt: skip
    assert torch.equal(out.view(torch.int16), p.to(dtype).view(torch.int16))


def test_one_call_steps_many_tensors_like_separate_calls(path: str) -> None:
    gen = torch.Generator().manual_seed(4)
    sizes = [3, 100_003, 17]
    base = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    together = [b.clone() for b in base]
    alone = [b.clone() for b in base]
    kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
              decoupled_weight_decay=False, simd=_simd(path))  # fmt: skip
    step = _fn(path, "adam_step")
    step(together, grads, [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes], **kw)
    for a, g in zip(alone, grads):
        step([a], [g], [torch.zeros_like(a)], [torch.zeros_like(a)], **kw)
    for a, b in zip(together, alone):
        assert torch.equal(a, b)


def test_bad_input_is_refused_with_the_fix() -> None:
    p, g = torch.zeros(4), torch.zeros(4)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              decoupled_weight_decay=False)  # fmt: skip
    with pytest.raises(TypeError, match="fp32"):
        cpu_optim.adam_step([p.half()], [g], [p.clone()], [p.clone()], **kw)
    with pytest.raises(ValueError, match="contiguous"):
        q = torch.zeros(4, 2).t()
        cpu_optim.adam_step([q], [q.clone()], [q.clone()], [q.clone()], **kw)
    with pytest.raises(ValueError, match="elements"):
        cpu_optim.adam_step([p], [torch.zeros(5)], [p.clone()], [p.clone()], **kw)
    with pytest.raises(ValueError, match="step must be >= 1"):
        cpu_optim.adam_step([p], [g], [p.clone()], [p.clone()], **{**kw, "step": 0})
    with pytest.raises(TypeError, match="bf16 or all fp16"):
        cpu_optim.adam_step([p], [g], [p.clone()], [p.clone()], write_back=[p.clone()], **kw)
