"""ZeRO on one GPU: parity with plain PyTorch, the 1B-parameter step's MFU and memory, offload.

One process, world size 1, the accelerator's backend (NCCL on a GPU, gloo in the dry run),
started with `comm.init_distributed()` as a user's script does.

`train.zero`: the GPT of examples/gpt.py (4 layers, width 128), AdamW (weight decay on), six
steps on fixed random batches, fp32: plain PyTorch, then `zero.shard` at stages 0, 1, 2, 3, and
ZeRO-Offload (stage 2 and stage 3 with `offload_optimizer` on the CPU, pinned): each run's losses
and final weights against plain PyTorch's (‖Δ‖/‖ref‖ against `TOL["fp32-train"]`). Then ZeRO-1
and ZeRO-3 with every state parked in host memory after each step and given back
(`zero.parking`, DeepSpeed's `offload_states`): the losses of the unparked run exactly, and the
device memory freed by the park (`torch.cuda.memory_allocated`) within 5% of the bytes parked.

`speed.gpt1b`: a 1.01B-parameter GPT (18 layers, width 2048, 16 heads, vocabulary 50304,
context 1024), bf16 parameters with fp32 masters and gradients (`MixedPrecision(param_dtype=
bf16)`), AdamW, batch 8 × 1024 tokens, at ZeRO-0 and ZeRO-3: the median step time of 5 after
2 warm-ups; MFU = (6·Ψ·B·T + 12·L·C·B·T²) FLOPs per step / step time / the chip's bf16 matmul
rate measured in this run (`Ctx.matmul_flops`; the goal is 40% at ZeRO-0); the memory ledger
(`zero.memory.predict`: parameters + gradients + masters + Adam state) against
`torch.cuda.memory_allocated()` after a backward (every model state alive, the activations freed:
goal within 5%) and against `torch.cuda.max_memory_allocated()` over a step (the rest is
activations and workspace).

`speed.offload`: a 204M-parameter GPT (12 layers, width 1024), bf16, ZeRO-2 with the optimizer
offloaded to the CPU, batch 4 × 1024: step time with the host buffers pinned and not pinned
(`offload_optimizer.pin_memory`), and the device-to-host copy rate of each kind of buffer.
"""

from __future__ import annotations

from gpucheck.harness import TOL, Ctx, Report, gpt_module, rel_err


def _init_comm() -> str:
    import minispeed.comm as comm

    comm.init_distributed()
    import torch.distributed as dist

    return dist.get_backend()


def _batches(ctx: Ctx, vocab: int, steps: int, batch: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(8)
    return [
        tuple(torch.randint(0, vocab, (batch, seq), generator=gen).to(ctx.device) for _ in "xy")
        for _ in range(steps)
    ]


def _model(ctx: Ctx, cfg):
    import torch

    torch.manual_seed(0)
    with torch.device(ctx.device):
        return gpt_module().GPT(cfg)


def _plain(ctx, cfg, batches):
    import torch

    model = _model(ctx, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _zeroed(ctx, cfg, batches, config, parked=None):
    """`parked`: a list that receives, after each step, (bytes parked, device bytes freed) of
    `parking.park` over every kind of state, given back with `unpark` before the next step."""
    import torch

    import minispeed.zero as zero
    from minispeed.zero import parking

    model = _model(ctx, cfg)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
                     config=config)  # fmt: skip
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        opt.backward(loss)
        opt.step()
        losses.append(float(loss))
        if parked is not None:
            before = torch.cuda.memory_allocated() if ctx.gpu else 0
            held = parking.park(opt, model, host_too=not ctx.gpu)  # dry run: moves host states
            after = torch.cuda.memory_allocated() if ctx.gpu else 0
            parked.append((sum(held.nbytes.values()), before - after))
            parking.unpark(held)
    opt.close()  # stage 3: gathers the parameters back into the model
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def zero_parity(ctx: Ctx, report: Report) -> None:
    import torch

    import minispeed.zero as zero
    from minispeed.offload import OffloadOptimizerConfig

    backend = _init_comm()
    report.info("process group", backend, note="world size 1")
    G = gpt_module()
    cfg = G.GPTConfig(vocab_size=257, block_size=64, n_layer=ctx.pick(4, 2), n_head=4,
                      n_embd=ctx.pick(128, 32))  # fmt: skip
    steps = ctx.pick(6, 3)
    batches = _batches(ctx, cfg.vocab_size, steps, ctx.pick(8, 2), cfg.block_size)
    ref_losses, ref_weights = _plain(ctx, cfg, batches)
    ref_losses_t = torch.tensor(ref_losses, dtype=torch.float64)
    host = OffloadOptimizerConfig(device="cpu", pin_memory=True)
    runs = {f"ZeRO-{s}": zero.ZeroConfig(stage=s) for s in range(4)}
    runs["ZeRO-Offload (stage 2, cpu, pinned)"] = zero.ZeroConfig(stage=2, offload_optimizer=host)
    runs["ZeRO-Offload (stage 3, cpu, pinned)"] = zero.ZeroConfig(stage=3, offload_optimizer=host)
    for label, config in runs.items():
        losses, weights = _zeroed(ctx, cfg, batches, config)
        report.check(f"{label}: losses", rel_err(torch.tensor(losses, dtype=torch.float64),
                     ref_losses_t), TOL["fp32-train"], note=f"{steps} steps, last {losses[-1]:.4f}")  # fmt: skip
        worst = max(rel_err(weights[n], w) for n, w in ref_weights.items())
        report.check(f"{label}: final weights (worst tensor)", worst, TOL["fp32-train"])
        ctx.free()
    # DeepSpeed's offload_states / reload_states (zero/parking.py) between every step: the same
    # losses bit for bit, and the device memory freed is the bytes parked.
    for stage in (1, 3):
        parked: list[tuple[int, int]] = []
        plain, _ = _zeroed(ctx, cfg, batches, zero.ZeroConfig(stage=stage))
        losses, _ = _zeroed(ctx, cfg, batches, zero.ZeroConfig(stage=stage), parked)
        report.check(f"ZeRO-{stage} parked between steps: losses vs unparked", float(
            losses != plain), 0.0, unit="differ", note=f"{len(parked)} parks")  # fmt: skip
        nbytes, freed = parked[-1]
        if ctx.gpu:
            report.check(f"ZeRO-{stage} parked: device bytes freed / parked, short by",
                         1.0 - freed / max(nbytes, 1), 0.05, unit="fraction",
                         note=f"{nbytes:,} bytes parked, {freed:,} freed")  # fmt: skip
        else:
            report.info(f"ZeRO-{stage} parked: bytes parked (host, dry run)", nbytes)
        ctx.free()


def _flops_per_step(cfg, params: int, batch: int, seq: int) -> float:
    """6·Ψ·B·T (every parameter's matmuls, forward and backward) + 12·L·C·B·T² (attention)."""
    return 6 * params * batch * seq + 12 * cfg.n_layer * cfg.n_embd * batch * seq * seq


def _bf16_case(ctx: Ctx, layers: int, width: int, heads: int, batch: int):
    """A GPT of vocabulary 50304 and context 1024 (tiny in the dry run) and one batch of ids."""
    G = gpt_module()
    cfg = ctx.pick(G.GPTConfig(vocab_size=50304, block_size=1024, n_layer=layers, n_head=heads,
                               n_embd=width),
                   G.GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32))  # fmt: skip
    batch, seq = ctx.pick((batch, 1024), (2, 32))
    ((x, y),) = _batches(ctx, cfg.vocab_size, 1, batch, seq)
    return cfg, x, y


def _bf16_sharded(ctx: Ctx, cfg, config, x, y):
    """The model with bf16 parameters (fp32 masters) under `config`, and one training step."""
    import torch

    import minispeed.zero as zero

    model = _model(ctx, cfg)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config,
                     precision=zero.MixedPrecision(param_dtype=torch.bfloat16))  # fmt: skip

    def step() -> None:
        _, loss = model(x, y)
        opt.backward(loss)
        opt.step()

    return model, opt, step


def gpt1b(ctx: Ctx, report: Report) -> None:
    import minispeed.zero as zero
    from minispeed.zero.memory import predict

    _init_comm()
    cfg, x, y = _bf16_case(ctx, layers=18, width=2048, heads=16, batch=8)
    batch, seq = x.shape
    rate = ctx.matmul_flops
    report.info("bf16 matmul rate (this run)", rate / 1e12, "TFLOP/s",
                note=ctx.pick("8192³, random data", "dry run: 512³ fp32 on the CPU"))  # fmt: skip
    for stage in (0, 3):
        ctx.free()
        model, opt, step = _bf16_sharded(ctx, cfg, zero.ZeroConfig(stage=stage), x, y)
        params = sum(p.numel() for p in model.parameters())
        seconds = ctx.wall(step, reps=5, warmup=2)
        mfu = _flops_per_step(cfg, params, batch, seq) / seconds / rate
        tag = f"ZeRO-{stage} ({params / 1e9:.2f}B, {batch}×{seq})"
        report.info(f"{tag}: step", seconds * 1e3, "ms")
        if stage == 0:
            report.goal(f"{tag}: MFU", 100 * mfu, 40.0, "%")
        else:
            report.info(f"{tag}: MFU", 100 * mfu, "%")
        # the ledger: every model state alive (after a backward), the activations freed
        ctx.acc.reset_peak_memory_stats()
        loss = model(x, y)[1]  # the logits (B·T·V bf16) are dropped before the reading
        opt.backward(loss)
        ctx.sync()
        live = ctx.acc.memory_allocated()
        opt.step()
        ctx.sync()
        peak = ctx.acc.max_memory_allocated()
        predicted = predict(opt).total
        report.info(f"{tag}: ledger predicts", predicted / 2**30, "GiB",
                    note="params + grads + masters + Adam state")  # fmt: skip
        off = 100 * abs(live / predicted - 1)
        report.goal(f"{tag}: allocated after backward vs ledger", off, 5.0, "%",
                    higher_is_better=False, note=f"{live / 2**30:.2f} GiB")  # fmt: skip
        report.info(f"{tag}: max_memory_allocated / ledger", peak / predicted, "×",
                    note=f"peak {peak / 2**30:.2f} GiB")  # fmt: skip
        opt.close()
        del model, opt, step
    ctx.free()


def _copy_rate(ctx: Ctx, numel: int, pinned: bool) -> float:
    """Device-to-host copy rate into a (pinned or pageable) fp32 buffer, bytes per second."""
    import torch

    src = torch.randn(numel, device=ctx.device)
    dst = torch.empty(numel, pin_memory=pinned and ctx.gpu)
    seconds = ctx.wall(lambda: dst.copy_(src, non_blocking=pinned), reps=5, warmup=1)
    return 4 * numel / seconds


def offload_speed(ctx: Ctx, report: Report) -> None:
    import minispeed.zero as zero
    from minispeed.offload import OffloadOptimizerConfig

    _init_comm()
    cfg, x, y = _bf16_case(ctx, layers=12, width=1024, heads=16, batch=4)
    times = {}
    for pinned in (True, False):
        ctx.free()
        host = OffloadOptimizerConfig(device="cpu", pin_memory=pinned)
        config = zero.ZeroConfig(stage=2, offload_optimizer=host)
        model, opt, step = _bf16_sharded(ctx, cfg, config, x, y)
        params = sum(p.numel() for p in model.parameters())
        masters = [m for ms in opt.strategy.master_params() for m in ms]
        is_pinned = all(m.is_pinned() for m in masters)
        if ctx.gpu:
            report.check(f"pin_memory={pinned}: host masters pinned as asked",
                         0 if is_pinned == pinned else 1, 0, unit="")  # fmt: skip
        times[pinned] = ctx.wall(step, reps=3, warmup=1)
        report.info(f"ZeRO-2 offload ({params / 1e6:.0f}M), pin_memory={pinned}: step",
                    times[pinned] * 1e3, "ms")  # fmt: skip
        opt.close()
        del model, opt, step
    report.info("step time: pageable / pinned", times[False] / times[True], "×")
    numel = ctx.pick(64 * 2**20, 2**16)
    for pinned in (True, False):
        rate = _copy_rate(ctx, numel, pinned)
        report.info(f"device→host copy, {'pinned' if pinned else 'pageable'} buffer",
                    rate / 1e9, "GB/s", note=f"{4 * numel / 2**20:.0f} MiB")  # fmt: skip
    if ctx.gpu:
        report.finding(
            "ZeRO-Offload copies are not stream-overlapped: the gradients are copied to the host "
            "after the reduction (non_blocking, then a full synchronize) and the masters back "
            "after the CPU step, on the current stream (zero/offload_bridge.py HostMasters); "
            "pin_memory is the only switch, so only pinned against pageable is measured here"
        )
