"""minispeed's engine against DeepSpeed 0.19.8 and against calling `zero.shard` directly.

The loop is the DeepSpeed GPT script's (`tests/engine/scripts/ds_gpt.py`): `initialize` from one
ds_config (AdamW with `torch_adam`, gradient accumulation 2, clipping 1.0), then
`engine(x, y)` / `engine.backward(loss)` / `engine.step()`. Three contenders per ZeRO stage, on
the same model, data and config, taking turns every round:

| contender | what runs |
|---|---|
| `engine ZeRO-k` | `minispeed.engine.initialize` |
| `shard ZeRO-k` | `minispeed.zero.shard` called directly (what the engine adds is the difference) |
| `DeepSpeed ZeRO-k` | `deepspeed.initialize` (when `import deepspeed` works) |
| `DDP ZeRO-0` | PyTorch's `DistributedDataParallel` (`no_sync` inside the window, `clip_grad_norm_`, the same AdamW): stage 0 only, the floor that per-call overheads are measured against |

Before any ratio is printed, every contender's per-step losses must equal the others' (1e-4):
a ratio between runs that train different things means nothing.

Run it with 2 processes, in a venv that has both DeepSpeed and minispeed (DeepSpeed's venv with
minispeed's sources on `PYTHONPATH` works):

```bash
DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node 2 \
    benchmarks/engine_vs_deepspeed.py --size small
DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node 2 \
    benchmarks/engine_vs_deepspeed.py --size large     # ≥ 30M parameters
```

Goals (issue 20): engine ≤ 0.5× DeepSpeed's step at the small size, ≤ 1.0× at the large one, at
every stage; engine ≤ 1.02× `zero.shard`. Issue 34 point 5: at 30K parameters the engine's CPU
time per step ≤ 1.03× `zero.shard`'s at every stage and ZeRO-0's ≤ 1.05× DDP's.

`--calls` counts instead of timing: every Python call (`sys.setprofile`'s `call` events) and
every builtin call (`c_call`) each contender makes on rank 0 over `--steps-per-round` steps after
one warm-up round, per micro-step, grouped by where the call goes (the package of the function
called; a builtin by the package of its caller, marked `[builtin]`). Counts do not depend on
the machine's load, so the table is the same on every run; it prints each contender's groups,
then what the engine adds over `zero.shard` and ZeRO-0 over DDP, function by function.
`--profile TOP` times instead of counting: cProfile's own time per micro-step, by the same
groups, and the TOP functions, each contender on rank 0 (`profile_report`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {  # vocab, seq, width, heads, layers, micro-batch
    "small": (64, 16, 32, 4, 2, 4),
    "large": (4096, 64, 512, 8, 10, 2),
}
GAS = 2


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def ds_config(stage: int, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
    }


class Contender:
    """One way of running the loop: `step(batches)` runs one optimizer step, returns its loss."""

    def __init__(self, name: str, size: str) -> None:
        vocab, seq, dim, heads, layers, micro = SIZES[size]
        torch.manual_seed(0)
        model = GPT(vocab, seq, dim, heads, layers)
        self.name, self.params = name, sum(p.numel() for p in model.parameters())
        kind, stage = name.rsplit(" ZeRO-", 1)
        cfg = ds_config(int(stage), micro)
        if kind == "DDP":
            self._step = self._ddp(model)  # type: ignore[method-assign]
            return
        if kind == "shard":
            import minispeed.zero as zero
            from minispeed.engine import EngineConfig

            opt = zero.shard(
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                config=EngineConfig.from_ds_config(cfg).zero,  # what the engine shards with
            )
            self.forward, self.backward, self.opt_step = model, opt.backward, opt.step
            return
        if kind == "engine":
            import minispeed.engine as deepspeed
        else:
            import deepspeed  # type: ignore[no-redef]
        linear = F.linear
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        self.forward, self.backward, self.opt_step = engine, engine.backward, engine.step
        if F.linear is not linear:
            # DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear for the whole process
            # ("This will persist unless manually reset"): every contender built after it
            # would run DeepSpeed's linear (+9 Python calls per nn.Linear forward). Each
            # contender runs with the linear it was built with: DeepSpeed's only in its step.
            self.linear, F.linear = F.linear, linear

    @staticmethod
    def _ddp(model: nn.Module) -> Any:
        """Plain PyTorch data parallelism, the same loop: gradients reduced on the last
        micro-batch of each window, clipped to 1.0, AdamW."""
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def step(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
            total = 0.0
            for m, (x, y) in enumerate(batches):
                with ddp.no_sync() if m < len(batches) - 1 else contextlib.nullcontext():
                    loss = ddp(x, y)
                    (loss / len(batches)).backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return total / len(batches)

        return step

    linear: Any = None  # the F.linear this contender's steps run with (None: torch's own)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if self.linear is None:
            return self._step(batches)
        torch_linear, F.linear = F.linear, self.linear
        try:
            return self._step(batches)
        finally:
            F.linear = torch_linear

    def _step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        total = 0.0
        for x, y in batches:
            loss = self.forward(x, y)
            self.backward(loss)
            self.opt_step()
            total += loss.item()
        return total / len(batches)


def batches_for(step: int, size: str, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    vocab, seq, *_, micro = SIZES[size]
    out = []
    for m in range(GAS):
        g = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
        idx = torch.randint(0, vocab, (micro, seq + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def _round_ratio_range(
    samples: dict[str, list[float]], a: str, b: str, per_round: int
) -> tuple[float, float]:
    """The spread of a / b: lowest and highest ratio of the two contenders' per-round medians
    (they ran back to back in each round)."""
    rounds = len(samples[a]) // per_round
    ratios = [
        statistics.median(samples[a][r * per_round : (r + 1) * per_round])
        / statistics.median(samples[b][r * per_round : (r + 1) * per_round])
        for r in range(rounds)
    ]
    return min(ratios), max(ratios)


# Where a call goes, by the path of the function's file: the first matching fragment names it.
_GROUPS = (
    ("/minispeed/engine/", "engine"),
    ("/minispeed/zero/", "zero"),
    ("/minispeed/comm/", "comm"),
    ("/minispeed/core/", "core"),
    ("/minispeed/", "minispeed (other)"),
    ("/deepspeed/", "deepspeed"),
    ("/torch/nn/parallel/", "torch.nn.parallel"),
    ("/torch/nn/", "torch.nn"),
    ("/torch/optim/", "torch.optim"),
    ("/torch/distributed/", "torch.distributed"),
    ("/torch/autograd/", "torch.autograd"),
    ("/torch/utils/", "torch.utils"),
    ("/torch/", "torch (other)"),
    ("engine_vs_deepspeed.py", "benchmark loop"),
)


def _group(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    return next((g for part, g in _GROUPS if part in path), "python (stdlib)")


def count_calls(run: Any) -> collections.Counter[tuple[str, str]]:
    """Every call `run()` makes, as {(group, function): count}: Python functions by the group
    of their own file, builtins (`[builtin] name`) by the group of the function calling them."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            counts[_group(code.co_filename), code.co_qualname] += 1
        elif event == "c_call":
            name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
            counts[_group(frame.f_code.co_filename), f"[builtin] {name}"] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return counts


def _by_group(counts: collections.Counter[tuple[str, str]]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for (group, _), n in counts.items():
        out[group] += n
    return out


def _print_diff(title: str, a: collections.Counter, b: collections.Counter, per: int) -> None:
    """What `a` makes more (or fewer) than `b`, per micro-step: by group, then by function."""
    ga, gb = _by_group(a), _by_group(b)
    total = (sum(a.values()) - sum(b.values())) / per
    print(f"  {title}: {total:+.1f} calls per micro-step")
    for g in sorted(set(ga) | set(gb), key=lambda g: -abs(ga[g] - gb[g])):
        if ga[g] != gb[g]:
            print(f"    {g:<22} {(ga[g] - gb[g]) / per:+8.1f}")
    rows = [(k, a[k] - b[k]) for k in set(a) | set(b) if a[k] != b[k]]
    rows.sort(key=lambda r: (-abs(r[1]), r[0]))
    for (group, name), d in rows[:40]:
        print(f"      {d / per:+7.1f}  {group:<20} {name}")
    if len(rows) > 40:
        rest = sum(d for _, d in rows[40:]) / per
        print(f"      {rest:+7.1f}  ({len(rows) - 40} more functions)")


def calls_report(
    contenders: dict[str, Contender], names: list[str], stages: list[int], size: str, steps: int
) -> None:
    """`--calls`: count each contender's calls over `steps` steps on this rank, after a warm-up
    step (lazy state: the optimizer's, autograd's); print per micro-step (rank 0)."""
    import minispeed.comm as comm

    rank, per = comm.get_rank(), steps * GAS
    counts = {}
    for n in names:
        contenders[n].step(batches_for(0, size, rank))
        comm.barrier()
        counts[n] = count_calls(
            lambda n=n: [contenders[n].step(batches_for(1 + k, size, rank)) for k in range(steps)]
        )
    if rank != 0:
        return
    params = next(iter(contenders.values())).params
    print(f"size {size}: {params:,} parameters; calls per micro-step on rank 0 ({per} counted)")
    for s in stages:
        group = [n for n in names if n.endswith(f"ZeRO-{s}")]
        groups = sorted({g for n in group for g in _by_group(counts[n])})
        print(
            f"ZeRO-{s}: "
            + ", ".join(f"{n.split()[0]} {sum(counts[n].values()) / per:.1f}" for n in group)
        )
        print(f"  {'group':<22}" + "".join(f"{n.split()[0]:>11}" for n in group))
        for g in groups:
            print(f"  {g:<22}" + "".join(f"{_by_group(counts[n])[g] / per:>11.1f}" for n in group))
        _print_diff(f"engine - shard, ZeRO-{s}", counts[group[0]], counts[group[1]], per)
        if s == 0 and "DDP ZeRO-0" in counts:
            for n in group[:2]:
                _print_diff(f"{n} - DDP", counts[n], counts["DDP ZeRO-0"], per)


def profile_report(
    contenders: dict[str, Contender], names: list[str], size: str, steps: int, top: int
) -> None:
    """`--profile`: where each contender's CPU time goes on this rank, by cProfile over `steps`
    steps after a warm-up step: its own time (`tottime`) per micro-step in µs, by the groups of
    `--calls` (a builtin, torch ops included, by the group of its caller), then the `top`
    functions. cProfile's hook inflates Python-heavy code, so read shares, not the total; the
    CPU time of the same steps without the profiler is printed beside it."""
    import cProfile
    import pstats

    import minispeed.comm as comm

    rank, per = comm.get_rank(), steps * GAS
    tables = {}
    for n in names:
        contenders[n].step(batches_for(0, size, rank))
        comm.barrier()
        c0 = time.process_time()
        for k in range(steps):
            contenders[n].step(batches_for(1 + k, size, rank))
        cpu = (time.process_time() - c0) / per
        comm.barrier()
        prof = cProfile.Profile(time.process_time)  # CPU time: waits for the peer cost none
        prof.enable()
        for k in range(steps):
            contenders[n].step(batches_for(1 + k, size, rank))
        prof.disable()
        tables[n] = (cpu, pstats.Stats(prof).stats)  # type: ignore[attr-defined]
    if rank != 0:
        return
    print(f"size {size}: own time per micro-step on rank 0, µs (cProfile, {per} micro-steps)")
    for n, (cpu, stats) in tables.items():
        groups: collections.Counter[str] = collections.Counter()
        rows = []
        for (filename, line, func), (_, ncalls, tottime, _, callers) in stats.items():
            if filename == "~":  # a builtin: charged to the group of its (first) caller
                caller = next(iter(callers), ("~", 0, ""))[0]
                group, name = _group(caller) + " [builtin]", func
            else:
                group, name = _group(filename), f"{os.path.basename(filename)}:{line}({func})"
            groups[group] += tottime
            rows.append((tottime, ncalls, group, name))
        total = sum(groups.values())
        print(f"{n}: {total / per * 1e6:.0f} µs profiled, {cpu * 1e6:.0f} µs CPU unprofiled")
        for g, t in groups.most_common():
            print(f"  {g:<32} {t / per * 1e6:8.1f}  {t / total:6.1%}")
        for t, calls, g, name in sorted(rows, reverse=True)[:top]:
            print(f"    {t / per * 1e6:8.1f} µs {calls / per:7.1f} calls  {g:<26} {name[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=0, help="0: 20 small, 2 large")
    parser.add_argument("--deepspeed", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument(
        "--no-ddp", dest="ddp", action="store_false", help="leave out the DDP floor at stage 0"
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="count every contender's Python and builtin calls per micro-step instead of timing",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="profile each contender (cProfile, rank 0): own time by group and the TOP functions",
    )
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import minispeed.comm as comm

    comm.init_distributed()
    rank = comm.get_rank()
    kinds = ["engine", "shard"]
    if args.deepspeed != "no":
        try:
            import deepspeed  # noqa: F401

            kinds.append("DeepSpeed")
        except ImportError:
            if args.deepspeed == "yes":
                raise
    stages = [int(s) for s in args.stages.split(",")]
    names = [f"{k} ZeRO-{s}" for s in stages for k in kinds]
    if 0 in stages and args.ddp:
        names.insert(names.index(f"{kinds[-1]} ZeRO-0") + 1, "DDP ZeRO-0")
    contenders = {n: Contender(n, args.size) for n in names}
    per_round = args.steps_per_round or (20 if args.size == "small" else 2)
    if args.calls:
        calls_report(contenders, names, stages, args.size, per_round)
        return
    if args.profile:
        profile_report(contenders, names, args.size, per_round, args.profile)
        return
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}  # this process's CPU time per step
    losses: dict[str, list[float]] = {n: [] for n in names}
    step = 0
    for r in range(args.rounds + 1):  # round 0 warms up
        # Each round starts with the next contender: none always runs first (after another
        # stage's contenders, on a colder cache) or always last.
        for n in names[r % len(names) :] + names[: r % len(names)]:
            for k in range(per_round):
                data = batches_for(r * per_round + k, args.size, rank)
                comm.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                losses[n].append(contenders[n].step(data))
                if r > 0:
                    times[n].append(time.perf_counter() - t0)
                    cpu[n].append(time.process_time() - c0)
        step += per_round
    # The slower rank's time decides a data-parallel step; CPU time is summed over the ranks
    # (on a loaded machine it is the steadier measure of the work a step does).
    for n in names:
        t = torch.tensor(times[n])
        comm.all_reduce(t, op=comm.ReduceOp.MAX)
        times[n] = t.tolist()
        c = torch.tensor(cpu[n])
        comm.all_reduce(c)
        cpu[n] = c.tolist()
    if rank != 0:
        return
    params = next(iter(contenders.values())).params
    print(f"size {args.size}: {params:,} parameters, {per_round} steps x {args.rounds} rounds")
    for s in stages:
        group = [n for n in names if n.endswith(f"ZeRO-{s}")]
        ref = losses[group[0]]
        for n in group[1:]:
            worst = max(abs(a - b) for a, b in zip(ref, losses[n], strict=True))
            if not worst <= 1e-4 or not all(map(math.isfinite, losses[n])):
                raise SystemExit(
                    f"{n} trains something else than {group[0]}: loss differs by {worst}"
                )
        for label, samples in (("wall", times), ("cpu ", cpu)):
            med = {n: statistics.median(samples[n]) for n in group}
            line = f"ZeRO-{s} {label}: "
            line += ", ".join(f"{n.split()[0]} {med[n] * 1e3:.1f} ms" for n in group)
            pairs = [(group[0], n) for n in group[1:]]
            if s == 0 and "DDP ZeRO-0" in group:
                pairs.append((group[1], "DDP ZeRO-0"))
            for a, b in pairs:
                line += f" | {a.split()[0]}/{b.split()[0]} {med[a] / med[b]:.3f}"
                line += " ({:.2f}-{:.2f})".format(*_round_ratio_range(samples, a, b, per_round))
            print(line)


if __name__ == "__main__":
    main()
