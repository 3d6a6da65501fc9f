"""Block-sparse attention on CUDA: what the package does there, the CUDA kernels, and their speed.

`op.sparse_attention`:

- the public `block_sparse_attention` on CUDA tensors, forward and backward, against the float64
  reference; and how many bytes the call allocates at its peak against the dense `B·H·T²` fp32
  scores (the package sends CUDA tensors to its dense reference: a finding while it does);
- the CUDA kernels of `sparse_attention_cuda.cu` through `sparse_cuda.py`: `out`, the
  log-sum-exp, and `dq`, `dk`, `dv` against autograd through the reference in float64, for a
  causal fixed layout and a bidirectional BigBird layout.

`speed.sparse_attention`, at T = 4k and 16k (B 1, H 16, D 64, block 64, the causal fixed layout
with windows of 4 blocks): time per computed score of the CUDA kernels (fp32), forward and
forward + backward, against `scaled_dot_product_attention` in bf16 with the flash backend
(causal: T(T+1)/2 scores per head) and in fp32 (the backend torch picks); the ratio is ours over
flash per score. At 4k also the public API (dense reference) for scale.
"""

from __future__ import annotations

from gpucheck.harness import NO_GPU, TOL, Ctx, Report, rel_err


def _layouts(H: int, block: int):
    from minispeed.inference.sparse import BigBirdSparsityConfig, FixedSparsityConfig

    return {
        "fixed causal": (FixedSparsityConfig(H, block, num_local_blocks=4,
                                             attention="unidirectional"), True),
        "bigbird bidirectional": (BigBirdSparsityConfig(H, block, True), False),
    }  # fmt: skip


def _reference(q, k, v, layout, block, causal, scale, upstream):
    """float64 CPU reference: out, lse and the gradients of `(out · upstream).sum()`."""
    import torch

    from minispeed.inference.sparse import expand_layout, sparse_attention_reference

    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out = sparse_attention_reference(q64, k64, v64, layout, block, causal=causal, scale=scale)
    (out * upstream.cpu().double()).sum().backward()
    mask = expand_layout(layout, block, causal=causal)
    scores = (q64.detach() @ k64.detach().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return out.detach(), lse, q64.grad, k64.grad, v64.grad


def _why_no_kernels(ctx: Ctx) -> str:
    return NO_GPU if not ctx.gpu else "skipped: the kernels did not build or load (row above)"


def _kernels(ctx: Ctx, report: Report):
    """The kernels' launchers, or None (no GPU: skipped; a failed build or load: a failed row,
    so the public API's rows are still measured)."""
    if not ctx.gpu:
        return None
    import torch

    from gpucheck import sparse_cuda

    try:
        major, minor = torch.cuda.get_device_capability(ctx.device)
        lib, _ = sparse_cuda.build_library(ctx.scratch, f"{major}{minor}")
        return sparse_cuda.SparseAttentionCuda(lib)
    except Exception as err:
        report.fail("CUDA kernels build and load", f"{type(err).__name__}: {err}"[:300])
        return None


def correctness(ctx: Ctx, report: Report) -> None:
    import torch

    from gpucheck.sparse_cuda import device_csr
    from minispeed.inference.sparse import BlockSparseLayout, block_sparse_attention

    B, H, T, D, block = ctx.pick((2, 4, 1024, 64, 64), (1, 2, 64, 8, 16))
    scale = D**-0.5
    gen = torch.Generator().manual_seed(5)
    kern = _kernels(ctx, report)
    for name, (cfg, causal) in _layouts(H, block).items():
        layout = cfg.make_layout(T)
        csr = BlockSparseLayout.from_layout(layout, block, causal=causal)
        q, k, v, up = (torch.randn(B, H, T, D, generator=gen) for _ in range(4))
        ref = _reference(q, k, v, layout, block, causal, scale, up)
        qd, kd, vd = (t.to(ctx.device, copy=True).requires_grad_() for t in (q, k, v))
        ctx.free()
        before = ctx.acc.memory_allocated()
        out = block_sparse_attention(qd, kd, vd, csr, scale=scale)
        (out * up.to(ctx.device)).sum().backward()
        ctx.sync()
        peak = ctx.acc.max_memory_allocated() - before
        dense = 4 * B * H * T * T
        report.check(f"{name} ρ={csr.density:.2f}: public API forward", rel_err(out, ref[0]),
                     TOL["fp32"], note=f"on {ctx.device.type}")  # fmt: skip
        grads = [rel_err(a.grad, b) for a, b in zip((qd, kd, vd), ref[2:])]
        report.check(f"{name}: public API backward (max over dq, dk, dv)", max(grads), TOL["fp32"])
        if ctx.gpu:
            report.info(f"{name}: public API peak bytes / dense fp32 scores", peak / dense, "×")
            if peak >= dense:
                report.finding(
                    f"block_sparse_attention on CUDA tensors runs the dense PyTorch reference "
                    f"({name}: peak {peak / 2**20:.0f} MiB ≥ the {dense / 2**20:.0f} MiB of dense "
                    f"scores at T={T}): the CUDA kernels exist but have no binding"
                )
        if kern is None:
            report.skip(f"{name}: CUDA kernels (forward, lse, backward)", _why_no_kernels(ctx))
            continue
        dcsr = device_csr(csr, ctx.device)
        qd, kd, vd, upd = (t.to(ctx.device).contiguous() for t in (q, k, v, up))
        ctx.poison(8 * B * H * T * D)
        o, lse = kern.forward(qd, kd, vd, dcsr, scale)
        report.check(f"{name}: CUDA forward", rel_err(o, ref[0]), TOL["fp32"])
        report.check(f"{name}: CUDA log-sum-exp", rel_err(lse, ref[1]), TOL["fp32"])
        ctx.poison(8 * B * H * T * D)
        dq, dk, dv = kern.backward(qd, kd, vd, o, lse, upd, dcsr, scale)
        for label, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
            report.check(f"{name}: CUDA backward {label}", rel_err(got, want), TOL["fp32"])


def _scores(csr, B: int) -> int:
    """Scores the kernels compute: every kept tile's block², causal diagonal tiles' lower half."""
    import torch

    b = csr.block
    nb = csr.row_ptr.shape[1] - 1
    rows = torch.repeat_interleave(
        torch.arange(nb).repeat(csr.num_heads), (csr.row_ptr[:, 1:] - csr.row_ptr[:, :-1]).flatten()
    )
    diagonal = int((csr.cols.long() == rows).sum()) if csr.causal else 0
    tiles = csr.cols.numel()
    return B * ((tiles - diagonal) * b * b + diagonal * b * (b + 1) // 2)


def speed(ctx: Ctx, report: Report) -> None:
    B, H, D, block = ctx.pick((1, 16, 64, 64), (1, 2, 16, 16))
    kern = _kernels(ctx, report)
    for T in ctx.pick((4096, 16384), (128,)):
        _speed_at(ctx, report, kern, B, H, T, D, block)
        ctx.free()


def _speed_at(ctx: Ctx, report: Report, kern, B: int, H: int, T: int, D: int, block: int):
    import torch
    import torch.nn.functional as F

    from gpucheck.sparse_cuda import device_csr
    from minispeed.inference.sparse import BlockSparseLayout, block_sparse_attention

    cfg, causal = _layouts(H, block)["fixed causal"]
    csr = BlockSparseLayout.from_layout(cfg.make_layout(T), block, causal=causal)
    q, k, v, up = (torch.randn(B, H, T, D, device=ctx.device) for _ in range(4))
    dense_scores = B * H * T * (T + 1) // 2
    tag = f"T={T // 1024}k" if T >= 1024 else f"T={T}"
    flash = {}
    for label, dtype in (("flash bf16", torch.bfloat16), ("sdpa fp32", torch.float32)):
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        gg = up.to(dtype)

        def fwd(qq=qq, kk=kk, vv=vv):
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

        def fwd_bwd(fwd=fwd, gg=gg):
            fwd().backward(gg)

        backend = _flash_only if (label == "flash bf16" and ctx.gpu) else _any_backend
        with backend():
            flash[label] = (ctx.timed(fwd), ctx.timed(fwd_bwd))
        for i, what in enumerate(("forward", "fwd+bwd")):
            report.info(f"{tag} {label} {what}", flash[label][i] / dense_scores * 1e9,
                        "ns/score")  # fmt: skip
    if kern is None:
        report.skip(f"{tag} CUDA kernels per computed score", _why_no_kernels(ctx))
        t_api = ctx.timed(lambda: block_sparse_attention(q, k, v, csr), reps=3)
        report.info(f"{tag} public API forward (reference path)", t_api * 1e3, "ms")
        return
    dcsr = device_csr(csr, ctx.device)
    n = _scores(csr, B)
    scale = D**-0.5
    out, lse = kern.forward(q, k, v, dcsr, scale)
    t_fwd = ctx.timed(lambda: kern.forward(q, k, v, dcsr, scale))
    t_bwd = ctx.timed(lambda: kern.backward(q, k, v, out, lse, up, dcsr, scale))
    ours = (t_fwd / n, (t_fwd + t_bwd) / n)
    theirs = [t / dense_scores for t in flash["flash bf16"]]
    report.info(f"{tag} CUDA kernels forward (ρ={csr.density:.3f})", ours[0] * 1e9, "ns/score",
                note=f"{t_fwd * 1e3:.2f} ms")  # fmt: skip
    report.info(f"{tag} CUDA kernels fwd+bwd", ours[1] * 1e9, "ns/score",
                note=f"{(t_fwd + t_bwd) * 1e3:.2f} ms")  # fmt: skip
    report.info(f"{tag} per score: ours / flash bf16, forward", ours[0] / theirs[0], "×")
    report.info(f"{tag} per score: ours / flash bf16, fwd+bwd", ours[1] / theirs[1], "×")
    report.info(f"{tag} wall: ours / flash bf16, forward", t_fwd / flash["flash bf16"][0], "×")
    if T <= 4096:  # the dense reference's scores: 4·B·H·T² bytes (1 GiB at 4k)
        t_api = ctx.timed(lambda: block_sparse_attention(q, k, v, csr), reps=3, warmup=1)
        report.info(f"{tag} public API forward (dense reference on CUDA)", t_api * 1e3, "ms")


def _flash_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _any_backend():
    import contextlib

    return contextlib.nullcontext()
