"""Every CUDA op through its public wrapper, against its pure-PyTorch reference.

Inputs are fresh random draws on the device (never zeros); the reference runs on the CPU in
float64 where the contract is arithmetic (norms, softmax, attention, matmul: error
‖out − ref‖/‖ref‖ against `TOL["fp32"]`) and on the same fp32 values where the contract is
bit-for-bit (the cast op, sign bits, int8/int4 codes: the count of differing elements must be 0).
Before each call the device allocator is poisoned with NaN, so an output element a kernel fails
to write shows up as NaN. Each check first loads the op itself (`compiled_or_reason`): a failed
build would otherwise make the wrapper run the reference and compare it with itself.

- `op.cast`: fp32 → bf16 (random bit patterns: NaN payloads, infinities, subnormals, ties) and
  bf16 → fp32, bits against the reference and against `tensor.to`.
- `op.compression`: 1-bit sign pack/unpack, int8 and int4 block quantize/dequantize, the sparse
  accumulate, top-k (no CUDA kernel by design: torch.topk), and error feedback over four steps
  with each compressor (residuals against the CPU reference run; the telescoping sum).
- `op.moe_permute`: gather and combine rows, and `permute`/`unpermute` forward and backward
  (input and gate-weight gradients) against autograd through the reference in float64.
- `op.inference`: layer norm and RMS norm (with and without the residual), bias + GeLU, masked
  softmax, rotary embedding, paged decode attention (also where the cache tables address more
  positions than 48 KiB of shared memory holds), int8 linear.
"""

from __future__ import annotations

import contextlib
import os

from gpucheck.harness import TOL, Ctx, Report, compiled_or_reason, max_abs_diff, rel_err


@contextlib.contextmanager
def reference_ops():
    """Within the block every wrapper runs its pure-PyTorch reference."""
    old = os.environ.get("MINISPEED_DISABLE_OPS")
    os.environ["MINISPEED_DISABLE_OPS"] = "all"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MINISPEED_DISABLE_OPS"]
        else:
            os.environ["MINISPEED_DISABLE_OPS"] = old


def _need_op(ctx: Ctx, report: Report, builder) -> bool:
    """True when the CUDA op is there to test; records why not otherwise (dry run: skip)."""
    if not ctx.gpu:
        report.skip(f"CUDA op {builder.name}")
        return True  # the dry run still drives the wrappers (reference path) end to end
    op, why = compiled_or_reason(builder)
    if op is None:
        report.fail(f"CUDA op {builder.name} loads", why)
        return False
    return True


def _differing(a, b) -> int:
    return int((a.cpu() != b.cpu()).sum())


def cast(ctx: Ctx, report: Report) -> None:
    import torch

    from minispeed.core.ops import cast as ops

    if not _need_op(ctx, report, ops.CastCudaBuilder()):
        return
    n = ctx.pick(2**26 + 3, 4099)
    g = torch.Generator(device=ctx.device).manual_seed(1)
    bits = torch.randint(
        -(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=ctx.device, generator=g
    )
    x = bits.view(torch.float32).clone()
    x[::2] = torch.randn(x[::2].shape, device=ctx.device, generator=g) * 1e3  # ordinary values too
    ctx.poison(2 * n)
    got = ops.float_to_bf16(x)
    want = ops.reference.float_to_bf16(x.cpu())
    report.check("fp32→bf16: bits differing from the reference", _differing(got.view(torch.int16),
                 want.view(torch.int16)), 0, unit="elements", note=f"{n} random bit patterns")  # fmt: skip
    finite = x.isfinite()
    torch_bits = x[finite].to(torch.bfloat16).view(torch.int16)
    report.check("fp32→bf16: bits differing from tensor.to (finite)",
                 _differing(got[finite].view(torch.int16), torch_bits), 0, unit="elements")  # fmt: skip
    y = (torch.randn(n, device=ctx.device, generator=g) * 10).to(torch.bfloat16)
    ctx.poison(4 * n)
    back = ops.bf16_to_float(y)
    report.check("bf16→fp32: bits differing from the reference",
                 _differing(back.view(torch.int32),
                            ops.reference.bf16_to_float(y.cpu()).view(torch.int32)), 0,
                 unit="elements")  # fmt: skip
    out = torch.full((n,), float("nan"), device=ctx.device).to(torch.bfloat16)
    ops.float_to_bf16(x, out=out)
    report.check("fp32→bf16 into out=: bits differing", _differing(out.view(torch.int16),
                 want.view(torch.int16)), 0, unit="elements")  # fmt: skip


def compression(ctx: Ctx, report: Report) -> None:
    import torch

    from minispeed.comm.compression import (
        BlockQuantizer,
        ErrorFeedback,
        OnebitCompressor,
        ops,
        reference,
    )

    if not _need_op(ctx, report, ops.CompressionCudaBuilder()):
        return
    n = ctx.pick(2**24 + 5, 1001)
    g = torch.Generator(device=ctx.device).manual_seed(2)
    x = torch.randn(n, device=ctx.device, generator=g)
    xc = x.cpu()
    chunk = 256
    ctx.poison(n)
    bits, scales = ops.sign_pack(x, chunk)
    rbits, rscales = reference.sign_pack(xc, chunk)
    report.check("sign_pack: bit bytes differing", _differing(bits, rbits), 0, unit="bytes")
    report.check("sign_pack: chunk scales", rel_err(scales, rscales), TOL["fp32"])
    ctx.poison(4 * n)
    report.check("sign_unpack: elements differing",
                 _differing(ops.sign_unpack(bits, scales, chunk, n),
                            reference.sign_unpack(rbits, scales.cpu(), chunk, n)), 0,
                 unit="elements")  # fmt: skip
    for nbits in (8, 4):
        ctx.poison(n)
        q, s = ops.quantize_blocks(x, chunk, nbits)
        rq, rs = reference.quantize_blocks(xc, chunk, nbits)
        report.check(f"int{nbits} quantize: code bytes differing", _differing(q, rq), 0,
                     unit="bytes")  # fmt: skip
        report.check(f"int{nbits} quantize: scales differing", _differing(s, rs), 0,
                     unit="blocks")  # fmt: skip
        ctx.poison(4 * n)
        deq = ops.dequantize_blocks(q, s, chunk, nbits, n)
        rdeq = reference.dequantize_blocks(q.cpu(), s.cpu(), chunk, nbits, n)
        report.check(f"int{nbits} dequantize: elements differing", _differing(deq, rdeq), 0,
                     unit="elements")  # fmt: skip
    k = max(1, n // 100)
    values, idx = ops.topk_select(x, k)
    rvalues, ridx = reference.topk_select(xc, k)
    report.check("top-k (torch.topk on CUDA: no kernel, by design): indices differing",
                 _differing(idx, ridx), 0, unit="indices")  # fmt: skip
    out = torch.randn(n, device=ctx.device, generator=g)
    want = reference.sparse_accumulate_(out.cpu().clone(), rvalues, ridx)
    ops.sparse_accumulate_(out, values, idx)
    report.check("sparse_accumulate_: elements differing", _differing(out, want), 0,
                 unit="elements")  # fmt: skip
    steps = [torch.randn(n, device=ctx.device, generator=g) for _ in range(4)]
    for comp in (OnebitCompressor(chunk), BlockQuantizer(8, chunk), BlockQuantizer(4, chunk)):
        dev, ref = ErrorFeedback(comp), ErrorFeedback(comp)
        total = torch.zeros(n, dtype=torch.float64)
        for step in steps:
            total += comp.decompress(dev.compress(step)).cpu().double()
            with reference_ops():
                ref.compress(step.cpu())
        label = type(comp).__name__ + (f" int{comp.bits}" if hasattr(comp, "bits") else "")
        report.check(f"error feedback {label}: residual after 4 steps",
                     rel_err(dev.residual, ref.residual), TOL["fp32"])  # fmt: skip
        sent = sum(s.cpu().double() for s in steps) - dev.residual.cpu().double()
        report.check(f"error feedback {label}: Σ received = Σ x − residual",
                     rel_err(total, sent), TOL["fp32"])  # fmt: skip


def _routing(T: int, k: int, slots: int, gen):
    """A random dispatch plan: `token_slot` (T, k) with about 10% of choices dropped (-1), and
    its inverse `slot_token` (slots,) with -1 for empty slots."""
    import torch

    assert slots >= T * k
    perm = torch.randperm(slots, generator=gen)[: T * k].view(T, k)
    dropped = torch.rand(T, k, generator=gen) < 0.1
    token_slot = torch.where(dropped, torch.full_like(perm, -1), perm)
    slot_token = torch.full((slots,), -1, dtype=torch.int64)
    rows = torch.arange(T)[:, None].expand(T, k)
    keep = token_slot >= 0
    slot_token[token_slot[keep]] = rows[keep]
    return token_slot, slot_token


def moe_permute(ctx: Ctx, report: Report) -> None:
    import torch

    from minispeed.moe import permute as P

    if not _need_op(ctx, report, P.PermuteCudaBuilder()):
        return
    T, d, k = ctx.pick((8192, 1024, 2), (48, 16, 2))
    slots = T * k + T // 4
    gen = torch.Generator().manual_seed(3)
    token_slot, slot_token = _routing(T, k, slots, gen)
    x = torch.randn(T, d, generator=gen)
    w = torch.rand(T, k, generator=gen)
    upstream = torch.randn(T, d, generator=gen)
    dev = ctx.device
    ts, st = token_slot.to(dev), slot_token.to(dev)
    ctx.poison(4 * slots * d)
    report.check("gather_rows", rel_err(P.gather_rows(x.to(dev), st),
                 P.reference.gather_rows(x.double(), slot_token)), TOL["fp32"])  # fmt: skip
    y = torch.randn(slots, d, generator=gen)
    ctx.poison(4 * T * d)
    report.check("combine_rows (weighted)", rel_err(P.combine_rows(y.to(dev), ts, w.to(dev)),
                 P.reference.combine_rows(y.double(), token_slot, w.double())), TOL["fp32"])  # fmt: skip

    def forward(gather, combine, x_, w_):
        expert_out = gather(x_) * 1.5 + 0.25  # a stand-in expert: any function of the slots
        return combine(expert_out, w_)

    xd = x.to(dev, copy=True).requires_grad_()
    wd = w.to(dev, copy=True).requires_grad_()
    out = forward(lambda t: P.permute(t, st, ts), lambda t, ww: P.unpermute(t, ww, ts, st), xd, wd)
    (out * upstream.to(dev)).sum().backward()
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    ref = forward(lambda t: P.reference.gather_rows(t, slot_token),
                  lambda t, ww: P.reference.combine_rows(t, token_slot, ww), x64, w64)  # fmt: skip
    (ref * upstream.double()).sum().backward()
    report.check("permute → unpermute forward", rel_err(out, ref), TOL["fp32"])
    report.check("backward: input gradient", rel_err(xd.grad, x64.grad), TOL["fp32"])
    report.check("backward: gate-weight gradient", rel_err(wd.grad, w64.grad), TOL["fp32"])


def inference(ctx: Ctx, report: Report) -> None:
    import torch

    from minispeed.inference import kernels as K
    from minispeed.inference.kernels import reference as R

    if not _need_op(ctx, report, K.InferenceCudaKernelsBuilder()):
        return
    dev, gen = ctx.device, torch.Generator().manual_seed(4)
    rows, C = ctx.pick((4096, 4096), (7, 64))

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    x, res, w, b = rnd(rows, C), rnd(rows, C), rnd(C) + 1, rnd(C)
    on = [t.to(dev) for t in (x, res, w, b)]
    f64 = [t.double() for t in (x, res, w, b)]
    for residual in (False, True):
        tag = " + residual" if residual else ""
        ctx.poison(8 * rows * C)
        got = K.layer_norm(on[0], on[2], on[3], 1e-5, on[1] if residual else None)
        want = R.layer_norm(f64[0], f64[2], f64[3], 1e-5, f64[1] if residual else None)
        report.check(f"layer_norm{tag}", rel_err(got[0], want[0]), TOL["fp32"])
        report.check(f"layer_norm{tag}: the summed stream h", rel_err(got[1], want[1]), TOL["fp32"])
        ctx.poison(8 * rows * C)
        got = K.rms_norm(on[0], on[2], 1e-6, on[1] if residual else None)
        want = R.rms_norm(f64[0], f64[2], 1e-6, f64[1] if residual else None)
        report.check(f"rms_norm{tag}", rel_err(got[0], want[0]), TOL["fp32"])
    ctx.poison(4 * rows * C)
    report.check("bias_gelu", rel_err(K.bias_gelu(on[0], on[3]), R.bias_gelu(f64[0], f64[3])),
                 TOL["fp32"])  # fmt: skip
    mask = torch.rand(rows, C, generator=gen) < 0.7
    mask[:, 0] = True
    ctx.poison(4 * rows * C)
    report.check("masked_softmax (scale 0.125)",
                 rel_err(K.masked_softmax(on[0], mask.to(dev), 0.125),
                         R.masked_softmax(f64[0], mask, 0.125)), TOL["fp32"])  # fmt: skip

    T, H, D, max_pos = ctx.pick((2048, 32, 128, 4096), (5, 2, 8, 16))
    cos, sin = K.rotary_tables(max_pos, D)
    pos = torch.randint(0, max_pos, (T,), generator=gen)
    q = rnd(T, H, D)
    ctx.poison(4 * T * H * D)
    report.check("rotary_embedding",
                 rel_err(K.rotary_embedding(q.to(dev), pos.to(dev), cos.to(dev), sin.to(dev)),
                         R.rotary_embedding(q.double(), pos, cos.double(), sin.double())),
                 TOL["fp32"])  # fmt: skip

    cases = ctx.pick(  # (B, H, KV, D, block size, max blocks, label); KV < H: grouped-query
        [(8, 32, 32, 128, 16, 64, ""),
         (2, 8, 8, 128, 16, 1024, ", tables address 16k positions: 64 KiB of scores > 48 KiB"),
         (8, 32, 8, 128, 16, 64, ", 32 query heads over 8 cached (grouped-query)")],
        [(3, 2, 2, 8, 4, 3, ""), (3, 4, 2, 8, 4, 3, ", grouped-query")],
    )  # fmt: skip
    for B, H, KV, D, bs, max_blocks, label in cases:
        num_blocks = B * max_blocks
        kc, vc = rnd(num_blocks, bs, KV, D), rnd(num_blocks, bs, KV, D)
        tables = torch.randperm(num_blocks, generator=gen).view(B, max_blocks)
        lens = torch.randint(1, max_blocks * bs + 1, (B,), generator=gen)
        lens[0] = max_blocks * bs
        qd = rnd(B, H, D)
        ctx.poison(4 * B * H * D)
        try:
            got = K.decode_attention(qd.to(dev), kc.to(dev), vc.to(dev), tables.to(dev).int(),
                                     lens.to(dev).int())  # fmt: skip
            ctx.sync()
        except RuntimeError as err:
            report.fail(f"decode_attention{label}", str(err).splitlines()[0][:300])
            continue
        want = R.decode_attention(qd.double(), kc.double(), vc.double(), tables, lens)
        report.check(f"decode_attention{label}", rel_err(got, want), TOL["fp32"],
                     note=f"B {B}, H {H}, KV {KV}, D {D}, up to {max_blocks * bs} positions")  # fmt: skip

    M, N, Kd = ctx.pick((64, 4096, 4096), (3, 8, 16))
    wq = torch.randint(-127, 128, (N, Kd), dtype=torch.int8, generator=gen)
    scales, bias, xin = torch.rand(N, generator=gen) / 64 + 1e-3, rnd(N), rnd(M, Kd)
    ctx.poison(4 * M * N)
    got = K.int8_linear(xin.to(dev), wq.to(dev), scales.to(dev), bias.to(dev))
    want = xin.double() @ (wq.double() * scales.double()[:, None]).T + bias.double()
    report.check("int8_linear", rel_err(got, want), TOL["fp32"], note=f"M {M}, N {N}, K {Kd}")
    report.info("max |int8_linear − ref|", max_abs_diff(got, want))
