"""The chip's two ceilings, the optimizer step and the cast op, timed against torch in the same run.

`speed.matmul`: the bf16 matmul rate (8192³ on random data, METHOD's recipe; the denominator
of every MFU here) and the device-to-device copy rate (bytes read + written per second).

`speed.adamw`: one optimizer step over 256M fp32 parameters in 64 tensors with random
gradients: minispeed's `FusedAdam` (`minispeed.engine.ops.adam`, what the engine builds for
DeepSpeed's `"type": "AdamW"`) against `torch.optim.AdamW(fused=True)` and torch's default
(foreach), after one step from equal states gives equal weights. Ratio: ours / fused (below 1
is faster).

`speed.cast`: fp32 → bf16 and bf16 → fp32 of 256M elements, the cast op against `tensor.to`
(into a preallocated output both), as time ratios and GB/s (bytes read + written).
"""

from __future__ import annotations

from gpucheck.harness import TOL, Ctx, Report, rel_err


def matmul(ctx: Ctx, report: Report) -> None:
    import torch

    report.info("bf16 matmul rate", ctx.matmul_flops / 1e12, "TFLOP/s",
                note=ctx.pick("8192³ random, mean of 10 after 3 warm-ups", "dry run: 512³ fp32"))  # fmt: skip
    numel = ctx.pick(2**30, 2**20)  # 4 GiB of fp32 on the GPU
    src = torch.randn(numel, device=ctx.device)
    dst = torch.empty_like(src)
    seconds = ctx.timed(lambda: dst.copy_(src))
    report.info("device copy rate (read + write)", 8 * numel / seconds / 1e9, "GB/s",
                note=f"{4 * numel / 2**30:.0f} GiB")  # fmt: skip


def _params(ctx: Ctx, count: int, numel: int, seed: int):
    import torch

    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(numel, device=ctx.device, generator=gen))
        p.grad = torch.randn(numel, device=ctx.device, generator=gen)
        params.append(p)
    return params


def adamw(ctx: Ctx, report: Report) -> None:
    import torch

    from minispeed.engine.ops.adam import FusedAdam

    count, numel = ctx.pick((64, 4 * 2**20), (4, 1000))
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    opts = {
        "minispeed FusedAdam": FusedAdam(_params(ctx, count, numel, 9), adam_w_mode=True, **hyper),
        "torch AdamW(fused=True)": torch.optim.AdamW(_params(ctx, count, numel, 9), fused=ctx.gpu,
                                                     **hyper),
        "torch AdamW (foreach)": torch.optim.AdamW(_params(ctx, count, numel, 9), **hyper),
    }  # fmt: skip
    for opt in opts.values():
        opt.step()
    first = [opt.param_groups[0]["params"][0] for opt in opts.values()]
    report.check("one step: FusedAdam against AdamW(fused=True)", rel_err(first[0], first[1]),
                 TOL["fp32"])  # fmt: skip
    times = {name: ctx.timed(opt.step, reps=10, warmup=2) for name, opt in opts.items()}
    for name, t in times.items():
        report.info(f"{name} step ({count * numel / 1e6:.0f}M params)", t * 1e3, "ms")
    report.info("FusedAdam / AdamW(fused=True)",
                times["minispeed FusedAdam"] / times["torch AdamW(fused=True)"], "×")  # fmt: skip
    if ctx.gpu:
        report.finding(
            "minispeed's FusedAdam is torch's Adam with decoupled weight decay (foreach kernels), "
            "not a fused kernel: the ratio above is what passing fused=True on CUDA would buy"
        )


def cast(ctx: Ctx, report: Report) -> None:
    import torch

    from minispeed.core.ops import cast as ops

    n = ctx.pick(2**28, 2**16)
    x = torch.randn(n, device=ctx.device)
    low = torch.empty(n, dtype=torch.bfloat16, device=ctx.device)
    y = torch.randn(n, device=ctx.device).to(torch.bfloat16)
    high = torch.empty(n, device=ctx.device)
    pairs = {
        "fp32→bf16": (lambda: ops.float_to_bf16(x, out=low), lambda: low.copy_(x)),
        "bf16→fp32": (lambda: ops.bf16_to_float(y, out=high), lambda: high.copy_(y)),
    }
    for label, (ours, theirs) in pairs.items():
        t_ours, t_torch = ctx.timed(ours), ctx.timed(theirs)
        report.info(
            f"{label} cast op", 6 * n / t_ours / 1e9, "GB/s", note=f"{n / 2**20:.0f}M elements"
        )
        report.info(f"{label} tensor.to", 6 * n / t_torch / 1e9, "GB/s")
        report.info(f"{label}: op time / tensor.to time", t_ours / t_torch, "×")
