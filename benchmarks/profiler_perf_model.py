"""The step-time model against measured ZeRO steps: 2 gloo processes, stages 0-3, two sizes.

1. Calibrate (`minispeed.profiler.calibrate.measure_in_group`) inside the 2-rank group, one
   thread each, at the start of every round: float32 matmul FLOP/s at a few sizes, the memory
   rate, the per-operator overhead, AdamW's seconds per parameter, each collective's α and β
   (fitted to 4 message sizes), and the FLOP/s of every matrix-product shape the model runs
   (`measure_matmul_shapes`, slowest rank).
2. Count one micro-step's FLOPs, MACs and operator calls (forward + backward) of
   examples/gpt.py's GPT with the FLOPs profiler; parameters Ψ from the model.
3. Predict each stage's step (`perf_model.predict_step`: Ψ, N = 2, the stage's bucket size,
   stage 3's gathers per pass from `perf_model.stage3_gather_calls` with zero's default
   prefetch budget, and stage 3's fixed cost per module from `measure_stage3_unit_s`, timed
   in every round on a one-rank group).
4. Measure: the four stages (each its own `minispeed.zero.shard` model and AdamW) take turns,
   one step each per round right after the round's calibration, `--steps` rounds after a
   warm-up round, so that load from other programs falls on calibration and stages alike; a
   step is forward, backward, optimizer step, the slower rank's time. Reported: medians over
   rounds, and the median of the per-round errors.

    python benchmarks/profiler_perf_model.py [--steps 3]

Both the model and the measurement see a machine shared with other programs (the load average
is printed before and after); the error column is (predicted - measured) / measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, GPTConfig

from minispeed.profiler import FlopsProfiler, predict_step
from minispeed.profiler.calibrate import measure_in_group, measure_matmul_shapes
from minispeed.profiler.launch import _free_port
from minispeed.profiler.perf_model import matmul_seconds, stage3_gather_calls

SIZES = {
    "small": dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, batch=4),
    "35M": dict(vocab_size=8192, block_size=32, n_layer=6, n_head=10, n_embd=640, batch=1),
}
BUCKET_NUMEL = 2_000_000
PREFETCH_NUMEL = 50_000_000  # minispeed.zero's default stage3_prefetch_bucket_numel
WORLD = 2


def _build(spec: dict) -> tuple[GPT, int]:
    spec = dict(spec)
    batch = spec.pop("batch")
    torch.manual_seed(0)
    return GPT(GPTConfig(**spec)), batch


SIZES_CALIBRATED = (64, 128, 256, 512, 1024)


def measure_stage3_unit_s(zero, group, steps: int = 6) -> float:
    """Seconds per module with parameters per micro-step that minispeed.zero's stage 3 adds to
    stage 2 (its module hooks: fetch, wrap the inputs for the backward hook, release), on one
    rank (`group` of size 1, so no collective waits) and a tiny GPT whose arithmetic is
    negligible: forward + backward of stage 3 minus stage 2, alternating, medians."""
    spec = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**spec))
        cfg = zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=0,
                              stage3_prefetch_bucket_numel=PREFETCH_NUMEL)  # fmt: skip
        opt = zero.shard(model, torch.optim.AdamW(model.parameters()), config=cfg, group=group)
        runs[stage] = (model, opt, [])
    for i in range(steps + 2):
        for model, opt, samples in runs.values():
            start = time.perf_counter()
            _, loss = model(idx, idx)
            opt.backward(loss)
            if i >= 2:
                samples.append(time.perf_counter() - start)
            opt.step()
    model = runs[3][0]
    units = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    extra = statistics.median(runs[3][2]) - statistics.median(runs[2][2])
    for _, opt, _ in runs.values():
        opt.close()
    return max(extra, 0.0) / units


def _predict(machine, counted: tuple, stage: int, shape_s: tuple[float, float], unit_s: float):
    flops, macs, ops, psi, tensors, with_params, width, _ = counted
    return predict_step(
        machine,
        flops_per_step=flops,
        macs_per_step=macs,
        ops_per_step=ops,
        num_tensors=tensors,
        stage3_units=with_params,
        stage3_unit_s=unit_s,
        num_params=psi,
        stage=stage,
        world_size=WORLD,
        matmul_size=width,
        bucket_numel=BUCKET_NUMEL,
        gather_calls=stage3_gather_calls(psi, with_params, PREFETCH_NUMEL),
        matmul_shape_s=shape_s,
    )


def _worker(rank: int, port: int, steps: int, counted: dict, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MINISPEED_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    import minispeed.comm as comm
    import minispeed.zero as zero

    comm.init_distributed(backend="gloo")
    solo = [comm.new_group([r]) for r in range(WORLD)][rank]  # every rank creates every group
    out = {}
    for label, spec in SIZES.items():
        trainers = {}
        for stage in (0, 1, 2, 3):
            model, batch = _build(spec)
            cfg = zero.ZeroConfig(
                stage=stage,
                reduce_bucket_numel=BUCKET_NUMEL,
                allgather_bucket_numel=BUCKET_NUMEL,
                stage3_param_persistence_threshold_numel=0,
                stage3_prefetch_bucket_numel=PREFETCH_NUMEL,
            )
            opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
            trainers[stage] = (model, opt)
        g = torch.Generator().manual_seed(rank)
        rounds: list[dict] = []
        # Rounds: calibrate, then every stage steps once, so that calibration and steps see the
        # same load from other programs (round 0 warms up).
        for i in range(steps + 1):
            machine = measure_in_group(comm, SIZES_CALIBRATED, seconds=0.1)
            shapes = counted[label][-1]
            rates = measure_matmul_shapes(list(shapes))
            slowest = torch.tensor(list(rates.values()), dtype=torch.float64)
            comm.all_reduce(slowest, op=comm.ReduceOp.MIN)  # the slower rank sets the pace
            shape_s = matmul_seconds(shapes, dict(zip(rates, slowest.tolist(), strict=True)))
            unit_s = torch.tensor([measure_stage3_unit_s(zero, solo)])
            comm.all_reduce(unit_s, op=comm.ReduceOp.MAX)
            row = {}
            for stage, (model, opt) in trainers.items():
                shape = (batch, model.cfg.block_size)
                idx = torch.randint(0, model.cfg.vocab_size, shape, generator=g)
                comm.barrier()
                start = time.perf_counter()
                _, loss = model(idx, idx)
                opt.backward(loss)
                opt.step()
                t = torch.tensor([time.perf_counter() - start])
                comm.all_reduce(t, op=comm.ReduceOp.MAX)
                row[stage] = (
                    t.item(),
                    _predict(machine, counted[label], stage, shape_s, unit_s.item()),
                )
            if i > 0:
                rounds.append(row)
        for stage, (_, opt) in trainers.items():
            out[(label, stage)] = [row[stage] for row in rounds]
            opt.close()
        out[label] = machine  # the last round's calibration
    if rank == 0:
        queue.put(out)
    comm.barrier()
    comm.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    counted = {}
    for label, spec in SIZES.items():
        model, batch = _build(spec)
        idx = torch.randint(0, model.cfg.vocab_size, (batch, model.cfg.block_size))
        with FlopsProfiler(model) as prof:
            model(idx, idx)[1].backward()
        with_params = sum(
            1 for m in model.modules() if any(True for _ in m.parameters(recurse=False))
        )
        r = prof.result()
        ops = sum(r.op_calls.values())
        counted[label] = (
            r.flops,
            r.forward.macs + r.backward.macs,
            ops,
            model.num_params(),
            sum(1 for _ in model.parameters()),
            with_params,
            model.cfg.n_embd,
            r.matmul_shapes,
        )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, args.steps, counted, queue))
        for r in range(WORLD)
    ]
    load_before = os.getloadavg()
    for p in procs:
        p.start()
    measured = queue.get(timeout=1800)
    for p in procs:
        p.join()
    load_after = os.getloadavg()
    print(
        "size   stage compute memory ops  adam hooks units params unpack  comm predicted measured "
        "error"
    )
    for label in SIZES:
        for stage in (0, 1, 2, 3):
            rows = measured[(label, stage)]
            m = statistics.median(t for t, _ in rows)
            p = statistics.median(pred.step_s for _, pred in rows)
            last = rows[-1][1]
            err = statistics.median((pred.step_s - t) / t for t, pred in rows)
            print(
                f"{label:6} {stage:5} {last.compute_s * 1e3:7.0f} {last.memory_s * 1e3:6.0f} "
                f"{last.overhead_s * 1e3:3.0f} {last.optimizer_s * 1e3:5.0f} "
                f"{last.hooks_s * 1e3:5.0f} {last.units_s * 1e3:5.0f} {last.params_s * 1e3:6.0f} {last.unpack_s * 1e3:6.0f} "
                f"{last.comm_s * 1e3:5.0f} {p * 1e3:9.0f} {m * 1e3:8.0f} {100 * err:+5.0f}%"
            )
    print("(terms: ms, last round's calibration; predicted, measured: medians over rounds, ms;")
    print(" error: median over rounds of (predicted - measured) / measured)")
    for label in SIZES:
        m = measured[label]
        links = ", ".join(
            f"{op} α {c.alpha_s * 1e3:.2f} ms β {c.busbw_bytes_per_s / 1e6:.0f} MB/s"
            for op, c in m.links.items()
        )
        print(f"{label} calibration: {links}; AdamW {m.adam_s_per_param * 1e9:.1f} ns/param "
              f"+ {m.adam_s_per_tensor * 1e6:.0f} us/tensor, hook {m.hook_s_per_grad * 1e6:.0f} us, DRAM {m.dram_bytes_per_s / 1e9:.2f} GB/s, element-wise "
              f"{m.stream_bytes_per_s / 1e9:.2f} GB/s, t_op {m.op_overhead_s * 1e6:.1f} us")  # fmt: skip
    loads = " ".join(f"{x:.1f}" for x in load_before), " ".join(f"{x:.1f}" for x in load_after)
    print(f"load average (1, 5, 15 min) before: {loads[0]}; after: {loads[1]}")


if __name__ == "__main__":
    main()
